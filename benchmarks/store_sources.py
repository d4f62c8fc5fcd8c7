"""Where a store lives and which format it is in, side by side in one run (ratios).

    python benchmarks/store_sources.py [--tokens 48M] [--chunk-tokens 2M] [--seconds 10]
        [--repeats 3] [--rows local,s3,seed,megatron] [--latency 0.020] [--s3-cache-mb 256]

One random uint16 token array, stored several ways, each served by its own
`tokenfeed serve` process and drained by one FeederClient (shuffled, 16 x 1024):

* `local`: native, local disk (the baseline of every ratio);
* `s3`: native, in S3 (SeaweedFS on 127.0.0.1) behind benchmarks/latency_proxy.py,
  which holds every request `--latency` seconds (20 ms) and moves the bytes with
  os.splice, so the proxy itself costs next to no CPU (see its docstring for why not
  netem, and what it does not model);
* `s3direct`: the same S3 store without the proxy (what S3 costs on this machine apart
  from latency: SeaweedFS and the feeder share its cores);
* `seed`: the seed layout (chunk_NNNNNN/ save_to_disk folders, int32 Arrow, with the
  meta.json `tokenfeed info` suggests edited to uint16), local;
* `megatron`: a Megatron PREFIX.bin/.idx (uint16), local.

SeaweedFS stands in for object storage that would run on other machines: none of its
CPU would come from the data node's. Here it shares the feeder's two cores, so it runs
with its in-memory chunk cache for GETs (`--s3-cache-mb`, its -s3.cacheCapacityMB), as
an object store's front end serves hot objects: measured, 2.2 ms of its CPU per 4 MiB
GET instead of 4.2 (reading from its volume server over its own loopback HTTP). With
`--s3-cache-mb 0` the s3 rows show what the untuned server takes from the feeder.

The rows run one after another within a repeat, in an order rotated every repeat, so
a neighbour's load on this shared machine spreads over all of them; each ratio is
taken within its repeat (row / `local` of the same repeat) and reported as the median
and range over the repeats.

The cache (--cache-bytes) holds about 3/4 of the store, so every epoch reads chunks
again: steady state is chunk loading plus serving, not a warm cache. Every row gets the
same --cache-bytes and --readahead-bytes (10 chunks: a shuffle group of 8 plus room).
One FeederClient drains epoch after epoch, as a training loop does (its lookahead opens
the next epoch's stream as one ends); the store is small, so an epoch lasts well under
a second and epoch starts weigh far more than in training. Per row:
steady-state tokens/s (after the first 2 s), the ratio to `local`, chunk loads and
waits per epoch (the cache policy's share, steadier than tokens/s on a shared machine),
the time to the first batch from a cold server (process start excluded: from the first
request), and memory: how far the server's resident set grew from idle (serving, before the first
request) to its peak, against --cache-bytes plus the read-ahead budget, and the peak
growth of its parts: the chunks (AnonHugePages), the heap (the rest of RssAnon), mapped
files (RssFile).

Goals: s3 >= 0.9x local, first batch from cold S3 < 2 s, memory within
--cache-bytes plus the read-ahead budget; seed and megatron >= 0.9x local.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from procs import process_cpu

from tokenfeed.cli.process import serve_argv, stop, wait_for_port
from tokenfeed.server.config import parse_size

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent / "tests"
SEQ_LEN, BATCH = 1024, 16
ROWS = ("local", "s3", "s3direct", "seed", "megatron")
LABELS = {
    "local": "native, local disk",
    "s3": "native, S3 +{ms} ms/request",
    "s3direct": "native, S3 (no proxy)",
    "seed": "seed layout, local",
    "megatron": "Megatron .bin/.idx, local",
}


def write_all(root: Path, tokens: np.ndarray, chunk_tokens: int) -> None:
    from tokenfeed.core.store import write_store

    write_store(root / "native", tokens, dtype="uint16", tokens_per_chunk=chunk_tokens)
    # Megatron: one document per chunk-sized run, uint16 (dtype code 8)
    n = tokens.size
    lengths = np.full(n // chunk_tokens, chunk_tokens, dtype="<i4")
    if n % chunk_tokens:
        lengths = np.append(lengths, n % chunk_tokens).astype("<i4")
    pointers = (np.concatenate([[0], np.cumsum(lengths[:-1])]) * 2).astype("<i8")
    docs = np.arange(lengths.size + 1, dtype="<i8")
    head = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, lengths.size, docs.size)
    (root / "megatron.idx").write_bytes(
        head + lengths.tobytes() + pointers.tobytes() + docs.tobytes()
    )
    tokens.tofile(root / "megatron.bin")
    # the seed layout, as the seed prepare script writes it (datasets, int32)
    import datasets

    datasets.disable_progress_bars()
    seed = root / "seed"
    for i, a in enumerate(range(0, n, chunk_tokens)):
        ds = datasets.Dataset.from_dict({"input_ids": [tokens[a : a + chunk_tokens]]})
        ds.save_to_disk(str(seed / f"chunk_{i:06d}"))
    from tokenfeed.core.store import SeedStore

    meta = SeedStore.open(seed).suggested_meta() | {"dtype": "uint16"}
    (seed / "meta.json").write_text(json.dumps(meta))


def start_proxy(s3_port: int, latency: float) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "latency_proxy.py"), str(s3_port), "--latency", str(latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def scrape(port: int) -> dict[str, float]:
    """The feeder's /metrics: the cache's counters (misses: a stream waited for a chunk)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if not sample.labels or sample.name.endswith(("_sum", "_count")):
                out[sample.name] = sample.value
    return out


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def status(pid: int, name: str = "status") -> dict[str, int]:
    """/proc/PID/status sizes in bytes (VmRSS, VmHWM, RssAnon, RssFile, ...), or those
    of /proc/PID/smaps_rollup (AnonHugePages, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/{name}").read_text().splitlines():
        key, _, value = line.partition(":")
        if value.strip().endswith("kB"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """Peaks of the resident set and of its parts, sampled every 20 ms: AnonHugePages
    (the chunks: each is a private map of its own in transparent huge pages,
    core/store/memory.py; 0 where THP is off, the chunks then count as heap), the rest of
    RssAnon (malloc heaps, thread stacks) and RssFile (mapped files: libraries, the seed
    layout's Arrow files)."""

    PARTS = ("VmRSS", "AnonHugePages", "Heap", "RssFile")

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak = dict.fromkeys(self.PARTS, 0)
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.02):
            try:
                s = status(self.pid)
                s["AnonHugePages"] = status(self.pid, "smaps_rollup").get("AnonHugePages", 0)
            except OSError:
                return
            s["Heap"] = s.get("RssAnon", 0) - s["AnonHugePages"]
            for k in self.PARTS:
                self.peak[k] = max(self.peak[k], s.get(k, 0))


