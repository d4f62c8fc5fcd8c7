"""Train a tiny causal LM with the Hugging Face Trainer from a tokenfeed feeder.

    tokenfeed serve --data-root DATA --port 50051 &
    torchrun --nproc-per-node 2 examples/train_transformers.py --feeder localhost:50051 \\
        --dataset demo --output-dir out

`FeederTrainer` is the Trainer with each process streaming its own rank's batches.
Every `--save-steps` steps a checkpoint folder in `--output-dir` holds the model,
optimizer and each rank's loader position; run the same command again, with any
number of processes, and training resumes from the newest one at the first batch
it had not trained on. With `--log-starts` every batch logs, before it trains, the
`starts` of its windows, so a run can be checked afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

from tokenfeed.client import FeederClient
from tokenfeed.integrations.transformers import FeederTrainer

log = logging.getLogger("train_transformers")


class StartsTrainer(FeederTrainer):
    """Logs each batch's window starts before training on it (`--log-starts`)."""

    def training_step(self, model: Any, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        # The feeder's keys (starts, step, epoch, ...) ride along to here; FeederTrainer
        # drops them before the model.
        starts = ",".join(map(str, inputs["starts"].tolist()))
        log.info("epoch %d step %d starts %s", inputs["epoch"], inputs["step"], starts)
        return super().training_step(model, inputs, *args, **kwargs)


class LogLines(TrainerCallback):
    """The Trainer's loss and checkpoints as log lines of this process."""

    def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
        if logs and "loss" in logs:
            log.info("step %d loss %.3f", state.global_step, logs["loss"])

    def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        log.info("checkpoint saved at step %d", state.global_step)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--feeder", default="localhost:50051", help="feeder address(es)")
    p.add_argument("--dataset", default="demo")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per process")
    p.add_argument("--epochs", type=float, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--output-dir", default="out")
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    p.add_argument("--log-starts", action="store_true", help="log every batch's window starts")
    args = p.parse_args()

    rank = int(os.environ.get("RANK", "0"))
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    cuda = torch.cuda.is_available()
    # RANK and WORLD_SIZE (torchrun's) pick this process's batches.
    loader = FeederClient(
        args.feeder,
        dataset=args.dataset,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        shuffle=True,
        seed=1234,
        device="cuda" if cuda else "cpu",
    )
    info = loader.dataset_info
    torch.manual_seed(0)  # the same initial weights in every process
    config = LlamaConfig(
        vocab_size=info.vocab_size or 65536,
        hidden_size=args.dim,
        intermediate_size=4 * args.dim,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        max_position_embeddings=args.seq_len,
        bos_token_id=None,
        eos_token_id=info.eos_token_id,
        pad_token_id=None,
    )
    training = TrainingArguments(
        output_dir=args.output_dir,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        save_steps=args.save_steps,
        logging_steps=args.log_every,
        report_to=[],
        disable_tqdm=True,
        use_cpu=not cuda,
        ddp_backend=None if cuda else "gloo",
    )
    trainer = (StartsTrainer if args.log_starts else FeederTrainer)(
        LlamaForCausalLM(config), training, train_loader=loader, callbacks=[LogLines()]
    )
    resume = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    log.info(
        "rank %d of %d, pid %d, resuming from %s", rank, loader.world_size, os.getpid(), resume
    )
    trainer.train(resume_from_checkpoint=resume)
    log.info("done after %d steps", trainer.state.global_step)
    loader.close()


if __name__ == "__main__":
    main()
