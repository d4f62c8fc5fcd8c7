"""Chunk memory of one node: `--workers 2` vs two private single-process feeders.

    python benchmarks/workers_memory.py [--tokens 32M] [--seconds 5] [--cache 256M]

Two ways to put two cores to work on one node, with the same total --cache-bytes:

* private: two independent `tokenfeed serve` processes (each --cache-bytes C/2), four
  streams each: every process reads its chunks into its own anonymous memory and
  checks each chunk's crc32 itself (what N private copies cost);
* shared: one `tokenfeed serve --workers 2 --cache-bytes C`, eight streams on its one
  port: the workers map the chunk files read-only (page cache shared), each chunk's
  checksum checked once per node. The kernel spreads the streams over the workers;
  +RSS, which counts a shared page in every process that maps it, shows both workers
  mapping the store.

The store (random uint16, chunks of 1 M tokens) fits in each cache, so after a few
seconds of shuffled streaming each process holds all of it. Reported per arrangement,
summed over the server processes after streaming: RSS, PSS (shared pages divided
among the processes that map them, so the sum counts a page once), anonymous memory,
the chunk bytes resident in the caches, tokens/s and server CPU per 10^9 tokens. The
load generator is serve_throughput.py's (one asyncio process per address).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from serve_throughput import DEFAULT_PER_MESSAGE, make_store, tree_cpu

from tokenfeed.cli.process import wait_for_port


def smaps(pid: int) -> dict[str, int]:
    """Rss, Pss, Anonymous (bytes) from /proc/PID/smaps_rollup."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, value = line.split(":", 1)
        if key in ("Rss", "Pss", "Anonymous"):
            out[key] = int(value.split()[0]) * 1024
    return out


def serve(data: Path, tmp: Path, name: str, *extra: str) -> tuple[subprocess.Popen, str]:  # type: ignore[type-arg]
    port_file = tmp / f"port-{name}"
    argv = [sys.executable, "-m", "tokenfeed", "serve", "--data-root", str(data)]
    argv += ["--port", "0", "--port-file", str(port_file), "--log-level", "WARNING", *extra]
    proc = subprocess.Popen(argv)
    return proc, f"127.0.0.1:{wait_for_port(proc, port_file)}"


def clients(addresses: list[tuple[str, int]], seconds: float) -> int:
    """Stream from every (address, streams) at once; total tokens received."""
    here = str(Path(__file__).parent / "serve_throughput.py")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                here,
                "--client",
                a,
                "--streams",
                str(n),
                "--seconds",
                str(seconds),
                "--per-message",
                str(DEFAULT_PER_MESSAGE),
            ],
            stdout=subprocess.PIPE,
        )
        for a, n in addresses
    ]
    return sum(json.loads(p.communicate()[0])["tokens"] for p in procs)


def memory(procs: list[subprocess.Popen]) -> dict[str, int]:  # type: ignore[type-arg]
    mem = {"Rss": 0, "Pss": 0, "Anonymous": 0}
    for p in procs:
        for pid in tree_cpu(p.pid):
            for k, v in smaps(pid).items():
                mem[k] += v
    return mem


def resident(metrics_ports: list[int]) -> float:
    """tokenfeed_cache_resident_bytes summed over the given /metrics endpoints."""
    import urllib.request

    total = 0.0
    for port in metrics_ports:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read()
        for line in text.decode().splitlines():
            if line.startswith("tokenfeed_cache_resident_bytes "):
                total += float(line.split()[1])
    return total


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(
    name: str,
    procs: list[subprocess.Popen],  # type: ignore[type-arg]
    addresses: list[tuple[str, int]],
    seconds: float,
    metrics_ports: list[int],
) -> dict:  # type: ignore[type-arg]
    idle = memory(procs)  # serving, nothing loaded yet
    clients(addresses, 0.5)  # warm-up: connections, first loads
    cpu0 = {k: v for p in procs for k, v in tree_cpu(p.pid).items()}
    tokens = clients(addresses, seconds)
    cpu1 = {k: v for p in procs for k, v in tree_cpu(p.pid).items()}
    mem = memory(procs)
    cpu = sum(cpu1[p] - cpu0.get(p, 0.0) for p in cpu1)
    return {
        "name": name,
        "processes": len(cpu1),
        **mem,
        **{"d" + k: mem[k] - idle[k] for k in mem},
        "resident": resident(metrics_ports),
        "tokens_s": tokens / seconds,
        "cpu_per_gtok": cpu * 1e9 / max(tokens, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32 << 20)
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--cache", default="256M")
    args = ap.parse_args()
    from tokenfeed.server.config import parse_size

    cache = parse_size(args.cache)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as d:
        tmp = Path(d)
        make_store(tmp / "data", args.tokens)
        store_bytes = args.tokens * 2
        ports = [free_port() for _ in range(3)]
        a, addr_a = serve(
            tmp / "data",
            tmp,
            "a",
            "--cache-bytes",
            str(cache // 2),
            "--metrics-port",
            str(ports[0]),
        )
        b, addr_b = serve(
            tmp / "data",
            tmp,
            "b",
            "--cache-bytes",
            str(cache // 2),
            "--metrics-port",
            str(ports[1]),
        )
        try:
            rows.append(
                measure("private x2", [a, b], [(addr_a, 4), (addr_b, 4)], args.seconds, ports[:2])
            )
        finally:
            for p in (a, b):
                p.terminate()
                p.wait(60)
        w, addr_w = serve(
            tmp / "data",
            tmp,
            "w",
            "--cache-bytes",
            str(cache),
            "--workers",
            "2",
            "--metrics-port",
            str(ports[2]),
        )
        try:
            rows.append(measure("--workers 2", [w], [(addr_w, 8)], args.seconds, ports[2:]))
        finally:
            w.terminate()
            w.wait(60)
    mib = 1 << 20
    print(
        f"\nworkers_memory: store {store_bytes / mib:.0f} MiB (fits each cache), --cache-bytes "
        f"{cache / mib:.0f} MiB in all, 8 streams, {args.seconds:g} s, sums over the server "
        "processes\n"
    )
    print(
        f"{'arrangement':12s} {'procs':>5s} {'RSS':>6s} {'PSS':>6s} {'anon':>6s} "
        f"{'+RSS':>6s} {'+PSS':>6s} {'+anon':>6s} {'cached':>6s} {'Mtok/s':>7s} {'cpu s/Gtok':>10s}"
    )
    print(f"{'':19s}MiB, after streaming; +: grown since idle; cached: the caches' bytes")
    for r in rows:
        print(
            f"{r['name']:12s} {r['processes']:5d} {r['Rss'] / mib:6.0f} {r['Pss'] / mib:6.0f} "
            f"{r['Anonymous'] / mib:6.0f} {r['dRss'] / mib:6.0f} {r['dPss'] / mib:6.0f} "
            f"{r['dAnonymous'] / mib:6.0f} "
            f"{r['resident'] / mib:6.0f} {r['tokens_s'] / 1e6:7.0f} {r['cpu_per_gtok']:10.2f}"
        )


if __name__ == "__main__":
    main()
