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
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np

from tokenfeed.client.transport import RETRYABLE
from tokenfeed.core.store.megatron import HEADER, MAGIC, VERSION
from tokenfeed.core.store.meta import Chunk, StoreMeta, chunk_name
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.feeders import FeederProcess

MiB = 1 << 20
CHUNK = 1 << 24  # the default tokens per chunk
SEQ, B = 2048, 8  # the batch shape of every stream: 8 x 2,048 tokens
TOKENFEED = str(Path(sys.executable).with_name("tokenfeed"))


@dataclass
class Row:
    item: str
    goal: str
    measured: str
    ok: bool
    functional: bool = False  # a correctness check (the exit status), not a cost goal


ROWS: list[Row] = []
MEASURED: dict[str, float] = {}  # figures one item measures and item 8 checks


def row(item: str, goal: str, measured: str, ok: bool, functional: bool = False) -> None:
    ROWS.append(Row(item, goal, measured, bool(ok), functional))
    print(f"  {item}: {measured} ({goal}) {'PASS' if ok else 'MISS'}", flush=True)


# ----------------------------------------------------------------------------- stores

_ZERO_CRC: dict[int, str] = {}


def zero_checksum(nbytes: int) -> str:
    """The crc32 of `nbytes` zero bytes (what a sparse chunk reads as)."""
    if nbytes not in _ZERO_CRC:
        crc, block = 0, bytes(min(nbytes, 4 * MiB) or 1)
        left = nbytes
        while left:
            n = min(left, len(block))
            crc = zlib.crc32(block[:n], crc)
            left -= n
        _ZERO_CRC[nbytes] = f"crc32:{crc:08x}"
    return _ZERO_CRC[nbytes]


def sparse_store(path: Path, tokens: int, per_chunk: int = CHUNK) -> Path:
    """A native uint16 store of `tokens` zero tokens in sparse chunk files."""
    path.mkdir(parents=True, exist_ok=True)
    chunks = []
    for i, a in enumerate(range(0, tokens, per_chunk)):
        n = min(per_chunk, tokens - a)
        with open(path / chunk_name(i), "wb") as f:
            f.truncate(2 * n)  # a hole: reads as zeros, costs no disk
        chunks.append(Chunk(chunk_name(i), n, zero_checksum(2 * n)))
    meta = StoreMeta(
        dtype="uint16",
        chunks=tuple(chunks),
        eos_token_id=0,
        vocab_size=65536,
        tokens_per_chunk=per_chunk,
        source={"kind": "benchmark", "sparse": True},
    )
    (path / "meta.json").write_text(json.dumps(meta.to_json()))
    return path


# ----------------------------------------------------------------------------- process figures


def _tree(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        for k in kids:
            out += _tree(int(k))
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its children (workers): the run time of their
    threads in nanoseconds (/proc/.../schedstat; /proc/PID/stat counts 10 ms ticks)."""
    total = 0
    for p in _tree(pid):
        for task in Path(f"/proc/{p}/task").iterdir():
            with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # it ended
                total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def children_cpu() -> float:
    """CPU seconds of this process's finished children."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def rss(pid: int) -> int:
    return sum(status_kib(p, "VmRSS") for p in _tree(pid)) * 1024


def threads_and_fds(pid: int) -> tuple[int, int]:
    pids = _tree(pid)
    return (
        sum(status_kib(p, "Threads") for p in pids),
        sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids),
    )


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- the wire


def params(dataset: str = "", world: int = 1, **kw: Any) -> pb.SamplingParams:
    base = dict(
        dataset=dataset,
        split="train",
        split_rate=1.0,
        seq_len=SEQ,
        batch_size=B,
        world_size=world,
        shuffle=True,
        seed=7,
    )
    return pb.SamplingParams(**(base | kw))


@dataclass
class Stream:
    """One rank's stream on the wire, resuming on the next address after a failure."""

    rank: int
    starts: list[int]
    times: list[float]  # monotonic time of each batch
    opened: float = 0.0
    served_by: int = -1  # the address of the first batch
    failures: int = 0
    resumed: int = 0
    error: str = ""


