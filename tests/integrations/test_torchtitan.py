"""FeederDataLoader (tokenfeed.integrations.torchtitan) against a real feeder: built
by torchtitan's own build call, torchtitan's (input, labels) pairs, endless across
epochs, its state saved and restored by torchtitan's CheckpointManager (one entry per
dp rank; a resume on another number of dp ranks); and examples/train_torchtitan.py
under torchrun, killed and resumed with one process. torchtitan's trainer needs a GPU:
it is not run here, its CheckpointManager is, on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torchtitan.components.checkpoint import CheckpointManager

from tokenfeed.integrations.torchtitan import FeederDataLoader

from support import ROOT
from support.feeders import FeederProcess
from support.stores import COUNTING, write_counting_store
from support.torchrun import TorchRun, assert_epoch_once, finished, kill_after


def built(address: str, dp_rank: int = 0, dp_world_size: int = 1, **config) -> FeederDataLoader:
    """The loader as a torchtitan trainer builds it from its config."""
    return FeederDataLoader.Config(address=address, dataset=COUNTING, **config).build(
        dp_rank=dp_rank,
        dp_world_size=dp_world_size,
        tokenizer=None,
        seq_len=32,
        local_batch_size=8,
        snapshot_every_n_steps=10,
    )


def test_pairs_from_torchtitans_build_call_endless_across_epochs(lm_feeder) -> None:
    loader = built(lm_feeder.address, shuffle=True, seed=5)
    with loader.loader:
        assert (loader.loader.seq_len, loader.loader.batch_size) == (32, 8)  # torchtitan's
        steps = len(loader.loader)
        seen: dict[int, list[int]] = {0: [], 1: []}
        for n, (inputs, labels) in enumerate(loader):
            batch = loader.batch
            assert set(inputs) == {"input"}
            assert inputs["input"].dtype == torch.int64
            assert inputs["input"].device.type == "cpu"
            want = np.asarray(batch["starts"])[:, None] + np.arange(33)
            np.testing.assert_array_equal(inputs["input"].numpy(), want[:, :32] % 512)
            np.testing.assert_array_equal(labels.numpy(), want[:, 1:] % 512)
            seen[batch["epoch"]].extend(batch["starts"].tolist())
            if n == steps + 2:
                break
    assert len(seen[0]) == len(set(seen[0])) == steps * 8  # a whole epoch, then the next
    assert len(seen[1]) == 3 * 8
    assert seen[1] != seen[0][:24]


def test_documents_add_positions(lm_feeder) -> None:
    loader = FeederDataLoader.Config(address=lm_feeder.address, dataset="docs", documents=True)
    loader = loader.build(dp_rank=0, dp_world_size=1, seq_len=32, local_batch_size=4)
    with loader.loader:
        inputs, _ = next(iter(loader))
    assert set(inputs) == {"input", "positions"}
    np.testing.assert_array_equal(inputs["positions"].numpy(), loader.batch["position_ids"].numpy())


def test_state_is_one_entry_per_dp_rank_and_resumes_on_another_dp_size(lm_feeder) -> None:
    ranks = [built(lm_feeder.address, r, 2) for r in (0, 1)]
    assert [list(r.state_dict()) for r in ranks] == [["dp_rank_0"], ["dp_rank_0"]]  # fresh
    for r in ranks:
        it = iter(r)
        for _ in range(5):
            next(it)
    states = [r.state_dict() for r in ranks]
    assert [list(s) for s in states] == [["dp_rank_0"], ["dp_rank_1"]]
    assert json.loads(states[0]["dp_rank_0"]) == json.loads(states[1]["dp_rank_1"])

    alone = built(lm_feeder.address, 0, 1)
    alone.load_state_dict(states[1])
    _, _labels = next(iter(alone))
    assert alone.batch["step"] == 5
    assert alone.batch["offset"] == 5 * 8 * 2
    for r in (*ranks, alone):
        r.close()


class Weights(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(3))


class NoOptimizer:  # CheckpointManager saves its state dict; nothing to optimize here
    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def manager(folder: Path, loader: FeederDataLoader) -> CheckpointManager:
    return CheckpointManager.Config(
        enable=True, folder=str(folder), interval=4, keep_latest_k=0, last_save_model_only=False
    ).build(
        dataloader=loader,
        model_parts=[Weights()],
        optimizers=NoOptimizer(),
        lr_schedulers=NoOptimizer(),
        states={},
        sd_adapter=None,
    )


@pytest.fixture
def one_process_group():
    """A gloo group of this process alone, on loopback: DCP saves through one."""
    import torch.distributed as dist

    from support import free_port

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_process_group")
def test_checkpoint_manager_saves_and_restores_the_position(lm_feeder, tmp_path) -> None:
    first = built(lm_feeder.address, shuffle=True, seed=2)
    it, trained = iter(first), []
    saver = manager(tmp_path / "ckpt", first)
    for step in range(1, 9):
        next(it)
        trained.append(first.batch["starts"].tolist())
        saver.save(step)
    after = [next(it) and first.batch["starts"].tolist() for _ in range(3)]
    first.close()
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step-4", "step-8"]

    second = built(lm_feeder.address, shuffle=True, seed=2)
    assert manager(tmp_path / "ckpt", second).load()  # the newest: step-8
    it = iter(second)
    resumed = [next(it) and second.batch["starts"].tolist() for _ in range(3)]
    assert resumed == after  # the batch after the 8th, nothing skipped or repeated
    second.close()


# ------------------------------------------------------------------ the example
SEQ_LEN, BATCH, TOKENS = 32, 4, 12_000
EXAMPLE = ROOT / "examples" / "train_torchtitan.py"


def example(ranks: int, address: str, checkpoints: Path, steps: int) -> TorchRun:
    return TorchRun(
        EXAMPLE,
        ranks,
        [
            "--feeder", address, "--dataset", COUNTING, "--vocab-size", "512", "--seq-len",
            str(SEQ_LEN), "--batch-size", str(BATCH), "--dim", "32", "--layers", "1",
            "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "10",
            "--steps", str(steps), "--log-starts",
        ],
    )  # fmt: skip


@pytest.mark.slow
def test_example_two_processes_killed_after_a_checkpoint_resume_with_one(tmp_path: Path) -> None:
    root = tmp_path / "data"
    write_counting_store(root, TOKENS)
    checkpoints = tmp_path / "ckpt"
    windows = (TOKENS - SEQ_LEN - 1) // SEQ_LEN + 1
    with FeederProcess(root) as feeder:
        first = example(2, feeder.address, checkpoints, 1000)
        saved = [rf"\[rank {r}\] train_torchtitan: checkpoint saved at step 10" for r in (0, 1)]
        kill_after(first, "train_torchtitan", 2, *saved)
        newest = max(checkpoints.iterdir(), key=lambda p: int(p.name.split("-")[1]))
        done = int(newest.name.split("-")[1])  # steps trained before the checkpoint
        # The resumed rank trains the epoch's rest (and a few steps into the next).
        second = example(1, feeder.address, checkpoints, done + (windows - done * 8) // 4 + 3)
        finished(second)
    assert f"resumed at step {done}" in "\n".join(second.lines)
    starts = set(range(0, TOKENS, SEQ_LEN))
    assert_epoch_once(first, second, "train_torchtitan", done, 2, BATCH, windows, starts)
