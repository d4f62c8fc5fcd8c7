"""A large mixture's spec is remembered by its params' bytes as the client sent them
(wire.field_bytes, SamplingSpec.from_proto's `wire`): found in any field order, never
for a field sent twice, and on a real feeder one spec and sampler for the Info and
every rank's and step's stream of one request's params."""

from __future__ import annotations

import hashlib
import random
from itertools import islice
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import request as request_module
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import write_store
from tokenfeed.server import wire
from tokenfeed.v1 import feeder_pb2 as pb

from support.feeders import running_feeder

PARAMS = {
    pb.StreamBatchesRequest: pb.StreamBatchesRequest.DESCRIPTOR.fields_by_name["params"].number,
    pb.InfoRequest: pb.InfoRequest.DESCRIPTOR.fields_by_name["params"].number,
}
STREAM = "/tokenfeed.v1.Feeder/StreamBatches"


def _mixture(names: list[str], segments: int, seed: int = 3, world_size: int = 1):
    params = pb.SamplingParams(
        dataset="", seq_len=16, stride=16, batch_size=4, seed=seed, world_size=world_size
    )
    params.shuffle = True
    for i, name in enumerate(names):
        params.sources.add(name=name, weight=1.0 + i % 3)
    for j in range(segments):
        seg = params.schedule.add(from_tokens=64 * (j + 1))
        for i, name in enumerate(names):
            seg.weights.add(name=name, weight=1.0 + (i + j) % 5)
    return params


def _fields(message) -> list[bytes]:
    """`message`'s fields, each serialized on its own (their concatenation in any order
    parses to `message`)."""
    out = []
    names = [field.name for field, _ in message.ListFields()]
    for name in names:
        one = type(message)()
        one.CopyFrom(message)
        for other in names:
            if other != name:
                one.ClearField(other)
        out.append(one.SerializeToString())
    return out


requests = st.tuples(
    st.sampled_from([pb.StreamBatchesRequest, pb.InfoRequest]),
    st.integers(0, 5),  # sources
    st.integers(0, 3),  # schedule segments
    st.integers(0, 2**63 - 1),  # seed
    st.integers(0, 2**40),  # rank
    st.integers(-(2**63), 2**63 - 1),  # step, budget
    st.randoms(use_true_random=False),  # the fields' order
)


@given(requests, st.booleans())
def test_field_bytes_are_the_params_as_sent_in_any_field_order(drawn, twice: bool) -> None:
    kind, sources, segments, seed, rank, step, shuffle = drawn
    message = kind(rank=rank)
    if kind is pb.StreamBatchesRequest:
        message.step = step
        message.describe = bool(step % 2)
    else:
        message.budget_tokens = step % 2**63
        message.dataset = "a/b"
    if sources or seed:
        message.params.CopyFrom(_mixture([f"s{i}" for i in range(sources)], segments, seed))
    parts = _fields(message)
    shuffle.shuffle(parts)
    data = b"".join(parts)
    assert kind.FromString(data) == message
    got = wire.field_bytes(data, PARAMS[kind])
    if not message.HasField("params"):
        assert got is None
        return
    assert got is not None
    assert pb.SamplingParams.FromString(bytes(got)) == message.params
    assert bytes(got) == message.params.SerializeToString()
    if twice:  # a field sent twice is merged by the parser: its bytes alone say nothing
        again = _fields(pb.StreamBatchesRequest(params=message.params))[0]
        if kind is pb.InfoRequest:
            again = _fields(pb.InfoRequest(params=message.params))[0]
        assert wire.field_bytes(data + again, PARAMS[kind]) is None


@pytest.mark.parametrize("data", [b"\x08", b"\x0a\x05ab", b"\x80" * 11, b"\x0b\x0c"])
def test_field_bytes_of_what_is_not_a_message_is_none(data: bytes) -> None:
    assert wire.field_bytes(data, 1) is None