async def stream(
    addresses: list[str],
    p: pb.SamplingParams,
    rank: int,
    batches: int,
    epoch: int = 0,
    pace: float = 0.0,
    first: int = 0,
    progress: list[int] | None = None,
    start: int = 0,
) -> Stream:
    """Read `batches` batches of `rank` from step `start` of `epoch`; `pace` s after
    each is a consumer's rate; on a status FeederClient retries, the next address takes
    over at the first batch not received (what FeederClient does)."""
    s = Stream(rank, [], [], time.monotonic())
    at = first
    while len(s.starts) < batches * p.batch_size:
        step = start + len(s.times)
        req = pb.StreamBatchesRequest(
            params=p, rank=rank, epoch=epoch, step=step, offset=step * p.batch_size * p.world_size
        )
        options = [("grpc.use_local_subchannel_pool", 1)]
        try:
            async with grpc.aio.insecure_channel(addresses[at % len(addresses)], options) as ch:
                call = feeder_pb2_grpc.FeederStub(ch).StreamBatches(req)
                async for msg in call:
                    for b in msg.batches:
                        s.starts += list(b.starts)
                        s.times.append(time.monotonic())
                    if s.served_by < 0:
                        s.served_by = at % len(addresses)
                    if progress is not None:
                        progress[0] += len(msg.batches)
                    if len(s.times) >= batches:
                        call.cancel()
                        break
                    if pace:
                        await asyncio.sleep(pace)  # the consumer's rate
        except grpc.aio.AioRpcError as e:
            if e.code() not in RETRYABLE or s.resumed >= 10 * len(addresses):
                s.failures += 1
                s.error = f"{e.code().name}: {e.details()}"
                return s
            s.resumed += 1
            at += 1
            await asyncio.sleep(0.05 * min(s.resumed, 20))  # FeederClient's backoff, shorter
    return s


async def raw_stream(address: str, req: pb.StreamBatchesRequest, batches: int) -> None:
    """Read `batches` batches of one request."""
    async with grpc.aio.insecure_channel(address) as ch:
        call = feeder_pb2_grpc.FeederStub(ch).StreamBatches(req)
        n = 0
        async for msg in call:
            n += len(msg.batches)
            if n >= batches:
                call.cancel()
                return


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def first_batch_seconds(address: str, p: pb.SamplingParams) -> float:
    t = time.monotonic()
    run(stream([address], p, 0, 1))
    return time.monotonic() - t


def feeder_cpu_per_batch(
    proc: FeederProcess, p: pb.SamplingParams, batches: int, epoch: int, rank: int = 0
) -> float:
    """The feeder's CPU seconds per batch of `rank`'s stream in steady state: after
    `batches` batches that load the chunks the next `batches` read (at W = 1 a
    shuffle block's chunks serve thousands of batches)."""
    warm = run(stream([proc.address], p, rank, batches, epoch=epoch))
    before = cpu_seconds(proc.proc.pid)
    s = run(stream([proc.address], p, rank, batches, epoch=epoch, start=batches))
    if s.failures or warm.failures:
        raise RuntimeError(s.error or warm.error)
    return (cpu_seconds(proc.proc.pid) - before) / batches


def interleaved(cases: dict[str, Callable[[int], float]], repeats: int) -> dict[str, float]:
    """The median of `repeats` runs of each case, the cases taking turns."""
    got: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(repeats):
        for k, f in cases.items():
            got[k].append(f(r))
    return {k: statistics.median(v) for k, v in got.items()}


@contextmanager
def feeder(root: Path, **flags: Any) -> Iterator[FeederProcess]:
    proc = FeederProcess(root, **flags)
    try:
        yield proc
    finally:
        proc.stop()


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


# ----------------------------------------------------------------------------- 2. a Megatron index

MG_SMALL = 100_000  # the small Megatron store's documents (142 MB of tokens)
MG_CACHE = "64M"  # both feeders' chunk cache: full on either store, so memory compares
MG_BLOCK = 1 << 22  # documents written at a time


def doc_tokens(a: int, b: int) -> np.ndarray:
    """The tokens of documents [a, b) of the benchmark's Megatron stores: 200 to 1,223."""
    return 200 + np.arange(a, b, dtype=np.int64) * 7919 % 1024


