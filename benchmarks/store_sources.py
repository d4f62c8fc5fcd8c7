"""Where a store lives and which format it is in, side by side in one run (ratios).

    python benchmarks/store_sources.py [--tokens 48M] [--chunk-tokens 8M] [--seconds 8]

One random uint16 token array, stored five ways, each served by its own
`tokenfeed serve` process and drained by one FeederClient (shuffled, 16 x 1024):

* native, local disk (the baseline);
* native, in S3 (SeaweedFS on 127.0.0.1) behind a proxy that adds 20 ms to every
  request (tests/s3faultproxy.py in a process of its own; it copies every byte through
  Python, which costs CPU on this 2-core machine: a real far-away S3 would not);
* the seed layout (chunk_NNNNNN/ save_to_disk folders, int32 Arrow, served as uint32
  unless a meta.json says uint16: measured with the meta.json `info` suggests, edited
  to uint16), local;
* a Megatron PREFIX.bin/.idx (uint16), local.

The cache (--cache-bytes) holds about half of the store, so every epoch reads chunks
again: steady state is chunk loading plus serving, not a warm cache. Reported per
row: steady-state tokens/s (after the first 2 s), the ratio to the local native store,
time to the first batch from a cold server (process start excluded: from the first
request), and the server's peak RSS against --cache-bytes.

Goals (issue 14): S3 >= 0.9x local, first batch from cold S3 < 2 s, memory within
--cache-bytes plus the read-ahead budget; seed and Megatron >= 0.9x native.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from tokenfeed.cli.process import serve_argv, stop, wait_for_port
from tokenfeed.server.config import parse_size

TESTS = Path(__file__).resolve().parent.parent / "tests"
SEQ_LEN, BATCH = 1024, 16


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
    code = (
        "import sys, time; sys.path.insert(0, sys.argv[1]);"
        "from s3faultproxy import S3FaultProxy;"
        "p = S3FaultProxy(('127.0.0.1', int(sys.argv[2]))).start();"
        "p.configure(latency=float(sys.argv[3])); print(p.endpoint, flush=True);"
        "time.sleep(1e9)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(TESTS), str(s3_port), str(latency)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def measure(
    root: str, dataset: str, cache: int, seconds: float, tmp: Path, env: dict[str, str]
) -> dict[str, float]:
    from tokenfeed.client import FeederClient

    port_file = tmp / f"port-{time.monotonic_ns()}"
    log = open(tmp / "serve.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        serve_argv(root, port_file, cache_bytes=cache, log_level="WARNING"),  # type: ignore[arg-type]
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        port = wait_for_port(proc, port_file, 120)
        kw = dict(dataset=dataset, seq_len=SEQ_LEN, batch_size=BATCH, shuffle=True, seed=1)
        t0 = time.perf_counter()
        first = None
        tokens = 0
        marks: list[tuple[float, int]] = []
        epoch = 0
        while True:
            with FeederClient(f"127.0.0.1:{port}", rank=0, world_size=1, **kw) as c:
                c.set_epoch(epoch)
                for b in c:
                    now = time.perf_counter()
                    if first is None:
                        first = now - t0
                    tokens += b["input_ids"].size
                    marks.append((now, tokens))
                    if now - t0 > seconds:
                        break
            if time.perf_counter() - t0 > seconds:
                break
            epoch += 1
        warm = next((m for m in marks if m[0] - t0 >= 2.0), marks[0])
        end = marks[-1]
        if end[0] <= warm[0]:
            raise RuntimeError(f"{root}/{dataset}: {len(marks)} batches, first {first}")
        rate = (end[1] - warm[1]) / (end[0] - warm[0])
        return {"tokens_per_s": rate, "first_batch_s": first or 0.0, "rss": peak_rss(proc.pid)}
    finally:
        stop(proc, 15)
        log.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="48M")
    ap.add_argument("--chunk-tokens", default="8M")
    ap.add_argument("--cache-bytes", default=None, help="default: half the store")
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--latency", type=float, default=0.020)
    args = ap.parse_args()
    n, per = parse_size(args.tokens), parse_size(args.chunk_tokens)
    cache = parse_size(args.cache_bytes) if args.cache_bytes else n  # n uint16 = half
    sys.path.insert(0, str(TESTS))
    from seaweed import SeaweedS3

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, n, dtype=np.uint16)
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as tmpdir:
        tmp = Path(tmpdir)
        root = tmp / "root"
        t0 = time.perf_counter()
        write_all(root, tokens, per)
        print(f"stores written in {time.perf_counter() - t0:.1f} s ({n} tokens, chunks of {per})")
        with SeaweedS3(tmp / "seaweed") as s3:
            env = os.environ | s3.env()
            os.environ.update(s3.env())
            from tokenfeed.core.store import write_store

            t0 = time.perf_counter()
            url = f"s3://{s3.bucket}/bench"
            write_store(f"{url}/native", tokens, dtype="uint16", tokens_per_chunk=per)
            print(f"uploaded to {url}/native in {time.perf_counter() - t0:.1f} s")
            assert s3.ports is not None
            proxy, endpoint = start_proxy(s3.ports.s3, args.latency)
            try:
                rows = {
                    "native, local disk": (str(root), "native", env),
                    f"native, S3 +{args.latency * 1000:.0f} ms/request": (
                        url,
                        "native",
                        env | {"AWS_ENDPOINT_URL": endpoint},
                    ),
                    "seed layout, local": (str(root), "seed", env),
                    "Megatron .bin/.idx, local": (str(root), "megatron", env),
                }
                results = {
                    name: measure(r, ds, cache, args.seconds, tmp, e)
                    for name, (r, ds, e) in rows.items()
                }
            finally:
                proxy.kill()
                proxy.wait()
    base = results["native, local disk"]["tokens_per_s"]
    size = f"cache {cache / 2**20:.0f} MiB, store {2 * n / 2**20:.0f} MiB"
    print(f"\n{size}, {args.seconds:g} s per row")
    print(f"{'store':<28} {'tokens/s':>12} {'ratio':>6} {'first batch':>12} {'peak RSS':>10}")
    for name, r in results.items():
        print(
            f"{name:<28} {r['tokens_per_s']:>12,.0f} {r['tokens_per_s'] / base:>6.2f} "
            f"{r['first_batch_s']:>10.2f} s {r['rss'] / 2**20:>7.0f} MiB"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
