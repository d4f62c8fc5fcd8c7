"""FeederTrainer (tokenfeed.integrations.transformers) against a real feeder: the loss
is the next-token loss on the feeder's own targets, each process streams its rank's
batches with the Trainer's arithmetic, checkpoints hold every rank's position; and
examples/train_transformers.py under torchrun, killed and resumed with one process."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
import transformers

from tokenfeed.client import FeederClient
from tokenfeed.integrations.transformers import FeederTrainer, load_loader_state

from support import ROOT
from support.feeders import FeederProcess
from support.stores import COUNTING, write_counting_store
from support.torchrun import TorchRun, assert_epoch_once, finished, kill_after

DOCUMENTS = "docs"  # the lm_root fixture's (tests/integrations/conftest.py)


def tiny_gpt2(vocab: int = 512) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=vocab, n_positions=64, n_embd=32, n_layer=1, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=7, eos_token_id=7,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def arguments(tmp_path: Path, **changes: object) -> transformers.TrainingArguments:
    base = dict(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, disable_tqdm=True)
    return transformers.TrainingArguments(**(base | changes))


@pytest.mark.parametrize(
    ("shift", "masked"), [(1, False), (4, False), (1, True)], ids=["shift1", "shift4", "masked"]
)
def test_trainer_loss_is_cross_entropy_on_the_feeders_labels(
    lm_feeder, tmp_path: Path, shift: int, masked: bool
) -> None:
    model = tiny_gpt2(500)
    trainer = FeederTrainer(
        model,
        arguments(tmp_path),
        train_loader=dict(
            address=lm_feeder.address,
            dataset=DOCUMENTS,
            seq_len=64,
            batch_size=8,
            shift=shift,
            documents=masked,
            mask_cross_document_labels=masked,
        ),
    )
    with trainer.train_loader:
        batch = next(iter(trainer.get_train_dataloader()))
        loss = trainer.compute_loss(model, trainer._prepare_inputs(batch))
    labels = batch["labels"]
    assert batch["shift"] == shift
    assert ((labels == -100).any().item()) == masked  # the masked case masks some
    if not masked:  # the targets are the tokens `shift` ahead of the inputs
        row = np.asarray(batch["input_ids"][0])
        np.testing.assert_array_equal(np.asarray(labels[0, : 64 - shift]), row[shift:])
    extra = {"position_ids": batch["position_ids"]} if masked else {}  # documents=True's
    logits = model(input_ids=batch["input_ids"], **extra).logits.float()
    by_hand = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert loss.item() == pytest.approx(by_hand.item(), rel=1e-6)


def test_batch_size_comes_from_the_loader_with_a_warning_if_args_said_otherwise(
    lm_feeder, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loader = dict(address=lm_feeder.address, dataset=COUNTING, seq_len=32, batch_size=4)
    with caplog.at_level(logging.WARNING, "tokenfeed.integrations.transformers"):
        quiet = FeederTrainer(tiny_gpt2(), arguments(tmp_path), train_loader=loader)
    assert quiet.args.per_device_train_batch_size == 4
    assert not caplog.records
    with caplog.at_level(logging.WARNING, "tokenfeed.integrations.transformers"):
        told = FeederTrainer(
            tiny_gpt2(), arguments(tmp_path, per_device_train_batch_size=16), train_loader=loader
        )
    assert told.args.per_device_train_batch_size == 4
    assert "per_device_train_batch_size=16" in caplog.text
    for t in (quiet, told):
        t.train_loader.close()


def test_train_checkpoints_every_position_and_resumes_without_skipping(
    lm_feeder, tmp_path: Path
) -> None:
    """One process, gradient accumulation 2: the Trainer's steps are the loader's
    len() / 2; every checkpoint folder holds the loader's position after its
    micro-batches; a resume from the middle trains exactly the batches not trained."""
    loader = dict(address=lm_feeder.address, dataset=COUNTING, seq_len=32, batch_size=16)
    seen: list[int] = []

    class Recording(FeederTrainer):
        def training_step(self, model, inputs, *args, **kwargs):  # type: ignore[no-untyped-def]
            seen.extend(inputs["starts"].tolist())
            return super().training_step(model, inputs, *args, **kwargs)

    args = arguments(tmp_path, max_steps=20, save_steps=7, gradient_accumulation_steps=2)
    first = Recording(tiny_gpt2(), args, train_loader=loader)
    steps = len(first.train_loader)  # 78 batches of 16 windows of 32 tokens
    first.train()
    assert first.state.global_step == 20
    everything, seen[:] = list(seen), []
    state = load_loader_state(tmp_path / "out" / "checkpoint-14")
    assert state["step"] == 28
    assert state["epoch"] == 0
    stored = json.loads((tmp_path / "out" / "checkpoint-14" / "tokenfeed-rank0.json").read_text())
    assert stored == state
    first.train_loader.close()

    second = Recording(tiny_gpt2(), args, train_loader=loader)
    second.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-14"))
    assert seen == everything[28 * 16 :]  # no batch skipped by iterating, none lost
    assert second.state.global_step == 20
    assert steps == 78
    second.train_loader.close()


def test_a_loader_for_another_rank_or_without_a_device_is_refused(lm_feeder, tmp_path) -> None:
    common = dict(dataset=COUNTING, seq_len=32, batch_size=4)
    other = FeederClient(lm_feeder.address, rank=1, world_size=2, device="cpu", **common)
    with other, pytest.raises(ValueError, match="rank 1 of 2, but this process is rank 0 of 1"):
        FeederTrainer(tiny_gpt2(), arguments(tmp_path), train_loader=other)
    with (
        FeederClient(lm_feeder.address, **common) as numpy_loader,
        pytest.raises(ValueError, match="needs tensors"),
    ):
        FeederTrainer(tiny_gpt2(), arguments(tmp_path), train_loader=numpy_loader)
    with pytest.raises(ValueError, match="label_smoothing_factor"):
        FeederTrainer(
            tiny_gpt2(),
            arguments(tmp_path, label_smoothing_factor=0.1),
            train_loader=dict(address=lm_feeder.address, **common),
        )
    with pytest.raises(ValueError, match="holds no tokenfeed loader state"):
        load_loader_state(tmp_path)


# ------------------------------------------------------------------ the example
SEQ_LEN, BATCH, TOKENS = 32, 4, 12_000
EXAMPLE = ROOT / "examples" / "train_transformers.py"


def example(ranks: int, address: str, out: Path) -> TorchRun:
    return TorchRun(
        EXAMPLE,
        ranks,
        [
            "--feeder", address, "--dataset", COUNTING, "--seq-len", str(SEQ_LEN),
            "--batch-size", str(BATCH), "--dim", "32", "--layers", "1", "--output-dir",
            str(out), "--save-steps", "10", "--log-every", "5", "--log-starts",
        ],
    )  # fmt: skip


@pytest.mark.slow
def test_example_two_processes_killed_after_a_checkpoint_resume_with_one(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_counting_store(root, TOKENS)
    out = tmp_path / "out"
    with FeederProcess(root) as feeder:
        first = example(2, feeder.address, out)
        saved = [rf"\[rank {r}\] train_transformers: checkpoint saved at step 10" for r in (0, 1)]
        kill_after(first, "train_transformers", 2, *saved)
        newest = transformers.trainer_utils.get_last_checkpoint(str(out))
        state = load_loader_state(newest)
        done = state["step"]  # the first epoch step not trained on before the checkpoint
        assert state["offset"] == done * BATCH * 2
        assert done >= 10

        second = example(1, feeder.address, out)
        finished(second)
    windows = (TOKENS - SEQ_LEN - 1) // SEQ_LEN + 1
    starts = set(range(0, TOKENS, SEQ_LEN))
    assert_epoch_once(first, second, "train_transformers", done, 2, BATCH, windows, starts)
