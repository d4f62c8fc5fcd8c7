"""The biggest runs on one machine: a 10^12-token store, a Megatron index of 10^8
documents, 1,000 sources, thousands of ranks.

    python benchmarks/scale.py            # the full form: 10^12 tokens, 1,024 streams, ...
    python benchmarks/scale.py --quick    # the same measurements, smaller (CI: a few minutes)
    python benchmarks/scale.py --json out.json   # also write every row as JSON
    python benchmarks/scale.py --items 6         # only some items (5 and 6 run together)
    python benchmarks/scale.py --items 4 --baseline-client /tmp/base/client
                                  # item 4's idle clients in turns with another revision's

Stores are sparse files (`truncate`): the native format at the default 2^24 tokens per
chunk, so a 10^12-token store (59,605 chunks) costs no disk; a Megatron dataset's .bin
is a hole too, its .idx a real file (2 GB for 10^8 documents). Load comes from many raw
gRPC streams on one event loop (grpc.aio, one connection each, as separate trainer
processes have). Every feeder is `tokenfeed serve` in a subprocess; its cost is its
process tree's CPU seconds from /proc per batch, robust to other load on the machine;
wall-clock figures (first batch, Info, rates) are medians and depend on that load.

Each goal is printed with its measured figure and PASS or MISS; the functional checks
(every stream got all its batches, every window exactly once, no failures) are rows
too, and the exit status is 1 when one of those fails. The goals are in
benchmarks/README.md, "scale.py".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path

import grpc
from scale_megatron import megatron
from scale_parts import (
    CHUNK,
    MEASURED,
    ROWS,
    SEQ,
    TOKENFEED,
    B,
    FeederProcess,
    MiB,
    Stream,
    batches_sent,
    children_cpu,
    cpu_seconds,
    feeder,
    feeder_cpu_per_batch,
    first_batch_seconds,
    first_batch_seconds_p99,
    grpc_floor,
    interleaved,
    load,
    page_touch_us,
    params,
    quiet,
    raw_stream,
    row,
    rss,
    run,
    sparse_store,
    stream,
    threads_and_fds,
)

from tokenfeed.core.request import DEFAULT_SHUFFLE_BLOCKS
from tokenfeed.server.config import ServerConfig
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

from support import free_port

# ----------------------------------------------------------------------------- 1. the big store


def big_store(tmp: Path, big_tokens: int, batches: int, repeats: int) -> None:
    print(
        f"1. a store of {big_tokens:.3g} tokens ({-(-big_tokens // CHUNK):,} chunks) "
        f"against 1 GB ({load()})",
        flush=True,
    )
    roots = {"big": tmp / "big", "small": tmp / "small"}
    sparse_store(roots["big"] / "ds", big_tokens)
    sparse_store(roots["small"] / "ds", 32 * CHUNK)  # 2^29 tokens, 1 GiB of uint16
    first: dict[str, tuple[float, float]] = {}  # (wall s, feeder CPU s) to the first batch
    info: dict[str, tuple[float, float]] = {}  # the same for a cold Info
    cli: dict[str, tuple[float, float]] = {}  # (wall s, CPU s) of `tokenfeed info`
    mem: dict[str, int] = {}  # the feeder's RSS once the store is open
    for k, root in roots.items():
        t = time.monotonic()
        with feeder(root) as proc:
            wall = time.monotonic() - t + first_batch_seconds(proc.address, params("ds"))
            first[k] = (wall, cpu_seconds(proc.proc.pid))
            proc.restart()
            with grpc.insecure_channel(proc.address) as ch:
                c, t = cpu_seconds(proc.proc.pid), time.monotonic()
                feeder_pb2_grpc.FeederStub(ch).Info(pb.InfoRequest(params=params("ds")))
                info[k] = (time.monotonic() - t, cpu_seconds(proc.proc.pid) - c)
            mem[k] = rss(proc.proc.pid)
        c, t = children_cpu(), time.monotonic()
        argv = [TOKENFEED, "info", str(root / "ds"), "--seq-len", str(SEQ)]
        subprocess.run(argv, check=True, capture_output=True)
        cli[k] = (time.monotonic() - t, children_cpu() - c)
    with feeder(roots["big"]) as big, feeder(roots["small"]) as small:
        procs = {"big": big, "small": small}
        cases = {
            k: partial(lambda k, r: feeder_cpu_per_batch(procs[k], params("ds"), batches, r), k)
            for k in procs
        }
        cpu = interleaved(cases, repeats)

    def seconds(item: str, goal: float, got: dict[str, tuple[float, float]]) -> None:
        (wall, c), (small_wall, small_c) = got["big"], got["small"]
        measured = f"{c:.2f} s CPU, {wall:.2f} s wall (1 GB: {small_c:.2f} s, {small_wall:.2f} s)"
        row("1 big store", f"{item} <= {goal:g} s (CPU)", measured, c <= goal)

    seconds("first batch from serve's start", 2, first)
    seconds("cold Info", 1, info)
    seconds("tokenfeed info", 1, cli)
    extra = (mem["big"] - mem["small"]) / MiB
    row("1 big store", "RSS open <= 1 GB store's + 64 MiB", f"{extra:+.1f} MiB", extra <= 64)
    ratio = cpu["big"] / cpu["small"]
    measured = f"{cpu['big'] * 1e3:.3f} ms vs {cpu['small'] * 1e3:.3f} ms = {ratio:.2f}x"
    row("1 big store", "CPU/batch <= 1.2x 1 GB store's", measured, ratio <= 1.2)


# ----------------------------------------------------------------------------- 3. 1,000 sources


def mixture(
    tmp: Path, sources: int, segments: int, batches: int, group: int, repeats: int, storm: int
) -> None:
    from tokenfeed.client import FeederClient
    from tokenfeed.core.request import SamplingSpec

    print(f"3. a mixture of {sources:,} sources, {segments} segments ({load()})", flush=True)
    root = tmp / "mix"
    names = [f"src_{i:04d}" for i in range(sources)]
    for n in names:
        sparse_store(root / n, 1 << 22, per_chunk=1 << 22)
    sparse_store(root / "one", sources << 22)
    weights = [(n, 1.0 + i % 7) for i, n in enumerate(names)]
    schedule = [
        (10**9 * (j + 1), {n: 1.0 + (i + j) % 5 for i, n in enumerate(names)})
        for j in range(segments)
    ]
    with feeder(root) as proc:
        t, c = time.monotonic(), time.process_time()
        client = FeederClient(
            proc.address,
            mixture=weights,
            schedule=schedule,
            seq_len=SEQ,
            batch_size=B,
            rank=0,
            world_size=1,
            shuffle=True,
            seed=7,
        )
        built, built_cpu = time.monotonic() - t, time.process_time() - c
        t, c, fc = time.monotonic(), time.process_time(), cpu_seconds(proc.proc.pid)
        client.dataset_info  # noqa: B018 - the Info call
        info = time.monotonic() - t
        info_cpu = time.process_time() - c + cpu_seconds(proc.proc.pid) - fc
        client.close()
        spec = SamplingSpec(
            dataset="",
            sources=tuple(weights),
            schedule=tuple(schedule),
            seq_len=SEQ,
            batch_size=B,
            shuffle=True,
            seed=7,
        )
        mix = spec.to_proto()
        size = mix.ByteSize()

        def seeded(p: pb.SamplingParams, r: int) -> pb.SamplingParams:
            q = pb.SamplingParams()
            q.CopyFrom(p)
            q.seed = 100 + r  # fresh windows every repeat, as in a run
            return q

        # One dataset over a shuffle group's batches, as item 4's W = 1, so its chunk
        # loads count, and after the feeder's cache is full, as item 4's (FILL_CHUNKS);
        # the mixture reads in place and opens a stream every `batches`, each open
        # counted (a job re-opens at reconnects, resumes, epochs).
        fill_cache(proc, "one")
        cpu = interleaved(
            {
                "mixture": lambda r: feeder_cpu_per_batch(proc, seeded(mix, r), batches, epoch=0),
                "one": lambda r: feeder_cpu_per_batch(
                    proc, seeded(params("one"), r), group, 0, warm=batches
                ),
            },
            repeats,
        )
        # the same stream at its start and 2^40 tokens in (offset in windows)
        at = {}
        for offset in (0, (1 << 40) // SEQ):
            req = pb.StreamBatchesRequest(params=seeded(mix, 999), offset=offset)
            run(raw_stream(proc.address, req, batches))
            at[offset] = rss(proc.proc.pid)
        grown = (at[max(at)] - at[0]) / MiB
    # a job of `storm` ranks (re)starting on the mixture, as item 6's on one dataset: the
    # feeder has opened the mixture once before
    job = pb.SamplingParams()
    job.CopyFrom(mix)
    job.world_size = storm
    with feeder(root, workers=2, cache_bytes="128M") as proc:
        run(raw_stream(proc.address, pb.StreamBatchesRequest(params=job), 1))
        stormed = storm_starts(proc.address, proc.proc.pid, job)
    row(
        "3 mixture",
        "client construction <= 1 s (CPU)",
        f"{built_cpu:.2f} s CPU, {built:.2f} s wall",
        built_cpu <= 1,
    )
    row("3 mixture", "Info <= 1 s (CPU)", f"{info_cpu:.2f} s CPU, {info:.2f} s wall", info_cpu <= 1)
    row("3 mixture", "request within 16 MiB", f"{size / 1e6:.2f} MB", size <= 16 * MiB, True)
    ratio = cpu["mixture"] / cpu["one"]
    row(
        "3 mixture",
        "CPU/batch <= 2x one dataset's",
        f"{cpu['mixture'] * 1e3:.3f} ms vs {cpu['one'] * 1e3:.3f} ms = {ratio:.2f}x",
        ratio <= 2,
    )
    row("3 mixture", "RSS grows <= 16 MiB at 2^40 tokens in", f"{grown:+.1f} MiB", grown <= 16)
    row("3 mixture", f"reported: feeder CPU per start of {storm:,} ranks at once", stormed, True)


# ----------------------------------------------------------------------------- 4. world size


# Each world size is measured over one shuffle group's batches at W = 1 (8 blocks of a
# chunk's windows: 8,192 batches), so that each pays for reading its rows in proportion:
# W = 1 loads a group's 8 chunks whole once for those 8,192 batches, W = 1,024 reads
# each batch's rows. A window of a few hundred batches at W = 1 falls inside the chunks
# its warm-up loaded and counts no read at all (benchmarks/README.md, "scale.py").
GROUP_BATCHES = DEFAULT_SHUFFLE_BLOCKS * CHUNK // SEQ // B
# Before them the feeder's cache is filled (its default 2 GiB, and a group more for what
# its streams pin meanwhile) by a W = 1 stream of an epoch of its own: measured in steady
# state, as a feeder serves for days, a chunk loaded whole is read into the memory of one
# it evicted. A fresh feeder's first 2 GiB of loads land in memory new to the process,
# ~100-190 ms a 32 MiB chunk on a fresh VM here, ~13 ms into a map used before: that
# cost is reported on its own row.
FILL_CHUNKS = ServerConfig(".").cache_bytes // (2 * CHUNK) + DEFAULT_SHUFFLE_BLOCKS
FILL_EPOCH = 1_000


def world_size(
    root: Path,
    warm: int,
    batches: int,
    repeats: int,
    rounds: int,
    baseline_client: Path | None = None,
) -> None:
    """Item 4: `rounds` rounds of the three world sizes in turns, `batches` each after
    `warm`; then the idle clients, `repeats` times."""
    print(f"4. the world size ({load()})", flush=True)
    with feeder(root) as proc:
        fill = fill_cache(proc)

        def case(w: int, r: int) -> float:
            p = params("ds", world=w)
            return feeder_cpu_per_batch(proc, p, batches, r, rank=w // 2, warm=warm)

        cpu = interleaved({str(w): partial(case, w) for w in (1, 64, 1024)}, rounds)
        MEASURED["cpu_per_batch"] = cpu["1024"]
        spread = max(cpu.values()) / min(cpu.values())
        shown = ", ".join(f"W={w}: {v * 1e3:.3f} ms" for w, v in cpu.items())
        row(
            "4 world size",
            f"CPU/batch within 1.2x at W = 1, 64, 1024 ({batches:,} batches)",
            f"{shown} ({spread:.2f}x)",
            spread <= 1.2,
        )
        row(
            "4 world size",
            "reported: W = 1 filling a fresh feeder's cache",
            f"{fill * 1e3:.1f} ms CPU per chunk loaded, its 1,024 batches included",
            True,
        )
        idle_clients(proc, 64, repeats, baseline_client)


def fill_cache(proc: FeederProcess, dataset: str = "ds") -> float:
    """Fill the feeder's cache (FILL_CHUNKS chunks of `dataset` at W = 1, in packed
    messages): its CPU seconds per chunk loaded."""
    batches = FILL_CHUNKS * CHUNK // SEQ // B
    before = cpu_seconds(proc.proc.pid)
    p = params(dataset)
    s = run(stream([proc.address], p, 0, batches, FILL_EPOCH, message_bytes=MiB))
    if s.failures:
        raise RuntimeError(s.error)
    return (cpu_seconds(proc.proc.pid) - before) / FILL_CHUNKS


def idle_clients(proc: FeederProcess, n: int, repeats: int, baseline: Path | None = None) -> None:
    """`n` FeederClients in a child process, each with a full buffer: its CPU per second.
    With `baseline` (another revision's client/ folder) its clients take turns with
    these, `repeats` times each."""
    clients = {"": None} | ({"@base": baseline} if baseline else {})
    cores = interleaved(
        {k: partial(idle_cores, proc, n, c) for k, c in clients.items()},
        repeats if baseline else 1,
    )
    shown = f"{cores['']:.4f}"
    if baseline:
        shown += f" (base {cores['@base']:.4f}: {cores[''] / cores['@base']:.2f}x)"
    row("4 world size", f"{n} idle clients < 0.02 of a core", shown, cores[""] < 0.02)


def idle_cores(
    proc: FeederProcess, n: int, client: Path | None, _: int, seconds: float = 5.0
) -> float:
    """The CPU per second of `n` clients in a child process once their buffers are full:
    the feeder then has nothing left to send (every stream waits for its client's flow
    control window), which `quiet` waits for before the child measures."""
    code = f"""
import sys, time
from tokenfeed.client import FeederClient
cs = [FeederClient({proc.address!r}, dataset="ds", seq_len={SEQ}, batch_size={B}, rank=r,
                   world_size={n}, prefetch=4) for r in range({n})]
its = [iter(c) for c in cs]
for it in its:
    next(it)
print("started", flush=True)
sys.stdin.readline()  # the buffers are full
c0, t0 = time.process_time(), time.monotonic()
time.sleep({seconds})
print((time.process_time() - c0) / (time.monotonic() - t0), flush=True)
for c in cs:
    c.close()
"""
    env = dict(os.environ)
    if client is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(client.resolve()), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", code]
    pipe = subprocess.PIPE
    with subprocess.Popen(argv, stdin=pipe, stdout=pipe, text=True, env=env) as child:
        assert child.stdin is not None
        assert child.stdout is not None
        if child.stdout.readline().strip() != "started":
            raise RuntimeError(f"the idle clients did not start (exit {child.wait()})")
        # over whole seconds: CPU clocks tick every 10 ms, and while 64 streams still fill
        # their clients' windows a quarter of a second can pass without a tick
        quiet(proc.proc.pid, every=1.0)
        child.stdin.write("\n")
        child.stdin.flush()
        out = child.stdout.read()
    if child.returncode:
        raise RuntimeError(f"the idle clients exited {child.returncode}")
    return float(out.split()[-1])


# ----------------------------------------------------------------------------- 5-6. one node


def one_node(root: Path, streams: int, batches: int) -> None:
    print(
        f"5-6. {streams:,} streams on serve --workers 2 --cache-bytes 128M ({load()})", flush=True
    )
    metrics_port = free_port()
    with feeder(root, workers=2, cache_bytes="128M", metrics_port=metrics_port) as proc:
        idle = rss(proc.proc.pid)
        peak = [0, 0, 0]

        def watch() -> None:
            th, fd = threads_and_fds(proc.proc.pid)
            peak[:] = [max(peak[0], rss(proc.proc.pid)), max(peak[1], th), max(peak[2], fd)]

        got, cpu = paced_job(proc.address, proc.proc.pid, streams, batches, watch)
        # a stream runs ahead of its reader by its flow-control window (a few MB): what
        # the cancelled streams' windows held was built and sent too, and counts
        sent = batches_sent(metrics_port)
    with grpc_floor(messages=batches) as (address, pid):  # it sends `batches` a stream
        _, floor = paced_job(address, pid, streams, batches)
    failed = [s for s in got if s.failures]
    complete = sum(len(s.times) >= batches for s in got)
    row(
        "5 one node",
        "every stream gets all its batches",
        f"{complete}/{streams}",
        complete == streams and not failed,
        True,
    )
    starts = [x for s in got for x in s.starts]
    row(
        "5 one node",
        "every window at most once",
        f"{len(starts) - len(set(starts))} repeated",
        len(starts) == len(set(starts)),
        True,
    )
    rates = [(len(s.times) - 1) / (s.times[-1] - s.times[0]) for s in got if len(s.times) > 1]
    med = statistics.median(rates)
    worst = max(abs(r / med - 1) for r in rates)
    row(
        "5 one node",
        "each stream's rate within 20 % of the median",
        f"median {med:.2f}/s, worst {worst:.0%} off",
        worst <= 0.2,
    )
    per, floor_per = cpu / sent, floor / (streams * batches)
    MEASURED["paced_cpu_per_batch"] = per
    row(
        "5 one node",
        "reported: feeder CPU per batch sent, starts included",
        f"{per * 1e3:.3f} ms ({sent / (streams * batches):.1f} sent per batch read); "
        f"gRPC's floor: {floor_per * 1e3:.3f} ms ({per / floor_per:.2f}x)",
        True,
    )
    grown = (peak[0] - idle) / MiB
    MEASURED["bytes_per_stream"] = max(0, peak[0] - idle) / streams
    MEASURED["fds_per_stream"] = peak[2] / streams
    bound = 128 + streams
    row(
        "5 one node",
        "RSS over idle <= cache + 1 MiB/stream",
        f"{grown:.0f} MiB (idle {idle / MiB:.0f} MiB; bound {bound} MiB)",
        grown <= bound,
    )
    row("5 one node", "threads: not per stream", f"{peak[1]} threads", peak[1] <= 256)
    row(
        "5 one node",
        "fds <= 64 + 9 per stream",
        f"{peak[2]} ({peak[2] / streams:.2f}/stream)",
        peak[2] <= 64 + 9 * streams,
    )
    p99, median = first_batch_seconds_p99(got)
    row(
        "6 storm",
        "p99 first batch <= 2 s",
        f"{p99:.2f} s (median {median:.2f} s)",
        p99 <= 2,
    )
    row(
        "6 storm",
        "no stream fails",
        f"{len(failed)} failed" + (f": {failed[0].error}" if failed else ""),
        not failed,
        True,
    )


async def job_streams(
    address: str, p: pb.SamplingParams, batches: int, pace: float = 0.0
) -> list[Stream]:
    """Every rank of `p`'s job reads `batches` batches (`pace`: stream()'s), the
    streams all opened within one second: the storm of a job starting."""
    streams, tasks = p.world_size, []
    for r in range(streams):
        tasks.append(asyncio.ensure_future(stream([address], p, r, batches, pace=pace)))
        if r % 64 == 63:
            await asyncio.sleep(64 / streams)
    return list(await asyncio.gather(*tasks))


def paced_job(
    address: str, pid: int, streams: int, batches: int, watch: Callable[[], None] | None = None
) -> tuple[list[Stream], float]:
    """The ranks of a job of `streams` opened within one second, each reading `batches`
    batches at 2 a second (a trainer's pace): the streams and the CPU seconds of the
    server `pid` meanwhile. `watch` is called every half second."""
    p = params("ds", world=streams)

    async def sample(done: asyncio.Event) -> None:
        while watch is not None and not done.is_set():
            watch()
            await asyncio.sleep(0.5)  # a sample every half second, not a wait

    async def main() -> list[Stream]:
        done = asyncio.Event()
        sampling = asyncio.ensure_future(sample(done))
        got = await job_streams(address, p, batches, pace=0.5)
        done.set()
        await sampling
        return got

    quiet(pid)
    before = cpu_seconds(pid)
    got = run(main())
    return got, cpu_seconds(pid) - before


def storm_starts(address: str, pid: int, p: pb.SamplingParams) -> str:
    """The ranks of `p`'s job open their streams of one batch within one second, once
    the server `pid` is quiet: its CPU and this load generator's per start, and the
    p99 time to the first batch."""
    streams = p.world_size
    quiet(pid)
    before, mine = cpu_seconds(pid), time.process_time()
    got = run(job_streams(address, p, 1))
    served, generated = cpu_seconds(pid) - before, time.process_time() - mine
    p99, _ = first_batch_seconds_p99(got)
    failed = sum(bool(s.failures) for s in got)
    return (
        f"{served / streams * 1e3:.2f} ms (load generator {generated / streams * 1e3:.2f} ms;"
        f" p99 first batch {p99:.2f} s{f'; {failed} failed' if failed else ''})"
    )


def storm_cost(root: Path, streams: int) -> None:
    """Item 6's cost: `streams` streams of one batch each opened within a second, the
    server's and this load generator's CPU per stream start; first on a feeder done
    opening its store (`quiet`: that open is the start's, once, not each stream's),
    then on gRPC's floor (servers/grpc_floor.py: the same server setup answering one
    pre-built message, nothing of ours)."""
    print(f"6. {streams:,} streams of one batch each ({load()})", flush=True)
    p = params("ds", world=streams)
    with feeder(root, workers=2, cache_bytes="128M") as proc:
        measured = storm_starts(proc.address, proc.proc.pid, p)
    row("6 storm", "reported: feeder CPU per stream start", measured, True)
    with grpc_floor() as (address, pid):
        measured = storm_starts(address, pid, p)
    row("6 storm", "reported: gRPC's floor per stream start", measured, True)


# ----------------------------------------------------------------------------- 7. replicas


def replicas(root: Path, ranks: int, steps: int) -> None:
    print(f"7. {ranks:,} ranks over 4 replicas ({load()})", flush=True)
    procs = [FeederProcess(root, cache_bytes="64M") for _ in range(4)]
    try:
        addresses = [p.address for p in procs]
        p = params("ds", world=ranks)

        async def job(epoch: int, kill_after: int | None) -> list[Stream]:
            progress = [0]
            tasks = [
                asyncio.ensure_future(
                    stream(addresses, p, r, steps, epoch=epoch, first=r, progress=progress)
                )
                for r in range(ranks)
            ]
            if kill_after is not None:
                while progress[0] < kill_after:
                    await asyncio.sleep(0.05)  # progress is sampled, the kill is the event
                procs[3].kill()
            return list(await asyncio.gather(*tasks))

        for epoch, kill in ((0, None), (1, ranks // 8)):
            got = run(job(epoch, kill))
            starts = [x for s in got for x in s.starts]
            ok = len(starts) == steps * B * ranks and len(set(starts)) == len(starts)
            what = "after one replica is killed" if kill is not None else "4 replicas"
            if kill is None:
                per = [sum(1 for s in got if s.served_by == i) for i in range(4)]
                row(
                    "7 replicas",
                    f"{ranks // 4} +- 1 ranks per replica",
                    f"{per}",
                    max(per) - min(per) <= 1,
                    True,
                )
            failed = sum(s.failures for s in got)
            row(
                "7 replicas",
                f"every window exactly once, {what}",
                f"{len(starts):,} windows, {len(starts) - len(set(starts))} repeated, "
                f"{failed} failed, {sum(s.resumed for s in got)} resumed",
                ok and not failed,
                True,
            )
    finally:
        for proc in procs:
            proc.stop()


# ----------------------------------------------------------------------------- 8. plan


def plan() -> None:
    """tokenfeed plan for 16,384 GPUs against what one node measured (items 4 and 5)."""
    print("8. tokenfeed plan for 16,384 GPUs", flush=True)
    argv = [TOKENFEED, "plan", "--gpus", "16384", "--tokens-per-gpu-s", "12000"]
    argv += ["--seq-len", str(SEQ), "--batch-size", str(B), "--cores-per-node", "2", "--json"]
    doc = json.loads(subprocess.run(argv, check=True, capture_output=True, text=True).stdout)
    row(
        "8 plan",
        "16,384 GPUs on 2-core nodes",
        f"{doc['cores']} cores, {doc['replicas']} "
        f"replicas, {doc['streams_per_replica']:,} streams each",
        doc["cores_by_streams"] > 0,
    )
    if "fds_per_stream" in MEASURED:
        fds, mem = MEASURED["fds_per_stream"], MEASURED["bytes_per_stream"]
        row("8 plan", "plan's 9 descriptors per stream hold", f"measured {fds:.2f}", fds <= 9)
        row("8 plan", "plan's 1 MiB per stream holds", f"measured {mem / MiB:.2f} MiB", mem <= MiB)
    # the feeder CPU 16,384 ranks need at the plan's steps/s, at this build's cost per
    # batch: of many ranks at a trainer's pace (item 5) and of a lone rank (item 4)
    for key, what in (
        ("paced_cpu_per_batch", "item 5's CPU per batch sent"),
        ("cpu_per_batch", "item 4's at W = 1,024"),
    ):
        if key in MEASURED:
            need = 16384 * doc["steps_per_s"] * MEASURED[key] * doc["headroom"]
            row(
                "8 plan",
                "plan's cores cover the measured CPU per batch",
                f"{need:.2f} cores needed at {what} (x2 headroom), plan {doc['cores']}",
                need <= doc["cores"],
            )


# ----------------------------------------------------------------------------- main


def machine(when: str) -> None:
    """What a page new to a process costs here now, beside one just freed: the pages
    rows read in place fill pay the first (benchmarks/README.md, "The machine")."""
    new, again = page_touch_us()
    row(
        "machine",
        f"reported: CPU to touch a new page, {when}",
        f"{new:.1f} us ({again:.1f} us again)",
        True,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller, for CI")
    ap.add_argument("--json", type=Path, help="write the rows there too")
    ap.add_argument(
        "--items",
        default="1,2,3,4,5,6,7,8",
        help="which items to run, comma-separated (default: all; 5 and 6 are one run)",
    )
    ap.add_argument(
        "--baseline-client",
        type=Path,
        help="client/ source root of another revision: item 4's idle clients take turns with it",
    )
    args = ap.parse_args()
    items = {int(x) for x in args.items.split(",")}
    q = args.quick
    big_tokens = (2_000 if q else 59_605) * CHUNK
    repeats = 3 if q else 5
    # W = 1's batches of a shuffle group, the window of items 3 and 4; --quick: an eighth
    # of one, whose W = 1 figure counts a load or none
    group = GROUP_BATCHES // 8 if q else GROUP_BATCHES
    print(f"tokenfeed scale ({'quick' if q else 'full'}), {os.cpu_count()} cores, {load()}")
    machine("at the start")
    with tempfile.TemporaryDirectory(prefix="tokenfeed-scale-") as d:
        tmp = Path(d)
        if 1 in items:
            big_store(tmp, big_tokens, 100 if q else 400, repeats)
        elif items & {4, 5, 6, 7}:
            sparse_store(tmp / "big" / "ds", big_tokens)  # the store the other items read
        if 2 in items:
            megatron(tmp, 4 * 10**6 if q else 10**8, 100 if q else 2_000, 3 if q else 9)
        if 4 in items:
            world_size(
                tmp / "big", 100 if q else 400, group, repeats, 1 if q else 3, args.baseline_client
            )
        if 3 in items:
            mixture(tmp, 1_000, 100, 100 if q else 400, group, repeats, 128 if q else 1_024)
        if items & {5, 6}:
            one_node(tmp / "big", 128 if q else 1_024, 4 if q else 60)
        if 6 in items:
            storm_cost(tmp / "big", 128 if q else 1_024)
        if 7 in items:
            replicas(tmp / "big", 256 if q else 4_096, 3)
        if 8 in items:
            plan()
    machine("at the end")
    print(f"\n{'item':<14} {'goal':<46} {'measured':<58} result   ({load()})")
    for r in ROWS:
        print(f"{r.item:<14} {r.goal:<46} {r.measured:<58} {'PASS' if r.ok else 'MISS'}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in ROWS], indent=1))
    return 1 if any(r.functional and not r.ok for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
