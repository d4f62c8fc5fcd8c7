"""Train a tiny GPT whose attention stays inside each document of a packed sequence.

    tokenfeed serve --data-root DATA --port 50051 &
    python examples/train_documents.py --feeder localhost:50051 --dataset demo

The feeder packs windows across document boundaries, as every pretraining loader
does. With `documents=True` each batch also carries `document_ids` (which document of
its row each token belongs to), `position_ids` (restarting at 0 in each document),
`cu_seqlens` and `max_seqlen` (for FlashAttention's varlen kernels), and
`mask_cross_document_labels=True` sets to -100 the labels whose target lies in the
next document (the cross-entropy ignores them). Here the document mask is built from
`document_ids`:

    same document and causal:  allowed[b, q, k] = (q >= k) & (doc[b, q] == doc[b, k])

and used either with scaled_dot_product_attention (a boolean mask, any device,
`--attention sdpa`, the default) or with flex_attention's block mask
(`--attention flex`, on a GPU: flex_attention has no backward on CPU). Absolute position
embeddings are taken at `position_ids`, so every document sees the positions it would
see alone. Logs one loss line every `--log-every` steps, then a summary.
"""

from __future__ import annotations

import argparse
import logging
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenfeed.client import FeederClient

log = logging.getLogger("train_documents")


def sdpa_mask(document_ids: torch.Tensor) -> torch.Tensor:
    """[B, L] document ids -> [B, 1, L, L] boolean mask: True where query q may attend
    to key k (causal, same document). Memory is B x L x L: fine for short rows; use
    flex_attention or FlashAttention varlen (cu_seqlens) for long ones."""
    n = document_ids.shape[1]
    causal = torch.ones(n, n, dtype=torch.bool, device=document_ids.device).tril()
    same = document_ids[:, :, None] == document_ids[:, None, :]
    return (same & causal)[:, None]


def flex_block_mask(document_ids: torch.Tensor) -> Any:
    """The same mask as flex_attention's BlockMask (only its blocks are computed)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def document_causal(b: Any, h: Any, q: Any, k: Any) -> Any:
        return (q >= k) & (document_ids[b, q] == document_ids[b, k])

    rows, n = document_ids.shape
    return create_block_mask(document_causal, rows, None, n, n, device=document_ids.device)


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: Any, flex: bool) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if flex:
            from torch.nn.attention.flex_attention import flex_attention

            y = flex_attention(q, k, v, block_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, mask: Any, flex: bool) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), mask, flex)
        return x + self.mlp(self.norm2(x))


class TinyGPT(nn.Module):
    """Token embeddings + absolute position embeddings at `position_ids`, a few blocks
    with document-masked attention, a tied head."""

    def __init__(self, vocab_size: int, seq_len: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, dim)
        nn.init.normal_(self.tokens.weight, std=0.02)
        self.positions = nn.Embedding(seq_len, dim)
        nn.init.normal_(self.positions.weight, std=0.02)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)

    def forward(
        self, ids: torch.Tensor, position_ids: torch.Tensor, document_ids: torch.Tensor, flex: bool
    ) -> torch.Tensor:
        mask = flex_block_mask(document_ids) if flex else sdpa_mask(document_ids)
        x = self.tokens(ids) + self.positions(position_ids)
        for block in self.blocks:
            x = block(x, mask, flex)
        return self.norm(x) @ self.tokens.weight.T  # logits [B, L, vocab]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--feeder", default="localhost:50051", help="feeder address(es)")
    p.add_argument("--dataset", default="demo")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=200, help="training steps")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--attention", choices=("sdpa", "flex"), default="sdpa")
    p.add_argument("--log-every", type=int, default=20, help="steps between loss lines")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    flex = args.attention == "flex"
    if flex and device == "cpu":  # its forward runs on CPU, its backward does not (torch 2.13)
        raise SystemExit(
            "--attention flex trains on a GPU only (flex_attention has no backward on CPU); "
            "use --attention sdpa here"
        )

    loader = FeederClient(
        args.feeder,
        dataset=args.dataset,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        shuffle=True,
        seed=1234,
        device=device,
        documents=True,  # position_ids, document_ids, cu_seqlens, max_seqlen
        mask_cross_document_labels=True,  # labels crossing into the next document: -100
    )
    info = loader.dataset_info
    torch.manual_seed(0)
    model = TinyGPT(info.vocab_size or 65536, args.seq_len, args.dim, args.layers, 4).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    step, epoch, losses = 0, 0, []
    documents = ignored = tokens = 0
    with loader:
        while step < args.steps:
            loader.set_epoch(epoch)
            for batch in loader:
                logits = model(
                    batch["input_ids"], batch["position_ids"], batch["document_ids"], flex
                )
                labels = batch["labels"]  # int64, -100 where the target is another document
                loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                losses.append(loss.item())
                documents += len(batch["cu_seqlens"]) - 1  # segments: one per document piece
                ignored += int((labels == -100).sum())
                tokens += labels.numel()
                step += 1
                if step % args.log_every == 0 or step == 1:
                    log.info(
                        "step %d loss %.4f (longest segment %d tokens)",
                        step,
                        loss.item(),
                        batch["max_seqlen"],
                    )
                if step >= args.steps:
                    break
            epoch += 1
    first = sum(losses[:10]) / min(10, len(losses))
    last = sum(losses[-10:]) / min(10, len(losses))
    log.info(
        "trained %d steps: loss %.4f -> %.4f (mean of the first and last 10); %.1f document "
        "segments per row; %.2f %% of labels crossed a document end and were ignored",
        step,
        first,
        last,
        documents / (step * args.batch_size),
        100 * ignored / max(1, tokens),
    )
    if not math.isfinite(last):
        raise SystemExit("the loss is not finite")


if __name__ == "__main__":
    main()
