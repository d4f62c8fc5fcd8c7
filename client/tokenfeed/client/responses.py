"""A stream's responses, decoded straight from the bytes gRPC hands over.

protobuf's parse of a ~1 MiB StreamBatchesResponse copies every batch's tokens into its
own message objects, and reading `batch.tokens` copies them once more. The client reads
only a few fields, so `decode` (the stream's response deserializer) finds where they
lie (`scan`: one pass, compiled in _responses.c where built) and hands out each batch's
tokens and document ends as views of the message's bytes, its starts and sources as
int64 arrays: nothing of the tokens is copied. A message of another shape than the
feeder's (a field twice where protobuf would merge, unpacked repeated integers, a
known field of another wire type, anything malformed) is parsed by protobuf instead,
which decides; the result is the same either way (tested), and fields the client does
not know are skipped, as protobuf's would be by a client that never reads them.

The batches' views are read-only and may be unaligned (a message's fields are packed
back to back); numpy and torch read them as any other array.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from tokenfeed.core import native
from tokenfeed.core.protowire import LEN, VARINT, Unreadable, key, skip, span, varint
from tokenfeed.v1 import feeder_pb2 as pb

_scan_c: Callable[[Any], Any] | None
try:
    from tokenfeed.client._responses import scan as _scan_c
except ImportError:  # built without the extensions (TOKENFEED_PURE_PYTHON=1 at install)
    _scan_c = None


class Batch(NamedTuple):
    """One Batch of a response, with protobuf's names: `tokens` (a uint8 array) and
    `document_ends` are views of the message's bytes, `starts` and `sources` int64
    arrays (`sources` empty for a single dataset)."""

    epoch: int
    step: int
    offset: int
    shift: int
    rows: int
    cols: int  # seq_len + shift
    dtype: str  # of the tokens: the store's
    tokens: np.ndarray  # rows x cols tokens' bytes (uint8), in the message's bytes
    starts: np.ndarray
    sources: np.ndarray
    document_ends: memoryview  # little-endian uint32 flat indices, in the message's bytes


# _responses.c reads the fields by these numbers: the generated descriptors' own.
assert [pb.Batch.DESCRIPTOR.fields_by_name[f].number for f in Batch._fields] == list(range(1, 12))


class Response(NamedTuple):
    """A StreamBatchesResponse: its batches, the batches per message (0 but in a first
    response that tells it) and the InfoResponse (None but in a first response)."""

    batches: list[Batch]
    batches_per_message: int
    info: pb.InfoResponse | None


_FIELDS = pb.StreamBatchesResponse.DESCRIPTOR.fields_by_name
assert [_FIELDS[f].number for f in Response._fields] == list(range(1, 4))


_NO_INTS = np.empty(0, dtype=np.int64)  # a single dataset's sources
_NO_BYTES = memoryview(b"")  # a batch without document ends

# (epoch, step, offset, shift, rows, cols, dtype, tokens_at, tokens_len, starts_from,
# starts_to, sources_from, sources_to, ends_at, ends_len): see `scan_py`
Scanned = tuple[list[tuple[Any, ...]], bytearray, int, "tuple[int, int] | None"]


def decode(data: bytes) -> Response:
    """A StreamBatchesResponse from its bytes; ValueError for bytes protobuf rejects."""
    scanned = scan(data)
    if scanned is None:
        return from_protobuf(data)
    rows, values, per_message, info_span = scanned
    view = memoryview(data)
    octets = np.frombuffer(data, dtype=np.uint8)  # numpy views a slice of it fastest
    ints = np.frombuffer(values, dtype=np.int64)
    new = tuple.__new__  # Batch(...) through NamedTuple's __new__ costs twice as much
    batches = [
        new(
            Batch,
            (
                e,
                s,
                o,
                sh,
                r,
                c,
                dt,
                octets[ta : ta + tl],
                ints[a:b],
                ints[p:q] if q > p else _NO_INTS,
                view[ea : ea + el] if el else _NO_BYTES,
            ),
        )
        for (e, s, o, sh, r, c, dt, ta, tl, a, b, p, q, ea, el) in rows
    ]
    info = None
    if info_span is not None:
        at, n = info_span
        info = _parse(pb.InfoResponse, view[at : at + n])
    return Response(batches, per_message, info)


def from_protobuf(data: bytes) -> Response:
    """`decode` by protobuf's parse: for messages `scan` leaves to it."""
    msg = _parse(pb.StreamBatchesResponse, data)
    batches = [
        Batch(
            b.epoch,
            b.step,
            b.offset,
            b.shift,
            b.rows,
            b.cols,
            b.dtype,
            np.frombuffer(b.tokens, dtype=np.uint8),
            np.array(b.starts, dtype=np.int64),
            np.array(b.sources, dtype=np.int64),
            memoryview(b.document_ends),
        )
        for b in msg.batches
    ]
    return Response(batches, msg.batches_per_message, msg.info if msg.HasField("info") else None)