def megatron_store(prefix: Path, documents: int) -> None:
    """A Megatron uint16 dataset of `documents` one-sentence documents: a real .idx
    written a block of documents at a time (no Python object per document; 20 bytes a
    document), the .bin a hole as long as the tokens it indexes."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    blocks = [(a, min(a + MG_BLOCK, documents)) for a in range(0, documents, MG_BLOCK)]
    total = 0
    with open(prefix.with_name(prefix.name + ".idx"), "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, 8, documents, documents + 1))  # 8: uint16
        for a, b in blocks:
            doc_tokens(a, b).astype("<i4").tofile(f)
        for a, b in blocks:  # each sentence's byte offset in the .bin
            n = doc_tokens(a, b)
            ((total + np.cumsum(n) - n) * 2).astype("<i8").tofile(f)
            total += int(n.sum())
        for a, b in blocks:  # document d is sentence d
            np.arange(a, b, dtype="<i8").tofile(f)
        np.array([documents], dtype="<i8").tofile(f)
    with open(prefix.with_name(prefix.name + ".bin"), "wb") as f:
        f.truncate(2 * total)


async def document_batches(address: str, req: pb.StreamBatchesRequest, batches: int) -> int:
    """Read `batches` batches of one request: how many carried document ends."""
    with_ends = n = 0
    async with grpc.aio.insecure_channel(address) as ch:
        call = feeder_pb2_grpc.FeederStub(ch).StreamBatches(req)
        async for msg in call:
            n += len(msg.batches)
            with_ends += sum(bool(b.document_ends) for b in msg.batches)
            if n >= batches:
                call.cancel()
                break
    return with_ends


def memory(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) bytes of a process tree: its own memory, and the pages of
    files it maps (libraries, a Megatron index), which are the page cache's."""
    pids = _tree(pid)
    anon, mapped = (sum(status_kib(p, k) for p in pids) * 1024 for k in ("RssAnon", "RssFile"))
    return anon, mapped


def megatron(tmp: Path, documents: int, batches: int, repeats: int) -> None:
    print(f"2. a Megatron index of {documents:,} documents against {MG_SMALL:,} ({load()})")
    t = time.monotonic()
    roots = {"big": tmp / "mg_big", "small": tmp / "mg_small"}
    megatron_store(roots["big"] / "mg", documents)
    megatron_store(roots["small"] / "mg", MG_SMALL)
    index = (roots["big"] / "mg.idx").stat().st_size
    print(f"  wrote a {index / 1e9:.2f} GB index in {time.monotonic() - t:.1f} s", flush=True)
    p = params("mg")

    def request(epoch: int, step: int, ends: bool = True) -> pb.StreamBatchesRequest:
        return pb.StreamBatchesRequest(
            params=p, epoch=epoch, step=step, offset=step * B, document_ends=ends
        )

    first: dict[str, tuple[float, float]] = {}  # (wall s, feeder CPU s) from serve's start
    opened: dict[str, float] = {}  # feeder CPU s of the open and the first batch alone
    mem: dict[str, tuple[int, int]] = {}  # after the first batch
    with contextlib.ExitStack() as stack:
        procs = {}
        for k, root in roots.items():
            t = time.monotonic()
            procs[k] = proc = stack.enter_context(feeder(root, cache_bytes=MG_CACHE))
            c = cpu_seconds(proc.proc.pid)
            run(document_batches(proc.address, request(0, 0), 1))
            first[k] = (time.monotonic() - t, cpu_seconds(proc.proc.pid))
            opened[k] = cpu_seconds(proc.proc.pid) - c
            mem[k] = memory(proc.proc.pid)

        carried = [0, 0]  # batches with document ends, batches asked for them

        def case(k: str, ends: bool, r: int) -> float:
            """CPU per batch of a new epoch's stream, after as many that load its chunks."""
            proc = procs[k]
            got = run(document_batches(proc.address, request(r + 1, 0, ends), batches))
            before = cpu_seconds(proc.proc.pid)
            got += run(document_batches(proc.address, request(r + 1, batches, ends), batches))
            cpu = (cpu_seconds(proc.proc.pid) - before) / batches
            if ends:
                carried[0] += got
                carried[1] += 2 * batches
            return cpu

        # the same streams without document ends: the token path's own cost by store size
        cases = {
            f"{k} {what}": partial(case, k, what == "ends")
            for k in procs
            for what in ("ends", "tokens")
        }
        cpu = interleaved(cases, repeats)
        after = {k: memory(procs[k].proc.pid) for k in procs}
    (wall, c), (small_wall, small_c) = first["big"], first["small"]
    row(
        "2 Megatron",
        "open + first document batch from serve's start <= 2 s (CPU)",
        f"{c:.2f} s CPU, {wall:.2f} s wall (open and batch alone {opened['big']:.3f} s; "
        f"{MG_SMALL:,} documents: {small_c:.2f} s, {small_wall:.2f} s, {opened['small']:.3f} s)",
        c <= 2,
    )
    anon = [(m["big"][0] - m["small"][0]) / MiB for m in (mem, after)]
    mapped = [(m["big"][1] - m["small"][1]) / MiB for m in (mem, after)]
    row(
        "2 Megatron",
        "own memory (RssAnon) <= small store's + 16 MiB",
        f"{anon[0]:+.1f} MiB at the first batch, {anon[1]:+.1f} MiB after the runs "
        f"(index pages mapped, RssFile: {mapped[0]:+.0f} / {mapped[1]:+.0f} MiB of "
        f"{index / MiB:,.0f})",
        max(anon) <= 16,
    )
    ratio, tokens = cpu["big ends"] / cpu["small ends"], cpu["big tokens"] / cpu["small tokens"]
    measured = (
        f"{cpu['big ends'] * 1e3:.3f} ms vs {cpu['small ends'] * 1e3:.3f} ms = {ratio:.2f}x "
        f"(without document ends {cpu['big tokens'] * 1e3:.3f} vs "
        f"{cpu['small tokens'] * 1e3:.3f} ms = {tokens:.2f}x)"
    )
    row("2 Megatron", "CPU/document batch <= 1.1x small store's", measured, ratio <= 1.1)
    row(
        "2 Megatron",
        "every batch carries document ends",
        f"{carried[0]:,} of {carried[1]:,} batches",
        carried[0] == carried[1],
        True,
    )


