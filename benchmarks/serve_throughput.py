"""Feeder throughput vs the bare gRPC ceiling, side by side in one run on loopback.

    python benchmarks/serve_throughput.py [--seconds 3] [--repeat 3] [--tokens 32M]
    python benchmarks/serve_throughput.py --cpu [--baseline DIR]   # server CPU vs bare
    python benchmarks/serve_throughput.py --workers-rows           # workers and replicas

Rows of 16 x (1024 + 1) uint16 tokens, shuffled. Each configuration runs a server in
its own process and one load-generator process that drains 1 or 4 streams for
`--seconds`:

* tokenfeed: `python -m tokenfeed serve` over a random store;
* bare: a minimal grpc.aio server (uvloop, same method name) that streams one
  pre-built, pre-serialized response of exactly the same size over and over: the
  ceiling of gRPC itself for that message size on this machine;
* base (with `--baseline DIR`): the tokenfeed server of another checkout's source
  roots (`git archive <rev> | tar -x -C DIR`), so a change is measured beside what
  it replaces.

`--cpu` runs the one-stream rows at 1 batch per message and at the client's default
(31 batches, ~1 MiB) and prints each server's CPU seconds per 10^9 tokens against
bare grpc.aio's, with the ratio in every repeat (goal: at most 2x at the default
size). CPU per token is the steadier figure here: tokens/s swings with what
else the two cores run, and both servers share them with the load generator.

The load generator runs every stream on one asyncio event loop (one channel per
stream, as separate trainers would have) and decodes each response with protobuf to
count its tokens exactly, the same for both servers. One process on purpose: on a
two-core machine the clients share the CPU with the server, and four synchronous
client processes spent ~190 us of CPU per message (~140 for one asyncio process), so
the 4-stream row measured clients fighting the server for the cores, not the server.
Client CPU per 1e9 tokens is printed beside the server's so the split stays visible.

The whole schedule of rows runs `--repeat` times, rows interleaved, and each row reports its
median: this machine is noisy (+-15 % between identical runs). Reported: total
tokens/s, messages/s, server and client CPU seconds per 10^9 tokens, and the ratio to
the bare ceiling at the same message size (batches per message).

`--workers-rows` runs `tokenfeed serve --workers 1` (one process) beside `--workers 2`
(a supervisor and two worker processes on one port) and beside 2 replicas (two
separate servers; stream i dials replica i mod 2, as rank r starts on endpoint r mod
n) at the client's default message size (31 batches, ~1 MiB) with 1 and 4 streams,
and reports the server's CPU per token summed over all its processes and split by
process: per-worker CPU per token should stay within 10 % of one process's, so a
node's capacity is its cores times one core's figure (printed for a 16-core node, one
core left to the system).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from procs import process_cpu

from tokenfeed.cli.process import wait_for_port
from tokenfeed.client.options import Options
from tokenfeed.core.atomic import write_atomic

SEQ_LEN, BATCH, STRIDE = 1024, 16, 256
# the client's default batches per message for these batches (~1 MiB, options.py)
DEFAULT_PER_MESSAGE = Options().message_batches(BATCH, SEQ_LEN, 2)
METHOD = "/tokenfeed.v1.Feeder/StreamBatches"


def spec(**changes: Any):  # -> SamplingSpec
    """The benchmark's sampling: 16 x 1024 windows, stride 256, shuffled; `changes`
    (benchmarks/mixture_throughput.py: a mixture of the same layout)."""
    from tokenfeed.core.request import SamplingSpec

    layout = dict(dataset="bench", seq_len=SEQ_LEN, stride=STRIDE, batch_size=BATCH)
    return SamplingSpec(**{**layout, "shift": 1, "seed": 1, "shuffle": True, **changes})


def request(per_message: int, epoch: int):
    from tokenfeed.v1 import feeder_pb2 as pb

    return pb.StreamBatchesRequest(
        params=spec().to_proto(), epoch=epoch, batches_per_message=per_message
    )


# ---------------------------------------------------------------------- processes


def run_client(address: str, streams: int, seconds: float, per_message: int) -> None:
    """`streams` streams (epoch after epoch) for `seconds`; prints stream_load's figures."""
    print(json.dumps(stream_load(address, streams, seconds, partial(request, per_message))))


