"""Processes seen from /proc: CPU seconds, RSS and PSS of a process and its descendants.

Standard library only, so the benchmarks' child programs import it from any virtual
environment (benchmarks/peers/ runs the peer loaders in their own).
"""

from __future__ import annotations

import contextlib
import os

PAGE = os.sysconf("SC_PAGE_SIZE")
TICK = os.sysconf("SC_CLK_TCK")


def stat(pid: int) -> tuple[int, float]:
    """(RSS bytes, CPU seconds: user + system) of a live process."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[21]) * PAGE, (int(fields[11]) + int(fields[12])) / TICK


def process_cpu(pid: int) -> float:
    """User + system CPU seconds of a live process so far."""
    return stat(pid)[1]


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process we may read."""
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError), open(f"/proc/{name}/stat") as f:
                out[int(name)] = int(f.read().rsplit(")", 1)[1].split()[1])
    return out


def tree(pid: int) -> list[int]:
    """`pid` and all of its live descendants (workers, their helpers)."""
    parents = _parents()
    found, frontier = [pid], [pid]
    while frontier:
        here = set(frontier)
        frontier = [p for p, parent in parents.items() if parent in here]
        found += frontier
    return found


def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds spent so far by the processes of `pids` still alive."""
    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            total += stat(pid)[1]
    return total


def pss(pid: int) -> int:
    """Proportional set size in bytes (a page shared by n processes counts 1/n), 0 once
    the process is gone."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0
