"""scripts/gpu_check.py, the CUDA path's checks for a GPU machine, in its --dry-run form:
the same checks on the CPU against a feeder of its own, the CUDA-only ones skipped."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from support import ROOT

SCRIPT = ROOT / "scripts" / "gpu_check.py"
CHECKS = ["ceiling", "ids", "readers", "loop", "stream", "latency", "memory", "contexts"]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=600
    )


@pytest.mark.slow
def test_the_dry_run_passes_every_check_that_has_a_cpu_form() -> None:
    out = run("--dry-run")
    assert out.returncode == 0, out.stdout + out.stderr
    *lines, summary = out.stdout.strip().splitlines()
    status = {line.split()[1]: line.split()[0] for line in lines}
    assert list(status) == [*CHECKS, "sanitizer"]
    assert {name for name, s in status.items() if s == "SKIP"} == {"memory", "contexts"}
    assert summary.endswith("7 passed, 0 failed, 2 skipped")
    stream = re.search(r"PASS stream +(\d+) batches over 3 epochs", out.stdout)
    assert stream is not None
    assert int(stream[1]) > 3 * 64  # epochs longer than the lookahead: two readers at the ends


@pytest.mark.slow
def test_an_unknown_check_is_exit_2_naming_it() -> None:
    out = run("--only", "ids,nope")
    assert out.returncode == 2
    assert "unknown checks ['nope']" in out.stderr
