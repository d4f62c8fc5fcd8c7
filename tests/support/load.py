"""Load on a feeder: many raw gRPC streams on one event loop, and clients that vanish.

Shared by tests/server/test_load.py (what must hold under load) and
benchmarks/serve_memory.py (how much memory the server holds meanwhile):

    make_big_store(root)                         # root/"big": 200 MB, 50 chunks of 4 MB
    await stream(address, rank, batches, progress, delay)   # -> the window starts read
    vanish(proxy, n)                             # n streams opened, then reset (RST)
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import numpy as np

from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

from support.faultproxy import FaultProxy
from support.feeders import feeder_params
from support.stores import make_positional_store

RANKS = 64  # the world size of every stream; 190 steps each in an epoch of the big store


def make_big_store(root: Path) -> None:
    """50,000,000 uint32 tokens (token == position) in chunks of 1,000,000: far more
    than the 64 MiB cache the loads run with."""
    make_positional_store(root / "big", 50_000_000, 1_000_000)


# every stream: one of 64 ranks, steps of 16 shuffled 256-token windows, the whole store
_WINDOWS = dict(seq_len=256, stride=256, batch_size=16, world_size=RANKS)
PARAMS = feeder_params(dataset="big", split_rate=1.0, shuffle=True, seed=1, **_WINDOWS)


async def stream(
    address: str, rank: int, batches: int, progress: list[int], delay: float = 0.0
) -> list[int]:
    """Read `rank`'s stream until `batches` batches, counting them in `progress[rank]`;
    `delay` s after each message is a slow consumer's pace. Returns the window starts."""
    # One connection per stream, as separate trainer processes have (channels to one
    # address in a process would otherwise share one HTTP/2 connection and its window).
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as ch:
        stub = feeder_pb2_grpc.FeederStub(ch)
        call = stub.StreamBatches(pb.StreamBatchesRequest(params=PARAMS, rank=rank))
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
                await asyncio.sleep(delay)  # the consumer's pace, not a wait for anything
        return starts


def vanish(proxy: FaultProxy, n: int) -> None:
    """`n` clients, 25 at a time, each on a fresh connection through `proxy`: each
    starts a stream, reads one message and vanishes (the proxy resets every connection:
    an RST, no HTTP/2 goodbye, no cancel)."""

    async def one(i: int) -> None:
        ch = grpc.aio.insecure_channel(
            proxy.address, options=[("grpc.use_local_subchannel_pool", 1)]
        )
        call = feeder_pb2_grpc.FeederStub(ch).StreamBatches(
            pb.StreamBatchesRequest(params=PARAMS, rank=i % RANKS)
        )
        try:
            await call.read()
        finally:
            proxy.reset_all()
            await ch.close(grace=None)

    async def main() -> None:
        for start in range(0, n, 25):
            await asyncio.gather(
                *[one(i) for i in range(start, min(n, start + 25))], return_exceptions=True
            )

    asyncio.run(main())
