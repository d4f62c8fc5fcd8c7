"""`tokenfeed plan`: the arithmetic, its JSON, and a per-core figure measured live."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from tokenfeed.cli import main
from tokenfeed.cli.plan import BUILD_PER_CORE_TOKENS_S

JOB = ["--gpus", "1024", "--tokens-per-gpu-s", "40000", "--seq-len", "2048", "--batch-size", "4"]


def plan_json(*argv: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "tokenfeed", "plan", *JOB, *argv, "--json"],
        check=True,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    return json.loads(out)  # stdout is only JSON


def test_numbers_follow_from_the_job() -> None:
    doc = plan_json("--per-core-tokens-s", "1e6", "--cores-per-node", "16", "--headroom", "2")
    tokens = 1024 * 40000
    wire = tokens * 2049 / 2048
    assert doc["tokens_per_s"] == tokens
    assert doc["wire_tokens_per_s"] == pytest.approx(wire)
    assert doc["bytes_per_s"] == pytest.approx(2 * wire)  # uint16
    assert doc["gbit_per_s"] == pytest.approx(16 * wire / 1e9)
    assert doc["cores"] == math.ceil(2 * wire / 1e6)
    assert doc["replicas"] == math.ceil(doc["cores"] / 16)
    assert doc["per_core_source"] == "given"
    assert doc["cores_per_node"] == 16


def test_the_nic_can_decide_the_replicas() -> None:
    doc = plan_json("--per-core-tokens-s", "1e12", "--nic-gbit", "0.5", "--dtype", "uint32")
    assert doc["cores"] == 1
    assert doc["replicas"] == math.ceil(doc["gbit_per_s"] * 2 / 0.5) > 1


def test_the_builds_own_figure_is_the_default(capsys) -> None:
    assert main(["plan", *JOB]) == 0
    out = capsys.readouterr().out
    assert f"{BUILD_PER_CORE_TOKENS_S:,.0f} wire tokens/s (this build's benchmark)" in out
    assert " cores and " in out
    assert " replicas " in out


def test_measured_against_a_running_feeder(feeder, capsys) -> None:
    argv = [
        "plan",
        "--gpus",
        "8",
        "--tokens-per-gpu-s",
        "1e4",
        "--seq-len",
        "64",
        "--batch-size",
        "4",
        "--measure",
        feeder.address,
        "--dataset",
        "positions",
        "--seconds",
        "0.5",
        "--dtype",
        "uint32",
        "--json",
    ]
    assert main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["per_core_source"] == f"measured at {feeder.address}"
    assert doc["per_core_tokens_s"] > 0
    assert doc["cores"] >= 1


def test_bad_input_exits_2(capsys) -> None:
    assert main(["plan", *JOB, "--headroom", "0"]) == 2
    assert "--headroom must be positive" in capsys.readouterr().err


def test_a_mixture_splits_the_rate_by_source_in_each_segment(tmp_path) -> None:
    sched = tmp_path / "sched.yaml"
    sched.write_text("- {from_tokens: 1000000, weights: {web: 0.5, code: 0.5}}\n")
    doc = plan_json("--mixture", "web=0.7,code=0.3", "--schedule", str(sched))
    total = doc["tokens_per_s"]
    (base, late) = doc["segments"]
    assert base["from_tokens"] == 0
    assert late["from_tokens"] == 1_000_000
    assert base["tokens_per_s"] == pytest.approx({"web": 0.7 * total, "code": 0.3 * total})
    assert late["tokens_per_s"] == pytest.approx({"web": total / 2, "code": total / 2})


def test_the_streams_of_a_large_job_can_decide_the_cores() -> None:
    """16,384 ranks hold 16,384 streams: at 2x headroom 16 workers of 2,048 streams,
    whatever the token rate; each replica's streams size its memory and open files."""
    doc = plan_json("--gpus", "16384", "--per-core-tokens-s", "1e12", "--cores-per-node", "8")
    assert doc["cores"] == doc["cores_by_streams"] == 16
    assert (doc["replicas"], doc["workers_per_replica"]) == (2, 8)
    assert doc["streams_per_replica"] == 8192
    assert doc["open_files_per_replica"] == 8192 * 9 + 8 * 256
    # a small job: each worker's pool of chunk files keeps at least 1,024 open
    small = plan_json("--gpus", "64", "--per-core-tokens-s", "1e12", "--cores-per-node", "8")
    streams, workers = small["streams_per_replica"], small["workers_per_replica"]
    assert small["open_files_per_replica"] == streams + workers * (256 + 1024)
    assert doc["memory_beside_cache_bytes"] == 8192 * (1 << 20) + 8 * (100 << 20)
