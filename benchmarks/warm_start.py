"""A second FeederClient in the same process, from construction to its first batch.

    python benchmarks/warm_start.py                  # ~1 minute; see --help
    python benchmarks/warm_start.py --baseline /tmp/base

One uint16 store behind a local feeder (a `tokenfeed serve` subprocess); batches of
16 x 1024, shuffled, as in benchmarks/peers.py. Each trainer process builds a first
client and takes its first batch (the cold start: imports, the channel, the feeder's
first reads; not counted), closes it, then `--starts` times builds another one and
times it: construction (`FeederClient(...)`), then `set_epoch` and `next(iter(...))`
to the first batch, then `close()`, apart. Shown: the medians, and the CPU seconds per
warm start of the trainer process and of the feeder (from /proc and `resource`: less
noisy than the wall clock on a shared machine).

Variants: `stream` (this revision's client as users call it: iterate first), `info`
(the same client asked `dataset_info` before iterating: an Info call, then the
stream, which is what every start did before the stream told the client what Info
says). `--baseline DIR` also runs `stream@base`: another revision's client against
its own feeder (DIR is that revision's tree with its C extensions built in place, e.g.
`git archive main | tar -x -C /tmp/base` and the `*.so` files copied when the C
sources are the same). Variants are interleaved round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from procs import stat

from tokenfeed.cli.process import serve_argv, wait_for_port
from tokenfeed.core.store import write_store

SEQ_LEN, BATCH, DATASET = 1024, 16, "bench"
VARIANTS = ("stream", "info")


def child(args: argparse.Namespace) -> None:
    """One variant in this (fresh) process; prints a JSON line."""
    import tokenfeed.client
    from tokenfeed.client import FeederClient

    def start() -> tuple[Any, list[float]]:
        t0 = time.perf_counter()
        loader = FeederClient(
            args.address,
            dataset=DATASET,
            seq_len=SEQ_LEN,
            batch_size=BATCH,
            shuffle=True,
            seed=1,
            rank=0,
            world_size=1,
        )
        t1 = time.perf_counter()
        if args.child == "info":
            loader.dataset_info  # noqa: B018 (the Info call)
        loader.set_epoch(0)
        next(iter(loader))
        t2 = time.perf_counter()
        loader.close()
        return loader, [t1 - t0, t2 - t1, time.perf_counter() - t2]

    start()  # the cold start
    times, cpu = [], []
    for _ in range(args.starts):
        c0 = resource.getrusage(resource.RUSAGE_SELF)
        times.append(start()[1])
        c1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu.append(c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime)
    print(
        json.dumps(
            {
                "client": str(Path(tokenfeed.client.__file__).parents[2]),
                "construct": statistics.median(t[0] for t in times),
                "first": statistics.median(t[1] for t in times),
                "close": statistics.median(t[2] for t in times),
                "total": statistics.median(t[0] + t[1] for t in times),
                "cpu": sum(cpu) / len(cpu),
            }
        )
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=16e6, help="store size (default 16M)")
    p.add_argument("--starts", type=int, default=50, help="warm starts per process")
    p.add_argument("--repeat", type=int, default=3, help="rounds of every variant, interleaved")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--baseline",
        type=Path,
        help="another revision's tree (C extensions built): also runs stream@base on its feeder",
    )
    p.add_argument("--json", help="also write every result to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    variants = args.variants.split(",")
    envs = {"": dict(os.environ)}  # each revision's feeder and client: its source roots
    if args.baseline:
        variants.append("stream@base")
        roots = [str(r) for r in sorted(args.baseline.resolve().glob("*/tokenfeed")) if r.is_dir()]
        roots = [str(Path(r).parent) for r in roots]
        envs["@base"] = dict(os.environ, PYTHONPATH=os.pathsep.join(roots))
    results: list[dict[str, Any]] = []
    feeders: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as tmp:
        root = Path(tmp)
        n = int(args.tokens)
        tokens = np.random.default_rng(0).integers(0, 50257, n, dtype=np.uint16)
        write_store(root / DATASET, tokens, dtype="uint16", tokens_per_chunk=1 << 21)
        try:
            for name, env in envs.items():
                port_file = root / f"port{name}"
                proc = subprocess.Popen(
                    serve_argv(root, port_file),
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    env=env,
                )
                feeders[name] = proc, f"127.0.0.1:{wait_for_port(proc, port_file)}"
            print(
                f"store: {n / 1e6:.0f}M uint16 tokens; batches {BATCH} x {SEQ_LEN}, shuffled; "
                f"{args.starts} warm starts per process, {args.repeat} rounds; "
                f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at the start",
                flush=True,
            )
            for k in range(args.repeat):
                order = variants[k % len(variants) :] + variants[: k % len(variants)]
                for variant in order:
                    rev = "@base" if variant.endswith("@base") else ""
                    feeder, address = feeders[rev]
                    feeder_cpu0 = stat(feeder.pid)[1]
                    child_args = ["--child", variant.removesuffix("@base"), "--address", address]
                    out = subprocess.run(
                        [sys.executable, __file__, *child_args, "--starts", str(args.starts)],
                        check=True,
                        capture_output=True,
                        text=True,
                        env=envs[rev],
                    )
                    r = json.loads(out.stdout.strip().splitlines()[-1])
                    if rev:  # the other revision's client was the one imported
                        assert Path(r["client"]).parent == args.baseline.resolve(), r["client"]
                    # the cold start included: an upper bound of the warm starts' share
                    r["feeder_cpu"] = (stat(feeder.pid)[1] - feeder_cpu0) / (args.starts + 1)
                    r["variant"], r["round"] = variant, k
                    results.append(r)
        finally:
            for feeder, _ in feeders.values():
                feeder.terminate()
                feeder.wait(30)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    report(results, variants)


def report(results: list[dict[str, Any]], variants: list[str]) -> None:
    def med(variant: str, key: str) -> float:
        return statistics.median(r[key] for r in results if r["variant"] == variant)

    print(
        f"\n{'variant':<13} {'construct ms':>12} {'to first ms':>11} {'total ms':>9} "
        f"{'close ms':>9} {'CPU ms':>7} {'feeder CPU ms':>13}  (medians over rounds)"
    )
    for v in variants:
        print(
            f"{v:<13} {med(v, 'construct') * 1e3:>12.2f} {med(v, 'first') * 1e3:>11.2f} "
            f"{med(v, 'total') * 1e3:>9.2f} {med(v, 'close') * 1e3:>9.2f} "
            f"{med(v, 'cpu') * 1e3:>7.2f} {med(v, 'feeder_cpu') * 1e3:>13.2f}"
        )
    base = "stream@base" if "stream@base" in variants else "info"
    if "stream" in variants and base in variants:
        print(
            f"\nstream / {base}: total {med('stream', 'total') / med(base, 'total'):.2f}x, "
            f"CPU {med('stream', 'cpu') / med(base, 'cpu'):.2f}x, feeder CPU "
            f"{med('stream', 'feeder_cpu') / med(base, 'feeder_cpu'):.2f}x"
        )


if __name__ == "__main__":
    main()
