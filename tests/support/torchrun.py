"""An example script under `torchrun`, as a user runs it, its output read line by line.

    run = TorchRun(EXAMPLE, 2, ["--feeder", address, ...])
    run.wait_for(r"checkpoint saved at step (\\d+)")      # a regex match, or AssertionError
    run.pids("train_ddp")                               # each rank's pid, from its log line
    run.steps("train_ddp")                              # (rank, step) -> starts, epoch 0

The examples log `[rank R] NAME: rank R of W, pid P` at start and, with
`--log-starts`, `[rank R] NAME: epoch E step S starts a,b,c` before training a batch.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class TorchRun:
    """`python -m torch.distributed.run --standalone --nproc-per-node N script args`."""

    def __init__(self, script: Path, ranks: int, args: list[str]) -> None:
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            str(ranks),
            str(script),
            *args,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def finish(self, timeout: float = 300) -> int:
        """Wait for the end of the run and of its output."""
        code = self.proc.wait(timeout)
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

    def wait_for(self, pattern: str, timeout: float = 180) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for line in self.lines:
                    if m := re.search(pattern, line):
                        return m
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise AssertionError(f"no line matches {pattern!r}:\n" + self.output())
                self._changed.wait(0.5)

    def pids(self, name: str, ranks: int) -> list[int]:
        """Each rank's pid, from its `rank R of W, pid P` line."""
        return [
            int(self.wait_for(rf"\[rank {r}\] {name}: rank {r} of \d+, pid (\d+)")[1])
            for r in range(ranks)
        ]

    def kill(self, pids: list[int]) -> None:
        """SIGKILL the ranks (a crash: no cleanup, no final checkpoint), then torchrun."""
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        self.proc.kill()
        self.finish()

    def output(self) -> str:
        return "\n".join(self.lines[-60:])

    def steps(self, name: str) -> dict[tuple[int, int], list[int]]:
        """(rank, step) -> the starts that rank trained on at that step of epoch 0."""
        line = re.compile(rf"\[rank (\d+)\] {name}: epoch 0 step (\d+) starts ([\d,]+)")
        out = {}
        for text in list(self.lines):
            if m := line.search(text):
                out[(int(m[1]), int(m[2]))] = [int(s) for s in m[3].split(",")]
        return out

    def losses(self) -> list[float]:
        return [float(m[1]) for m in re.finditer(r" loss ([\d.]+)", "\n".join(self.lines))]


def kill_after(run: TorchRun, name: str, ranks: int, *patterns: str) -> None:
    """Wait for each of `patterns` in the output of `run`, then SIGKILL its ranks (a
    crash: no cleanup, no final checkpoint), which had not finished."""
    pids: list[int] = []
    try:
        pids = run.pids(name, ranks)
        for pattern in patterns:
            run.wait_for(pattern)
    finally:
        run.kill(pids)
    assert not any("done after" in line for line in run.lines)  # killed mid-epoch


def finished(run: TorchRun) -> None:
    """Wait for `run` to say it is done and to exit 0."""
    run.wait_for(r"done after \d+ steps", timeout=300)
    assert run.finish() == 0, run.output()


def assert_epoch_once(
    first: TorchRun,
    second: TorchRun,
    name: str,
    done: int,
    ranks: int,
    batch: int,
    windows: int,
    starts: set[int],
) -> None:
    """`first` (`ranks` ranks) trained steps 0..done-1 and was killed, `second` (1 rank)
    resumed at step `done` and finished the epoch: every window of the epoch was
    trained on exactly once, but the resumed epoch's own tail (fewer than B windows),
    and the loss fell after the resume."""
    trained_first = first.steps(name)
    assert all((r, s) in trained_first for r in range(ranks) for s in range(done))
    before = [s for (_, step), ss in trained_first.items() if step < done for s in ss]
    after = second.steps(name)
    assert min(step for _, step in after) == done, second.output()  # the first untrained
    trained = before + [s for ss in after.values() for s in ss]
    tail = (windows - done * batch * ranks) % batch
    assert len(trained) == len(set(trained)) == windows - tail  # nothing lost or repeated
    assert set(trained) <= starts
    losses = second.losses()
    assert losses[-1] < losses[0], second.output()
