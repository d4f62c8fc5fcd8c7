"""A FeederClient sets glibc's malloc thresholds for its ~1 MiB messages (allocator),
unless the process chose its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfeed.client import allocator

from support.feeders import running_feeder
from support.stores import make_positional_store

GLIBC = "glibc 2.36"
TUNED = {
    allocator.M_MMAP_THRESHOLD: allocator.MMAP_THRESHOLD,
    allocator.M_TRIM_THRESHOLD: allocator.TRIM_THRESHOLD,
}


def test_glibc_gets_both_thresholds() -> None:
    assert allocator.settings({}, GLIBC) == TUNED
    assert allocator.settings({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, GLIBC) == TUNED


@pytest.mark.parametrize("libc", [None, "", "musl 1.2"])
def test_another_malloc_is_left_alone(libc: str | None) -> None:
    assert allocator.settings({}, libc) == {}


@pytest.mark.parametrize(
    "environ",
    [
        {"MALLOC_MMAP_THRESHOLD_": "65536"},
        {"MALLOC_TRIM_THRESHOLD_": "0"},
        {"MALLOC_TOP_PAD_": "0"},
        {"GLIBC_TUNABLES": "glibc.pthread.rseq=0:glibc.malloc.trim_threshold=1"},
    ],
)
def test_a_process_that_chose_its_own_malloc_keeps_it(environ: dict[str, str]) -> None:
    assert allocator.settings(environ, GLIBC) == {}


DEFAULTS = {"GLIBC_TUNABLES": "glibc.malloc.perturb=0"}  # glibc's own: a tunable named

# One process streaming 1 MiB messages: its page faults per batch after a first epoch.
STREAM = """
import json, resource, sys
from tokenfeed.client import FeederClient, allocator
client = FeederClient(sys.argv[1], dataset="big", seq_len=1024, stride=64, batch_size=16)
for _ in client:
    pass
before, n = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, 0
for epoch in (1, 2, 3):
    client.set_epoch(epoch)
    for _ in client:
        n += 1
after = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
client.close()
print(json.dumps({"tuned": allocator.tune(), "faults": (after - before) / n, "batches": n}))
"""


@pytest.mark.skipif(
    not allocator.settings({}, allocator._libc_version()), reason="glibc's malloc only"
)
def test_the_client_keeps_its_message_buffers_out_of_page_faults(tmp_path: Path) -> None:
    """5-14 page faults per batch (a message's memory handed back to the kernel and
    faulted in again) with glibc's defaults; one or two with the client's thresholds
    (docs/client.md). The process that names a malloc tunable of its own keeps the defaults
    (perturb=0 is glibc's default: the same malloc as no tunable)."""
    make_positional_store(tmp_path / "big", 400_000, 40_000)  # uint32: ~1 MiB messages
    env = {k: v for k, v in os.environ.items() if k not in allocator.USERS_OWN}
    env.pop("GLIBC_TUNABLES", None)
    with running_feeder(tmp_path) as f:

        def stream(extra: dict[str, str]) -> dict[str, float]:
            run = subprocess.run(
                [sys.executable, "-c", STREAM, f.address],
                env={**env, **extra},
                capture_output=True,
                text=True,
                timeout=120,
            )
            assert run.returncode == 0, run.stderr
            return json.loads(run.stdout.splitlines()[-1])  # type: ignore[no-any-return]

        # each twice, in turns: a process that loses its core mid-stream (the other
        # tests' workers) faults more, with either setting
        runs = [stream(extra) for _ in range(2) for extra in ({}, DEFAULTS)]
    tuned, default = runs[0::2], runs[1::2]
    assert all(r["tuned"] for r in tuned)
    assert not any(r["tuned"] for r in default)
    assert {r["batches"] for r in runs} == {tuned[0]["batches"]}
    assert tuned[0]["batches"] > 1000
    fewest = [min(r["faults"] for r in rs) for rs in (tuned, default)]
    assert fewest[0] < fewest[1] / 2, (tuned, default)
