"""The feeder under load: many streams, slow consumers, clients that vanish.

Bounded in count and time; loopback only. Figures are printed (`pytest -s`);
assertions are about completeness, fairness and leaks (tasks, threads, descriptors),
never about speed or size. The server's memory under
the same loads is measured against its bounds by benchmarks/serve_memory.py
(docs/README.md, "How the contract is tested").
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
from pathlib import Path

import pytest

from support import until, wait_until
from support.faultproxy import FaultProxy
from support.feeders import FeederProcess, running_feeder
from support.load import RANKS, make_big_store, stream, vanish

pytestmark = pytest.mark.slow

CACHE = 64 << 20


@pytest.fixture(scope="module")
def big_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("load")
    make_big_store(root)
    return root


def test_64_concurrent_streams_complete_fairly(big_root: Path) -> None:
    batches = 120  # of the 190 steps each of 64 ranks has in an epoch
    with FeederProcess(big_root, cache_bytes=CACHE) as proc:
        progress = [0] * RANKS
        snapshots: dict[str, list[int]] = {}

        async def main() -> list[list[int]]:
            tasks = [
                asyncio.create_task(stream(proc.address, r, batches, progress))
                for r in range(RANKS)
            ]
            # Streams start one after another (each is set up on the server in turn);
            # fairness is judged once all of them are being served.
            await until(
                lambda: min(progress) > 0 or any(t.done() for t in tasks),
                60,
                "a first batch on every stream",
            )
            snapshots["all_started"] = list(progress)
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            snapshots["first_done"] = list(progress)
            return await asyncio.gather(*tasks)

        t = time.perf_counter()
        results = asyncio.run(main())
        seconds = time.perf_counter() - t
    assert all(len(r) == batches * 16 for r in results)
    every = [s for r in results for s in r]
    assert len(set(every)) == len(every)  # 64 ranks of one epoch: disjoint windows
    # No stream starves: between the moment every stream was served and the moment
    # the first one finished, every stream was served again.
    since = [b - a for a, b in zip(snapshots["all_started"], snapshots["first_done"], strict=True)]
    assert min(snapshots["all_started"]) >= 1, snapshots
    assert min(since) >= 1, snapshots
    print(
        f"\n64 streams x {batches} batches of 16x257 uint32 in {seconds:.1f} s; once all "
        f"streams ran, the slowest got {min(since)} batches while the fastest got {max(since)}"
    )


def test_slow_consumers_do_not_hold_back_fast_ones(big_root: Path) -> None:
    fast_batches = 150  # of the 190 steps each of 64 ranks has in an epoch
    with FeederProcess(big_root, cache_bytes=CACHE) as proc:
        progress = [0] * RANKS

        async def fast_alone() -> float:
            t = time.perf_counter()
            await asyncio.gather(*[stream(proc.address, r, fast_batches, progress) for r in (0, 1)])
            return time.perf_counter() - t

        alone = asyncio.run(fast_alone())
        progress = [0] * RANKS

        async def mixed() -> float:
            slow = [
                asyncio.create_task(stream(proc.address, r, 10**9, progress, delay=1.0))
                for r in range(2, 10)
            ]
            await until(lambda: min(progress[2:10]) > 0, 60, "a first batch on every slow stream")
            t = time.perf_counter()
            await asyncio.gather(*[stream(proc.address, r, fast_batches, progress) for r in (0, 1)])
            took = time.perf_counter() - t
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)
            return took

        with_slow = asyncio.run(mixed())
    assert progress[0] == progress[1] == fast_batches
    assert all(1 <= progress[r] <= 10 for r in range(2, 10)), progress[2:10]
    print(
        f"\nfast pair: {2 * fast_batches / alone:.0f} batches/s alone, "
        f"{2 * fast_batches / with_slow:.0f} batches/s beside 8 slow consumers "
        f"(ratio {alone / with_slow:.2f})"
    )


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_thousand_vanishing_clients_leak_nothing(big_root: Path) -> None:
    """Clients that start a stream and vanish (connection reset, no cancel), 1,000 times."""
    with running_feeder(big_root, cache_bytes=CACHE) as f:
        proxy = FaultProxy(("127.0.0.1", f.port)).start()

        async def tasks_on_server() -> int:
            return len(asyncio.all_tasks())

        idle_tasks = f.call(tasks_on_server())  # a serving feeder before any client

        def settled() -> tuple[int, int, float]:
            # A handler's task outlives its `finally` by the status sent to a dead peer:
            # settled once no stream is active, the server runs no more tasks than idle
            # and the proxy's connection threads (in this process too) have ended.
            def active() -> float:
                return f.registry.get_sample_value("tokenfeed_server_streams_active")

            wait_until(
                lambda: active() == 0 and f.call(tasks_on_server()) <= idle_tasks and proxy.quiet(),
                30,
                f"no active stream, the {idle_tasks} tasks of an idle server, a quiet proxy",
            )
            gc.collect()
            # the chunk files the feeder keeps open for the streams that follow
            # (inplace.KEEP_SECONDS) are not a leak: bounded, and closed in time
            kept = len(f.server.service.files)
            return threading.active_count(), _fds() - kept, active()

        vanish(proxy, 100)  # warm up: the thread pool, caches and grpc internals reach steady state
        threads0, fds0, active0 = settled()
        vanish(proxy, 1000)
        threads1, fds1, active1 = settled()
        # a task may still start after the proxy is quiet (a reset connection's last
        # call reaching the servicer under load): none may remain
        seen: list[int] = []
        wait_until(
            lambda: seen.append(f.call(tasks_on_server())) or seen[-1] <= idle_tasks,
            10,
            f"the server's tasks back to the {idle_tasks} of an idle server",
        )
        tasks1 = seen[-1]
        connections = proxy.connections
        proxy.stop()
    assert active0 == active1 == 0
    assert tasks1 <= idle_tasks
    assert threads1 <= threads0
    assert fds1 <= fds0 + 4  # the test's own sockets may linger a moment
    assert connections >= 1100
    print(
        f"\n1,100 vanished clients: server tasks {idle_tasks}->{tasks1}, threads "
        f"{threads0}->{threads1}, fds {fds0}->{fds1}"
    )
