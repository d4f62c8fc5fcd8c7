"""examples/train_ddp.py as a user runs it: torchrun, 2 ranks on CPU (gloo), a real
feeder; SIGKILL after a checkpoint; resume with 1 rank. From the `starts` each step
logs: every window of the epoch is trained on exactly once, counting what was trained
up to the checkpoint and everything after the resume."""

from __future__ import annotations

from pathlib import Path

import pytest

from support import ROOT
from support.feeders import FeederProcess
from support.stores import COUNTING, write_counting_store
from support.torchrun import TorchRun, assert_epoch_once, finished, kill_after

pytestmark = pytest.mark.slow

EXAMPLE = ROOT / "examples" / "train_ddp.py"
SEQ_LEN, BATCH, TOKENS = 32, 4, 40_000


def example(ranks: int, feeder: str, checkpoint: Path) -> TorchRun:
    return TorchRun(
        EXAMPLE,
        ranks,
        [
            "--feeder", feeder, "--dataset", COUNTING, "--seq-len", str(SEQ_LEN),
            "--batch-size", str(BATCH), "--dim", "32", "--layers", "1", "--checkpoint",
            str(checkpoint), "--checkpoint-every", "10", "--log-starts",
        ],
    )  # fmt: skip


def test_train_ddp_checkpoint_sigkill_resume_with_one_rank(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_counting_store(root, TOKENS)
    checkpoint = tmp_path / "ckpt.pt"
    with FeederProcess(root) as feeder:
        first = example(2, feeder.address, checkpoint)
        kill_after(first, "train_ddp", 2, r"checkpoint saved at step \d+")
        import torch

        state = torch.load(checkpoint, weights_only=False)["loader"]
        done = state["step"]  # the first epoch step not trained on before the checkpoint
        assert state["offset"] == done * BATCH * 2
        assert done >= 10

        second = example(1, feeder.address, checkpoint)
        finished(second)

    # A rank logs a step's starts before its forward pass, and rank 0 saves after the
    # backward (an all-reduce with every rank) of the step before: every step before
    # the checkpoint is in the log of both ranks.
    windows = (TOKENS - SEQ_LEN - 1) // SEQ_LEN + 1
    starts = set(range(0, TOKENS, SEQ_LEN))
    assert_epoch_once(first, second, "train_ddp", done, 2, BATCH, windows, starts)
