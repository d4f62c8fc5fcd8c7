"""The feeder under load: many streams, slow consumers, clients that vanish.

Bounded in count and time; loopback only. Figures are printed (`pytest -s`);
assertions are about completeness, fairness and memory bounds, never about speed
(docs/README.md, "How the contract is tested").
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

from support.faultproxy import FaultProxy
from support.feeders import FeederProcess, running_feeder
from support.stores import make_positional_store

pytestmark = pytest.mark.slow

MiB = 1 << 20
CACHE = 64 * MiB
# Measured idle RSS of `tokenfeed serve` here is ~57-61 MiB (Python, grpc, numpy,
# prometheus); the peak with 64 streams was 134-146 MiB for a 64 MiB cache. The bound:
OVERHEAD = 96 * MiB


def _params(**kw) -> pb.SamplingParams:
    base = dict(
        dataset="big",
        split="train",
        split_rate=1.0,
        seq_len=256,
        stride=256,
        batch_size=16,
        world_size=64,
        shuffle=True,
        seed=1,
    )
    return pb.SamplingParams(**(base | kw))


def _rss(pid: int) -> tuple[int, int]:
    """(current, peak) resident bytes of a process."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


@pytest.fixture(scope="module")
def big_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """200 MB of uint32 tokens in 4 MB chunks: far more than the 64 MiB cache."""
    root = tmp_path_factory.mktemp("load")
    make_positional_store(root / "big", 50_000_000, 1_000_000)
    return root


async def _stream(
    address: str, rank: int, batches: int, progress: list[int], delay: float = 0.0
) -> list[int]:
    # One connection per stream, as separate trainer processes have (channels to one
    # address in a process would otherwise share one HTTP/2 connection and its window).
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as ch:
        stub = feeder_pb2_grpc.FeederStub(ch)
        call = stub.StreamBatches(pb.StreamBatchesRequest(params=_params(), rank=rank))
        starts: list[int] = []
        async for msg in call:
            for b in msg.batches:
                rows = np.frombuffer(b.tokens, "<u4").reshape(b.rows, b.cols)
                assert np.array_equal(rows[:, 0], np.asarray(b.starts) % (1 << 32))
                starts += list(b.starts)
                progress[rank] += 1
            if progress[rank] >= batches:
                call.cancel()
                break
            if delay:
                await asyncio.sleep(delay)
        return starts


def test_64_concurrent_streams_complete_fairly_within_the_memory_bound(big_root: Path) -> None:
    batches = 120  # of the 190 steps each of 64 ranks has in an epoch
    with FeederProcess(big_root, cache_bytes=CACHE) as proc:
        idle, _ = _rss(proc.proc.pid)
        progress = [0] * 64
        snapshots: dict[str, list[int]] = {}

        async def main() -> list[list[int]]:
            tasks = [
                asyncio.create_task(_stream(proc.address, r, batches, progress)) for r in range(64)
            ]
            # Streams start one after another (each is set up on the server in turn);
            # fairness is judged once all of them are being served.
            while min(progress) == 0 and not any(t.done() for t in tasks):
                await asyncio.sleep(0.005)
            snapshots["all_started"] = list(progress)
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            snapshots["first_done"] = list(progress)
            return await asyncio.gather(*tasks)

        t = time.perf_counter()
        results = asyncio.run(main())
        seconds = time.perf_counter() - t
        _, peak = _rss(proc.proc.pid)
    assert all(len(r) == batches * 16 for r in results)
    every = [s for r in results for s in r]
    assert len(set(every)) == len(every)  # 64 ranks of one epoch: disjoint windows
    # No stream starves: between the moment every stream was served and the moment
    # the first one finished, every stream was served again.
    since = [b - a for a, b in zip(snapshots["all_started"], snapshots["first_done"], strict=True)]
    assert min(snapshots["all_started"]) >= 1 and min(since) >= 1, snapshots
    assert peak < CACHE + OVERHEAD, (idle, peak)
    print(
        f"\n64 streams x {batches} batches of 16x257 uint32 in {seconds:.1f} s; "
        f"server RSS idle {idle / MiB:.0f} MiB, peak {peak / MiB:.0f} MiB "
        f"(bound: cache {CACHE / MiB:.0f} + {OVERHEAD / MiB:.0f} MiB); once all streams "
        f"ran, the slowest got {min(since)} batches while the fastest got {max(since)}"
    )


