"""examples/train_ddp.py as a user runs it: torchrun, 2 ranks on CPU (gloo), a real
feeder; SIGKILL after a checkpoint; resume with 1 rank. From the `starts` each step
logs: every window of the epoch is trained on exactly once, counting what was trained
up to the checkpoint and everything after the resume."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tokenfeed.core.store import write_store

from support import ROOT
from support.feeders import FeederProcess

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "train_ddp.py"
SEQ_LEN, BATCH, TOKENS = 32, 4, 40_000
STEP = re.compile(r"\[rank (\d)\] train_ddp: epoch 0 step (\d+) starts ([\d,]+)")


class Run:
    """torchrun examples/train_ddp.py, its output collected line by line."""

    def __init__(self, ranks: int, feeder: str, checkpoint: Path) -> None:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(EXAMPLE),
            "--feeder",
            feeder,
            "--dataset",
            "mod512",
            "--seq-len",
            str(SEQ_LEN),
            "--batch-size",
            str(BATCH),
            "--dim",
            "32",
            "--layers",
            "1",
            "--checkpoint",
            str(checkpoint),
            "--checkpoint-every",
            "10",
            "--log-starts",
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def finish(self) -> int:
        """Wait for the end of the run and of its output."""
        code = self.proc.wait(120)
        self._reader.join(30)
        return code

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            for line in self.proc.stdout:
                with self._changed:
                    self.lines.append(line.rstrip("\n"))
                    self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float = 120) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no line matches {pattern!r}:\n" + self.output())
                self._changed.wait(0.5)

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def steps(self) -> dict[tuple[int, int], list[int]]:
        """(rank, step) -> the starts that rank trained on at that step."""
        out = {}
        for line in list(self.lines):
            if m := STEP.search(line):
                out[(int(m[1]), int(m[2]))] = [int(s) for s in m[3].split(",")]
        return out


def test_train_ddp_checkpoint_sigkill_resume_with_one_rank(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_store(
        root / "mod512",
        (np.arange(TOKENS) % 512).astype(np.uint16),
        dtype="uint16",
        tokens_per_chunk=4_000,
        vocab_size=512,
        eos_token_id=511,
        tokenizer="mod512",
    )
    checkpoint = tmp_path / "ckpt.pt"
    with FeederProcess(root) as feeder:
        first = Run(2, feeder.address, checkpoint)
        try:
            pids = [
                int(first.wait_for(rf"\[rank {r}\] train_ddp: rank {r} of 2, pid (\d+)")[1])
                for r in (0, 1)
            ]
            first.wait_for(r"checkpoint saved at step \d+")
        finally:
            for pid in pids:
                os.kill(pid, signal.SIGKILL)  # a crash: no cleanup, no final checkpoint
            first.proc.kill()
            first.finish()
        import torch

        assert not any("done after" in line for line in first.lines)  # killed mid-epoch
        state = torch.load(checkpoint, weights_only=False)["loader"]
        done = state["step"]  # the first epoch step not trained on before the checkpoint
        assert state["offset"] == done * BATCH * 2
        assert done >= 10

        second = Run(1, feeder.address, checkpoint)
        second.wait_for(r"done after \d+ steps", timeout=300)
        assert second.finish() == 0, second.output()

    # A rank logs a step's starts before its forward pass, and rank 0 saves after the
    # backward (an all-reduce with every rank) of the step before: every step before
    # the checkpoint is in the log of both ranks.
    trained_first = first.steps()
    assert all((r, s) in trained_first for r in (0, 1) for s in range(done))
    before = [s for (_, step), starts in trained_first.items() if step < done for s in starts]
    after = second.steps()
    assert min(step for _, step in after) == done  # resumed at the first untrained step
    trained = before + [s for starts in after.values() for s in starts]
    windows = (TOKENS - SEQ_LEN - 1) // SEQ_LEN + 1
    tail = (windows - done * BATCH * 2) % BATCH  # the resumed epoch drops its own tail
    assert len(trained) == len(set(trained)) == windows - tail  # nothing lost or repeated
    assert set(trained) <= set(range(0, TOKENS, SEQ_LEN))
    losses = [float(m[1]) for m in re.finditer(r"loss (\S+)", "\n".join(second.lines))]
    assert losses[-1] < losses[0]  # it learns (token i+1 follows token i)
