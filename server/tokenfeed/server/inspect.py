"""`tokenfeed info` and `tokenfeed verify`: look at a token store without serving it.

`info PATH` prints what meta.json says (tokens, chunks, dtype, vocabulary, EOS,
tokenizer, source) and, given `--seq-len`, the windows of each split for those
sampling parameters, computed by the sampling engine itself (tokenfeed.server.sampling),
so the numbers are the ones the feeder will serve. `--json` prints the same as JSON.
A folder of bare `*.bin` files needs `--dtype`.

`verify PATH` reads every chunk and checks its size, its checksum (when meta.json has
one: Streaming-Dataloader and bare stores have none) and its token ids against the
vocabulary size. Exit codes: 0 healthy, 1 problems found (each printed, naming the
chunk), 2 the store cannot be read at all (no such directory, unreadable meta.json).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

DTYPE_CHOICES = ("uint16", "uint32")


def _add_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", metavar="PATH", help="store directory")
    parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=None,
                        help="token dtype of a folder of bare *.bin files (no meta.json)")


def add_info_arguments(parser: argparse.ArgumentParser) -> None:
    _add_path(parser)
    parser.add_argument("--seq-len", type=int, default=None,
                        help="print windows per split for this sequence length")
    parser.add_argument("--stride", type=int, default=None, help="window stride (default seq-len)")
    parser.add_argument("--split-rate", type=float, default=0.9,
                        help="fraction of tokens in the train split (default 0.9)")
    parser.add_argument("--shift", default="1", help="label shift: an integer or 'auto'")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="with --seq-len: also print steps per epoch")
    parser.add_argument("--world-size", type=int, default=1, help="ranks (for steps per epoch)")
    parser.add_argument("--json", action="store_true", help="print JSON")


def add_verify_arguments(parser: argparse.ArgumentParser) -> None:
    _add_path(parser)


def _open(args: argparse.Namespace, check_sizes: bool = True) -> Any:
    from pathlib import Path

    from tokenfeed.server.errors import InvalidArgument
    from tokenfeed.server.store import META_NAME, TokenStore

    root = Path(args.path)
    if args.dtype is None and root.is_dir() and not (root / META_NAME).exists() \
            and any(root.glob("*.bin")):
        raise InvalidArgument(
            f"{root} has *.bin files but no meta.json: pass --dtype uint16 or --dtype uint32"
        )
    return TokenStore.open(root, dtype=args.dtype, check_sizes=check_sizes)


def _kind(meta: Any) -> str:
    if meta.format_version is None:
        return "Streaming-Dataloader meta.json" if meta.tokens_per_chunk is not None or \
            meta.eos_token_id is not None else "bare *.bin files"
    return f"tokenfeed v{meta.format_version}"


def _windows(args: argparse.Namespace, total: int) -> list[dict[str, Any]]:
    from tokenfeed.server.errors import FailedPrecondition, InvalidArgument
    from tokenfeed.server.sampling import SPLITS, Plan, split_bounds, steps_per_epoch

    shift: int | str = args.shift
    if shift != "auto":
        try:
            shift = int(shift)
        except ValueError:
            raise InvalidArgument(f"--shift must be an integer or 'auto', got {shift!r}") from None
    stride = args.stride or args.seq_len
    rows = []
    for split in SPLITS:
        begin, end = split_bounds(total, split, args.split_rate)
        try:  # batch 1 x 1 rank: only "too short for one window" can fail, i.e. 0 windows
            plan = Plan(total_tokens=total, split=split, split_rate=args.split_rate,
                        seq_len=args.seq_len, stride=stride, batch_size=1, world_size=1,
                        shift=shift)
            windows = plan.num_windows
        except FailedPrecondition:
            windows = 0
        row: dict[str, Any] = {"split": split, "tokens": end - begin, "windows": windows}
        if args.batch_size:
            row["steps_per_epoch_rank0"] = steps_per_epoch(
                windows, args.batch_size, args.world_size, 0, split)
        rows.append(row)
    return rows


def run_info(args: argparse.Namespace) -> int:
    store = _open(args)
    meta = store.meta
    doc: dict[str, Any] = {
        "path": str(store.path),
        "format": _kind(meta),
        "total_tokens": store.total_tokens,
        "chunks": store.num_chunks,
        "dtype": meta.dtype,
        "vocab_size": meta.vocab_size,
        "eos_token_id": meta.eos_token_id,
        "tokenizer": meta.tokenizer,
        "tokens_per_chunk": meta.tokens_per_chunk,
        "checksums": sum(1 for c in meta.chunks if c.checksum),
        "created_at_unix": meta.created_at_unix,
        "source": meta.source,
    }
    if args.seq_len is not None:
        doc["sampling"] = {"seq_len": args.seq_len, "stride": args.stride or args.seq_len,
                           "split_rate": args.split_rate, "shift": args.shift,
                           "splits": _windows(args, store.total_tokens)}
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    width = max(len(k) for k in doc)
    for key, value in doc.items():
        if key == "sampling":
            continue
        if key == "source":
            value = json.dumps(value) if value else "-"
            value = value if len(value) <= 200 else value[:197] + "..."
        print(f"{key:<{width}}  {'-' if value is None else value}")
    if "sampling" in doc:
        s = doc["sampling"]
        print(f"windows (seq_len {s['seq_len']}, stride {s['stride']}, shift {s['shift']}, "
              f"split_rate {s['split_rate']}):")
        for row in s["splits"]:
            extra = (f", {row['steps_per_epoch_rank0']} steps/epoch"
                     if "steps_per_epoch_rank0" in row else "")
            print(f"  {row['split']:<10} {row['tokens']:>14} tokens {row['windows']:>12} "
                  f"windows{extra}")
    return 0


def run_verify(args: argparse.Namespace) -> int:
    store = _open(args, check_sizes=False)
    problems = store.verify()
    for problem in problems:
        print(problem, file=sys.stderr)
    checked = "sizes and checksums" if all(c.checksum for c in store.meta.chunks) else \
        "sizes (this store has no checksums)"
    if problems:
        print(f"{store.path}: {len(problems)} problem(s) in {store.num_chunks} chunks")
        return 1
    print(f"{store.path}: OK, {store.num_chunks} chunks, {store.total_tokens} tokens "
          f"({checked} checked)")
    return 0