def test_slow_consumers_do_not_hold_back_fast_ones(big_root: Path) -> None:
    fast_batches = 150  # of the 190 steps each of 64 ranks has in an epoch
    with FeederProcess(big_root, cache_bytes=CACHE) as proc:
        progress = [0] * 64

        async def fast_alone() -> float:
            t = time.perf_counter()
            await asyncio.gather(
                *[_stream(proc.address, r, fast_batches, progress) for r in (0, 1)]
            )
            return time.perf_counter() - t

        alone = asyncio.run(fast_alone())
        _, peak_before = _rss(proc.proc.pid)
        progress = [0] * 64

        async def mixed() -> float:
            slow = [
                asyncio.create_task(_stream(proc.address, r, 10**9, progress, delay=1.0))
                for r in range(2, 10)
            ]
            await asyncio.sleep(1.0)  # the slow ones are stalled with full windows by now
            t = time.perf_counter()
            await asyncio.gather(
                *[_stream(proc.address, r, fast_batches, progress) for r in (0, 1)]
            )
            took = time.perf_counter() - t
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
            return took

        with_slow = asyncio.run(mixed())
        _, peak = _rss(proc.proc.pid)
    assert progress[0] == progress[1] == fast_batches
    assert all(1 <= progress[r] <= 10 for r in range(2, 10)), progress[2:10]
    # Eight stalled streams hold only what HTTP/2 flow control lets them (a few
    # messages each), not a growing backlog.
    assert peak - peak_before < 32 * MiB, (peak_before, peak)
    print(
        f"\nfast pair: {2 * fast_batches / alone:.0f} batches/s alone, "
        f"{2 * fast_batches / with_slow:.0f} batches/s beside 8 slow consumers "
        f"(ratio {alone / with_slow:.2f}); server peak RSS grew "
        f"{(peak - peak_before) / MiB:.1f} MiB"
    )


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _rss_self() -> int:
    return _rss(os.getpid())[0]


def test_a_thousand_vanishing_clients_leak_nothing(big_root: Path) -> None:
    """Clients that start a stream and vanish (connection reset, no cancel), 1,000 times."""
    with running_feeder(big_root, cache_bytes=CACHE) as f:
        proxy = FaultProxy(("127.0.0.1", f.port)).start()

        async def tasks_on_server() -> int:
            return len(asyncio.all_tasks())

        def vanish(n: int) -> None:
            async def one(i: int) -> None:
                # a fresh connection per client, so resetting it is all the server sees
                ch = grpc.aio.insecure_channel(
                    proxy.address, options=[("grpc.use_local_subchannel_pool", 1)]
                )
                call = feeder_pb2_grpc.FeederStub(ch).StreamBatches(
                    pb.StreamBatchesRequest(params=_params(), rank=i % 64)
                )
                try:
                    await call.read()
                finally:
                    proxy.reset_all()  # the peer vanishes: RST, no HTTP/2 goodbye
                    await ch.close(grace=None)

            async def main() -> None:
                for start in range(0, n, 25):
                    await asyncio.gather(
                        *[one(i) for i in range(start, min(n, start + 25))], return_exceptions=True
                    )

            asyncio.run(main())

        def settled() -> tuple[int, int, int, float]:
            # Quiet: no active stream, and the task count steady over 0.3 s (a handler's
            # task outlives its `finally` by the status sent to a dead peer).
            deadline = time.monotonic() + 30
            last = -1
            while time.monotonic() < deadline:
                active = f.registry.get_sample_value("tokenfeed_server_streams_active")
                tasks = f.call(tasks_on_server())
                if active == 0 and tasks == last:
                    break
                last = tasks
                time.sleep(0.3)
            gc.collect()
            return (
                f.call(tasks_on_server()),
                threading.active_count(),
                _fds(),
                f.registry.get_sample_value("tokenfeed_server_streams_active"),
            )

        vanish(100)  # warm up: the thread pool, caches and grpc internals reach steady state
        tasks0, threads0, fds0, active0 = settled()
        rss0 = _rss_self()
        vanish(1000)
        tasks1, threads1, fds1, active1 = settled()
        rss1 = _rss_self()
        connections = proxy.connections
        proxy.stop()
    assert active0 == active1 == 0
    assert tasks1 <= tasks0 and threads1 <= threads0
    assert fds1 <= fds0 + 4  # the test's own sockets may linger a moment
    assert rss1 - rss0 < 48 * MiB, (rss0, rss1)
    assert connections >= 1100
    print(
        f"\n1,100 vanished clients: server tasks {tasks0}->{tasks1}, threads "
        f"{threads0}->{threads1}, fds {fds0}->{fds1}, RSS {rss0 / MiB:.0f}->{rss1 / MiB:.0f} MiB"
    )
