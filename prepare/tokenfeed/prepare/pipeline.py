"""The prepare pipeline: documents -> batched tokenization -> chunks on disk.

    source --(batches of --batch-size docs)--> Encoder (inline, or a pool of --num-proc
    processes, order preserved, at most 2 x num_proc batches in flight)
    --> StoreWriter (a chunk per --tokens-per-chunk tokens) --> progress file

Resume. After every batch that completed a chunk, the progress file records the
chunks on disk and where they end in the source: `documents_done` (documents of this
shard whose tokens, EOS included, are all in completed chunks) and `carry_tokens`
(how many tokens of the next document already are). A re-run of the same command
skips `documents_done` documents without tokenizing them, re-tokenizes the next one
and drops its first `carry_tokens` tokens, so the finished store is byte-identical to
one made without the interruption. Everything after the last completed chunk (the
partial tail) is simply tokenized again.

Sharding (`--num-shards N --shard-index i`): document j of the source (counted
before sharding, after `--max-samples`) belongs to shard j mod N. Interleaving needs
no knowledge of the source's length (a streamed dataset has none) and balances the
shards; each machine still reads the whole stream but tokenizes only its share,
which is the expensive part. Each shard writes a complete part store into
OUTPUT/part-0000i/ and `tokenfeed prepare merge OUTPUT` joins them (part 0's chunks,
then part 1's, ...): the merged store holds every document once, grouped by shard
rather than in source order.
"""

from __future__ import annotations

import collections
import itertools
import logging
import multiprocessing
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tokenfeed.core.errors import FeederError, InvalidArgument
from tokenfeed.core.store import (
    DEFAULT_TOKENS_PER_CHUNK,
    Chunk,
    StoreMeta,
    StoreWriter,
    is_url,
    open_files,
)
from tokenfeed.core.store.objects import WRITER_POLICY, S3Url
from tokenfeed.prepare import output as out
from tokenfeed.prepare.tokenize import (
    Encoder,
    TokenizerInfo,
    describe_tokenizer,
    encode_in_worker,
    init_worker,
    load_tokenizer,
)

log = logging.getLogger(__name__)

DEFAULT_BATCH_SIZE = 256


class Source(Protocol):
    def describe(self) -> dict[str, Any]: ...
    def __iter__(self) -> Iterator[str]: ...


