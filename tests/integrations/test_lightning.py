"""FeederDataModule (tokenfeed.integrations.lightning) against a real feeder: each
rank's loader built in setup(), checkpoints hold the first batch not trained on
(also for an endless mixture, which Lightning reads ahead of the loop), and a resume
trains exactly the rest; and examples/train_lightning.py under torchrun, killed and
resumed with one process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch

from tokenfeed.integrations.lightning import FeederDataModule

from support import ROOT
from support.feeders import FeederProcess
from support.stores import COUNTING, write_counting_store
from support.torchrun import TorchRun, assert_epoch_once, finished, kill_after

# Lightning 2.6's own use of torch's pytree (not ours) warns under torch 2.13.
pytestmark = pytest.mark.filterwarnings("ignore:`isinstance.treespec, LeafSpec.` is deprecated")


class Recorder(L.LightningModule):
    """A one-parameter model that records the starts of every batch it trains on."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.trained: list[int] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.trained.extend(batch["starts"].tolist())
        return (self.weight - batch["input_ids"].float().mean()) ** 2

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-6)


class Validating(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.validated: list[int] = []

    def validation_step(self, batch: dict[str, Any], batch_idx: int) -> None:
        self.validated.extend(batch["starts"].tolist())


def fit(dm: FeederDataModule, max_steps: int, ckpt_path: str | None = None, model=None):
    model = model or Recorder()
    trainer = L.Trainer(
        accelerator="cpu", devices=1, max_steps=max_steps, max_epochs=-1 if max_steps > 0 else 1,
        logger=False, enable_progress_bar=False, enable_model_summary=False,
        enable_checkpointing=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(model, datamodule=dm, ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize("mixture", [False, True], ids=["dataset", "mixture"])
def test_a_checkpoint_resumes_at_the_first_batch_not_trained(lm_feeder, tmp_path, mixture) -> None:
    source = {"mixture": {COUNTING: 0.5, "docs": 0.5}} if mixture else {"dataset": COUNTING}
    train = {**source, "seq_len": 32, "batch_size": 8, "shuffle": True, "seed": 3}
    _whole, whole_model = fit(FeederDataModule(lm_feeder.address, train=train), 30)

    first, model = fit(FeederDataModule(lm_feeder.address, train=train), 12)
    checkpoint = tmp_path / "at12.ckpt"
    first.save_checkpoint(checkpoint)
    saved = torch.load(checkpoint, weights_only=False)["FeederDataModule"]["train"]
    assert saved["step"] == 12
    assert saved["offset"] == 12 * 8
    assert model.trained == whole_model.trained[: 12 * 8]

    rest, rest_model = fit(FeederDataModule(lm_feeder.address, train=train), 30, str(checkpoint))
    assert rest_model.trained == whole_model.trained[12 * 8 :]  # nothing skipped or repeated
    assert rest.global_step == 30


def test_an_epoch_is_the_loaders_and_validation_runs_the_same_steps_on_every_rank(
    lm_feeder, tmp_path
) -> None:
    train = {"dataset": COUNTING, "seq_len": 32, "batch_size": 16, "split_rate": 0.9}
    val = {**train, "split": "validation"}
    dm = FeederDataModule(lm_feeder.address, train=train, val=val, connect_timeout=10)
    trainer, model = fit(dm, -1, model=Validating())
    windows = (36_000 - 33) // 32 + 1  # the train split of 0.9 of 40,000 tokens
    assert trainer.num_training_batches == windows // 16
    assert sorted(model.trained) == list(range(0, (windows // 16) * 16 * 32, 32))
    val_windows = (4_000 - 33) // 32 + 1  # validation delivers every window
    assert trainer.num_val_batches == [(val_windows + 15) // 16]
    assert model.validated == list(range(36_000, 36_000 + val_windows * 32, 32))
    assert dm.train_loader is None  # closed by teardown


# ------------------------------------------------------------------ the example
SEQ_LEN, BATCH, TOKENS = 32, 4, 12_000
EXAMPLE = ROOT / "examples" / "train_lightning.py"


def example(ranks: int, address: str, checkpoints: Path) -> TorchRun:
    return TorchRun(
        EXAMPLE,
        ranks,
        [
            "--feeder", address, "--dataset", COUNTING, "--vocab-size", "512", "--seq-len",
            str(SEQ_LEN), "--batch-size", str(BATCH), "--dim", "32", "--layers", "1",
            "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "10", "--log-starts",
        ],
    )  # fmt: skip


@pytest.mark.slow
def test_example_two_processes_killed_after_a_checkpoint_resume_with_one(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_counting_store(root, TOKENS)
    checkpoints = tmp_path / "ckpt"
    with FeederProcess(root) as feeder:
        first = example(2, feeder.address, checkpoints)
        kill_after(
            first,
            "train_lightning",
            2,
            r"\[rank 0\] train_lightning: checkpoint saved at step 10",
            r"\[rank 0\] train_lightning: epoch 0 step 1[1-9] starts",  # written by then
        )
        state = torch.load(checkpoints / "last.ckpt", weights_only=False)["FeederDataModule"]
        done = state["train"]["step"]  # the first epoch step not trained on before it
        assert state["train"]["offset"] == done * BATCH * 2
        assert done >= 10

        second = example(1, feeder.address, checkpoints)
        finished(second)
    windows = (TOKENS - SEQ_LEN - 1) // SEQ_LEN + 1
    starts = set(range(0, TOKENS, SEQ_LEN))
    assert_epoch_once(first, second, "train_lightning", done, 2, BATCH, windows, starts)
