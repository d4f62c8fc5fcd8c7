"""What every item of benchmarks/scale.py uses: its rows of results, sparse stores,
process figures from /proc, raw streams on the wire and a feeder process."""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tokenfeed.cli.process import wait_for_port
from tokenfeed.client.transport import RETRYABLE
from tokenfeed.core.store.meta import Chunk, StoreMeta, chunk_name
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from support.feeders import FeederProcess, scrape

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


def process_tree(pid: int) -> list[int]:
    out = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        for k in kids:
            out += process_tree(int(k))
    return out


def cpu_seconds(pid: int) -> float:
    """CPU seconds of a process and its children (workers): each one's process CPU
    clock, nanosecond-resolved, which keeps its ended threads' time (a sum of its
    threads' /proc schedstat loses a thread's time when it ends; /proc/PID/stat counts
    10 ms ticks)."""
    total = 0.0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):  # it ended
            total += time.clock_gettime(-(p + 1) * 8 + 2)  # clock_getcpuclockid(p)
    return total


def quiet(pid: int, idle: float = 0.01, every: float = 0.25, bound: float = 60.0) -> None:
    """Return once the process tree of `pid` takes under `idle` of a core over `every`
    seconds (a feeder done opening its stores), or after `bound` seconds."""
    end, was = time.monotonic() + bound, cpu_seconds(pid)
    while time.monotonic() < end:
        time.sleep(every)  # a sample of the CPU clock, not a wait for an event
        now = cpu_seconds(pid)
        if now - was < idle * every:
            return
        was = now


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
    return sum(status_kib(p, "VmRSS") for p in process_tree(pid)) * 1024


def threads_and_fds(pid: int) -> tuple[int, int]:
    pids = process_tree(pid)
    return (
        sum(status_kib(p, "Threads") for p in pids),
        sum(len(os.listdir(f"/proc/{p}/fd")) for p in pids),
    )


def load() -> str:
    return "load " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def page_touch_us(mib: int = 256) -> tuple[float, float]:
    """CPU us to touch a page of memory new to this process, then of the same amount
    mapped again right after (pages the kernel just took back): on a VM whose memory
    goes back to the host when free, the first is several times the second, and every
    page the feeder fills (a row read in place, a chunk loaded) pays it."""
    import mmap

    costs = []
    for _ in range(2):
        m = mmap.mmap(-1, mib << 20)
        t = time.process_time()
        for i in range(0, mib << 20, mmap.PAGESIZE):
            m[i] = 1
        costs.append((time.process_time() - t) / ((mib << 20) // mmap.PAGESIZE) * 1e6)
        m.close()
    return costs[0], costs[1]


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
    message_bytes: int = 0,
) -> Stream:
    """Read `batches` batches of `rank` from step `start` of `epoch`; `pace` s after
    each is a consumer's rate; on a status FeederClient retries, the next address takes
    over at the first batch not received (what FeederClient does). `message_bytes`:
    as many batches a message as fit (FeederClient's packing), else one."""
    s = Stream(rank, [], [], time.monotonic())
    at = first
    while len(s.starts) < batches * p.batch_size:
        step = start + len(s.times)
        req = pb.StreamBatchesRequest(
            params=p,
            rank=rank,
            epoch=epoch,
            step=step,
            offset=step * p.batch_size * p.world_size,
            message_bytes=message_bytes,
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


def first_batch_seconds_p99(streams: list[Stream]) -> tuple[float, float]:
    """(p99, median) of the seconds from each stream's open to its first batch."""
    firsts = sorted(s.times[0] - s.opened for s in streams if s.times)
    return firsts[min(len(firsts) - 1, int(0.99 * len(firsts)))], statistics.median(firsts)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def first_batch_seconds(address: str, p: pb.SamplingParams) -> float:
    t = time.monotonic()
    run(stream([address], p, 0, 1))
    return time.monotonic() - t


def feeder_cpu_per_batch(
    proc: FeederProcess,
    p: pb.SamplingParams,
    batches: int,
    epoch: int,
    rank: int = 0,
    warm: int | None = None,
) -> float:
    """The feeder's CPU seconds per batch of `rank`'s stream over `batches` batches,
    after `warm` batches (default `batches`) that load the chunks they start with."""
    warm = batches if warm is None else warm
    first = run(stream([proc.address], p, rank, warm, epoch=epoch))
    before = cpu_seconds(proc.proc.pid)
    s = run(stream([proc.address], p, rank, batches, epoch=epoch, start=warm))
    if s.failures or first.failures:
        raise RuntimeError(s.error or first.error)
    return (cpu_seconds(proc.proc.pid) - before) / batches


def batches_sent(metrics_port: int) -> float:
    """The feeder's tokenfeed_server_batches_sent, every series summed (its workers')."""
    samples = scrape(metrics_port).items()
    return sum(v for (name, _), v in samples if name == "tokenfeed_server_batches_sent_total")


def interleaved(cases: dict[str, Callable[[int], float]], repeats: int) -> dict[str, float]:
    """The median of `repeats` runs of each case, the cases taking turns."""
    got: dict[str, list[float]] = {k: [] for k in cases}
    for r in range(repeats):
        for k, f in cases.items():
            got[k].append(f(r))
    return {k: statistics.median(v) for k, v in got.items()}


@contextmanager
def grpc_floor(workers: int = 2, messages: int = 1) -> Iterator[tuple[str, int]]:
    """servers/grpc_floor.py serving on `workers` processes, `messages` messages of one
    batch a stream: (its address, its pid)."""
    with tempfile.TemporaryDirectory(prefix="grpc-floor-") as d:
        port_file = Path(d) / "port"
        script = str(Path(__file__).with_name("servers") / "grpc_floor.py")
        argv = [sys.executable, script, "--workers", str(workers), "--port-file", str(port_file)]
        argv += ["--messages", str(messages)]
        with subprocess.Popen(argv) as proc:
            try:
                port = wait_for_port(proc, port_file, 30.0)
                yield f"127.0.0.1:{port}", proc.pid
            finally:
                proc.terminate()


@contextmanager
def feeder(root: Path, **flags: Any) -> Iterator[FeederProcess]:
    proc = FeederProcess(root, **flags)
    try:
        yield proc
    finally:
        proc.stop()
