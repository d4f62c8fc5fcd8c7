"""A request over the feeder's receive limit (MAX_REQUEST_BYTES, both sides use it):
refused by the client before it sends, and, from any other client, an immediate
RESOURCE_EXHAUSTED that the Python client does not retry (docs/request.md, "Request
size")."""

from __future__ import annotations

import time

import grpc
import pytest

from tokenfeed.client import (
    Connection,
    FeederClient,
    InvalidArgument,
    ResourceExhausted,
    SamplingSpec,
)
from tokenfeed.client.stream import call_with_retry
from tokenfeed.client.transport import Channels, retryable
from tokenfeed.core.limits import MAX_REQUEST_BYTES
from tokenfeed.v1 import feeder_pb2 as pb

from support.feeders import FEEDER_DATASET

# 60 sources with 300 KB names: about 18 MB of request, cheap to build.
OVERSIZED = [(f"s{i}" + "x" * 300_000, 1.0) for i in range(60)]


def test_a_mixture_of_1000_sources_over_100_segments_fits() -> None:
    names = [f"source_{i:04d}" for i in range(1000)]
    schedule = [
        (1_000 * (j + 1), {n: 1.0 + (i + j) % 5 for i, n in enumerate(names)}) for j in range(100)
    ]
    spec = SamplingSpec(
        dataset="",
        sources=tuple((n, 1.0) for n in names),
        schedule=tuple(schedule),
        seq_len=2048,
        batch_size=8,
    )
    spec.check_size()
    size = spec.to_proto().ByteSize()
    assert 2_000_000 < size < MAX_REQUEST_BYTES
    # built once, a new message each call: changing one changes neither the spec nor
    # the next, and the server reads back the spec it was made from
    first = spec.to_proto()
    first.seed, first.sources[0].weight = 99, 5.0
    again = spec.to_proto()
    assert again is not first
    assert (again.seed, again.sources[0].weight) == (0, 1.0)
    assert SamplingSpec.from_proto(again) == spec
    assert spec.with_(seed=3).to_proto().seed == 3


def test_a_client_refuses_a_request_over_the_limit_before_any_contact() -> None:
    start = time.monotonic()
    with pytest.raises(InvalidArgument, match=r"over the 16,777,216 bytes a feeder accepts"):
        # nothing listens there: the check comes first, no connect timeout is waited out
        FeederClient(
            "127.0.0.1:9",
            mixture=OVERSIZED,
            seq_len=8,
            batch_size=2,
            rank=0,
            world_size=1,
            connect_timeout=600,
        )
    assert time.monotonic() - start < 60  # not the 600 s connect timeout


def test_the_feeder_refuses_an_oversized_request_at_once_and_it_is_not_retried(feeder) -> None:
    request = pb.InfoRequest(dataset="x" * (MAX_REQUEST_BYTES + 1))
    channels = Channels(Connection(feeder.address))
    with pytest.raises(grpc.RpcError) as raw:
        channels.stub().Info(request, timeout=30)
    assert raw.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not retryable(raw.value)
    reconnects: list[str] = []
    with pytest.raises(ResourceExhausted, match="larger than max"):
        call_with_retry(channels, lambda stub, t: stub.Info(request, timeout=t), reconnects.append)
    assert reconnects == []  # not one retry
    # the feeder keeps serving a request within the limit
    ok = pb.InfoRequest(dataset=FEEDER_DATASET)
    assert [d.name for d in channels.stub().Info(ok, timeout=30).datasets] == [FEEDER_DATASET]
    channels.close()
