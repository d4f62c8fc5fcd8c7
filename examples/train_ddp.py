"""Train a tiny GPT from a tokenfeed feeder under torchrun (DDP), checkpoint, resume.

    tokenfeed serve --data-root DATA --port 50051 &
    torchrun --nproc-per-node 2 examples/train_ddp.py --feeder localhost:50051 \\
        --dataset demo --checkpoint ckpt.pt

Each rank streams its own batches (rank and world size come from torchrun's RANK and
WORLD_SIZE). Rank 0 saves model, optimizer and `loader.state_dict()` every
`--checkpoint-every` steps. Run the same command again, with any number of ranks, and
training resumes at the first batch after the checkpoint: nothing lost, nothing seen
twice. gloo on CPU, nccl on CUDA. With `--log-starts` every step logs, before it
trains, the `starts` of its windows (where in the store each begins), so a run can be
checked afterwards.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tokenfeed.client import FeederClient

log = logging.getLogger("train_ddp")


class TinyGPT(nn.Module):
    """Token + position embeddings, a few causal transformer blocks, a tied head."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.tokens.weight, std=0.02)  # small logits at the start
        self.positions = nn.Embedding(seq_len, dim)
        block = nn.TransformerEncoderLayer(
            dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True
        )
        self.blocks = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(dim)
        mask = torch.triu(torch.full((seq_len, seq_len), float("-inf")), diagonal=1)
        self.register_buffer("causal", mask, persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        n = ids.shape[1]
        x = self.tokens(ids) + self.positions(torch.arange(n, device=ids.device))
        x = self.blocks(x, mask=self.causal[:n, :n], is_causal=True)
        return self.norm(x) @ self.tokens.weight.T  # logits [B, n, vocab]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--feeder", default="localhost:50051", help="feeder address(es)")
    p.add_argument("--dataset", default="demo")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8, help="per rank")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--checkpoint", type=Path, default=Path("ckpt.pt"))
    p.add_argument("--checkpoint-every", type=int, default=50, help="steps")
    p.add_argument("--max-steps", type=int, default=0, help="stop after this many (0: all)")
    p.add_argument("--log-every", type=int, default=10, help="steps between loss lines")
    p.add_argument("--log-starts", action="store_true", help="log every step's window starts")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")  # torchrun's env:// rendezvous
    rank = dist.get_rank()
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(name)s: %(message)s")
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    log.info(
        "rank %d of %d, pid %d, %s", rank, dist.get_world_size(), os.getpid(), dist.get_backend()
    )

    loader = FeederClient(
        args.feeder,
        dataset=args.dataset,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        shuffle=True,
        seed=1234,
        device="cuda" if cuda else "cpu",  # "cuda" means cuda:LOCAL_RANK
    )
    info = loader.dataset_info  # vocab_size, eos_token_id, dtype, tokenizer, steps, ...
    torch.manual_seed(0)  # the same initial weights on every rank
    model = TinyGPT(info.vocab_size or 65536, args.seq_len, args.dim, args.layers, heads=4)
    model = model.to("cuda" if cuda else "cpu")
    ddp = DistributedDataParallel(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    start_epoch, step = 0, 0
    if args.checkpoint.exists():  # resume: weights, optimizer and the data position
        ckpt = torch.load(args.checkpoint, map_location="cpu", weights_only=False)
        model.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        loader.load_state_dict(ckpt["loader"])  # any world size: the position is global
        start_epoch, step = ckpt["loader"]["epoch"], ckpt["step"]
        log.info("resumed from %s at step %d", args.checkpoint, step)
    log.info(
        "%s: vocab %s, %d steps per epoch at world size %d, %d left in this one",
        info.name,
        info.vocab_size,
        len(loader),
        dist.get_world_size(),
        loader.steps_left,
    )

    for epoch in range(start_epoch, args.epochs):
        loader.set_epoch(epoch)  # keeps a loaded position for the same epoch
        for batch in loader:
            if args.log_starts:  # before training on it: logged means trained or lost
                starts = ",".join(map(str, batch["starts"].tolist()))
                log.info("epoch %d step %d starts %s", epoch, batch["step"], starts)
            logits = ddp(batch["input_ids"])
            loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # DDP averages the gradients of all ranks here
            optimizer.step()
            step += 1
            if step % args.log_every == 0:
                log.info("epoch %d step %d loss %.3f", epoch, batch["step"], loss.item())
            if step % args.checkpoint_every == 0 and rank == 0:
                save(args.checkpoint, model, optimizer, loader, step)
            if step == args.max_steps:
                break
        if step == args.max_steps:
            break
    if rank == 0 and step % args.checkpoint_every:
        save(args.checkpoint, model, optimizer, loader, step)
    log.info("done after %d steps", step)
    loader.close()
    dist.destroy_process_group()


def save(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, loader: FeederClient, step: int
) -> None:
    """Atomically: a crash mid-save leaves the previous checkpoint."""
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "loader": loader.state_dict(),  # the first batch not yet trained on
        "step": step,
    }
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    log.info("checkpoint saved at step %d: %s", step, loader.state_dict())


if __name__ == "__main__":
    main()