def stream_load(
    address: str, streams: int, seconds: float, make_request: Callable[[int], Any]
) -> dict[str, float]:
    """Drain `streams` streams of `make_request(epoch)`, epoch after epoch, for `seconds`
    on one event loop (one channel per stream, as separate trainers would have):
    {"tokens", "messages", "seconds", "cpu"} (cpu: this process, while streaming).
    benchmarks/mixture_throughput.py drives its streams with it too."""
    import asyncio

    import grpc

    from tokenfeed.server.app import new_event_loop
    from tokenfeed.v1 import feeder_pb2 as pb

    async def drain(channel: grpc.aio.Channel, end: float) -> tuple[int, int]:
        call = channel.unary_stream(
            METHOD,
            request_serializer=pb.StreamBatchesRequest.SerializeToString,
            response_deserializer=pb.StreamBatchesResponse.FromString,
        )
        tokens = messages = epoch = 0
        while time.perf_counter() < end:
            stream = call(make_request(epoch), wait_for_ready=True)
            async for msg in stream:
                for b in msg.batches:
                    tokens += b.rows * b.cols
                messages += 1
                if time.perf_counter() >= end:
                    stream.cancel()
                    break
            epoch += 1
        return tokens, messages

    async def main() -> dict[str, float]:
        opts = [("grpc.max_receive_message_length", -1)]
        addresses = address.split(",")  # replicas: stream i dials i mod n, as ranks do
        channels = [
            grpc.aio.insecure_channel(addresses[i % len(addresses)], options=opts)
            for i in range(streams)
        ]
        for ch in channels:
            await asyncio.wait_for(ch.channel_ready(), 60)
        cpu0, t0 = time.process_time(), time.perf_counter()
        done = await asyncio.gather(*(drain(ch, t0 + seconds) for ch in channels))
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        for ch in channels:
            await ch.close()
        return {
            "tokens": sum(t for t, _ in done),
            "messages": sum(m for _, m in done),
            "seconds": elapsed,
            "cpu": cpu,
        }

    return new_event_loop().run_until_complete(main())


def run_bare(port_file: str, per_message: int) -> None:
    """The ceiling: stream one pre-serialized message of the same size forever."""
    import grpc
    import numpy as np

    from tokenfeed.server.app import new_event_loop
    from tokenfeed.v1 import feeder_pb2 as pb

    rng = np.random.default_rng(0)
    resp = pb.StreamBatchesResponse()
    for i in range(per_message):
        resp.batches.add(
            epoch=0,
            step=i,
            offset=i * BATCH,
            shift=1,
            rows=BATCH,
            cols=SEQ_LEN + 1,
            dtype="uint16",
            starts=rng.integers(0, 1 << 25, BATCH).tolist(),
            tokens=rng.integers(0, 1 << 16, BATCH * (SEQ_LEN + 1), dtype=np.uint16).tobytes(),
        )
    payload = resp.SerializeToString()

    async def stream(request: bytes, context: grpc.aio.ServicerContext) -> None:
        while True:
            await context.write(payload)

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", -1)])
        handler = grpc.method_handlers_generic_handler(
            "tokenfeed.v1.Feeder",
            {
                "StreamBatches": grpc.unary_stream_rpc_method_handler(
                    stream, request_deserializer=bytes, response_serializer=bytes
                )
            },
        )
        server.add_generic_rpc_handlers((handler,))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        write_atomic(Path(port_file), str(port).encode())
        await server.wait_for_termination()

    new_event_loop().run_until_complete(main())


# ------------------------------------------------------------------------- driver


def tree_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of `pid` and of each of its live children (the `--workers` processes)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    out = {pid: process_cpu(pid)}
    for k in kids:
        with contextlib.suppress(OSError):
            out[int(k)] = process_cpu(int(k))
    return out


def workers_of(kind: str) -> int:
    """tokenfeed-w2 -> 2 (`--workers 2`); plain tokenfeed -> 1."""
    return int(kind.rsplit("-w", 1)[1]) if "-w" in kind else 1


def replicas_of(kind: str) -> int:
    """tokenfeed-r2 -> 2 separate servers; anything else -> 1."""
    return int(kind.rsplit("-r", 1)[1]) if "-r" in kind else 1


BASELINE: Path | None = None  # --baseline: the checkout whose server the "base" rows run


def start_server(kind: str, data_root: Path, per_message: int, tmp: Path, i: int = 0) -> tuple:
    port_file = tmp / f"port-{kind}-{per_message}-{i}"
    port_file.unlink(missing_ok=True)
    env = None
    if kind == "bare":
        argv = [
            sys.executable,
            __file__,
            "--bare",
            str(port_file),
            "--per-message",
            str(per_message),
        ]
    else:
        argv = [
            sys.executable,
            "-m",
            "tokenfeed",
            "serve",
            "--data-root",
            str(data_root),
            "--port",
            "0",
            "--port-file",
            str(port_file),
            "--log-level",
            "WARNING",
        ]
        if workers_of(kind) > 1:
            argv += ["--workers", str(workers_of(kind))]
    if kind == "base":
        assert BASELINE is not None, "--baseline DIR is needed for base rows"
        env = checkout_env(BASELINE)
    proc = subprocess.Popen(argv, env=env)
    return proc, f"127.0.0.1:{wait_for_port(proc, port_file)}"


