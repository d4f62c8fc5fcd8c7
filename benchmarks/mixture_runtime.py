"""Run-time mixture weights: what 10,000 weight changes cost the feeder and a checkpoint.

    python benchmarks/mixture_runtime.py [--segments 10000] [--every 100] [--intervals 20]
        [--repeat 3] [--tokens 33554432]

Goals: with 10,000 run-time segments, the feeder's CPU per batch is at most 1.5x a
static mixture's, the stream re-opened at each change included (both segment rows
below); the loader's state dict at 10,000 segments is at most 1 MiB. The static
mixture re-opened at the same steps is shown beside them: what a re-open costs at
any number of segments.

The mixture is benchmarks/mixture_throughput.py's (3 sources, batch 16 x 1024, stride
256, shuffled, one rank, one batch per message: the per-batch costs). Run-time
segments are what OnlineMixer makes: one every `--every` steps, weights of 4 decimals
that sum to 1. Each row starts `tokenfeed serve` in its own process and reads
`--intervals` x `--every` batches with a gRPC client in this process; the feeder's CPU
seconds (from /proc) over those batches, per batch:

* `static`: the mixture as constructed, one stream;
* `static, re-opened`: the same, the stream re-opened every `--every` steps (what a
  re-open costs by itself);
* `N segments`: N run-time segments, one stream from the last one (a long schedule's
  cost per batch);
* `N segments, +1 per re-open`: the run as it happens: every `--every` steps one more
  segment, the stream re-opened at its step with the longer request (the feeder
  extends the mixture it built for the request before).

The segment rows first open the N-segment request once (not counted): the feeder
builds that mixture from scratch, which a run pays once per feeder process (`cold
open` below). Rows are interleaved `--repeat` times; medians are shown, and each
row's ratio to the static row. Then the trainer's side, in this process: a
set_weights call at N segments (CPU, median of 200) and the state dict's size at N
segments, pickled (what torch.save writes) and as JSON, and the request's size.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from statistics import median

from mixture_throughput import SOURCES, make_stores
from procs import process_cpu
from serve_throughput import BATCH, SEQ_LEN
from serve_throughput import spec as dataset_spec

from tokenfeed.cli.process import wait_for_port

STATE_GOAL = 1 << 20  # bytes
CPU_GOAL = 1.5  # x the static mixture's CPU per batch


def weights(rng: random.Random, k: int) -> list[float]:
    """k weights of 4 decimals summing to 1, as OnlineMixer rounds them."""
    cuts = sorted(rng.sample(range(1, 10_000), k - 1))
    units = [b - a for a, b in zip([0, *cuts], [*cuts, 10_000], strict=True)]
    return [u / 10_000 for u in units]


def runtime(n: int, every: int, seed: int = 0):  # -> RuntimeSegments
    """n run-time segments, one every `every` steps of one rank's batches."""
    from tokenfeed.core.mixture import RuntimeSegments

    rng, k = random.Random(seed), len(SOURCES)
    rt = RuntimeSegments(k)
    for j in range(1, n + 1):
        rt = rt.with_segment(j * every * BATCH * SEQ_LEN, weights(rng, k))
    return rt


def mixture_spec(rt=None):  # -> SamplingSpec
    sources = tuple((name, w) for name, w, _ in SOURCES)
    return dataset_spec(dataset="", sources=sources, runtime=b"" if rt is None else rt.data)


@contextmanager
def feeder(data: Path, tmp: Path) -> Iterator[tuple[str, int]]:
    """`tokenfeed serve` over `data`: (address, pid)."""
    port_file = tmp / "port"
    port_file.unlink(missing_ok=True)
    argv = ["--data-root", str(data), "--port", "0", "--port-file", str(port_file)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenfeed", "serve", *argv, "--log-level", "WARNING"]
    )
    try:
        yield f"127.0.0.1:{wait_for_port(proc, port_file)}", proc.pid
    finally:
        proc.terminate()
        proc.wait(30)


def read(stub, params, offset: int, step: int, batches: int) -> int:
    """Open a stream at (offset, step), read `batches` batches, close it."""
    from tokenfeed.v1 import feeder_pb2 as pb

    request = pb.StreamBatchesRequest(
        params=params, offset=offset, step=step, batches_per_message=1, max_message_bytes=1 << 30
    )
    call = stub.StreamBatches(request)
    got = 0
    for response in call:
        got += len(response.batches)
        if got >= batches:
            break
    call.cancel()
    return got


def measure(row: str, data: Path, tmp: Path, args: argparse.Namespace, requests: dict) -> dict:
    """The feeder's CPU per batch of one row (and, for segment rows, the cold open)."""
    import grpc

    from tokenfeed.v1 import feeder_pb2_grpc

    every, n = args.every, args.segments
    out: dict = {}
    with feeder(data, tmp) as (address, pid):
        options = [("grpc.max_receive_message_length", 1 << 30)]
        with grpc.insecure_channel(address, options=options) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            step = n * every  # every row streams from the N-th segment's step on
            if row.startswith("segments"):
                cpu0 = process_cpu(pid)
                read(stub, requests["segments"][0], step * BATCH, step, 1)
                out["cold_open_s"] = process_cpu(pid) - cpu0
            else:
                read(stub, requests["static"], step * BATCH, step, 1)  # connection, chunks
            cpu0, got = process_cpu(pid), 0
            for i in range(args.intervals):
                s = step + i * every
                if row == "static":
                    got += read(stub, requests["static"], s * BATCH, s, every * args.intervals)
                    break
                if row == "segments":
                    params = requests["segments"][0]
                    got += read(stub, params, s * BATCH, s, every * args.intervals)
                    break
                params = requests["static"] if row == "static-reopen" else requests["segments"][i]
                got += read(stub, params, s * BATCH, s, every)
            out["cpu_per_batch_us"] = (process_cpu(pid) - cpu0) * 1e6 / got
    return out


