"""The feeder's memory under load, each figure against its bound.

    python benchmarks/serve_memory.py [--batches 120] [--fast-batches 150] [--vanish 1000]

The three loads of tests/server/test_load.py (tests/support/load.py drives both), on
loopback, each against its own `tokenfeed serve --cache-bytes 64M` over 200 MB of
uint32 tokens in 4 MB chunks (far more than the cache). The test checks what holds
on any machine: every stream completes, fairly, and nothing leaks (tasks, threads,
descriptors). How much memory the server holds meanwhile depends on the allocator,
the page size and the Python build, so it is measured here, from /proc/PID/status:

* 64 concurrent streams of `--batches` batches: the server's peak RSS (VmHWM) stays
  within the cache + 96 MiB (idle, `tokenfeed serve` holds ~57-61 MiB: Python, grpc,
  numpy, prometheus; the peak was 134-146 MiB);
* 8 consumers reading one message a second beside 2 fast streams of
  `--fast-batches`: the server's peak RSS grows less than 32 MiB over the fast pair's
  alone (HTTP/2 flow control lets a stalled stream hold a few messages, not a backlog);
* `--vanish` clients that start a stream and vanish (their connection reset, no
  cancel), after 100 to warm up: the server's RSS grows less than 48 MiB.

Each figure is printed against its bound; the exit status is 1 if one is over.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support import free_port, until, wait_until
from support.faultproxy import FaultProxy
from support.feeders import FeederProcess
from support.load import RANKS, make_big_store, stream, vanish

MiB = 1 << 20
CACHE = 64 * MiB

Row = tuple[str, int, int]  # what was measured, bytes, the bound in bytes


def rss(pid: int) -> tuple[int, int]:
    """(current, peak) resident bytes of a process: VmRSS, VmHWM."""
    lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in lines)
    return int(fields["VmRSS"].split()[0]) * 1024, int(fields["VmHWM"].split()[0]) * 1024


def concurrent(root: Path, batches: int) -> Row:
    with FeederProcess(root, cache_bytes=CACHE) as proc:
        idle, _ = rss(proc.proc.pid)
        progress = [0] * RANKS

        async def main() -> None:
            await asyncio.gather(
                *[stream(proc.address, r, batches, progress) for r in range(RANKS)]
            )

        asyncio.run(main())
        _, peak = rss(proc.proc.pid)
    what = f"{RANKS} streams x {batches} batches: peak RSS (idle {idle / MiB:.0f} MiB)"
    return what, peak, CACHE + 96 * MiB


def stalled(root: Path, batches: int) -> Row:
    with FeederProcess(root, cache_bytes=CACHE) as proc:
        progress = [0] * RANKS

        async def fast_pair() -> None:
            await asyncio.gather(*[stream(proc.address, r, batches, progress) for r in (0, 1)])

        asyncio.run(fast_pair())
        _, alone = rss(proc.proc.pid)
        progress[:] = [0] * RANKS

        async def beside_slow_ones() -> None:
            slow = [
                asyncio.create_task(stream(proc.address, r, 10**9, progress, delay=1.0))
                for r in range(2, 10)
            ]
            await until(lambda: min(progress[2:10]) > 0, 60, "a first batch on every slow stream")
            await fast_pair()
            for task in slow:
                task.cancel()
            await asyncio.gather(*slow, return_exceptions=True)

        asyncio.run(beside_slow_ones())
        _, peak = rss(proc.proc.pid)
    return "8 slow consumers beside 2 fast streams: peak RSS grew", peak - alone, 32 * MiB


def vanished(root: Path, clients: int) -> Row:
    metrics_port = free_port()
    with FeederProcess(root, cache_bytes=CACHE, metrics_port=metrics_port) as proc:
        proxy = FaultProxy(("127.0.0.1", proc.port)).start()

        def settled() -> int:
            wait_until(lambda: streams_active(metrics_port) == 0, 30, "no active stream")
            return rss(proc.proc.pid)[0]

        vanish(proxy, 100)  # warm up: the thread pool, caches and grpc internals
        before = settled()
        vanish(proxy, clients)
        after = settled()
        proxy.stop()
    return f"{clients:,} clients vanished: RSS grew", after - before, 48 * MiB


def streams_active(metrics_port: int) -> float:
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    name = "tokenfeed_server_streams_active "
    return next(float(line[len(name) :]) for line in text.splitlines() if line.startswith(name))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, default=120, help="per concurrent stream (of 190)")
    ap.add_argument("--fast-batches", type=int, default=150, help="per fast stream (of 190)")
    ap.add_argument("--vanish", type=int, default=1000, help="clients that vanish")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as d:
        root = Path(d)
        make_big_store(root)
        rows = [
            concurrent(root, args.batches),
            stalled(root, args.fast_batches),
            vanished(root, args.vanish),
        ]
    print(f"\nserve_memory: the server's memory, --cache-bytes {CACHE / MiB:.0f}M, loopback\n")
    print(f"{'load':62s} {'MiB':>6s} {'bound':>6s}")
    for what, value, bound in rows:
        verdict = "ok" if value < bound else "OVER"
        print(f"{what:62s} {value / MiB:6.1f} {bound / MiB:6.0f}  {verdict}")
    return 0 if all(value < bound for _, value, bound in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