def checkout_env(checkout: Path) -> dict[str, str]:
    """The environment that runs another checkout's tokenfeed (`--baseline DIR`): its
    source roots first on the path (the first root holding tokenfeed/server wins)."""
    roots = [str(checkout / r) for r in ("core", "server", "client", "prepare", "protos", "cli")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(roots)}


def measure(
    kind: str, streams: int, per_message: int, seconds: float, data_root: Path, tmp: Path
) -> dict:
    servers = [start_server(kind, data_root, per_message, tmp, i) for i in range(replicas_of(kind))]
    procs = [p for p, _ in servers]
    address = ",".join(a for _, a in servers)
    client = [sys.executable, __file__, "--client", address, "--per-message", str(per_message)]

    def cpu_now() -> dict[int, float]:
        return {pid: c for p in procs for pid, c in tree_cpu(p.pid).items()}

    try:
        # warm up (cache fill, connection setup) outside the measurement
        warm = str(max(streams, len(procs)))
        subprocess.run(
            [*client, "--seconds", "0.5", "--streams", warm], check=True, capture_output=True
        )
        cpu0 = cpu_now()
        out = subprocess.run(
            [*client, "--seconds", str(seconds), "--streams", str(streams)],
            check=True,
            stdout=subprocess.PIPE,
        ).stdout
        cpu1 = cpu_now()
        per_process = {p: cpu1[p] - cpu0.get(p, 0.0) for p in cpu1}
        cpu = sum(per_process.values())
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(30)
    r = json.loads(out)
    per_gtok = 1e9 / r["tokens"] if r["tokens"] else float("nan")
    first = {p.pid for p in procs}
    return {
        "kind": kind,
        "streams": streams,
        "per_message": per_message,
        "tokens_s": r["tokens"] / r["seconds"],
        "msgs_s": r["messages"] / r["seconds"],
        "cpu_per_gtok": cpu * per_gtok,
        "client_cpu_per_gtok": r["cpu"] * per_gtok,
        # CPU seconds of each process while streaming: a supervisor first, then its workers
        "cpu_split": [per_process[p] for p in sorted(per_process, key=lambda p: p not in first)],
    }


def bare_message_seconds(seconds: float = 3.0) -> float:
    """Wall time per message of the bare gRPC ceiling at one 16 x 1025 uint16 batch per
    message (benchmarks/sampling_cost.py compares the sampling cost with it)."""
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as d:
        return 1.0 / measure("bare", 1, 1, seconds, Path(d), Path(d))["msgs_s"]


def make_store(root: Path, total: int) -> None:
    import numpy as np

    from tokenfeed.core.store import write_store

    rng = np.random.default_rng(0)
    write_store(
        root / "bench",
        rng.integers(0, 50_257, total, dtype=np.uint16),
        dtype="uint16",
        tokens_per_chunk=1 << 20,
        vocab_size=50_257,
        eos_token_id=50_256,
    )


