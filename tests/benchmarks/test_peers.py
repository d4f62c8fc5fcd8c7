"""benchmarks/peers.py: its command line, its pure helpers, and (slow) one real run of
the loaders that need no peer venv: tokenfeed and the DataLoader.

The peers' own venvs (benchmarks/peers/setup.sh) are not needed by any test here.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
# Programs, not a package: imported as their adapters import each other, by path.
sys.path[:0] = [str(BENCHMARKS), str(BENCHMARKS / "peers")]
harness = importlib.import_module("harness")
peers = importlib.import_module("peers")  # benchmarks/peers.py, not the folder beside it
procs = importlib.import_module("procs")


def test_help_runs_without_the_peer_venvs() -> None:
    out = subprocess.run(
        [sys.executable, str(BENCHMARKS / "peers.py"), "--help"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "--rounds" in out
    assert "--peers" in out


@given(st.lists(st.integers(), min_size=1, max_size=8, unique=True), st.integers(1, 6))
def test_interleaved_runs_everything_once_per_round_and_rotates(items, rounds) -> None:
    order = peers.interleaved(items, rounds)
    assert len(order) == len(items) * rounds
    for r in range(rounds):
        ran = [item for k, item in order if k == r]
        assert sorted(ran) == sorted(items)
        assert ran[0] == items[r % len(items)]  # a different item starts each round


@given(
    st.lists(st.integers(0, 2), min_size=1, max_size=300),
    st.lists(st.floats(0.05, 5), min_size=3, max_size=3),
    st.integers(1, 8),
)
def test_deviation_is_the_largest_gap_over_whole_batches(sources, weights, per_batch) -> None:
    n = len(sources) // per_batch * per_batch
    if n == 0:
        return
    got = harness.deviation(np.array(sources[:n]), weights, per_batch)
    share = np.array(weights) / sum(weights)
    gaps = []  # the same by a plain loop
    for b in range(1, n // per_batch + 1):
        counts = np.bincount(sources[: b * per_batch], minlength=3)
        gaps.append(np.abs(counts - share * b * per_batch))
    assert got["batches"] == n // per_batch
    assert got["max_rows"] == pytest.approx(max(g.max() for g in gaps))
    assert got["final_rows"] == pytest.approx(list(gaps[-1]))


def test_deviation_of_a_stream_that_follows_its_weights_exactly() -> None:
    stream = np.array([0, 0, 0, 0, 0, 1, 1, 1, 2, 2] * 20)  # 0.5 / 0.3 / 0.2 every 10 rows
    assert harness.deviation(stream, [0.5, 0.3, 0.2], 10)["max_rows"] == pytest.approx(0)


def test_keys_tell_rows_apart_by_their_first_tokens() -> None:
    rows = peers.flat_tokens(64 * 1025, 0).reshape(64, 1025)
    keys = harness.keys(rows)
    assert len(set(keys)) == 64
    assert harness.keys(rows.astype(np.int64)) == keys  # the same row in any dtype


def test_flat_tokens_are_the_same_for_every_peer_and_stay_in_range() -> None:
    a = peers.flat_tokens(10_000, 3, 40_000, 60_000)
    assert np.array_equal(a, peers.flat_tokens(10_000, 3, 40_000, 60_000))
    assert a.dtype == np.uint16
    assert a.min() >= 40_000
    assert a.max() < 60_000
    assert set(a // harness.SOURCE_SPAN) == {2}  # a mixture row's first token names source 2


def test_table_takes_medians_and_ratios_compare_with_the_best_other_loader() -> None:
    def run(name: str, tps: float, cpu: float, r: int) -> dict:
        return {
            "name": name,
            "part": "run",
            "round": r,
            "empty": {"tokens_per_s": tps, "cpu_s_per_1e9_tokens": cpu},
        }

    results = [
        run("tokenfeed/numpy", 90e6, 5.0, 0),
        run("tokenfeed/numpy", 120e6, 9.0, 1),
        run("tokenfeed/numpy", 100e6, 6.0, 2),
        run("grain/w0", 40e6, 20.0, 0),
        run("litdata/w0", 50e6, 10.0, 0),
        run("floor/ready", 900e6, 1.0, 0),  # the harness's floor: never a column's best
    ]
    rows = peers.table(results, "run")
    assert list(rows) == ["tokenfeed/numpy", "litdata/w0", "grain/w0", "floor/ready"]  # PEERS
    assert rows["tokenfeed/numpy"]["Mtok/s"] == pytest.approx(100)
    assert rows["tokenfeed/numpy"]["stall %"] is None  # not measured: no figure, no ratio
    ratios = peers.ratios(rows, "tokenfeed/numpy")
    assert ratios["Mtok/s"] == ("litdata/w0", pytest.approx(2.0))
    assert ratios["CPU s/1e9"] == ("litdata/w0", pytest.approx(0.6))
    assert "stall %" not in ratios


def test_process_tree_cpu_and_pss_of_a_real_child() -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys; sum(range(10**7)); print(1, flush=True); input()"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        assert child.stdout is not None
        child.stdout.readline()  # it has spent its CPU
        assert child.pid in procs.tree(os.getpid())
        assert procs.pss(child.pid) > 0
        assert procs.cpu_seconds([child.pid]) > 0
    finally:
        child.communicate(b"\n")
    assert procs.pss(child.pid) == 0  # gone


@pytest.mark.slow
def test_a_small_run_of_tokenfeed_and_the_dataloader(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "peers.py"),
            "--peers",
            "tokenfeed,dataloader,floor",
            "--variants",
            "tokenfeed/numpy,dataloader/w0",
            "--mixture-batches",
            "200",
            "--parts",
            "write,run,mixture,resume",
            "--tokens",
            "2e6",
            "--mixture-tokens",
            "1e6",
            "--rounds",
            "1",
            "--seconds",
            "0.3",
            "--json",
            str(out),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    results = json.loads(out.read_text())
    resumed = {r["name"]: r for r in results if r["part"] == "resume"}
    for name in ("tokenfeed/numpy", "dataloader/w0"):
        r = resumed[name]
        assert r["exact"], name
        e = r["elastic"]
        assert (e["lost"], e["repeated"], e["foreign"]) == (0, 0, 0), name
        assert e["rows"] == e["rows_left"] > 0
        assert 0 <= e["short_last_step"] < 2 * 16  # only what no longer fills a step of 2 ranks
    assert set(resumed) == {"tokenfeed/numpy", "dataloader/w0"}  # the floor is no loader
    ran = {r["name"]: r for r in results if r["part"] == "run"}
    assert set(ran) == {"tokenfeed/numpy", "dataloader/w0", "floor/ready"}
    for r in ran.values():
        assert r["empty"]["tokens_per_s"] > 0
        assert 0 <= r["step"]["stall_fraction"] < 1
    mixed = {r["name"]: r for r in results if r["part"] == "mixture"}
    assert set(mixed) == {"tokenfeed/numpy", "dataloader/w0"}
    for r in mixed.values():
        assert r["deviation"]["batches"] == 200
        assert r["empty"]["tokens_per_s"] > 0
        assert r["peak_pss"] > 0
    # tokenfeed's apportionment keeps every source within 1 row of its share
    assert mixed["tokenfeed/numpy"]["deviation"]["max_rows"] <= 1
