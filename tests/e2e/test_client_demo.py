"""`tokenfeed demo` and `tokenfeed bench` end to end (subprocesses, a real feeder), and
the demo's exactly-once check of a mixture on rows made up to break it."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenfeed.cli.demo import MIXTURE, _mixture_check
from tokenfeed.core.mixture import Mixture
from tokenfeed.prepare.demo import DEMO_PARTS, demo_store_names

from support.feeders import running_feeder
from support.stores import make_positional_store

SIZES = {"demo": 300_000, "comedies": 200_000, "tragedies": 120_000}


def built(root: Path) -> None:
    """Every demo store, "built" (positional tokens: each window is checkable)."""
    assert sorted(SIZES) == sorted(demo_store_names())
    for name, tokens in SIZES.items():
        make_positional_store(root / name, tokens, 65_536, dtype="uint16")


def demo(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfeed",
            "demo",
            "--data-root",
            str(root),
            "--seq-len",
            "64",
            "--batch-size",
            "8",
            "--step-time",
            "0",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )


def check_table(stdout: str) -> None:
    # the time to first batch has a column of its own, apart from the steady-state stall
    header, *rows = [line.split() for line in stdout.splitlines()[:3]]
    assert header[5:8] == ["first", "batch", "ms"]
    assert header[8:10] == ["stall", "%"]
    for row in rows:
        first_ms, stall = float(row[5]), float(row[6])
        assert first_ms > 0
        assert 0 <= stall <= 100


@pytest.mark.slow
def test_demo_streams_the_mixture_until_every_source_is_passed_twice(tmp_path: Path) -> None:
    built(tmp_path)
    out = demo(tmp_path, "--epochs", "2")
    assert out.returncode == 0, out.stderr
    assert sorted(DEMO_PARTS) == ["comedies", "tragedies"]
    assert MIXTURE.startswith("comedies=")
    # the oracle: walk the steps until every source is drawn twice over
    windows = [(SIZES[name] - 65) // 64 + 1 for name in ("comedies", "tragedies")]
    mix = Mixture([pair.split("=") for pair in MIXTURE.split(",")], seq_len=64)
    steps = next(
        s
        for s in itertools.count(1)
        if all(c >= 2 * w for c, w in zip(mix.counts(s * 16), windows, strict=True))
    )
    drawn = mix.counts(steps * 16)
    parts = [
        f"{name} {c} windows (2 passes of {w} + {c - 2 * w})"
        for name, c, w in zip(("comedies", "tragedies"), drawn, windows, strict=True)
    ]
    assert f"mixture over 2 ranks: {', '.join(parts)}: each pass exactly once" in out.stdout
    assert out.stdout.splitlines()[0].split()[1] == "passes"
    for row in out.stdout.splitlines()[1:3]:
        assert row.split()[1:4] == ["2", str(steps), str(steps * 8)]
    check_table(out.stdout)


@pytest.mark.slow
def test_demo_runs_two_ranks_over_one_epoch_of_a_dataset_and_stops_cleanly(
    tmp_path: Path,
) -> None:
    built(tmp_path)
    out = demo(tmp_path, "--dataset", "demo")
    assert out.returncode == 0, out.stderr
    assert "each exactly once" in out.stdout
    windows = (300_000 - 65) // 64 + 1
    assert f"delivered {windows // 16 * 16} windows to 2 ranks" in out.stdout
    check_table(out.stdout)


def ranks(starts: list[list[int]], drawn: int, windows: int = 4) -> list[dict[str, Any]]:
    """Two ranks' results for a one-source mixture of `windows` windows (stride 10)."""
    base = {"sources": ["s"], "source_windows": [windows], "stride": 10, "drawn": [drawn]}
    return [{**base, "starts": [rows]} for rows in starts]


def test_mixture_check_counts_every_window_of_every_pass() -> None:
    # 2 passes of 4 windows and 1 of the third: 0, 10, 20, 30 twice each, one of them 3x
    good = ranks([[0, 10, 20, 30, 0], [10, 20, 30, 20]], drawn=9)
    assert _mixture_check(good).endswith("s 9 windows (2 passes of 4 + 1): each pass exactly once")
    for starts, drawn in [
        ([[0, 10, 20, 30, 0], [10, 20, 30, 30, 30]], 10),  # 30 four times: a pass repeats it
        ([[0, 10, 20, 0], [10, 20, 0, 20, 0]], 9),  # 30 never delivered
        ([[0, 10, 20, 30, 0], [10, 20, 30]], 9),  # a row missing
        ([[0, 10, 20, 30, 0], [10, 20, 30, 25]], 9),  # not a window start
    ]:
        assert "SOME WINDOWS TWICE IN A PASS OR MISSING" in _mixture_check(ranks(starts, drawn))


@pytest.mark.slow
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
    assert result["batches"] > 0
    assert result["tokens"] == result["batches"] * 4 * 64
    assert 0 <= result["stall_fraction"] <= 1
    assert result["reconnects"] == 0