# ----------------------------------------------------------------------------- 3. 1,000 sources


def mixture(tmp: Path, sources: int, segments: int, batches: int, repeats: int) -> None:
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

        cpu = interleaved(
            {
                "mixture": lambda r: feeder_cpu_per_batch(proc, seeded(mix, r), batches, epoch=0),
                "one": lambda r: feeder_cpu_per_batch(proc, seeded(params("one"), r), batches, 0),
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


# ----------------------------------------------------------------------------- 4. world size


def world_size(root: Path, batches: int, repeats: int, baseline_client: Path | None = None) -> None:
    print(f"4. the world size ({load()})", flush=True)
    with feeder(root) as proc:

        def case(w: int, r: int) -> float:
            return feeder_cpu_per_batch(proc, params("ds", world=w), batches, r, rank=w // 2)

        cpu = interleaved({str(w): partial(case, w) for w in (1, 64, 1024)}, repeats)
        MEASURED["cpu_per_batch"] = cpu["1024"]
        spread = max(cpu.values()) / min(cpu.values())
        shown = ", ".join(f"W={w}: {v * 1e3:.3f} ms" for w, v in cpu.items())
        row(
            "4 world size",
            "CPU/batch within 1.2x at W = 1, 64, 1024",
            f"{shown} ({spread:.2f}x)",
            spread <= 1.2,
        )
        idle_clients(proc.address, 64, repeats, baseline_client)


def idle_clients(address: str, n: int, repeats: int, baseline: Path | None = None) -> None:
    """`n` FeederClients in a child process, each with a full buffer: its CPU per second.
    With `baseline` (another revision's client/ folder) its clients take turns with
    these, `repeats` times each."""
    clients = {"": None} | ({"@base": baseline} if baseline else {})
    cores = interleaved(
        {k: partial(idle_cores, address, n, c) for k, c in clients.items()},
        repeats if baseline else 1,
    )
    shown = f"{cores['']:.4f}"
    if baseline:
        shown += f" (base {cores['@base']:.4f}: {cores[''] / cores['@base']:.2f}x)"
    row("4 world size", f"{n} idle clients < 0.02 of a core", shown, cores[""] < 0.02)


def idle_cores(address: str, n: int, client: Path | None, _: int, seconds: float = 5.0) -> float:
    code = f"""
import time
from tokenfeed.client import FeederClient
cs = [FeederClient({address!r}, dataset="ds", seq_len={SEQ}, batch_size={B}, rank=r,
                   world_size={n}, prefetch=4) for r in range({n})]
its = [iter(c) for c in cs]
for it in its:
    next(it)
time.sleep(5.0)  # the buffers fill
c0, t0 = time.process_time(), time.monotonic()
time.sleep({seconds})
print((time.process_time() - c0) / (time.monotonic() - t0))
for c in cs:
    c.close()
"""
    env = dict(os.environ)
    if client is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(client.resolve()), env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env
    )
    return float(out.stdout.split()[-1])


# ----------------------------------------------------------------------------- 5-6. one node


def one_node(root: Path, streams: int, batches: int) -> None:
    print(
        f"5-6. {streams:,} streams on serve --workers 2 --cache-bytes 128M ({load()})", flush=True
    )
    with feeder(root, workers=2, cache_bytes="128M") as proc:
        idle = rss(proc.proc.pid)
        p = params("ds", world=streams)
        peak = [0, 0, 0]

        async def watch(done: asyncio.Event) -> None:
            while not done.is_set():
                th, fd = threads_and_fds(proc.proc.pid)
                peak[:] = [max(peak[0], rss(proc.proc.pid)), max(peak[1], th), max(peak[2], fd)]
                await asyncio.sleep(0.5)  # a sample every half second, not a wait

        async def main() -> list[Stream]:
            done = asyncio.Event()
            w = asyncio.ensure_future(watch(done))
            tasks = []
            for r in range(streams):  # all opened within one second: the storm
                tasks.append(asyncio.ensure_future(stream([proc.address], p, r, batches, pace=0.5)))
                if r % 64 == 63:
                    await asyncio.sleep(64 / streams)
            got = await asyncio.gather(*tasks)
            done.set()
            await w
            return list(got)

        got = run(main())
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
    firsts = sorted(s.times[0] - s.opened for s in got if s.times)
    p99 = firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))]
    row(
        "6 storm",
        "p99 first batch <= 2 s",
        f"{p99:.2f} s (median {statistics.median(firsts):.2f} s)",
        p99 <= 2,
    )
    row(
        "6 storm",
        "no stream fails",
        f"{len(failed)} failed" + (f": {failed[0].error}" if failed else ""),
        not failed,
        True,
    )