def trainer_side(rt, every: int) -> dict:
    """set_weights CPU at len(rt) segments, the state dict's and the request's sizes."""
    from tokenfeed.client import FeederClient

    names = [name for name, _, _ in SOURCES]
    ld = FeederClient("127.0.0.1:1", spec=mixture_spec())  # no feeder needed here
    state = ld.state_dict()
    n = len(rt)
    step = n * every
    mixture = {**state["mixture"], "runtime": rt.to_state()}
    ld.load_state_dict({**state, "offset": step * BATCH, "step": step, "mixture": mixture})
    rng = random.Random(1)
    costs = []
    for i in range(200):
        w = dict(zip(names, weights(rng, len(names)), strict=True))
        t0 = time.process_time()
        ld.set_weights(w, at_step=step + i * every)
        costs.append(time.process_time() - t0)
    state = ld.state_dict()
    out = {
        "set_weights_ms": median(costs) * 1e3,
        "state_pickle_bytes": len(pickle.dumps(state)),
        "state_json_bytes": len(json.dumps(state)),
        "request_bytes": ld.spec.to_proto().ByteSize(),
        "segments": len(state["mixture"]["runtime"]),
    }
    ld.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--segments", type=int, default=10_000)
    ap.add_argument("--every", type=int, default=100, help="steps between weight changes")
    ap.add_argument("--intervals", type=int, default=20, help="changes measured per row")
    ap.add_argument("--repeat", type=int, default=3, help="runs of every row (median shown)")
    ap.add_argument("--tokens", type=int, default=32 << 20)
    args = ap.parse_args()

    n, every = args.segments, args.every
    t0 = time.process_time()
    base = runtime(n + args.intervals, every)
    record = base.record_bytes
    grown = [type(base)(base.k, base.data[: (n + i) * record]) for i in range(args.intervals)]
    static = mixture_spec()
    first = mixture_spec(grown[0])  # built once here: the others extend it, as a client does
    requests = {
        "static": static.to_proto(),
        "segments": [first.to_proto()]
        + [first.with_(runtime=rt.data).to_proto() for rt in grown[1:]],
    }
    print(f"requests built in {time.process_time() - t0:.1f} s CPU", flush=True)
    rows = ["static", "static-reopen", "segments", "segments-reopen"]
    runs: dict[str, list[dict]] = {row: [] for row in rows}
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as d:
        tmp = Path(d)
        make_stores(tmp / "data", args.tokens)
        for i in range(args.repeat):  # interleaved: a noisy minute hits every row alike
            for row in rows:
                r = measure(row, tmp / "data", tmp, args, requests)
                runs[row].append(r)
                print(
                    f"  run {i + 1}/{args.repeat} {row:16s} {r['cpu_per_batch_us']:8.1f} us/batch",
                    flush=True,
                )
    trainer = trainer_side(grown[0], every)

    labels = {
        "static": "static",
        "static-reopen": f"static, re-opened every {every}",
        "segments": f"{n} segments",
        "segments-reopen": f"{n} segments, +1 per re-open",
    }
    base_us = median(r["cpu_per_batch_us"] for r in runs["static"])
    print(
        f"\nmixture_runtime: batch {BATCH} x {SEQ_LEN}+1 uint16, {len(SOURCES)} sources, one "
        f"rank, 1 batch/message; {args.intervals} x {every} batches per row; median of "
        f"{args.repeat}; {os.cpu_count()} cpus\n"
    )
    print(f"{'row':34s} {'server cpu':>11s} {'vs static':>9s}  each run")
    print(f"{'':34s} {'us/batch':>11s}")
    for row in rows:
        us = [r["cpu_per_batch_us"] for r in runs[row]]
        each = " ".join(
            f"{u / s['cpu_per_batch_us']:.2f}" for u, s in zip(us, runs["static"], strict=True)
        )
        print(f"{labels[row]:34s} {median(us):11.1f} {median(us) / base_us:9.2f}  {each}")
    cold = median(r["cold_open_s"] for r in runs["segments"])
    print(f"\ncold open of {n} segments (once per feeder process): {cold:.2f} s CPU")
    print(
        f"trainer: set_weights at {trainer['segments']} segments "
        f"{trainer['set_weights_ms']:.2f} ms CPU; request "
        f"{trainer['request_bytes'] / 1024:.0f} KiB; state dict "
        f"{trainer['state_pickle_bytes'] / 1024:.0f} KiB pickled, "
        f"{trainer['state_json_bytes'] / 1024:.0f} KiB JSON"
    )
    reopen = {row: median(r["cpu_per_batch_us"] for r in runs[row]) for row in rows}
    print(
        f"like for like: {n} segments +1 per re-open vs static re-opened "
        f"{reopen['segments-reopen'] / reopen['static-reopen']:.2f}x; a re-open alone "
        f"{reopen['static-reopen'] / reopen['static']:.2f}x (batches in flight when the stream "
        "is cancelled, and its start)"
    )
    worst = max(reopen["segments"], reopen["segments-reopen"]) / base_us
    print(
        f"\ngoals: server CPU per batch <= {CPU_GOAL}x static (worst segment row {worst:.2f}x); "
        f"state dict <= 1 MiB ({trainer['state_pickle_bytes'] / STATE_GOAL:.2f} MiB pickled)"
    )


if __name__ == "__main__":
    main()
