"""Hand-rolled protobuf encoding of the hot path: StreamBatchesResponse messages.

A response is its batches one after another, each a length-delimited field, so a
message is head_0, rows_0, tail_0, head_1, ...: `frames()` encodes, for every batch of
a round at once, the bytes before its tokens (the field tag and length, epoch ...
dtype, the tokens' tag and length) and after them (the packed `starts`, a mixture's
`sources`), as one blob of head_0 tail_0 head_1 tail_1 ... and their sizes. The
tokens themselves go in as slices of the cached chunks (splice.py), so they are
copied once; building pb.Batch objects costs three (joining the rows, setting the
field, serializing). Byte-identical to SerializeToString (tests compare them over
many shapes); field numbers come from the generated descriptors, so the .proto stays
the only source of the wire format.

The per-batch loop, a mixture's `sources` included, runs in C (_native.c's `frames`,
given the tags) where the extension is built; `frames_py` is its reference, run when
the compiled loops are off (tokenfeed.core.native).

The other way, `field_bytes` finds a request's params as the bytes the client sent
(what a large mixture's spec is remembered by).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tokenfeed.core import native, protowire
from tokenfeed.v1 import feeder_pb2 as pb

_VARINT, _LEN = protowire.VARINT, protowire.LEN  # wire types
_MASK64 = (1 << 64) - 1


def varint(n: int) -> bytes:
    """Base-128 varint of a non-negative integer below 2**64 (one, two and three byte
    ones, the lengths and most steps and offsets, unrolled: this runs per batch)."""
    if n < 0x80:
        return bytes((n,))
    if n < 0x4000:
        return bytes((n & 0x7F | 0x80, n >> 7))
    if n < 0x200000:
        return bytes((n & 0x7F | 0x80, n >> 7 & 0x7F | 0x80, n >> 14))
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(message: Any, field: str, wire_type: int) -> bytes:
    return varint(message.DESCRIPTOR.fields_by_name[field].number << 3 | wire_type)


_EPOCH = _tag(pb.Batch, "epoch", _VARINT)
_STEP = _tag(pb.Batch, "step", _VARINT)
_OFFSET = _tag(pb.Batch, "offset", _VARINT)
_TOKENS = _tag(pb.Batch, "tokens", _LEN)
_STARTS = _tag(pb.Batch, "starts", _LEN)
_SOURCES = _tag(pb.Batch, "sources", _LEN)
_BATCH = _tag(pb.StreamBatchesResponse, "batches", _LEN)
assert [f.name for f in sorted(pb.Batch.DESCRIPTOR.fields, key=lambda f: f.number)][:10] == [
    "epoch",
    "step",
    "offset",
    "shift",
    "rows",
    "cols",
    "dtype",
    "tokens",
    "starts",
    "sources",
], "frames() writes Batch's fields in this order (documents.py appends document_ends)"


def _int_field(tag: bytes, n: int) -> bytes:
    """An int64 field (proto3 leaves out zeros; negatives are 10-byte two's complement)."""
    return tag + varint(n & _MASK64) if n else b""


@functools.lru_cache(maxsize=256)
def _middle_fields(shift: int, rows: int, cols: int, dtype: str, payload: int) -> bytes:
    """Batch fields 4-7 (serialized by protobuf) and the tokens' tag and length: the
    same for most batches of a stream."""
    fields = pb.Batch(shift=shift, rows=rows, cols=cols, dtype=dtype).SerializeToString()
    return fields + _TOKENS + varint(payload) if payload else fields


def frames(
    epoch: int,
    step: int,
    offsets: Sequence[int],
    shifts: Sequence[int],
    rows: Sequence[int] | np.ndarray,
    cols: Sequence[int] | np.ndarray,
    dtype: str,
    itemsize: int,
    starts: np.ndarray,
    sources: np.ndarray | None = None,
    cut: np.ndarray | None = None,
) -> tuple[bytes, np.ndarray]:
    """(blob, sizes) of consecutive batches (steps step, step + 1, ...): the blob is
    head_0 tail_0 head_1 tail_1 ..., `sizes` their 2n lengths (int64); batch i of a
    response is head_i, then its rows x cols tokens of `itemsize` bytes, then tail_i.
    `starts` are the batches' window starts (non-negative), concatenated; `cut`, if
    given, is where each batch's begin in them (0, then the running sum of `rows`).

    Fields are written in number order, as SerializeToString does: epoch, step and
    offset (they change every batch), fields 4-7 by protobuf (cached per shape), the
    tokens' tag and length; then `starts`, packed, then (a mixture's) `sources`, each
    row's source index, packed the same way.
    """
    rows_a = np.asarray(rows, dtype=np.int64)
    cols_a = np.asarray(cols, dtype=np.int64)
    payloads = rows_a * cols_a * itemsize
    if (
        len(shifts) == list(shifts).count(shifts[0])
        and (rows_a == rows_a[0]).all()
        and (cols_a == cols_a[0]).all()
    ):  # one shape: most rounds, one lookup
        middles = [
            _middle_fields(shifts[0], int(rows_a[0]), int(cols_a[0]), dtype, int(payloads[0]))
        ]
        middles *= len(rows_a)
    else:
        shapes = zip(shifts, rows_a.tolist(), cols_a.tolist(), payloads.tolist(), strict=True)
        middles = [_middle_fields(sh, r, c, dtype, pay) for sh, r, c, pay in shapes]
    if cut is None:
        cut = np.zeros(len(rows_a) + 1, dtype=np.int64)  # batch i: starts[cut[i]:cut[i+1]]
        np.cumsum(rows_a, out=cut[1:])
    loop = frames_py if _frames_c is None or not native.enabled() else _frames_c
    blob, sizes = loop(
        _BATCH,
        _int_field(_EPOCH, epoch),
        _STEP,
        step,
        _OFFSET,
        np.asarray(offsets, dtype=np.int64),
        middles,
        payloads,
        _STARTS,
        np.ascontiguousarray(starts, dtype=np.int64),
        cut,
        _SOURCES,
        None if sources is None else np.ascontiguousarray(sources, dtype=np.int64),
    )
    return blob, np.frombuffer(sizes, dtype=np.int64)


def frames_py(
    batch_tag: bytes,
    epoch_field: bytes,
    step_tag: bytes,
    step: int,
    offset_tag: bytes,
    offsets: np.ndarray,
    middles: Sequence[bytes],
    payloads: np.ndarray,
    starts_tag: bytes,
    starts: np.ndarray,
    cut: np.ndarray,
    sources_tag: bytes,
    sources: np.ndarray | None,
) -> tuple[bytes, bytes]:
    """`frames`' loop in Python, the reference of _native.frames: every batch's head and
    tail, and their sizes (int64 bytes). A batch's tail is its `starts` packed, then
    (`sources` given: a mixture's) its rows' `sources` packed: starts[cut[i]:cut[i+1]]
    and the same slice of sources."""
    out, sizes = [], []
    values = starts.tolist()
    source_values = None if sources is None else sources.tolist()
    for i, (offset, middle, payload) in enumerate(
        zip(offsets.tolist(), middles, payloads.tolist(), strict=True)
    ):
        tail = _packed(starts_tag, values[cut[i] : cut[i + 1]])
        if source_values is not None:
            tail += _packed(sources_tag, source_values[cut[i] : cut[i + 1]])
        fields = b"".join(
            (
                epoch_field,
                _int_field(step_tag, step + i),
                _int_field(offset_tag, offset),
                middle,
            )
        )
        head = batch_tag + varint(len(fields) + payload + len(tail)) + fields
        out += [head, tail]
        sizes += [len(head), len(tail)]
    return b"".join(out), np.array(sizes, dtype=np.int64).tobytes()


_frames_c: Callable[..., tuple[bytes, bytes]] | None
try:
    from tokenfeed.server._native import frames as _frames_c
except ImportError:  # built without the extension (TOKENFEED_PURE_PYTHON=1 at install)
    _frames_c = None


def _packed(tag: bytes, values: list[int]) -> bytes:
    """A packed repeated int64/int32 field as protobuf encodes it (negatives as 10-byte
    two's complement); nothing for no values (proto3 leaves out an empty field)."""
    packed = b"".join(varint(v & _MASK64) for v in values)
    return tag + varint(len(packed)) + packed if packed else b""


def field_bytes(data: bytes, number: int) -> memoryview | None:
    """The bytes of a message's length-delimited field `number` as they are in `data`
    (a serialized message, top level only), or None if it is not there exactly once:
    a field sent twice is merged by a parser, so its bytes alone do not say its value.
    Used for a request's params, so that what identifies them is the bytes the client
    sent, not a serialization of the parsed message (SamplingSpec.from_proto)."""
    mv, pos, found = memoryview(data).cast("B"), 0, None
    try:
        while pos < len(mv):
            field, wire_type, pos = protowire.key(mv, pos, len(mv))
            if wire_type != protowire.LEN or field != number:
                pos = protowire.skip(mv, pos, len(mv), wire_type)
            elif found is not None:
                return None
            else:
                at, size, pos = protowire.span(mv, pos, len(mv))
                found = mv[at : at + size]
    except protowire.Unreadable:
        return None
    return found
