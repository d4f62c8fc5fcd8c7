"""Fair shares between jobs on a saturated feeder, and what the scheduler costs one job.

    python benchmarks/tenants.py [--seconds 6] [--repeat 3] [--baseline DIR]

One feeder process (`tokenfeed serve`) with a tokens file of two jobs, `small` and
`large`, each reading its own copy of one store (hard links: the same bytes, two
dataset names); one load process per job opens its streams (one connection each, as
separate trainer ranks would) and drains them, epoch after epoch, without decoding
(the load must cost less than the feeder, or it, not the feeder, would be the
bottleneck). What each job got is counted where it is sent: the feeder's
`tokenfeed_server_tokens_sent_total` by dataset over the window, read from its
/metrics. The feeder is pinned to CPU 0 and the load processes to CPU 1 (`taskset`),
and each row prints how busy the feeder's core was (its CPU seconds over the window):
shares only mean something on a saturated feeder (near 100 %). Batches of 16 x
(1024 + 1) uint16 tokens, shuffled, 2 batches per message (~64 KiB).

Rows:

* `shares 1:1`: `small` (4 streams) and `large` (32 streams), both weight 1: each
  job's share of the bytes sent against its weighted share (goal: within 20 %, i.e. a
  ratio in [0.8, 1.2]);
* `shares 3:1`: the same with `small` at weight 3 (its share: 75 %);
* `streams 4+32` with `--baseline DIR`: the same load on DIR's feeder (no tokens file,
  no scheduler): what the split is by stream count;
* `one job, 32 streams` and `one job, 1 stream`: the feeder without a tokens file
  (one job: its streams send without turns, there being nothing to divide) against
  DIR's feeder with `--baseline DIR`, tokens/s and server CPU per 10^9 tokens: the
  scheduler's cost on a single job's throughput (goal: under 3 %);
* with `--baseline DIR`, `shares 1:1` against `streams 4+32`: server CPU per token
  with the scheduler dividing the feeder between two jobs, against the same load
  without it.

The scheduler's cost is also measured in process, where the machine's noise matters
less: the CPU time of a turn (`FairShares.try_enter` + `leave`) when nobody waits,
and of a turn taken by waiting (32 streams cycling through 4 slots on one event loop),
against the feeder's CPU per burst (a burst: 4 messages of 2 batches, at the one-job
row's CPU per token).

DIR is another checkout's source roots (`git archive main | tar -x -C DIR`), run with
PYTHONPATH as benchmarks/serve_throughput.py does. Rows are interleaved over
`--repeat` runs and each row reports its median: the machine is noisy.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from procs import process_cpu
from prometheus_client.parser import text_string_to_metric_families
from serve_throughput import checkout_env, make_store  # the same store

from tokenfeed.cli.process import wait_for_port

SEQ_LEN, BATCH, PER_MESSAGE = 1024, 16, 2  # serve_throughput's batches, 2 to a message
METHOD = "/tokenfeed.v1.Feeder/StreamBatches"
TOKENS = {"small": "bench-small-token", "large": "bench-large-token"}  # dataset = job
BASELINE: Path | None = None


# ---------------------------------------------------------------------- processes


def run_load(address: str, job: str, streams: int, start: float, seconds: float) -> None:
    """Drain `streams` streams of `job` (its dataset has the job's name) until wall time
    `start` + `seconds`; print {"cpu": this process's CPU seconds from `start`} as JSON."""
    import asyncio

    import grpc

    from tokenfeed.core.request import SamplingSpec
    from tokenfeed.server.app import new_event_loop
    from tokenfeed.v1 import feeder_pb2 as pb

    spec = SamplingSpec(
        dataset=job, seq_len=SEQ_LEN, stride=256, batch_size=BATCH, shuffle=True, seed=1,
        world_size=streams,
    )  # fmt: skip
    metadata = (("authorization", f"Bearer {TOKENS[job]}"),)

    async def drain(channel: grpc.aio.Channel, rank: int) -> None:
        call = channel.unary_stream(
            METHOD, request_serializer=pb.StreamBatchesRequest.SerializeToString
        )
        epoch = 0
        while True:
            req = pb.StreamBatchesRequest(
                params=spec.to_proto(), rank=rank, epoch=epoch, batches_per_message=PER_MESSAGE
            )
            async for _ in call(req, metadata=metadata, wait_for_ready=True):
                pass
            epoch += 1

    async def main() -> dict[str, Any]:
        opts = [("grpc.max_receive_message_length", -1), ("grpc.use_local_subchannel_pool", 1)]
        channels = [grpc.aio.insecure_channel(address, options=opts) for _ in range(streams)]
        tasks = [asyncio.ensure_future(drain(ch, r)) for r, ch in enumerate(channels)]
        await asyncio.sleep(max(0.0, start - time.time()))
        cpu0 = time.process_time()
        await asyncio.sleep(seconds)
        cpu = time.process_time() - cpu0
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for ch in channels:
            await ch.close()
        return {"cpu": cpu}

    print(json.dumps(new_event_loop().run_until_complete(main())))


# ------------------------------------------------------------------------- driver


def pinned(cpu: int) -> list[str]:
    return ["taskset", "-c", str(cpu)] if shutil.which("taskset") and os.cpu_count() else []


def tokens_file(tmp: Path, small_weight: float) -> Path:
    path = tmp / f"tokens-{small_weight:g}.json"
    jobs = {
        job: {
            "token_sha256": hashlib.sha256(TOKENS[job].encode()).hexdigest(),
            "datasets": [job],
            "weight": small_weight if job == "small" else 1,
        }
        for job in TOKENS
    }
    path.write_text(json.dumps({"jobs": jobs}))
    return path


def start_server(
    kind: str, data_root: Path, tmp: Path, tokens: Path | None
) -> tuple[Any, str, str]:
    """The feeder: its process, gRPC address and /metrics URL."""
    port_file = tmp / "port"
    port_file.unlink(missing_ok=True)
    metrics = free_port()
    argv = [*pinned(0), sys.executable, "-m", "tokenfeed", "serve", "--data-root", str(data_root)]
    argv += ["--port", "0", "--port-file", str(port_file), "--log-level", "WARNING"]
    argv += ["--metrics-port", str(metrics)]
    argv += ["--assembly-threads", "2"]
    if tokens is not None:
        argv += ["--tokens-file", str(tokens)]
    env = None
    if kind == "base":
        assert BASELINE is not None
        env = checkout_env(BASELINE)
    proc = subprocess.Popen(argv, env=env)
    address = f"127.0.0.1:{wait_for_port(proc, port_file)}"
    return proc, address, f"http://127.0.0.1:{metrics}/metrics"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tokens_sent(url: str) -> dict[str, float]:
    """The feeder's tokens sent so far, by dataset."""
    text = urllib.request.urlopen(url, timeout=30).read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "tokenfeed_server_tokens_sent_total":
                name = sample.labels["dataset"]
                out[name] = out.get(name, 0.0) + sample.value
    return out


def measure(
    kind: str, loads: dict[str, int], small_weight: float, seconds: float, root: Path, tmp: Path
) -> dict[str, Any]:
    """One row: the server `kind` ("tokenfeed" or "base") and a load process per job."""
    tokens = tokens_file(tmp, small_weight) if kind == "tokenfeed" and len(loads) > 1 else None
    proc, address, metrics = start_server(kind, root, tmp, tokens)
    try:
        start = time.time() + 3.0  # connections made, caches warm
        argv = [*pinned(1), sys.executable, __file__, "--load", address]
        clients = {
            job: subprocess.Popen(
                [
                    *argv,
                    "--job",
                    job,
                    "--streams",
                    str(n),
                    "--start",
                    str(start),
                    "--seconds",
                    str(seconds),
                ],
                stdout=subprocess.PIPE,
            )
            for job, n in loads.items()
        }
        time.sleep(max(0.0, start - time.time()))
        sent0, cpu0, t0 = tokens_sent(metrics), process_cpu(proc.pid), time.perf_counter()
        time.sleep(seconds - 0.5)  # the load stops at start + seconds
        sent1, cpu1, t1 = tokens_sent(metrics), process_cpu(proc.pid), time.perf_counter()
        out = {job: json.loads(c.communicate(timeout=120)[0]) for job, c in clients.items()}
    finally:
        proc.terminate()
        proc.wait(30)
    wall, cpu = t1 - t0, cpu1 - cpu0
    sent = {job: sent1.get(job, 0.0) - sent0.get(job, 0.0) for job in loads}
    total = sum(sent.values())
    return {
        "share": {job: n / total if total else float("nan") for job, n in sent.items()},
        "tokens_s": total / wall,
        "cpu_per_gtok": cpu / total * 1e9 if total else float("nan"),
        "busy": cpu / wall,
        "load_cpu": {job: r["cpu"] for job, r in out.items()},
    }


def ratio(mine: dict[str, Any], base: dict[str, Any], key: str) -> float:
    """mine[key] / base[key] of one repeat; nan if either run sent nothing."""
    if not (mine["tokens_s"] and base["tokens_s"]):
        return float("nan")
    return float(mine[key] / base[key])


def median(xs: list[float]) -> float:
    """The median of the runs that sent something (a run that sent nothing is nan)."""
    xs = sorted(x for x in xs if x == x)
    return xs[len(xs) // 2] if xs else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32 << 20)
    ap.add_argument("--baseline", type=Path, metavar="DIR", help="also run DIR's feeder")
    ap.add_argument("--load", metavar="ADDRESS", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--streams", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--start", type=float, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.load:
        return run_load(args.load, args.job, args.streams, args.start, args.seconds)
    global BASELINE
    BASELINE = args.baseline
    two = {"small": 4, "large": 32}
    schedule: list[tuple[str, str, dict[str, int], float]] = [
        ("shares 1:1", "tokenfeed", two, 1.0),
        ("shares 3:1", "tokenfeed", two, 3.0),
        ("one job, 32 streams", "tokenfeed", {"large": 32}, 1.0),
        ("one job, 1 stream", "tokenfeed", {"large": 1}, 1.0),
    ]
    if BASELINE is not None:
        schedule += [
            ("streams 4+32", "base", two, 1.0),
            ("one job, 32 streams", "base", {"large": 32}, 1.0),
            ("one job, 1 stream", "base", {"large": 1}, 1.0),
        ]
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {(r[0], r[1]): [] for r in schedule}
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as d:
        tmp = Path(d)
        make_store(tmp / "data", args.tokens)
        bench = tmp / "data" / "bench"
        for job in TOKENS:  # one store, a dataset name per job
            (tmp / "data" / job).mkdir()
            for f in bench.iterdir():
                os.link(f, tmp / "data" / job / f.name)
        shutil.rmtree(bench)
        for i in range(args.repeat):
            for name, kind, loads, weight in schedule:
                r = measure(kind, loads, weight, args.seconds, tmp / "data", tmp)
                runs[(name, kind)].append(r)
                shares = " ".join(f"{j} {s:.1%}" for j, s in r["share"].items())
                print(
                    f"  run {i + 1}/{args.repeat} {kind:9s} {name:20s} "
                    f"{r['tokens_s'] / 1e6:7.1f} M tok/s  cpu {r['cpu_per_gtok']:.2f} s/Gtok  "
                    f"feeder busy {r['busy']:.0%}  {shares}  load cpu "
                    + " ".join(f"{c:.2f}" for c in r["load_cpu"].values()),
                    flush=True,
                )
    report(runs, args)


def report(runs: dict[tuple[str, str], list[dict[str, Any]]], args: argparse.Namespace) -> None:
    print(
        f"\ntenants: batches {BATCH} x {SEQ_LEN}+1 uint16, {PER_MESSAGE} per message, "
        f"median of {args.repeat} x {args.seconds:g} s, feeder on CPU 0, load on CPU 1\n"
    )
    idle = [f"{k[1]} {k[0]}" for k, rs in runs.items() for r in rs if not r["tokens_s"]]
    if idle:  # nothing to divide in such a window: left out of the medians
        print(f"runs that sent nothing in their window, left out: {', '.join(idle)}")
    for name, small_weight in (("shares 1:1", 1.0), ("shares 3:1", 3.0)):
        rs = runs[(name, "tokenfeed")]
        want = {"small": small_weight / (small_weight + 1), "large": 1 / (small_weight + 1)}
        for job in ("small", "large"):
            ratios = [r["share"][job] / want[job] for r in rs]
            print(
                f"{name}: {job:5s} ({two_streams(job)} streams) share "
                f"{median([r['share'][job] for r in rs]):.1%} of {want[job]:.0%}: "
                f"{median(ratios):.2f} of its weighted share (goal 0.8-1.2; per run "
                + " ".join(f"{x:.2f}" for x in ratios)
                + ")"
            )
    if ("streams 4+32", "base") in runs:
        rs = runs[("streams 4+32", "base")]
        print(
            f"without shares (baseline): small {median([r['share']['small'] for r in rs]):.1%}, "
            f"large {median([r['share']['large'] for r in rs]):.1%}"
        )
        mine = runs[("shares 1:1", "tokenfeed")]
        cpu = [ratio(x, y, "cpu_per_gtok") for x, y in zip(mine, rs, strict=True)]
        print(
            f"two jobs, CPU/token with shares vs without (baseline): {median(cpu):.3f}x "
            "(per run " + " ".join(f"{x:.3f}" for x in cpu) + ")"
        )
    costs = turn_costs()
    burst_tokens = 4 * PER_MESSAGE * BATCH * (SEQ_LEN + 1)
    burst_cpu = median([r["cpu_per_gtok"] for r in runs[("one job, 32 streams", "tokenfeed")]])
    burst_cpu *= burst_tokens / 1e9
    print(
        f"a turn (in process): {costs['uncontended'] * 1e6:.2f} us uncontended, "
        f"{costs['waited'] * 1e6:.2f} us taken by waiting; the feeder's CPU per burst "
        f"{burst_cpu * 1e6:.0f} us: {costs['uncontended'] / burst_cpu:.2%} and "
        f"{costs['waited'] / burst_cpu:.2%} of it (goal < 3 %)"
    )
    for name in ("one job, 32 streams", "one job, 1 stream"):
        mine = runs[(name, "tokenfeed")]
        line = (
            f"{name}: {median([r['tokens_s'] or float('nan') for r in mine]) / 1e6:.1f} M tok/s, "
            f"{median([r['cpu_per_gtok'] for r in mine]):.2f} s/Gtok"
        )
        base = runs.get((name, "base"))
        if base:
            tput = [ratio(x, y, "tokens_s") for x, y in zip(mine, base, strict=True)]
            cpu = [ratio(x, y, "cpu_per_gtok") for x, y in zip(mine, base, strict=True)]
            line += (
                f"; vs baseline: tokens/s {median(tput):.3f}x (per run "
                + " ".join(f"{x:.3f}" for x in tput)
                + f"), CPU/token {median(cpu):.3f}x (per run "
                + " ".join(f"{x:.3f}" for x in cpu)
                + ")"
            )
        print(line)


def turn_costs(turns: int = 200_000) -> dict[str, float]:
    """CPU seconds of one turn: uncontended (try_enter + leave), and taken by waiting
    (32 streams through 4 slots, each turn yielding to the loop once, as a write does),
    net of the same loop without the scheduler."""
    import asyncio

    from tokenfeed.server.shares import FairShares

    shares = FairShares(4)
    acct = shares.account("job", 1.0)
    t0 = time.process_time()
    for _ in range(turns):
        turn = shares.try_enter(acct, 131_200)
        assert turn is not None
        shares.leave(turn, 131_200)
    uncontended = (time.process_time() - t0) / turns

    async def cycle(with_shares: bool, n: int) -> float:
        shares = FairShares(4)
        accounts = [shares.account("a", 1.0), shares.account("b", 1.0)]

        async def stream(i: int) -> None:
            acct = accounts[i % 2]
            for _ in range(n):
                if with_shares:
                    turn = shares.try_enter(acct, 131_200) or await shares.enter(acct, 131_200)
                await asyncio.sleep(0)
                if with_shares:
                    shares.leave(turn, 131_200)

        t = time.process_time()
        await asyncio.gather(*(stream(i) for i in range(32)))
        return time.process_time() - t

    per = turns // 32 // 4
    bare = asyncio.run(cycle(False, per))
    waited = (asyncio.run(cycle(True, per)) - bare) / (per * 32)
    return {"uncontended": uncontended, "waited": waited}


def two_streams(job: str) -> int:
    return {"small": 4, "large": 32}[job]


if __name__ == "__main__":
    main()