@dataclass
class PrepareConfig:
    source: Source
    tokenizer: str
    output: Path | str  # a directory, or "s3://bucket/prefix" (kept as a string)
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK
    max_samples: int | None = None
    num_proc: int = 1
    batch_size: int = DEFAULT_BATCH_SIZE
    overwrite: bool = False
    num_shards: int = 1
    shard_index: int = 0
    progress: bool | None = None  # tqdm bar; None = only when stderr is a terminal

    def __post_init__(self) -> None:
        if is_url(self.output):
            S3Url.parse(str(self.output))  # InvalidArgument for a malformed URL, now
        else:
            # Path() would fold "s3://b/p" into a local folder "s3:"; refuse other schemes
            self.output = Path(open_files(self.output).location)
        for name in ("tokens_per_chunk", "num_proc", "batch_size", "num_shards"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_samples is not None and self.max_samples < 0:
            raise InvalidArgument("--max-samples must be >= 0")
        if not 0 <= self.shard_index < self.num_shards:
            raise InvalidArgument(
                f"--shard-index {self.shard_index} must be in [0, --num-shards {self.num_shards})"
            )

    @property
    def store_path(self) -> Path | str:
        if self.num_shards == 1:
            return self.output
        if isinstance(self.output, Path):
            return out.part_dir(self.output, self.shard_index)
        return f"{str(self.output).rstrip('/')}/{out.part_name(self.shard_index)}"


@dataclass
class PrepareResult:
    path: Path | str  # str: an s3:// URL
    meta: StoreMeta
    documents: int  # documents of this shard in the store
    tokens_written: int  # tokens tokenized and written by this run
    seconds: float
    already_complete: bool = False
    resumed_chunks: int = 0
    # setup_seconds: loading the tokenizer and checking the output (once per run);
    # run_seconds: reading, tokenizing and writing (what grows with the corpus)
    stats: dict[str, float] = field(default_factory=dict)


def describe(cfg: PrepareConfig, tok: TokenizerInfo) -> dict[str, Any]:
    """The store's `source`: everything that decides its bytes (and so a resume)."""
    desc = cfg.source.describe() | {
        "tokenizer": tok.spec,
        "tokenizer_fingerprint": tok.fingerprint,
        "tokens_per_chunk": cfg.tokens_per_chunk,
        "max_samples": cfg.max_samples,
    }
    if cfg.num_shards > 1:
        desc |= {
            "num_shards": cfg.num_shards,
            "shard_index": cfg.shard_index,
            "sharding": "interleaved: document j -> shard j % num_shards",
        }
    return desc


def _shard_documents(cfg: PrepareConfig, skip: int) -> Iterator[str]:
    docs: Iterable[str] = iter(cfg.source)
    if cfg.max_samples is not None:
        docs = itertools.islice(docs, cfg.max_samples)
    if cfg.num_shards > 1:
        docs = itertools.islice(docs, cfg.shard_index, None, cfg.num_shards)
    return itertools.islice(docs, skip, None)


def _batches(docs: Iterator[str], size: int) -> Iterator[list[str]]:
    while batch := list(itertools.islice(docs, size)):
        yield batch


def _measured(
    batches: Iterator[list[str]], sizes: collections.deque[np.ndarray]
) -> Iterator[list[str]]:
    """The batches, with each document's UTF-8 byte count appended to `sizes` as a
    batch is taken (encoding runs ahead, but in order, so results pop them in order)."""
    for batch in batches:
        sizes.append(
            np.array([len(d.encode("utf-8", "surrogatepass")) for d in batch], dtype=np.int64)
        )
        yield batch


def _encoded(
    cfg: PrepareConfig, tok: Any, info: TokenizerInfo, batches: Iterator[list[str]]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encode batches in order: inline, or in a process pool with bounded read-ahead."""
    if cfg.num_proc == 1:
        # One encoding thread, one batch ahead: the Rust tokenizer runs without the GIL
        # while this thread reads the next documents and writes the previous chunks.
        encode = Encoder(tok, info)
        with ThreadPoolExecutor(1, thread_name_prefix="tokenfeed-encode") as thread:
            yield from _in_order(lambda batch: thread.submit(encode, batch), batches, 2)
        return
    # spawn: a forked child would inherit the parent's tokenizer thread pool state.
    # An executor (not multiprocessing.Pool) so a worker that dies fails the run
    # (BrokenProcessPool) instead of hanging it.
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        cfg.num_proc, mp_context=ctx, initializer=init_worker, initargs=(info.spec, info)
    ) as pool:
        yield from _in_order(
            lambda batch: pool.submit(encode_in_worker, batch), batches, 2 * cfg.num_proc
        )


def _in_order(
    submit: Callable[[Any], Future[Any]], items: Iterable[Any], depth: int
) -> Iterator[Any]:
    """`submit(item)` for each item with at most `depth` in flight; results in order.
    Leaving early cancels whatever has not started."""
    pending: collections.deque[Future[Any]] = collections.deque()
    try:
        for item in items:
            pending.append(submit(item))
            if len(pending) >= depth:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        for f in pending:
            f.cancel()


def _progress_bar(cfg: PrepareConfig, path: Path | str, initial: int) -> Any:
    from tqdm import tqdm

    disable = None if cfg.progress is None else not cfg.progress
    return tqdm(
        desc=f"prepare {str(path).rstrip('/').rsplit('/', 1)[-1]}",
        unit="tok",
        unit_scale=True,
        initial=initial,
        file=sys.stderr,
        disable=disable,
        dynamic_ncols=True,
    )


def prepare(cfg: PrepareConfig) -> PrepareResult:
    """Tokenize `cfg.source` into a store at `cfg.store_path`; resume if interrupted before."""
    t0 = time.perf_counter()
    tok = load_tokenizer(cfg.tokenizer)
    info = describe_tokenizer(cfg.tokenizer, tok)
    source = describe(cfg, info)
    path = cfg.store_path
    files = open_files(path, WRITER_POLICY)
    claim = out.claim_output(files, source, cfg.overwrite, "prepare")
    if claim.complete is not None:
        return PrepareResult(
            path, claim.complete, 0, 0, time.perf_counter() - t0, already_complete=True
        )
    done_chunks: tuple[Chunk, ...] = ()
    docs_done = carry = bytes_done = 0
    if claim.resume is not None:
        out.drop_unrecorded_chunks(files, claim.resume)
        done_chunks = claim.resume.chunks
        docs_done = int(claim.progress.get("documents_done", 0)) if claim.progress else 0
        carry = int(claim.progress.get("carry_tokens", 0)) if claim.progress else 0
        bytes_done = int(claim.progress.get("text_bytes_done", 0)) if claim.progress else 0
    writer = StoreWriter(
        files,
        dtype=info.dtype,
        tokens_per_chunk=cfg.tokens_per_chunk,
        eos_token_id=info.eos_token_id,
        vocab_size=info.vocab_size,
        tokenizer=info.name,
        source=source,
        chunks=tuple(done_chunks),
    )
    if claim.resume is None:  # the directory is this command's from the first moment
        out.write_progress(
            files, writer.meta(), {"documents_done": 0, "carry_tokens": 0, "text_bytes_done": 0}
        )
    t_setup = time.perf_counter() - t0  # tokenizer load, fingerprint, output checks
    completed = sum(c.tokens for c in done_chunks)  # tokens in chunks on disk
    position = completed - carry  # where the next document starts in the shard's tokens
    docs = docs_done
    text_bytes = bytes_done  # UTF-8 bytes of the documents before `docs`
    written = 0
    sizes: collections.deque[np.ndarray] = collections.deque()
    try:
        with _progress_bar(cfg, path, completed) as bar:
            batches = _measured(_batches(_shard_documents(cfg, docs_done), cfg.batch_size), sizes)
            for tokens, lengths in _encoded(cfg, tok, info, batches):
                byte_ends = text_bytes + np.cumsum(sizes.popleft())
                ends = position + np.cumsum(lengths)
                if carry:  # the resumed document: its first tokens are already on disk
                    tokens, carry = tokens[carry:], 0
                new = writer.add(tokens)
                if new:
                    completed += sum(c.tokens for c in new)
                    k = int(np.searchsorted(ends, completed, side="right"))
                    prev_end = int(ends[k - 1]) if k else position
                    out.write_progress(
                        files,
                        writer.meta(),
                        {
                            "documents_done": docs + k,
                            "carry_tokens": completed - prev_end,
                            "text_bytes_done": int(byte_ends[k - 1]) if k else text_bytes,
                        },
                    )
                position = int(ends[-1])
                docs += len(lengths)
                text_bytes = int(byte_ends[-1])
                written += int(tokens.size)
                bar.update(int(tokens.size))
                bar.set_postfix(docs=docs, refresh=False)
        writer.stats = {"documents": docs, "text_bytes": text_bytes}
        meta = writer.finish()
    except FeederError:
        out.abandon(claim)  # bad input: nothing half-written stays behind
        raise
    except BaseException:
        log.warning(
            "stopped; progress is saved in %s: re-run the same command to resume after the "
            "last completed chunk",
            path,
        )
        raise
    out.finish_progress(files)
    seconds = time.perf_counter() - t0
    return PrepareResult(
        path,
        meta,
        docs,
        written,
        seconds,
        resumed_chunks=len(done_chunks),
        stats={"setup_seconds": t_setup, "run_seconds": seconds - t_setup},
    )