def _parse(message: Any, data: Any) -> Any:
    try:
        return message.FromString(bytes(data))
    except Exception as e:  # protobuf's DecodeError
        raise ValueError(
            f"the feeder sent a {message.DESCRIPTOR.name} that does not parse: {e}"
        ) from None


def scan(data: bytes) -> Scanned | None:
    """Where a StreamBatchesResponse's fields lie in `data`, or None when it is not the
    plain shape the feeder writes (see `scan_py`). Compiled (_responses.c) when built;
    the reference is `scan_py`."""
    if _scan_c is None or not native.enabled():
        return scan_py(data)
    result: Scanned | None = _scan_c(data)
    return result


def scan_py(data: bytes) -> Scanned | None:
    """`scan`'s reference: (batches, values, batches_per_message, info) or None.

    Each batch is a tuple (epoch, step, offset, shift, rows, cols, dtype, tokens_at,
    tokens_len, starts_from, starts_to, sources_from, sources_to, ends_at, ends_len):
    its integer fields (int64, proto3's zeros when absent, the last when repeated), its
    dtype, byte ranges of its tokens and document ends in `data` (empty at 0 when
    absent), index ranges of its starts and sources in `values`, a bytearray of int64
    holding every batch's starts then its sources, batch after batch (sources narrowed
    to int32, as protobuf does). info is the (at, len) of the InfoResponse field, None
    when absent. None, for protobuf to parse, when a packed field runs twice or comes
    unpacked, a known field has another wire type, info comes twice, a dtype is not
    UTF-8, a field is a group or of an invalid wire type, or anything runs past its end.
    """
    mv = memoryview(data).cast("B")
    values: list[int] = []
    batches: list[tuple[Any, ...]] = []
    per_message = 0
    info: tuple[int, int] | None = None
    try:
        pos, end = 0, len(mv)
        while pos < end:
            field, wire, pos = key(mv, pos, end)
            if field == 1:
                _expect(wire, LEN)
                at, n, pos = span(mv, pos, end)
                batches.append(_batch(mv, at, at + n, values))
            elif field == 2:
                _expect(wire, VARINT)
                u, pos = varint(mv, pos, end)
                per_message = _int64(u)
            elif field == 3:
                _expect(wire, LEN)
                if info is not None:
                    raise _NotPlain
                at, n, pos = span(mv, pos, end)
                info = (at, n)
            else:
                pos = skip(mv, pos, end, wire)
    except Unreadable:
        return None
    return batches, bytearray(np.array(values, dtype=np.int64).tobytes()), per_message, info


class _NotPlain(Unreadable):
    """Not the plain shape: protobuf's to parse."""


def _batch(mv: memoryview, pos: int, end: int, values: list[int]) -> tuple[Any, ...]:
    ints = [0] * 7
    dtype = tokens = ends = (0, 0)
    runs: dict[int, tuple[int, int]] = {}
    none = (len(values), len(values))  # an absent run: empty, where the batch's begin
    while pos < end:
        field, wire, pos = key(mv, pos, end)
        if 1 <= field <= 6:
            _expect(wire, VARINT)
            u, pos = varint(mv, pos, end)
            ints[field] = _int64(u)
        elif field in (7, 8, 11):
            _expect(wire, LEN)
            at, n, pos = span(mv, pos, end)
            if field == 7:
                dtype = (at, n)
            elif field == 8:
                tokens = (at, n)
            else:
                ends = (at, n)
        elif field in (9, 10):
            _expect(wire, LEN)
            if field in runs:
                raise _NotPlain
            at, n, pos = span(mv, pos, end)
            first = len(values)
            i = at
            while i < at + n:
                u, i = varint(mv, i, at + n)
                values.append(_int32(u) if field == 10 else _int64(u))
            runs[field] = (first, len(values))
        else:
            pos = skip(mv, pos, end, wire)
    try:
        name = bytes(mv[dtype[0] : dtype[0] + dtype[1]]).decode()
    except UnicodeDecodeError:
        raise _NotPlain from None
    return (
        *ints[1:],
        name,
        *tokens,
        *runs.get(9, none),
        *runs.get(10, none),
        *ends,
    )


def _expect(wire: int, wanted: int) -> None:
    if wire != wanted:
        raise _NotPlain


def _int64(u: int) -> int:
    return u - (1 << 64) if u >> 63 else u


def _int32(u: int) -> int:
    u &= 0xFFFFFFFF
    return u - (1 << 32) if u >> 31 else u
