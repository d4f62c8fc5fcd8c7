"""examples/train_adaptive_mixture.py as a user runs it: its stores made offline, a real
feeder, a tiny model on CPU. With the learning-progress bandit the noise source's
weight falls well below its start; a run SIGKILLed after a checkpoint and started again
ends on exactly the weight trajectory of a run that was never interrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tokenfeed.cli import main

from support import ROOT, wait_until
from support.feeders import running_feeder

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "train_adaptive_mixture.py"
STEPS, EVERY, CHECKPOINT_EVERY = 60, 10, 20
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def example(*argv: object, **kw) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(EXAMPLE), *(str(a) for a in argv)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=ENV,
        **kw,
    )


def train(address: str, checkpoint: Path) -> subprocess.Popen:
    return example(
        "--address", address, "--steps", STEPS, "--every", EVERY,
        "--checkpoint-every", CHECKPOINT_EVERY, "--dim", 64, "--checkpoint", checkpoint,
    )  # fmt: skip


def finished(proc: subprocess.Popen) -> list[str]:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    return out.splitlines()


def trajectory(checkpoint: Path, capsys) -> dict:
    """What `tokenfeed info --state` reads from the checkpoint."""
    capsys.readouterr()
    assert main(["info", "--state", str(checkpoint), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_noise_weight_falls_and_a_killed_run_resumes_on_the_same_trajectory(
    tmp_path: Path, capsys
) -> None:
    root = tmp_path / "data"
    made = example("--make-stores", root)
    finished(made)
    assert sorted(p.name for p in root.iterdir()) == ["comedies", "noise", "tragedies"]
    whole, killed = tmp_path / "whole.pt", tmp_path / "killed.pt"
    with running_feeder(root) as feeder:
        lines = finished(train(feeder.address, whole))
        # killed right after its first checkpoint (step 20), then started again
        first = train(feeder.address, killed)
        wait_until(killed.exists, 300, "the first checkpoint")
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
        again = finished(train(feeder.address, killed))
    assert any("resumed from" in line for line in again)

    last = lines[-1]
    assert last.startswith("weights: ")
    weights = {k: float(v) for k, v in (kv.split("=") for kv in last.split()[1:])}
    assert list(weights) == ["comedies", "tragedies", "noise"]
    assert abs(sum(weights.values()) - 1) < 1e-9
    assert weights["noise"] < 0.15 < 1 / 3  # well below its start
    assert again[-1] == last

    want, got = trajectory(whole, capsys), trajectory(killed, capsys)
    assert got == want
    loader = want["loaders"][0]
    assert loader["step"] == STEPS
    assert loader["runtime"] >= 3
    assert [s["kind"] for s in loader["trajectory"]][:2] == ["base", "run-time"]
