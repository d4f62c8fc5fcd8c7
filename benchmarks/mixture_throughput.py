"""A 3-source mixture vs one dataset through the feeder, side by side in one run.

    python benchmarks/mixture_throughput.py [--seconds 3] [--repeat 3] [--tokens 32M]

Goal: a mixture streams at >= 0.9x the tokens/s of one dataset with the same
parameters. Both requests are one SamplingSpec (batch 16 x 1024, stride 256, shift 1,
block shuffle, seed 1), the second with `sources` instead of `dataset`:

* one dataset: `bench`, `--tokens` random uint16 tokens in chunks of 2^20;
* the mixture: `mix-a=0.5, mix-b=0.3, mix-c=0.2` over three stores of 1/2, 5/16 and
  3/16 of `--tokens` (as many tokens in all, so the cache holds the same bytes; sizes
  and weights differ, so the sources' passes end at different positions).

Each row starts `tokenfeed serve` over the same data root in its own process, warms it
up (cache fill, connection) for 0.5 s, then one load-generator process drains 1 or 4
streams of the request for `--seconds` on one asyncio event loop and decodes every
response with protobuf to count its tokens (benchmarks/serve_throughput.py's load
generator, `stream_load`). Rows run at 1 batch per message (the per-batch costs:
sampling, assembly, one message each) and at the client's default message size (31
batches, ~1 MiB), with 1 stream and with 4. The
schedule of rows runs `--repeat` times, rows interleaved; each row reports its median tokens/s
and server CPU seconds per 10^9 tokens, and each mixture row its ratio to the dataset
row beside it (median, and each run's) and its tokens per server CPU second as a ratio
to the dataset's (median CPU per token): on a machine shared with other work the
tokens/s of single runs swing by tens of percent, the CPU a token costs much less.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from procs import process_cpu
from serve_throughput import BATCH, DEFAULT_PER_MESSAGE, SEQ_LEN, STRIDE  # one layout
from serve_throughput import spec as dataset_spec

from tokenfeed.cli.process import wait_for_port

SOURCES = (("mix-a", 0.5, 8), ("mix-b", 0.3, 5), ("mix-c", 0.2, 3))  # name, weight, 16ths


def spec(mixture: bool):  # -> SamplingSpec
    """serve_throughput's sampling over the dataset, or over the mixture of SOURCES."""
    if not mixture:
        return dataset_spec()
    return dataset_spec(dataset="", sources=tuple((name, w) for name, w, _ in SOURCES))


def run_client(address: str, mixture: bool, streams: int, seconds: float, per_message: int):
    """Drain `streams` streams for `seconds` (serve_throughput's load generator); prints
    {"tokens", "messages", "seconds", "cpu"}."""
    from serve_throughput import stream_load

    from tokenfeed.v1 import feeder_pb2 as pb

    params = spec(mixture).to_proto()

    def make_request(epoch: int) -> pb.StreamBatchesRequest:  # a mixture's epoch stays 0
        return pb.StreamBatchesRequest(params=params, epoch=epoch, batches_per_message=per_message)

    print(json.dumps(stream_load(address, streams, seconds, make_request)))


def measure(mixture: bool, streams: int, per_message: int, seconds: float, tmp: Path) -> dict:
    port_file = tmp / "port"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tokenfeed",
            "serve",
            "--data-root",
            str(tmp / "data"),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--log-level",
            "WARNING",
        ]
    )
    try:
        address = f"127.0.0.1:{wait_for_port(proc, port_file)}"
        client = [sys.executable, __file__, "--client", address, "--per-message", str(per_message)]
        client += ["--mixture"] if mixture else []
        subprocess.run([*client, "--seconds", "0.5"], check=True, capture_output=True)  # warm
        cpu0 = process_cpu(proc.pid)
        out = subprocess.run(
            [*client, "--seconds", str(seconds), "--streams", str(streams)],
            check=True,
            stdout=subprocess.PIPE,
        ).stdout
        cpu = process_cpu(proc.pid) - cpu0
    finally:
        proc.terminate()
        proc.wait(30)
    r = json.loads(out)
    return {
        "tokens_s": r["tokens"] / r["seconds"],
        "cpu_per_gtok": cpu * 1e9 / r["tokens"] if r["tokens"] else float("nan"),
    }


