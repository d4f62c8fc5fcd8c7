"""`tokenfeed demo` and `tokenfeed bench` end to end (subprocesses, a real feeder)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_positional_store, running_feeder

pytestmark = pytest.mark.slow


def test_demo_runs_two_ranks_over_one_epoch_and_stops_cleanly(tmp_path: Path) -> None:
    make_positional_store(tmp_path / "demo", 300_000, 65_536, dtype="uint16")  # "built"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfeed",
            "demo",
            "--data-root",
            str(tmp_path),
            "--seq-len",
            "64",
            "--batch-size",
            "8",
            "--step-time",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr
    assert "each exactly once" in out.stdout
    windows = (300_000 - 65) // 64 + 1
    assert f"delivered {windows // 16 * 16} windows to 2 ranks" in out.stdout
    # the time to first batch has a column of its own, apart from the steady-state stall
    header, *rows = [line.split() for line in out.stdout.splitlines()[:3]]
    assert header[5:8] == ["first", "batch", "ms"] and header[8:10] == ["stall", "%"]
    for row in rows:
        first_ms, stall = float(row[5]), float(row[6])
        assert first_ms > 0 and 0 <= stall <= 100


def test_bench_reports_throughput_from_a_running_feeder(feeder_root: Path) -> None:
    with running_feeder(feeder_root) as f:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "tokenfeed",
                "bench",
                "--address",
                f.address,
                "--dataset",
                "positions",
                "--seq-len",
                "64",
                "--batch-size",
                "4",
                "--seconds",
                "1",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    result = json.loads(out.stdout)
    assert result["batches"] > 0 and result["tokens"] == result["batches"] * 4 * 64
    assert 0 <= result["stall_fraction"] <= 1 and result["reconnects"] == 0
