"""A feeder whose data root is on S3 behind a fault proxy: latency, 503 SlowDown,
connection resets. Every epoch must still come exactly once with the right tokens;
when the retries run out, only the streams that need the object fail (UNAVAILABLE
naming it) and the others keep going. A store's writer outlasts a longer outage.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.client import Backoff, FeederClient
from tokenfeed.core.errors import StorageUnavailable
from tokenfeed.core.store import META_NAME
from tokenfeed.core.store.objects import ObjectStore
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support.feeders import running_feeder
from support.s3faultproxy import S3FaultProxy
from support.stores import make_positional_store

pytestmark = pytest.mark.slow

KW = {"dataset": "big", "seq_len": 128, "stride": 128, "batch_size": 8, "seed": 5}
KW |= {"shuffle": True, "rank": 0, "world_size": 1}


@pytest.fixture
def proxy(s3):  # type: ignore[no-untyped-def]
    with S3FaultProxy(("127.0.0.1", s3.ports.s3), seed=11) as p:
        yield p


def _epoch(address: str, epoch: int, **kw) -> tuple[list[int], int]:  # type: ignore[no-untyped-def]
    """(window starts in order, batches) of one epoch; every row checked token by token."""
    starts: list[int] = []
    with FeederClient(address, **(KW | kw)) as c:
        c.set_epoch(epoch)
        for b in c:
            s = b["starts"]
            want = s[:, None] + np.arange(KW["seq_len"])  # positional store: token i == i
            np.testing.assert_array_equal(b["input_ids"], want)
            starts += s.tolist()
    return starts, len(starts)


def test_every_epoch_exactly_once_through_s3_faults(
    s3_root: str, proxy: S3FaultProxy, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 15 chunks of 40 KB, a cache of ~3: chunks are fetched again and again
    make_positional_store(f"{s3_root}/big", 150_000, 10_000)  # type: ignore[arg-type]
    make_positional_store(tmp_path / "big", 150_000, 10_000)
    with running_feeder(tmp_path) as local:
        expected = [_epoch(local.address, e)[0] for e in range(2)]
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    proxy.configure(latency=0.005, slowdown=0.15, reset=0.1)
    backoff = Backoff(initial=0.05, maximum=0.5, deadline=120)
    with running_feeder(s3_root, cache_bytes=130_000) as f:  # type: ignore[arg-type]
        for e in range(2):
            got, _ = _epoch(f.address, e, backoff=backoff)
            assert got == expected[e]  # the same order: nothing lost, nothing repeated
        retries = f.server.catalog.objects.retries  # type: ignore[union-attr]
    assert proxy.faults["slowdown"] > 0
    assert proxy.faults["reset"] > 0
    assert retries >= proxy.faults["slowdown"]


def _stream(address: str, dataset: str):  # type: ignore[no-untyped-def]
    p = pb.SamplingParams(dataset=dataset, seq_len=64, batch_size=4, world_size=1)
    ch = grpc.insecure_channel(address)
    return ch, pb_grpc.FeederStub(ch).StreamBatches(pb.StreamBatchesRequest(params=p))


def test_retries_run_out_unavailable_for_that_stream_only(
    s3_root: str, proxy: S3FaultProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    make_positional_store(f"{s3_root}/small", 2_000, 1_000)  # type: ignore[arg-type]
    # 2 M tokens in 20 chunks of 400 KB, a 1 MiB cache: read-ahead cannot have loaded
    # the large store's later chunks before object storage stops answering
    make_positional_store(f"{s3_root}/large", 2_000_000, 100_000)  # type: ignore[arg-type]
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    with running_feeder(s3_root, cache_bytes=1 << 20) as f:  # type: ignore[arg-type]
        ch_a, a = _stream(f.address, "small")
        ch_b, b = _stream(f.address, "large")
        first_a, first_b = next(a), next(b)
        proxy.configure(slowdown=1.0)  # object storage answers nothing but 503 SlowDown
        rest_a = list(a)  # its chunks are cached: it keeps going to the end
        # 30 windows of 64 (+1 shift) in 2,000 tokens: 7 full batches of 4
        assert sum(len(m.batches) for m in [first_a, *rest_a]) == 7
        with pytest.raises(grpc.RpcError) as ei:
            list(b)
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
        assert f"{s3_root}/large/chunk_0000" in ei.value.details()
        assert "failed after 6 attempt(s): HTTP 503 SlowDown" in ei.value.details()
        assert len(first_b.batches) > 0
        ch_a.close()
        ch_b.close()


def test_a_store_writer_outlasts_an_outage_that_fails_a_read(
    s3,
    s3_root: str,
    monkeypatch: pytest.MonkeyPatch,  # type: ignore[no-untyped-def]
) -> None:
    # 7 SlowDowns in a row: one more than a request's default attempts, within a writer's
    with S3FaultProxy(("127.0.0.1", s3.ports.s3), seed=3, methods=("PUT",)) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        proxy.fail_next(7, "slowdown")
        with pytest.raises(StorageUnavailable, match=r"PUT failed after 6 attempt\(s\)"):
            ObjectStore(f"{s3_root}/refused").put("a.bin", b"x")
        proxy.heal()
        proxy.fail_next(7, "slowdown")
        store = make_positional_store(f"{s3_root}/written", 2_000, 1_000)  # type: ignore[arg-type]
        assert proxy.faults["slowdown"] == 6 + 7
        assert store.meta.total_tokens == 2_000
        keys = {o.key for o in ObjectStore(f"{s3_root}/written").list()}
        assert keys == {META_NAME, "chunk_000000.bin", "chunk_000001.bin"}
