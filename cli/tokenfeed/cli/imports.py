"""`tokenfeed import`: existing token files -> a token store, without re-tokenizing.

The formats and their rules are tokenfeed.prepare.importers' (nanoGPT, llm.c).
"""

from __future__ import annotations

import argparse

from tokenfeed.core.store import DEFAULT_TOKENS_PER_CHUNK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format",
        required=True,
        choices=("nanogpt", "llmc"),
        help="nanogpt: raw uint16 train.bin/val.bin (one store per file, "
        "OUTPUT/<stem>); llmc: llm.c shards (one store at OUTPUT)",
    )
    parser.add_argument("paths", nargs="+", metavar="PATH", help="files or globs")
    parser.add_argument("--output", required=True, metavar="DIR")
    parser.add_argument("--tokens-per-chunk", type=int, default=DEFAULT_TOKENS_PER_CHUNK)
    parser.add_argument(
        "--tokenizer", default=None, help="record this tokenizer name in meta.json (e.g. gpt2)"
    )
    parser.add_argument(
        "--eos-token-id", type=int, default=None, help="record the EOS id (GPT-2: 50256)"
    )
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="record the vocabulary size and check every id against it",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing store in the output directory"
    )


def run(args: argparse.Namespace) -> int:
    from tokenfeed.prepare.importers import import_files

    stores = import_files(
        args.format,
        args.paths,
        args.output,
        tokens_per_chunk=args.tokens_per_chunk,
        overwrite=args.overwrite,
        eos_token_id=args.eos_token_id,
        vocab_size=args.vocab_size,
        tokenizer=args.tokenizer,
    )
    for path, meta in stores.items():
        print(f"{path}: {meta.total_tokens} {meta.dtype} tokens in {len(meta.chunks)} chunks")
    return 0
