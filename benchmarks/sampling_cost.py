"""Cost of the sampling math, on a virtual store of 10^12 tokens (no data needed).

    python benchmarks/sampling_cost.py [--quick]

Prints: the latency of the first batch at a random deep offset (a resume), peak
Python memory while doing it, and the steady-state cost per batch while streaming,
through `DatasetSampler.rounds()` (what the server uses) and `.batches()`; then, side
by side, a mixture of 16 sources with 100 schedule segments through
`MixtureSampler.rounds()` (the mixture math and every source's passes mapped to windows,
what the server uses), as a ratio to one dataset (goal: <= 2x).
Goal: the per-batch cost is under 5% of the server's per-batch send cost;
benchmarks/serve_throughput.py measures that send cost (its bare gRPC ceiling), and
this script measures it too, side by side, with that module's bare server. Costs are
CPU seconds of this process (the machine may be shared), best of interleaved repeats.
"""

from __future__ import annotations

import random
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import DatasetSampler

TOKENS = 10**12
STEADY_BATCHES = 20_000
B, W, SEQ = 16, 64, 1024
REPEATS = 5


def spec(**kw) -> SamplingSpec:
    base = dict(
        dataset="bench",
        split="train",
        split_rate=0.99,
        seq_len=SEQ,
        stride=SEQ,
        batch_size=B,
        world_size=W,
        shift=1,
        shuffle=True,
        seed=1,
    )
    return SamplingSpec(**(base | kw))


def mixture_plan(sources: int = 16, segments: int = 100) -> MixtureSampler:
    """16 sources of 10^8..10^10 tokens, 3-decimal weights, 100 segments over 10^12."""
    rng = np.random.default_rng(0)
    names = [f"source{i:02d}" for i in range(sources)]

    def weights() -> tuple:
        w = [round(float(x), 3) for x in rng.integers(1, 1000, sources) / 1000]
        return tuple(zip(names, w, strict=True))

    starts = np.sort(rng.choice(TOKENS // 4096, segments - 1, replace=False)) * 4096
    mix = spec(
        dataset="",
        sources=weights(),
        schedule=tuple((int(s), weights()) for s in starts),
    )
    totals = tuple(int(x) for x in rng.integers(10**8, 10**10, sources))
    return MixtureSampler(mix, totals, (1 << 24,) * sources)


def per_batch(rounds, batches: int) -> float:
    """CPU seconds per batch over `batches` batches of a rounds() iterator."""
    next(rounds)  # warm: caches, the first small rounds
    n = 0
    t = time.process_time()
    while n < batches:
        n += len(next(rounds))
    return (time.process_time() - t) / n


def main() -> None:
    quick = "--quick" in sys.argv
    sampler = DatasetSampler(spec(), TOKENS)
    global_batch = sampler.batch_size * sampler.world_size
    rng = random.Random(0)
    first = []
    tracemalloc.start()
    for _ in range(200):
        step = rng.randrange(sampler.num_windows // global_batch)
        t = time.perf_counter()
        next(
            sampler.batches(
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

    middle = sampler.num_windows // 2 // global_batch * global_batch
    it = sampler.batches(epoch=3, rank=5, offset=middle)
    t = time.perf_counter()
    for _ in range(STEADY_BATCHES):
        next(it)
    steady_batches = (time.perf_counter() - t) / STEADY_BATCHES

    mplan = mixture_plan()
    mix_offset = (TOKENS // SEQ) // 2 // global_batch * global_batch
    n = 4096 if quick else 16384
    best = {"one": float("inf"), "mix": float("inf")}
    for _ in range(2 if quick else REPEATS):  # interleaved: a noisy minute hits both
        best["one"] = min(best["one"], per_batch(sampler.rounds(3, 5, middle), n))
        best["mix"] = min(best["mix"], per_batch(mplan.rounds(5, mix_offset), n))
    steady, mixed = best["one"], best["mix"]
    m_first = []
    for _ in range(50):
        o = rng.randrange(mplan.mixture.max_position // global_batch - 1) * global_batch
        t = time.process_time()
        next(mplan.rounds(rng.randrange(64), o))
        m_first.append(time.process_time() - t)
    m_first.sort()

    print(
        f"virtual store: {TOKENS:.0e} tokens, {sampler.num_windows:.3e} windows, "
        f"batch 16 x 1024, 64 ranks, block shuffle"
    )
    print(
        f"first batch at a random offset: p50 {first[100] * 1e6:8.1f} us   "
        f"p99 {first[197] * 1e6:8.1f} us"
    )
    print(f"peak Python memory while resuming: {peak / 1024:8.1f} KiB")
    print(f"steady state per batch, rounds():  {steady * 1e6:8.2f} us (the server's path)")
    print(f"steady state per batch, batches(): {steady_batches * 1e6:8.2f} us")
    print(
        f"mixture, 16 sources x 100 segments, rounds(): {mixed * 1e6:8.2f} us per batch "
        f"= {mixed / steady:4.2f}x one dataset (goal <= 2x); first batch at a random "
        f"offset p50 {m_first[25] * 1e6:.0f} us"
    )

    sys.path.insert(0, str(Path(__file__).parent))
    try:
        from serve_throughput import bare_message_seconds
    except ImportError:
        print("(serve_throughput.bare_message_seconds not available: no send-cost ratio)")
        return
    send = bare_message_seconds()
    print(f"bare gRPC send per 16x1025 uint16 message: {send * 1e6:8.1f} us")
    print(f"sampling / send ratio: {steady / send:6.2%} (goal < 5%)")
    print(f"mixture sampling / send ratio: {mixed / send:6.2%} (goal < 5%)")


if __name__ == "__main__":
    main()
