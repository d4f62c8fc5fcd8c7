"""`tokenfeed info`: describe a token store without serving it.

`info PATH` prints what the store says (tokens, chunks, dtype, vocabulary, EOS,
tokenizer, source) and, given `--seq-len`, the tokens and windows of each split (and,
with `--batch-size`, rank 0's steps per epoch) computed by the sampling engine itself
with SamplingSpec's defaults, so the numbers are the ones the feeder serves. `--json`
prints the same as JSON. A folder of bare `*.bin` files needs `--dtype`.

PATH is any served format: a native store directory or `s3://bucket/prefix` (the
root is listed first: bad credentials or no such bucket exit 2), a folder of the seed
loader's chunk_NNNNNN/ save_to_disk datasets (info then prints the meta.json to put
beside them, to give the EOS, vocabulary or a narrower dtype), or a Megatron indexed
dataset (its PREFIX, or the .bin or .idx path).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from tokenfeed.core.dtypes import DTYPES


def add_path_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path",
        metavar="PATH",
        help="store: directory, s3://bucket/prefix, seed-layout folder, or Megatron PREFIX "
        "(or PREFIX.bin / PREFIX.idx)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="token dtype of a folder of bare *.bin files (no meta.json)",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from tokenfeed.core.request import SamplingSpec

    add_path_arguments(parser)
    SamplingSpec.add_arguments(parser, dataset=False, seq_len_default=None, batch_size_default=None)
    parser.add_argument("--json", action="store_true", help="print JSON")


def open_store(args: argparse.Namespace, check_sizes: bool = True) -> Any:
    """The store at args.path, any format (args.dtype for a folder of bare *.bin files)."""
    from tokenfeed.core.errors import InvalidArgument
    from tokenfeed.core.store import META_NAME, is_url
    from tokenfeed.core.store import open_store as open_any

    if is_url(args.path):
        from tokenfeed.core.store.objects import ObjectStore

        ObjectStore(args.path).check_access()  # exit 2 on bad credentials / no such bucket
    else:
        root = Path(args.path)
        if (
            args.dtype is None
            and root.is_dir()
            and not (root / META_NAME).exists()
            and any(root.glob("*.bin"))
        ):
            raise InvalidArgument(
                f"{root} has *.bin files but no meta.json: pass --dtype uint16 or --dtype uint32"
            )
    return open_any(args.path, dtype=args.dtype, check_sizes=check_sizes)


def _kind(store: Any) -> str:
    meta = store.meta
    if store.format == "seed":
        return "seed layout (save_to_disk chunk folders" + (
            ", with meta.json)" if store.has_meta else ", no meta.json)"
        )
    if store.format == "megatron":
        src = meta.source
        return (
            f"Megatron indexed dataset ({src['dtype']} tokens, {src['documents']} documents, "
            f"{src['sequences']} sequences)"
        )
    if meta.format_version is None:
        return (
            "Streaming-Dataloader meta.json"
            if meta.tokens_per_chunk is not None or meta.eos_token_id is not None
            else "bare *.bin files"
        )
    return f"tokenfeed v{meta.format_version}"


def _splits(args: argparse.Namespace, total: int) -> dict[str, Any]:
    from tokenfeed.core.request import SPLITS, SamplingSpec
    from tokenfeed.core.sampling import split_windows, steps_per_epoch

    spec = SamplingSpec.from_args(args, dataset=args.path, batch_size=args.batch_size or 1)
    rows = []
    for split in SPLITS:
        tokens, windows = split_windows(spec, total, split)
        row: dict[str, Any] = {"split": split, "tokens": tokens, "windows": windows}
        if args.batch_size:
            row["steps_per_epoch_rank0"] = steps_per_epoch(
                windows, spec.batch_size, spec.world_size, 0, split
            )
        rows.append(row)
    return {
        "seq_len": spec.seq_len,
        "stride": spec.stride,
        "split_rate": spec.split_rate,
        "shift": spec.shift,
        "splits": rows,
    }


def run(args: argparse.Namespace) -> int:
    store = open_store(args)
    meta = store.meta
    doc: dict[str, Any] = {
        "path": store.location,
        "format": _kind(store),
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
        doc["sampling"] = _splits(args, store.total_tokens)
    suggested = store.suggested_meta() if store.format == "seed" and not store.has_meta else None
    if suggested is not None:
        doc["meta_json_to_add"] = suggested
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    width = max(len(k) for k in doc)
    for key, value in doc.items():
        if key in ("sampling", "meta_json_to_add"):
            continue
        if key == "source":
            value = json.dumps(value) if value else "-"
            value = value if len(value) <= 200 else value[:197] + "..."
        print(f"{key:<{width}}  {'-' if value is None else value}")
    if "sampling" in doc:
        s = doc["sampling"]
        print(
            f"windows (seq_len {s['seq_len']}, stride {s['stride']}, shift {s['shift']}, "
            f"split_rate {s['split_rate']}):"
        )
        for row in s["splits"]:
            extra = (
                f", {row['steps_per_epoch_rank0']} steps/epoch"
                if "steps_per_epoch_rank0" in row
                else ""
            )
            print(
                f"  {row['split']:<10} {row['tokens']:>14} tokens {row['windows']:>12} "
                f"windows{extra}"
            )
    if suggested is not None:
        where = Path(store.location) / "meta.json"
        print(
            f"\nmeta.json to add at {where} (served as {meta.dtype} without EOS or "
            "vocabulary until you do; set eos_token_id, vocab_size, and dtype uint16 if the "
            "vocabulary fits 65,536 ids):"
        )
        print(json.dumps(suggested, indent=2))
    return 0