def make_stores(root: Path, total: int) -> None:
    import numpy as np

    from tokenfeed.core.store import write_store

    rng = np.random.default_rng(0)
    sizes = [("bench", total)] + [(name, total * n // 16) for name, _, n in SOURCES]
    for name, tokens in sizes:
        write_store(
            root / name,
            rng.integers(0, 50_257, tokens, dtype=np.uint16),
            dtype="uint16",
            tokens_per_chunk=1 << 20,
            vocab_size=50_257,
            eos_token_id=50_256,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of every row (median shown)")
    ap.add_argument("--tokens", type=int, default=32 << 20)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--per-message", type=int, default=1)
    ap.add_argument("--client", metavar="ADDRESS")
    ap.add_argument("--mixture", action="store_true")
    args = ap.parse_args()
    if args.client:
        return run_client(args.client, args.mixture, args.streams, args.seconds, args.per_message)

    schedule = [(1, 1), (1, DEFAULT_PER_MESSAGE), (4, DEFAULT_PER_MESSAGE)]  # streams, per message
    runs: dict[tuple, list[dict]] = {(m, *row): [] for row in schedule for m in (False, True)}
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as d:
        tmp = Path(d)
        make_stores(tmp / "data", args.tokens)
        for i in range(args.repeat):  # interleaved: a noisy minute hits both alike
            for key in runs:
                r = measure(*key, args.seconds, tmp)
                runs[key].append(r)
                print(
                    f"  run {i + 1}/{args.repeat} {'mixture' if key[0] else 'dataset':7s} "
                    f"streams={key[1]} batches/msg={key[2]}: {r['tokens_s'] / 1e6:7.1f} M tokens/s",
                    flush=True,
                )

    def median(rs: list[dict]) -> dict:
        return sorted(rs, key=lambda r: r["tokens_s"])[len(rs) // 2]

    def median_cpu(rs: list[dict]) -> float:
        return sorted(r["cpu_per_gtok"] for r in rs)[len(rs) // 2]

    print(
        f"\nmixture_throughput: batch {BATCH} x {SEQ_LEN}+1 uint16, stride {STRIDE}, shuffled; "
        f"mixture {', '.join(f'{n}={w}' for n, w, _ in SOURCES)}; median of {args.repeat} x "
        f"{args.seconds:g} s per row, loopback, {os.cpu_count()} cpus\n"
    )
    print(
        f"{'request':8s} {'streams':>7s} {'batch/msg':>9s} {'Mtok/s':>8s} {'server cpu':>10s} "
        f"{'vs dataset':>10s} {'per cpu':>8s}  each run"
    )
    print(f"{'':36s}{'s/Gtok':>10s}")
    for streams, per in schedule:
        one, mix = runs[(False, streams, per)], runs[(True, streams, per)]
        for name, rs in (("dataset", one), ("mixture", mix)):
            r = median(rs)
            ratio = r["tokens_s"] / median(one)["tokens_s"]
            each = " ".join(
                f"{x['tokens_s'] / y['tokens_s']:.2f}" for x, y in zip(rs, one, strict=True)
            )
            per_cpu = median_cpu(one) / median_cpu(rs)
            print(
                f"{name:8s} {streams:7d} {per:9d} {r['tokens_s'] / 1e6:8.1f} "
                f"{r['cpu_per_gtok']:10.2f} "
                + (f"{ratio:10.2f} {per_cpu:8.2f}  {each}" if rs is mix else "")
            )
    print(
        "\ngoal: every mixture row >= 0.90 x the dataset row with the same parameters "
        "(vs dataset: tokens/s; per cpu: tokens per server CPU second)"
    )


if __name__ == "__main__":
    main()
