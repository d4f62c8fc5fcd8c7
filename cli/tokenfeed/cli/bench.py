"""`tokenfeed bench`: how fast a running feeder feeds one trainer, measured at the loop.

    tokenfeed bench --address 127.0.0.1:50051 --dataset demo --seconds 10
    tokenfeed bench ... --step-time 0.002     # simulate 2 ms of training per batch

It reports what a trainer feels: tokens per second into the loop, the trainer
process's CPU seconds per 10^9 tokens, how long `next()` blocked (p50/p99/max) and
the data-stall fraction (time waited / wall time). `measure()` is shared with
benchmarks/trainer_loop.py, so the baselines there are timed the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable, Generator, Iterable
from pathlib import Path
from typing import Any


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def measure(
    batches: Callable[[], Iterable[Any]],
    seconds: float,
    step_time: float = 0.0,
    tokens_of: Callable[[Any], int] | None = None,
    extra_cpu: Callable[[], float] | None = None,
    warmup: int = 5,
) -> dict[str, float]:
    """Time a training loop over `batches()` (re-called for each new epoch).

    The loop takes batches for `seconds` of wall time after `warmup` batches, doing
    nothing (`step_time` 0) or sleeping `step_time` per batch like a training step.
    `extra_cpu()` adds CPU seconds spent outside this process on the trainer side
    (DataLoader workers).
    """
    tokens_of = tokens_of or (lambda b: int(b["input_ids"].shape[0] * b["input_ids"].shape[1]))
    waits: list[float] = []
    tokens = 0

    def stream() -> Generator[Any, None, None]:
        while True:
            empty = True
            for b in batches():
                empty = False
                yield b
            if empty:
                raise RuntimeError("the loader yielded no batch")

    it = stream()
    for _ in range(warmup):
        next(it)
    cpu0, extra0 = _cpu_seconds(), (extra_cpu() if extra_cpu else 0.0)
    start = time.perf_counter()
    end = start + seconds
    now = start
    while now < end:
        t0 = time.perf_counter()
        b = next(it)
        now = time.perf_counter()
        waits.append(now - t0)
        tokens += tokens_of(b)
        if step_time:
            time.sleep(step_time)
            now = time.perf_counter()
    wall = now - start
    cpu = _cpu_seconds() - cpu0 + ((extra_cpu() - extra0) if extra_cpu else 0.0)
    it.close()
    waits.sort()
    n = len(waits)
    return {
        "batches": n,
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        "cpu_s_per_1e9_tokens": cpu / tokens * 1e9,
        "wait_p50_ms": waits[n // 2] * 1e3,
        "wait_p99_ms": waits[min(n - 1, int(n * 0.99))] * 1e3,
        "wait_max_ms": waits[-1] * 1e3,
        "stall_fraction": sum(waits) / wall,
    }


def add_arguments(p: argparse.ArgumentParser) -> None:
    from tokenfeed.core.request import SamplingSpec

    p.add_argument(
        "--address",
        default=os.environ.get("TOKENFEED_ADDRESS", "127.0.0.1:50051"),
        help="feeder address(es), comma-separated (default %(default)s)",
    )
    SamplingSpec.add_arguments(p)
    p.add_argument("--batches-per-message", type=int, default=None, help="default: auto")
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--device", default=None, help="e.g. cpu or cuda (default: numpy arrays)")
    p.add_argument("--seconds", type=float, default=10.0, help="how long to measure")
    p.add_argument(
        "--step-time",
        type=float,
        default=0.0,
        help="simulated training seconds per batch (0: an empty loop)",
    )
    p.add_argument("--token-file", default=None, help="file holding the bearer token")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from tokenfeed.client import FeederClient
    from tokenfeed.core.request import SamplingSpec

    token = Path(args.token_file).read_text().strip() if args.token_file else None
    spec = SamplingSpec.from_args(args)
    with FeederClient(
        args.address,
        spec=spec,
        rank=0,
        device=args.device,
        prefetch=args.prefetch,
        batches_per_message=args.batches_per_message,
        token=token,
    ) as client:
        epoch = [0]

        def batches() -> Iterable[Any]:
            if not client.is_mixture:  # a mixture is one endless stream
                client.set_epoch(epoch[0])
                epoch[0] += 1
            return client

        result = measure(batches, args.seconds, args.step_time)
        result["reconnects"] = client.reconnects
    if args.json:
        print(json.dumps(result))
    else:
        what = (
            "mixture " + ",".join(spec.source_names)
            if spec.is_mixture
            else "dataset " + spec.dataset
        )
        print(
            f"feeder {args.address} {what}: {args.batch_size} x "
            f"{args.seq_len} per batch, step time {args.step_time * 1e3:g} ms"
        )
        print(f"  tokens/s              {result['tokens_per_s'] / 1e6:10.1f} M")
        print(f"  batches               {result['batches']:10d}")
        print(f"  trainer CPU / 1e9 tok {result['cpu_s_per_1e9_tokens']:10.1f} s")
        print(
            f"  next() wait p50/p99   {result['wait_p50_ms']:10.3f} / "
            f"{result['wait_p99_ms']:.3f} ms (max {result['wait_max_ms']:.1f})"
        )
        print(f"  stall fraction        {result['stall_fraction'] * 100:10.2f} %")
        print(f"  reconnects            {result['reconnects']:10d}")
    return 0