def storm_cost(root: Path, streams: int) -> None:
    """Item 6's cost: `streams` streams of one batch each opened within a second on a
    fresh feeder, the feeder's and this load generator's CPU per stream."""
    print(f"6. {streams:,} streams of one batch each ({load()})", flush=True)
    with feeder(root, workers=2, cache_bytes="128M") as proc:
        p = params("ds", world=streams)
        before, mine = cpu_seconds(proc.proc.pid), time.process_time()

        async def main() -> list[Stream]:
            tasks = []
            for r in range(streams):
                tasks.append(asyncio.ensure_future(stream([proc.address], p, r, 1)))
                if r % 64 == 63:
                    await asyncio.sleep(64 / streams)
            return list(await asyncio.gather(*tasks))

        got = run(main())
        fed, generated = cpu_seconds(proc.proc.pid) - before, time.process_time() - mine
    firsts = sorted(s.times[0] - s.opened for s in got if s.times)
    row(
        "6 storm",
        "reported: feeder CPU per stream start",
        f"{fed / streams * 1e3:.2f} ms (load generator {generated / streams * 1e3:.2f} ms; "
        f"p99 first batch {firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))]:.2f} s)",
        True,
    )


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
    """tokenfeed plan for 16,384 GPUs against what one node measured (items 5 and 1)."""
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
    if "cpu_per_batch" in MEASURED:
        # the feeder CPU 16,384 ranks need at the plan's steps/s, at this build's cost
        need = 16384 * doc["steps_per_s"] * MEASURED["cpu_per_batch"] * doc["headroom"]
        row(
            "8 plan",
            "plan's cores cover the measured CPU per batch",
            f"{need:.2f} cores needed at W = 1,024 (x2 headroom), plan {doc['cores']}",
            need <= doc["cores"],
        )


# ----------------------------------------------------------------------------- main


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
    print(f"tokenfeed scale ({'quick' if q else 'full'}), {os.cpu_count()} cores, {load()}")
    with tempfile.TemporaryDirectory(prefix="tokenfeed-scale-") as d:
        tmp = Path(d)
        if 1 in items:
            big_store(tmp, big_tokens, 100 if q else 400, repeats)
        elif items & {4, 5, 6, 7}:
            sparse_store(tmp / "big" / "ds", big_tokens)  # the store the other items read
        if 2 in items:
            megatron(tmp, 10**6 if q else 10**8, 100 if q else 400, repeats)
        if 4 in items:
            world_size(tmp / "big", 100 if q else 400, repeats, args.baseline_client)
        if 3 in items:
            mixture(tmp, 1_000, 100, 100 if q else 400, repeats)
        if items & {5, 6}:
            one_node(tmp / "big", 128 if q else 1_024, 4 if q else 20)
        if 6 in items:
            storm_cost(tmp / "big", 128 if q else 1_024)
        if 7 in items:
            replicas(tmp / "big", 256 if q else 4_096, 3)
        if 8 in items:
            plan()
    print(f"\n{'item':<14} {'goal':<46} {'measured':<58} result   ({load()})")
    for r in ROWS:
        print(f"{r.item:<14} {r.goal:<46} {r.measured:<58} {'PASS' if r.ok else 'MISS'}")
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in ROWS], indent=1))
    return 1 if any(r.functional and not r.ok for r in ROWS) else 0


if __name__ == "__main__":
    sys.exit(main())