def median_row(runs: list[dict]) -> dict:
    """The run with the median tokens/s (its CPU figures come with it)."""
    return sorted(runs, key=lambda r: r["tokens_s"])[len(runs) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--repeat", type=int, default=3, help="runs of every row (median shown)")
    ap.add_argument("--tokens", type=int, default=32 << 20)
    ap.add_argument("--per-message", type=int, default=1)
    ap.add_argument("--streams", type=int, default=1)
    ap.add_argument("--client", metavar="ADDRESS")
    ap.add_argument("--bare", metavar="PORT_FILE")
    ap.add_argument("--stretch", type=int, default=16, help="batches per message, stretch rows")
    ap.add_argument("--only", help="comma-separated rows to run, e.g. tokenfeed:1:1 (debugging)")
    ap.add_argument(
        "--workers-rows",
        action="store_true",
        help="--workers 1 vs 2 vs 2 replicas (see the docstring)",
    )
    ap.add_argument(
        "--cpu", action="store_true", help="server CPU per token vs bare, 1 stream (docstring)"
    )
    ap.add_argument(
        "--baseline", metavar="DIR", type=Path, help="also run DIR's server (rows 'base')"
    )
    args = ap.parse_args()
    if args.client:
        return run_client(args.client, args.streams, args.seconds, args.per_message)
    if args.bare:
        return run_bare(args.bare, args.per_message)
    global BASELINE
    BASELINE = args.baseline
    servers = ["bare", "tokenfeed", *(["base"] if args.baseline else [])]

    k = args.stretch
    schedule = [
        ("bare", 1, 1),
        ("tokenfeed", 1, 1),
        ("bare", 4, 1),
        ("tokenfeed", 4, 1),
        ("bare", 1, k),
        ("tokenfeed", 1, k),
        ("tokenfeed", 4, k),
    ]
    if args.workers_rows:
        d = DEFAULT_PER_MESSAGE
        schedule = [
            ("tokenfeed", 1, d),
            ("tokenfeed-w2", 1, d),
            ("tokenfeed", 4, d),
            ("tokenfeed-w2", 4, d),
            ("tokenfeed-r2", 4, d),
        ]
    if args.cpu:
        schedule = [(kind, 1, m) for m in (1, DEFAULT_PER_MESSAGE) for kind in servers]
    elif args.baseline:
        schedule += [("base", 1, 1), ("base", 1, k)]
    if args.only:
        schedule = [
            (k_, int(s_), int(m_)) for k_, s_, m_ in (x.split(":") for x in args.only.split(","))
        ]
    runs: dict[tuple, list[dict]] = {row: [] for row in schedule}
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as d:
        tmp = Path(d)
        make_store(tmp / "data", args.tokens)
        for i in range(args.repeat):  # interleaved, so a noisy minute hits every row alike
            for row in schedule:
                r = measure(*row, args.seconds, tmp / "data", tmp)
                runs[row].append(r)
                print(
                    f"  run {i + 1}/{args.repeat} {row[0]:9s} streams={row[1]} "
                    f"batches/msg={row[2]}: {r['tokens_s'] / 1e6:8.1f} M tokens/s",
                    flush=True,
                )
    rows = [median_row(runs[row]) for row in schedule]
    if args.only:
        for row in schedule:
            cpu = " ".join(f"{r['cpu_per_gtok']:.2f}" for r in runs[row])
            print(f"{':'.join(map(str, row))}: server CPU s/Gtok per run {cpu}")
        return
    if args.workers_rows:
        return report_workers(rows, args)
    if args.cpu:
        return report_cpu(runs, servers[1:])
    bare = {(r["streams"], r["per_message"]): r for r in rows if r["kind"] == "bare"}
    print(
        f"\nserve_throughput: batch {BATCH} x {SEQ_LEN}+1 uint16, shuffled, "
        f"median of {args.repeat} x {args.seconds:g} s per row, loopback, "
        f"{os.cpu_count()} cpus\n"
    )
    print(
        f"{'server':10s} {'streams':>7s} {'batch/msg':>9s} {'Mtok/s':>9s} {'msg/s':>8s} "
        f"{'server cpu':>10s} {'client cpu':>10s} {'vs bare':>8s}"
    )
    print(f"{'':48s}{'s/Gtok':>10s} {'s/Gtok':>10s}")
    for r in rows:
        ref = bare.get((r["streams"], r["per_message"])) or bare.get((1, r["per_message"]))
        ratio = r["tokens_s"] / ref["tokens_s"] if ref and r["kind"] != "bare" else float("nan")
        print(
            f"{r['kind']:10s} {r['streams']:7d} {r['per_message']:9d} "
            f"{r['tokens_s'] / 1e6:9.1f} {r['msgs_s']:8.0f} {r['cpu_per_gtok']:10.2f} "
            f"{r['client_cpu_per_gtok']:10.2f} {ratio:8.2f}"
        )
    tf = {(r["streams"], r["per_message"]): r for r in rows if r["kind"] == "tokenfeed"}

    def each(a: tuple, b: tuple, pick: str = "tokenfeed") -> str:
        """The ratio in each repeat, so the spread shows beside the median."""
        num = runs[("tokenfeed", *a)]
        den = runs[(pick, *b)]
        return " ".join(
            f"{x['tokens_s'] / y['tokens_s']:.2f}" for x, y in zip(num, den, strict=True)
        )

    print("\nratios (median; each run):")
    print(
        f"  1 stream / bare ceiling (1 batch/msg):        "
        f"{tf[(1, 1)]['tokens_s'] / bare[(1, 1)]['tokens_s']:.2f}  (goal >= 0.70; "
        f"{each((1, 1), (1, 1), 'bare')})"
    )
    print(
        f"  4 streams / 1 stream (1 batch/msg):           "
        f"{tf[(4, 1)]['tokens_s'] / tf[(1, 1)]['tokens_s']:.2f}  (goal >= 1.00; "
        f"{each((4, 1), (1, 1))})"
    )
    print(
        f"  1 stream, {k} batches/msg / bare at that size: "
        f"{tf[(1, k)]['tokens_s'] / bare[(1, k)]['tokens_s']:.2f}"
    )
    print(
        f"  1 stream, {k} batches/msg: {tf[(1, k)]['tokens_s'] / 1e6:.0f} M tokens/s "
        f"(stretch goal > 250; "
        + " ".join(f"{r['tokens_s'] / 1e6:.0f}" for r in runs[("tokenfeed", 1, k)])
        + ")"
    )


def report_cpu(runs: dict[tuple, list[dict]], kinds: list[str]) -> None:
    """Server CPU s per 1e9 tokens against bare grpc.aio's, one stream: medians over the
    repeats, and the ratio in each repeat (a repeat's rows run next to each other)."""

    def median(xs: list[float]) -> float:
        return sorted(xs)[len(xs) // 2]

    print("\nserver CPU s per 1e9 tokens vs bare grpc.aio, 1 stream (median; ratio per run)")
    for m in sorted({m for _, _, m in runs}):
        bare = runs[("bare", 1, m)]
        note = "  (the client's default)" if m == DEFAULT_PER_MESSAGE else ""
        print(
            f"  {m:2d} batches/msg{note}: bare {median([r['cpu_per_gtok'] for r in bare]):.2f} s, "
            f"{median([r['tokens_s'] for r in bare]) / 1e6:.0f} M tok/s"
        )
        for kind in kinds:
            mine = runs[(kind, 1, m)]
            ratios = [
                x["cpu_per_gtok"] / y["cpu_per_gtok"] for x, y in zip(mine, bare, strict=True)
            ]
            goal = " (goal <= 2)" if m == DEFAULT_PER_MESSAGE and kind == "tokenfeed" else ""
            print(
                f"    {kind:9s} {median([r['cpu_per_gtok'] for r in mine]):.2f} s, "
                f"{median([r['tokens_s'] for r in mine]) / 1e6:.0f} M tok/s: "
                f"{median(ratios):.2f}x bare{goal}; per run " + " ".join(f"{x:.2f}" for x in ratios)
            )


def report_workers(rows: list[dict], args: argparse.Namespace) -> None:  # type: ignore[type-arg]
    print(
        f"\nserve_throughput --workers-rows: batch {BATCH} x {SEQ_LEN}+1 uint16, "
        f"{DEFAULT_PER_MESSAGE} batches/msg, shuffled, median of {args.repeat} x "
        f"{args.seconds:g} s, loopback, {os.cpu_count()} cpus (the load generator needs one)\n"
    )
    print(
        f"{'server':14s} {'streams':>7s} {'Mtok/s':>8s} {'server cpu':>10s} {'per worker':>10s} "
        f"{'vs w1':>6s}  cpu seconds: supervisor / workers"
    )
    print(f"{'':31s}{'s/Gtok':>10s} {'s/Gtok':>10s}")
    one = {r["streams"]: r for r in rows if r["kind"] == "tokenfeed"}
    for r in rows:
        n = workers_of(r["kind"])
        split = r["cpu_split"]
        # per worker: the workers' CPU (not the supervisor's) per token they sent; replicas
        # have no supervisor, and every token is one replica's
        work = sum(split[1:]) if n > 1 else sum(split)
        per_worker = r["cpu_per_gtok"] * work / max(sum(split), 1e-9)
        base = one.get(r["streams"])
        ratio = per_worker / base["cpu_per_gtok"] if base else float("nan")
        name = f"{replicas_of(r['kind'])} replicas" if "-r" in r["kind"] else f"--workers {n}"
        print(
            f"{name:14s} {r['streams']:7d} {r['tokens_s'] / 1e6:8.1f} "
            f"{r['cpu_per_gtok']:10.2f} {per_worker:10.2f} {ratio:6.2f}  "
            + " / ".join(f"{c:.2f}" for c in split)
        )
    # conservative: the dearest row of one node's workers (replicas here share this
    # box's two cores with each other and the load generator: not a per-core figure)
    worst = max(r["cpu_per_gtok"] for r in rows if replicas_of(r["kind"]) == 1)
    per_core = 1e9 / worst
    print(
        f"\none worker core: {per_core / 1e6:.0f} M tokens/s at {worst:.2f} s/Gtok (the "
        f"dearest row); a 16-core node with 15 workers: ~{15 * per_core / 1e9:.1f} G "
        f"tokens/s = {15 * per_core * 2 * 8 / 1e9:.0f} Gbit/s of uint16 payload, if the "
        "clients and the NIC keep up"
    )


if __name__ == "__main__":
    main()