def test_a_large_mixture_is_remembered_by_the_bytes_it_came_in() -> None:
    params = _mixture([f"s{i}" for i in range(40)], 120)  # 40 x 121 weights: "large"
    canonical = params.SerializeToString(deterministic=True)
    parts = _fields(params)
    other = b"".join(reversed(parts))  # the same params, fields in another order
    assert other != canonical
    assert pb.SamplingParams.FromString(other) == params
    first = SamplingSpec.from_proto(params, wire=canonical)
    assert SamplingSpec.from_proto(params) is first  # the serialization's key: the same
    again = SamplingSpec.from_proto(pb.SamplingParams.FromString(other), wire=other)
    assert again == first
    assert again is not first
    assert SamplingSpec.from_proto(params, wire=memoryview(other)) is again
    key = hashlib.blake2b(other, digest_size=32).digest()
    assert request_module._PARSED[key] is again


def _write(root: Path, names: list[str]) -> list[int]:
    offsets = []
    for i, name in enumerate(names):
        tokens = (np.arange(2_000 + 300 * i) + 1_000_000 * i).astype("uint32")
        write_store(root / name, tokens, dtype="uint32", tokens_per_chunk=500)
        offsets.append(1_000_000 * i)
    return offsets


def _raw_stream(channel: grpc.Channel, data: bytes, batches: int) -> list[pb.Batch]:
    """The first `batches` batches of a stream whose request is the bytes `data` (a
    message holds one batch at least)."""
    call = channel.unary_stream(STREAM, response_deserializer=pb.StreamBatchesResponse.FromString)
    responses = call(data)
    got = [b for message in islice(responses, batches) for b in message.batches]
    responses.cancel()
    return got[:batches]


def test_ranks_steps_and_the_info_of_one_params_share_its_spec_and_sampler(
    tmp_path: Path,
) -> None:
    """The Info and streams of ranks 0..3 at two positions, their requests' fields in
    shuffled orders around the same params bytes: one spec, one sampler, each stream
    the rows of the same request sent by protobuf; params in another field order are
    a spec of their own and the same rows."""
    names = [f"s{i}" for i in range(12)]
    root = tmp_path / "root"
    _write(root, names)
    params = _mixture(names, 400, world_size=4)  # 12 x 401 weights: "large"
    shuffle = random.Random(5)
    with running_feeder(root) as feeder, grpc.insecure_channel(feeder.address) as channel:
        stub_info = channel.unary_unary(
            "/tokenfeed.v1.Feeder/Info",
            request_serializer=pb.InfoRequest.SerializeToString,
            response_deserializer=pb.InfoResponse.FromString,
        )
        info = stub_info(pb.InfoRequest(params=params, rank=1, budget_tokens=10**6))
        assert [s.name for s in info.sources] == names
        for rank in range(4):
            for offset, step in ((0, 0), (160, 10)):  # a step is 16 windows
                request = pb.StreamBatchesRequest(params=params, rank=rank, offset=offset)
                request.step = step
                parts = _fields(request)
                shuffle.shuffle(parts)
                got = _raw_stream(channel, b"".join(parts), 6)
                want = _raw_stream(channel, request.SerializeToString(), 6)
                assert [b.SerializeToString() for b in got] == [b.SerializeToString() for b in want]
        kept = feeder.server.service.mixtures._kept[tuple(names)]
        assert len(kept.samplers) == 1
        spec = kept.samplers[0][0]
        key = hashlib.blake2b(params.SerializeToString(), digest_size=32).digest()
        assert request_module._PARSED[key] is spec
        # the same params with their own fields in another order: other bytes
        reordered = b"".join(reversed(_fields(params)))
        request = pb.StreamBatchesRequest(rank=2)
        data = _fields(request)[0] + b"\x0a" + wire.varint(len(reordered)) + reordered
        got = _raw_stream(channel, data, 6)
        request.params.CopyFrom(params)
        want = _raw_stream(channel, request.SerializeToString(), 6)
        assert [b.SerializeToString() for b in got] == [b.SerializeToString() for b in want]
        assert len(kept.samplers) == 2
        other = request_module._PARSED[hashlib.blake2b(reordered, digest_size=32).digest()]
        assert other == spec
        assert other is not spec
