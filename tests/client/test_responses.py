"""The client's decoding of StreamBatchesResponse bytes (responses.py, _responses.c):
on real feeders' messages and on Hypothesis-made ones, `decode` gives what protobuf's
parse gives, the compiled scan equals its reference `scan_py`, a message of any other
shape goes to protobuf, and bytes protobuf rejects raise ValueError, never a crash.
And the client hands out batches whose tokens were never copied out of the message."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tokenfeed.client import FeederClient, responses
from tokenfeed.client.channel_pool import SharedChannel
from tokenfeed.core import native
from tokenfeed.core.request import SamplingSpec
from tokenfeed.server import wire
from tokenfeed.v1 import feeder_pb2 as pb

from support.feeders import FEEDER_DATASET, running_feeder
from support.stores import make_document_store, make_mixture_root, make_positional_store

BUILT = native.built("tokenfeed.client._responses")


def same(got: responses.Response, want: responses.Response) -> None:
    """Two decoded responses hold the same values (arrays and views by content)."""
    assert got.batches_per_message == want.batches_per_message
    assert got.info == want.info
    assert len(got.batches) == len(want.batches)
    for a, b in zip(got.batches, want.batches, strict=True):
        assert a[:7] == b[:7]
        assert bytes(a.tokens) == bytes(b.tokens)
        assert bytes(a.document_ends) == bytes(b.document_ends)
        for x, y in ((a.starts, b.starts), (a.sources, b.sources)):
            assert x.dtype == y.dtype == np.int64
            np.testing.assert_array_equal(x, y)


def check(data: bytes) -> None:
    """decode == protobuf's parse, both ways of the switch, and the C scan == scan_py;
    where protobuf rejects the bytes, decode raises ValueError."""
    try:
        want = responses.from_protobuf(data)
    except ValueError:
        for context in (contextlib.nullcontext(), native.disabled()):
            with context, pytest.raises(ValueError, match="does not parse"):
                responses.decode(data)
        return
    same(responses.decode(data), want)
    with native.disabled():
        same(responses.decode(data), want)
        reference = responses.scan(data)
    if BUILT:
        assert responses.scan(data) == reference


# ------------------------------------------------------------ real feeders' messages


def raw_messages(address: str, request: pb.StreamBatchesRequest, n: int) -> list[bytes]:
    """A stream's first `n` responses (or all, if fewer) as the bytes gRPC received."""
    with grpc.insecure_channel(address) as channel:
        stream = channel.unary_stream(
            "/tokenfeed.v1.Feeder/StreamBatches",
            request_serializer=pb.StreamBatchesRequest.SerializeToString,
        )
        call = stream(request, timeout=30)
        messages = list(itertools.islice(call, n))
        call.cancel()
        return messages


@pytest.fixture(scope="module")
def data_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = make_mixture_root(tmp_path_factory.mktemp("responses") / "root")
    make_positional_store(root / FEEDER_DATASET, 10_000, 1_000)
    make_document_store(root / "docs", total=6_000, mean=30)
    return root


@pytest.fixture(scope="module")
def feeder(data_root: Path) -> Iterator[Any]:
    with running_feeder(data_root) as f:
        yield f


SPECS = {
    "dataset": SamplingSpec(dataset=FEEDER_DATASET, seq_len=64, batch_size=4, shuffle=True),
    "documents": SamplingSpec(dataset="docs", seq_len=48, batch_size=4, shift="auto"),
    "mixture": SamplingSpec(
        dataset="", sources=(("a", 0.5), ("b", 0.3), ("c", 0.2)), seq_len=8, batch_size=4
    ),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_a_real_stream_decodes_as_protobuf_parses_it(feeder: Any, name: str) -> None:
    spec = SPECS[name]
    request = pb.StreamBatchesRequest(
        params=spec.to_proto(),
        batches_per_message=3,
        describe=True,
        document_ends=name == "documents",
    )
    messages = raw_messages(feeder.address, request, 20)
    assert len(messages) > 2
    first = responses.decode(messages[0])
    assert first.info is not None
    assert first.batches_per_message == 3
    for data in messages:
        check(data)
        decoded = responses.decode(data)
        assert decoded.batches
        assert all(b.rows == 4 for b in decoded.batches)
        if name == "mixture":
            assert all(len(b.sources) == 4 for b in decoded.batches)
        if name == "documents":
            assert any(len(b.document_ends) for b in decoded.batches)


def test_the_client_hands_out_the_messages_own_bytes(feeder: Any) -> None:
    """input_ids and labels are views of the received message, not of a copy of the
    batch's tokens (protobuf's parse makes one per batch)."""
    with FeederClient(
        feeder.address, dataset=FEEDER_DATASET, seq_len=64, batch_size=4, prefetch=2
    ) as client:
        batches = [b for _, b in zip(range(6), client, strict=False)]
    for batch in batches:
        arr = batch["input_ids"]
        while isinstance(arr.base, np.ndarray):
            arr = arr.base
        message = arr.base
        assert isinstance(message, bytes)
        assert len(message) > 4 * 65 * 4  # the whole message: fields around the tokens
        assert batch["starts"].dtype == np.int64
        assert batch["starts"].shape == (4,)


def test_the_pooled_channel_streams_with_the_client_decoder(feeder: Any) -> None:
    with grpc.insecure_channel(feeder.address) as channel:
        shared = SharedChannel((0, feeder.address, (), None), channel)  # type: ignore[arg-type]
        request = pb.StreamBatchesRequest(params=SPECS["dataset"].to_proto(), describe=True)
        first = next(iter(shared.stream_batches(request, timeout=30)))
    assert isinstance(first, responses.Response)
    assert first.info is not None
    assert first.info.datasets[0].name == FEEDER_DATASET


# ------------------------------------------------------------ Hypothesis-made messages

int64s = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 2**40)
int32s = st.integers(-(2**31), 2**31 - 1)


