"""torchtitan's data path and checkpoints with a tokenfeed feeder, on CPU or GPU.

    tokenfeed serve --data-root DATA --port 50051 &
    torchrun --nproc-per-node 2 examples/train_torchtitan.py --feeder localhost:50051 \\
        --dataset demo --checkpoint-dir ckpt --steps 200

In a torchtitan job the trainer's config selects the loader and torchtitan does the
rest:

    dataloader=FeederDataLoader.Config(address="feeder:50051", dataset="demo",
                                       shuffle=True, seed=1234),

This script runs the same pieces without torchtitan's GPU trainer: the loader built
by torchtitan's own build call, a tiny model under DistributedDataParallel,
torchtitan's optimizer and scheduler containers, and its CheckpointManager, which
saves every `--checkpoint-every` steps with each dp rank's loader position. Run the
same command again, with any number of processes, and training resumes at the first
batch it had not trained on. With `--log-starts` every step logs, before it trains,
the `starts` of its windows.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torchtitan.components.checkpoint import CheckpointManager
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig

from tokenfeed.integrations.torchtitan import FeederDataLoader

sys.path.insert(0, str(Path(__file__).parent))
from train_ddp import TinyGPT

log = logging.getLogger("train_torchtitan")


class TrainState:
    """The step, saved with the checkpoint (torchtitan's trainer saves itself so)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--feeder", default="localhost:50051", help="feeder address(es)")
    p.add_argument("--dataset", default="demo")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per dp rank")
    p.add_argument("--steps", type=int, default=200, help="training steps in all")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--checkpoint-dir", default="ckpt")
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    p.add_argument("--log-starts", action="store_true", help="log every step's window starts")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    log.info("rank %d of %d, pid %d", rank, world, os.getpid())
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")

    # What a torchtitan trainer does with its config's dataloader:
    loader = FeederDataLoader.Config(
        address=args.feeder, dataset=args.dataset, shuffle=True, seed=1234
    ).build(
        dp_rank=rank,
        dp_world_size=world,
        tokenizer=None,
        seq_len=args.seq_len,
        local_batch_size=args.batch_size,
        snapshot_every_n_steps=args.checkpoint_every,
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyGPT(args.vocab_size, args.seq_len, args.dim, args.layers, heads=4).to(device)
    ddp = DistributedDataParallel(model)
    optimizers = OptimizersContainer.Config(
        param_groups=[ParamGroupConfig(pattern=".*", optimizer_name="AdamW",
                                       optimizer_kwargs={"lr": args.lr})]
    ).build(model_parts=[model])  # fmt: skip
    schedulers = LRSchedulersContainer.Config(warmup_steps=0, decay_type="linear").build(
        optimizers=optimizers, training_steps=args.steps
    )
    train_state = TrainState()
    checkpointer = CheckpointManager.Config(
        enable=True,
        folder=args.checkpoint_dir,
        interval=args.checkpoint_every,
        keep_latest_k=0,
        last_save_model_only=False,
    ).build(
        dataloader=loader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=schedulers,
        states={"train_state": train_state},
        sd_adapter=None,
    )
    if checkpointer.load():  # the newest step-N folder, any number of ranks
        log.info("resumed at step %d: %s", train_state.step, loader.loader.state_dict())

    batches = iter(loader)
    while train_state.step < args.steps:
        train_state.step += 1
        inputs, labels = next(batches)
        batch = loader.batch  # the feeder's batch behind the pair
        if args.log_starts:  # before training on it: logged means trained or lost
            starts = ",".join(map(str, batch["starts"].tolist()))
            log.info("epoch %d step %d starts %s", batch["epoch"], batch["step"], starts)
        logits = ddp(inputs["input"].to(device))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.to(device).flatten())
        optimizers.zero_grad()
        loss.backward()
        optimizers.step()
        schedulers.step()
        if train_state.step % 5 == 0:
            log.info("step %d loss %.3f", train_state.step, loss.item())
        if checkpointer.save(train_state.step, last_step=train_state.step == args.steps):
            log.info("checkpoint saved at step %d", train_state.step)
    log.info("done after %d steps", train_state.step)
    checkpointer.close()
    loader.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