def measure(
    root: str,
    dataset: str,
    seconds: float,
    tmp: Path,
    env: dict[str, str],
    flags: dict[str, object],
    others: list[int],
) -> dict[str, float]:
    """One row: the feeder's tokens/s, first batch, memory growth, and CPU seconds per
    second of the steady state of the feeder, this process (the client) and `others`
    (the S3 server and the proxy)."""
    from tokenfeed.client import FeederClient

    port_file = tmp / f"port-{time.monotonic_ns()}"
    watchdog: threading.Timer | None = None
    log = open(tmp / "serve.log", "ab")  # noqa: SIM115 - closed below
    metrics_port = free_port()
    proc = subprocess.Popen(
        serve_argv(root, port_file, log_level="WARNING", metrics_port=metrics_port, **flags),  # type: ignore[arg-type]
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        port = wait_for_port(proc, port_file, 120)
        # a feeder that stops serving must fail the row, not hang the run (the client
        # reconnects on its own): stopped after twice the row's time plus a minute
        watchdog = threading.Timer(2 * seconds + 60, proc.kill)
        watchdog.daemon = True
        watchdog.start()
        time.sleep(0.5)  # settle: imports done, threads started
        idle = status(proc.pid)
        idle_huge = status(proc.pid, "smaps_rollup").get("AnonHugePages", 0)
        sampler = Sampler(proc.pid)
        sampler.start()
        kw = dict(dataset=dataset, seq_len=SEQ_LEN, batch_size=BATCH, shuffle=True, seed=1)
        t0 = time.perf_counter()
        cpu0: list[float] = []
        m0: dict[str, float] = {}
        first = None
        tokens = 0
        marks: list[tuple[float, int]] = []
        epoch_tokens = 0
        epoch = 0
        # one client for every epoch, as a training loop: set_epoch(epoch + 1) adopts the
        # stream the client opened ahead as the epoch ended (its `lookahead`)
        with FeederClient(f"127.0.0.1:{port}", rank=0, world_size=1, **kw) as c:
            while time.perf_counter() - t0 <= seconds:
                c.set_epoch(epoch)
                for b in c:
                    now = time.perf_counter()
                    if first is None:
                        first = now - t0
                    tokens += b["input_ids"].size
                    marks.append((now, tokens))
                    if not cpu0 and now - t0 >= 2.0:
                        cpu0 = [process_cpu(p) for p in (proc.pid, os.getpid(), *others)]
                        m0 = scrape(metrics_port)
                    if now - t0 > seconds:
                        break
                else:  # a whole epoch: its tokens (per-epoch rates below)
                    epoch_tokens = epoch_tokens or tokens
                epoch += 1
        cpu1 = [process_cpu(p) for p in (proc.pid, os.getpid(), *others)]
        m1 = scrape(metrics_port)
        sampler.done.set()
        sampler.join()
        peak = status(proc.pid)
        warm = next((m for m in marks if m[0] - t0 >= 2.0), marks[0])
        end = marks[-1]
        if end[0] <= warm[0] or not cpu0:
            raise RuntimeError(f"{root}/{dataset}: {len(marks)} batches, first {first}")
        span = end[0] - warm[0]
        cpu = [(b - a) / span for a, b in zip(cpu0, cpu1, strict=True)]

        def rate(name: str) -> float:
            return (m1.get(name, 0.0) - m0.get(name, 0.0)) / span

        loads = rate("tokenfeed_chunk_load_seconds_count")
        tokens_per_s = (end[1] - warm[1]) / (end[0] - warm[0])
        epochs_per_s = tokens_per_s / epoch_tokens if epoch_tokens else float("nan")
        return {
            "loads": loads,
            "waits": rate("tokenfeed_cache_misses_total"),
            "loads_per_epoch": loads / epochs_per_s,
            "waits_per_epoch": rate("tokenfeed_cache_misses_total") / epochs_per_s,
            "load_ms": 1e3 * rate("tokenfeed_chunk_load_seconds_sum") / loads if loads else 0.0,
            "feeder_cpu": cpu[0],
            "client_cpu": cpu[1],
            "other_cpu": sum(cpu[2:]),
            "tokens_per_s": tokens_per_s,
            "first_batch_s": first or 0.0,
            "idle": idle["VmRSS"],
            "grew": max(peak["VmHWM"], sampler.peak["VmRSS"]) - idle["VmRSS"],
            "chunks_grew": sampler.peak["AnonHugePages"] - idle_huge,
            "heap_grew": sampler.peak["Heap"] - (idle.get("RssAnon", 0) - idle_huge),
            "files_grew": sampler.peak["RssFile"] - idle.get("RssFile", 0),
            "epochs": epoch + 1,
        }
    finally:
        if watchdog is not None:
            watchdog.cancel()
        stop(proc, 15)
        log.close()


def spread(values: list[float], fmt: str) -> str:
    med = statistics.median(values)
    if len(values) == 1:
        return format(med, fmt)
    return f"{format(med, fmt)} ({format(min(values), fmt)}-{format(max(values), fmt)})"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="48M")
    ap.add_argument("--chunk-tokens", default="2M")
    ap.add_argument("--cache-bytes", default=None, help="default: 3/4 of the store")
    ap.add_argument(
        "--readahead-bytes",
        default=None,
        help="every row's --readahead-bytes (default: 10 chunks, shuffle_blocks + 2)",
    )
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--latency", type=float, default=0.020)
    ap.add_argument(
        "--s3-cache-mb",
        type=int,
        default=256,
        help="SeaweedFS's in-memory chunk cache for GETs (-s3.cacheCapacityMB; 0 = off)",
    )
    ap.add_argument("--rows", default="local,s3,seed,megatron", help=",".join(ROWS))
    args = ap.parse_args()
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if "local" not in rows or any(r not in ROWS for r in rows):
        ap.error(f"--rows: a list of {', '.join(ROWS)} that includes local")
    n, per = parse_size(args.tokens), parse_size(args.chunk_tokens)
    cache = parse_size(args.cache_bytes) if args.cache_bytes else n * 3 // 2  # n uint16 = 2n
    ahead = parse_size(args.readahead_bytes) if args.readahead_bytes else 10 * 2 * per
    flags: dict[str, object] = {"cache_bytes": cache, "readahead_bytes": ahead}
    sys.path.insert(0, str(TESTS))
    from support.seaweed import SeaweedS3

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, n, dtype=np.uint16)
    results: dict[str, list[dict[str, float]]] = {r: [] for r in rows}
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as tmpdir:
        tmp = Path(tmpdir)
        root = tmp / "root"
        t0 = time.perf_counter()
        write_all(root, tokens, per)
        print(f"stores written in {time.perf_counter() - t0:.1f} s ({n} tokens, chunks of {per})")
        weed_flags = (f"-s3.cacheCapacityMB={args.s3_cache_mb}",) if args.s3_cache_mb else ()
        with SeaweedS3(tmp / "seaweed", extra_args=weed_flags) as s3:
            env = os.environ | s3.env()
            os.environ.update(s3.env())
            from tokenfeed.core.store import write_store

            t0 = time.perf_counter()
            url = f"s3://{s3.bucket}/bench"
            write_store(f"{url}/native", tokens, dtype="uint16", tokens_per_chunk=per)
            print(f"uploaded to {url}/native in {time.perf_counter() - t0:.1f} s")
            assert s3.ports is not None
            assert s3.proc is not None
            proxy, endpoint = start_proxy(s3.ports.s3, args.latency)
            where = {
                "local": (str(root), "native", env),
                "s3": (url, "native", env | {"AWS_ENDPOINT_URL": endpoint}),
                "s3direct": (url, "native", env),
                "seed": (str(root), "seed", env),
                "megatron": (str(root), "megatron", env),
            }
            try:
                for rep in range(args.repeats):
                    order = rows[rep % len(rows) :] + rows[: rep % len(rows)]
                    for row in order:
                        r, ds, e = where[row]
                        others = [s3.proc.pid, proxy.pid] if row.startswith("s3") else []
                        results[row].append(measure(r, ds, args.seconds, tmp, e, flags, others))
                        got = results[row][-1]
                        print(
                            f"  repeat {rep + 1} {row:<9} {got['tokens_per_s'] / 1e6:6.1f} M tok/s"
                            f"  first {got['first_batch_s']:.2f} s"
                            f"  grew {got['grew'] / 2**20:.0f} MiB (chunks "
                            f"{got['chunks_grew'] / 2**20:.0f}, heap {got['heap_grew'] / 2**20:.0f}"
                            f", files {got['files_grew'] / 2**20:.0f})  CPU feeder "
                            f"{got['feeder_cpu']:.2f} client {got['client_cpu']:.2f} "
                            f"S3+proxy {got['other_cpu']:.2f}  loads/s {got['loads']:.1f} "
                            f"({got['load_ms']:.0f} ms) waits/s {got['waits']:.1f}"
                            f"  per epoch: loads {got['loads_per_epoch']:.1f} waits "
                            f"{got['waits_per_epoch']:.2f}",
                            flush=True,
                        )
            finally:
                proxy.kill()
                proxy.wait()
    print(
        f"\nstore {2 * n / 2**20:.0f} MiB in chunks of {2 * per / 2**20:.0f} MiB, cache "
        f"{cache / 2**20:.0f} MiB + read-ahead {ahead / 2**20:.0f} MiB = memory bound "
        f"{(cache + ahead) / 2**20:.0f} MiB; {args.seconds:g} s per row, {args.repeats} "
        "repeats interleaved: median (range)"
    )
    print(
        f"{'store':<28} {'M tokens/s':>18} {'ratio':>17} {'first batch s':>17} {'RSS grew MiB':>15}"
    )

    def label(row: str) -> str:
        return LABELS[row].format(ms=round(args.latency * 1000))

    def medians(title: str, keys: tuple[str, ...], cell: str, unit: float = 1.0) -> None:
        """A table of each row's medians of `keys` (in `unit`s), each formatted by `cell`."""
        print(title)
        for row in rows:
            rs = results[row]
            cells = (cell.format(k=k, v=statistics.median(r[k] for r in rs) / unit) for k in keys)
            print(f"{label(row):<28} " + "  ".join(cells))

    base = results["local"]
    for row in rows:
        rs = results[row]
        ratios = [r["tokens_per_s"] / b["tokens_per_s"] for r, b in zip(rs, base, strict=True)]
        print(
            f"{label(row):<28} {spread([r['tokens_per_s'] / 1e6 for r in rs], '.1f'):>18} "
            f"{spread(ratios, '.2f'):>17} {spread([r['first_batch_s'] for r in rs], '.2f'):>17} "
            f"{spread([r['grew'] / 2**20 for r in rs], '.0f'):>15}"
        )
    medians(
        "\nmemory, MiB (medians): RSS idle (serving, before the first request), and the peak"
        " growth from there of RSS and its parts: chunks (AnonHugePages: each chunk is a"
        " private map in huge pages), heap (the rest of RssAnon: malloc, stacks), files"
        " (RssFile: mapped files)",
        ("idle", "grew", "chunks_grew", "heap_grew", "files_grew"),
        "{k} {v:4.0f}",
        unit=2**20,
    )
    medians(
        "\nsteady state (medians): CPU cores busy (feeder, client, S3 server + proxy); chunk"
        " loads/s and ms per load; waits/s (a stream asked for a chunk not loaded yet);"
        " loads and waits per epoch (rates over epochs/s: apart from how fast a neighbour"
        " lets the row run)",
        (
            "feeder_cpu",
            "client_cpu",
            "other_cpu",
            "loads",
            "load_ms",
            "waits",
            "loads_per_epoch",
            "waits_per_epoch",
        ),
        "{v:5.2f}",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