@st.composite
def batch_messages(draw: st.DrawFn) -> pb.Batch:
    ints = st.one_of(small, int64s)
    return pb.Batch(
        epoch=draw(ints),
        step=draw(ints),
        offset=draw(ints),
        shift=draw(ints),
        rows=draw(ints),
        cols=draw(ints),
        dtype=draw(st.sampled_from(["uint16", "uint32", "", "ü8"])),
        tokens=draw(st.binary(max_size=64)),
        starts=draw(st.lists(int64s, max_size=6)),
        sources=draw(st.lists(int32s, max_size=6)),
        document_ends=draw(st.binary(max_size=12)),
    )


@st.composite
def response_messages(draw: st.DrawFn) -> bytes:
    msg = pb.StreamBatchesResponse(
        batches=draw(st.lists(batch_messages(), max_size=4)),
        batches_per_message=draw(st.one_of(small, int64s)),
    )
    if draw(st.booleans()):
        msg.info.datasets.add(name=draw(st.text(max_size=8)), total_tokens=draw(small))
    return msg.SerializeToString()


def varint(n: int) -> bytes:
    return wire.varint(n & (1 << 64) - 1)  # negatives: 10-byte two's complement


def field(number: int, wire: int, payload: bytes) -> bytes:
    return varint(number << 3 | wire) + payload


def length_delimited(number: int, payload: bytes) -> bytes:
    return field(number, 2, varint(len(payload)) + payload)


# Fields another writer might add, or write otherwise than the feeder does.
unknown = st.one_of(
    st.builds(lambda n, v: field(n, 0, varint(v)), st.integers(12, 2**29 - 1), small),
    st.builds(lambda n, b: length_delimited(n, b), st.integers(12, 5000), st.binary(max_size=9)),
    st.builds(lambda n: field(n, 1, bytes(8)), st.integers(12, 99)),
    st.builds(lambda n: field(n, 5, bytes(4)), st.integers(12, 99)),
)
unusual = st.one_of(
    unknown,
    st.builds(lambda v: field(9, 0, varint(v)), int64s),  # an unpacked start
    st.builds(lambda vs: length_delimited(10, b"".join(map(varint, vs))), st.lists(int32s)),
    st.builds(lambda v: field(2, 0, varint(v)), int64s),  # a step given twice
    st.builds(lambda b: length_delimited(8, b), st.binary(max_size=8)),  # tokens twice
    st.just(length_delimited(7, b"\xff\xfe")),  # a dtype that is not UTF-8
    st.just(field(4, 2, varint(1) + b"\x01")),  # shift with the wrong wire type
)


@st.composite
def odd_responses(draw: st.DrawFn) -> bytes:
    """A response with unknown or unusual fields spliced into its batches and itself."""
    batches = []
    for b in draw(st.lists(batch_messages(), min_size=1, max_size=3)):
        body = b.SerializeToString() + b"".join(draw(st.lists(unusual, max_size=3)))
        batches.append(length_delimited(1, body))
    tail = b"".join(draw(st.lists(unknown, max_size=2)))
    info = draw(st.lists(st.just(length_delimited(3, b"\x10\x05")), max_size=2))
    return b"".join(batches) + tail + b"".join(info)


@given(response_messages())
def test_decoded_as_protobuf_parses_it(data: bytes) -> None:
    check(data)


@given(odd_responses())
def test_unusual_and_unknown_fields_decode_as_protobuf_parses_them(data: bytes) -> None:
    check(data)


@given(st.one_of(st.binary(max_size=80), response_messages().map(lambda d: d[: len(d) // 2])))
@example(b"\x0a\xff\xff\xff\xff\x0f")  # a length past the end
@example(b"\x08" + b"\xff" * 10 + b"\x01")  # a varint of 11 bytes
@example(b"\x0b\x0c")  # a group
@example(b"\x00\x00")  # field number 0
def test_bytes_protobuf_rejects_raise_value_error(data: bytes) -> None:
    check(data)


def test_the_extension_is_built_unless_told_not_to() -> None:
    """Built at install, and scan runs it, unless TOKENFEED_PURE_PYTHON=1."""
    if os.environ.get(native.ENV) == "1":
        assert not native.enabled()
    else:
        assert BUILT
        assert responses._scan_c is not None


@pytest.mark.skipif(not BUILT, reason="the extension is not built (TOKENFEED_PURE_PYTHON=1)")
def test_the_compiled_scan_takes_any_buffer_and_rejects_non_buffers() -> None:
    from tokenfeed.client import _responses

    data = pb.StreamBatchesResponse(batches=[pb.Batch(step=3, tokens=b"ab")]).SerializeToString()
    assert _responses.scan(memoryview(data)) == _responses.scan(bytearray(data))
    assert _responses.scan(data) == responses.scan_py(data)
    with pytest.raises(TypeError):
        _responses.scan(3)
