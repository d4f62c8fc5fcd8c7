"""Cost of the sampling math, on a virtual store of 10^12 tokens (no data needed).

    python benchmarks/sampling_cost.py

Prints: the latency of the first batch at a random deep offset (a resume), peak
Python memory while doing it, and the steady-state cost per batch while streaming,
through `Plan.rounds()` (what the server uses) and `Plan.batches()`.
Issue 3's goal: the per-batch cost is under 5% of the server's per-batch send cost;
benchmarks/serve_throughput.py measures that send cost (its bare gRPC ceiling), and
this script measures it too, side by side, with that module's bare server.
"""

from __future__ import annotations

import random
import sys
import time
import tracemalloc
from pathlib import Path

from tokenfeed.core.sampling import Plan

TOKENS = 10**12
STEADY_BATCHES = 20_000


def main() -> None:
    plan = Plan(
        total_tokens=TOKENS,
        split="train",
        split_rate=0.99,
        seq_len=1024,
        stride=1024,
        batch_size=16,
        world_size=64,
        shift=1,
        shuffle=True,
        seed=1,
    )
    global_batch = plan.batch_size * plan.world_size
    rng = random.Random(0)
    first = []
    tracemalloc.start()
    for _ in range(200):
        step = rng.randrange(plan.num_windows // global_batch)
        t = time.perf_counter()
        next(
            plan.batches(
                epoch=rng.randrange(100),
                rank=rng.randrange(64),
                offset=step * global_batch,
                step=step,
            )
        )
        first.append(time.perf_counter() - t)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    first.sort()

    middle = plan.num_windows // 2 // global_batch * global_batch
    it = plan.batches(epoch=3, rank=5, offset=middle)
    t = time.perf_counter()
    for _ in range(STEADY_BATCHES):
        next(it)
    steady_batches = (time.perf_counter() - t) / STEADY_BATCHES
    # The server takes Rounds (many batches as arrays), not one BatchPlan at a time.
    rounds, n = plan.rounds(epoch=3, rank=5, offset=middle), 0
    t = time.perf_counter()
    while n < STEADY_BATCHES:
        n += len(next(rounds))
    steady = (time.perf_counter() - t) / n

    print(
        f"virtual store: {TOKENS:.0e} tokens, {plan.num_windows:.3e} windows, "
        f"batch 16 x 1024, 64 ranks, block shuffle"
    )
    print(
        f"first batch at a random offset: p50 {first[100] * 1e6:8.1f} us   "
        f"p99 {first[197] * 1e6:8.1f} us"
    )
    print(f"peak Python memory while resuming: {peak / 1024:8.1f} KiB")
    print(f"steady state per batch, rounds():  {steady * 1e6:8.2f} us (the server's path)")
    print(f"steady state per batch, batches(): {steady_batches * 1e6:8.2f} us")

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from serve_throughput import bare_message_seconds
    except ImportError:
        print("(serve_throughput.bare_message_seconds not available: no send-cost ratio)")
        return
    send = bare_message_seconds()
    print(f"bare gRPC send per 16x1025 uint16 message: {send * 1e6:8.1f} us")
    print(f"sampling / send ratio: {steady / send:6.2%} (goal < 5%)")


if __name__ == "__main__":
    main()
