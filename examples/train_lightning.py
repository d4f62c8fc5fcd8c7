"""Train a tiny GPT with Lightning from a tokenfeed feeder, checkpoint, resume.

    tokenfeed serve --data-root DATA --port 50051 &
    torchrun --nproc-per-node 2 examples/train_lightning.py --feeder localhost:50051 \\
        --dataset demo --checkpoint-dir ckpt

`FeederDataModule` builds each rank's loader in `setup()`. Every
`--checkpoint-every` steps Lightning saves model, optimizer and the loader position
(`ckpt/last.ckpt`); run the same command again, with any number of processes, and
training resumes at the first batch it had not trained on. With `--log-starts`
every step logs, before it trains, the `starts` of its windows.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from tokenfeed.integrations.lightning import FeederDataModule

sys.path.insert(0, str(Path(__file__).parent))
from train_ddp import TinyGPT

log = logging.getLogger("train_lightning")


class LitGPT(L.LightningModule):
    def __init__(self, vocab: int, seq_len: int, dim: int, layers: int, lr: float, starts: bool):
        super().__init__()
        self.model = TinyGPT(vocab, seq_len, dim, layers, heads=4)
        self.lr, self.log_starts = lr, starts

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        if self.log_starts:  # before training on it: logged means trained or lost
            starts = ",".join(map(str, batch["starts"].tolist()))
            log.info("epoch %d step %d starts %s", batch["epoch"], batch["step"], starts)
        logits = self.model(batch["input_ids"])
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        if self.global_step % 5 == 0:
            log.info("step %d loss %.3f", self.global_step, loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


class Saved(L.Callback):
    def on_save_checkpoint(self, trainer: Any, module: Any, checkpoint: Any) -> None:
        log.info("checkpoint saved at step %d", trainer.global_step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--feeder", default="localhost:50051", help="feeder address(es)")
    p.add_argument("--dataset", default="demo")
    p.add_argument("--vocab-size", type=int, default=50257)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--checkpoint-dir", type=Path, default=Path("ckpt"))
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    p.add_argument("--log-starts", action="store_true", help="log every step's window starts")
    args = p.parse_args()

    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    log.info("rank %d of %d, pid %d", rank, world, os.getpid())
    data = FeederDataModule(
        args.feeder,
        train={
            "dataset": args.dataset,
            "seq_len": args.seq_len,
            "batch_size": args.batch_size,
            "shuffle": True,
            "seed": 1234,
        },
    )
    torch.manual_seed(0)  # the same initial weights in every process
    model = LitGPT(args.vocab_size, args.seq_len, args.dim, args.layers, args.lr, args.log_starts)
    trainer = L.Trainer(
        accelerator="auto",
        devices=world,  # torchrun's processes
        strategy="ddp" if world > 1 else "auto",
        max_epochs=args.epochs,
        callbacks=[
            ModelCheckpoint(
                dirpath=args.checkpoint_dir,
                every_n_train_steps=args.checkpoint_every,
                save_top_k=-1,
                save_last=True,
            ),
            Saved(),
        ],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    last = args.checkpoint_dir / "last.ckpt"
    trainer.fit(model, datamodule=data, ckpt_path=str(last) if last.exists() else None)
    log.info("done after %d steps", trainer.global_step)


if __name__ == "__main__":
    main()
