"""Batch plans -> serialized StreamBatches messages, from the shared chunk cache.

The feeder's hot path. A stream's batches come from the sampling engine in Rounds
(up to a few hundred consecutive batches as arrays), and everything that can be done
for a whole round is done once per round, in a few numpy calls (`LocatedRound`): the
chunk and byte offset where every row starts, which rows cross a chunk boundary,
every batch's encoding around its tokens (wire.frames), and the round as a splice
program: (chunk, byte offset, byte count) per row, the frames between them. What is
left per message is one call (splice.py, in C) that copies its pieces once into the
message, with no Python object per row.

Cache rules (cache.py): a burst of messages pins all its chunks at once, and only
when every one is resident (it never waits holding pins); otherwise it copies chunk
by chunk, one pin at a time, loading or waiting for each (`gather`).

Where a burst is built is the servicer's choice (service.py): on the event loop
(`inline`: from resident chunks only, never waiting) or on a worker thread.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Hashable, Iterator
from functools import cached_property, partial
from typing import Any

import numpy as np

from tokenfeed.core import sampling
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.server import splice, wire
from tokenfeed.server.cache import ChunkCache, count_by_dataset
from tokenfeed.server.datasets import Dataset
from tokenfeed.server.documents import BatchEnds
from tokenfeed.server.metrics import ServerMetrics

# A burst is built in one go: one pin of its chunks, one thread-pool round trip. 8 was
# no faster end to end than 4 (serve_throughput) and gave streams coarser turns.
BURST_MESSAGES = 4  # messages per burst...
BURST_BYTES = 1 << 20  # ...unless they reach this size first
READ_AHEAD_BATCHES = 8  # batches past the last burst built whose chunks are read ahead (min)
ASK_AGAIN = 8  # a chunk read ahead is not asked for again for this many bursts...
WAITING_CHUNKS = 16  # ...unless left out for want of room: these many, nearest first
# Stores whose chunks come over the network (s3://): every DEEP_EVERY bursts, also read
# ahead the chunks of the next DEEP_GROUPS shuffle groups' worth of batches (at least
# DEEP_BATCHES, at most MAX_DEEP_BATCHES), nearest first, so the next shuffle group's
# chunks are loading a group or more before the stream reaches them (a GET costs tens
# of ms before its first byte, a 32 MiB chunk a few hundred; with one group's worth,
# looked at every DEEP_EVERY bursts, a stream serving from cache at full speed reached
# a new group 40-110 ms after first asking for its chunks: measured, one stall per
# group). They wait in the cache's read-ahead budget (cache.py); the chunks already
# cached are warmed nearest last, and a chunk the look saw needed later is not cooled.
# Done every few bursts, its cost stays small (chunk_uses: ~0.4 ms per 2080 batches of 16).
DEEP_EVERY = 16
DEEP_GROUPS = 2
DEEP_BATCHES = 1024
MAX_DEEP_BATCHES = 16384

Message = tuple[bytes, int, int, int]  # (serialized response, batches, tokens, payload bytes)
Span = tuple["LocatedRound", int, int]  # batches [i, j) of a round


class LocatedRound:
    """A sampling Round found in the store's chunks and encoded around its tokens.

    Batch i is rows [row_lo[i], row_lo[i + 1]) of the round's flat row arrays, and
    goes on the wire as head(i) + its rows' tokens + tail(i): pieces
    [piece_lo[i], piece_lo[i + 1]) of `program` (splice.py; key -1 reads `frames`,
    wire.frames' heads and tails one after another).
    """

    def __init__(
        self, ds: Dataset, rnd: sampling.Round, seq_len: int, num_sources: int = 0
    ) -> None:
        store, size = ds.store, ds.store.dtype.itemsize
        # the round's lists as arrays once (each conversion costs what the arithmetic does)
        rows = np.asarray(rnd.rows, dtype=np.int64)
        cols = np.add(rnd.shifts, seq_len, dtype=np.int64)
        self.cols = cols.tolist()
        cut = np.zeros(len(rows) + 1, dtype=np.int64)  # batch i: rows [cut[i], cut[i + 1])
        np.cumsum(rows, out=cut[1:])
        self._cut = cut
        # Only a round's last batch can be short, so its rows are a prefix of the flat array.
        n = int(cut[-1])
        own = rnd.starts.ravel()[:n]  # in each row's store (a mixture's: its source's)
        sources = None if rnd.sources is None else rnd.sources.ravel()[:n]
        self.starts = ds.virtual(own, sources)  # where assembly finds the rows
        self.sources = sources  # a mixture's: each row's source index
        # a mixture's tokens by source, summed over batches [0, i) in row i: a span's
        # count is one subtraction (`num_sources` > 0 for a mixture)
        self.source_tokens: np.ndarray | None = None
        if sources is not None and num_sources:
            batch = np.repeat(np.arange(len(rows), dtype=np.int64), rows)
            per = np.bincount(batch * num_sources + sources, minlength=len(rows) * num_sources)
            per = per.reshape(-1, num_sources) * cols[:, None]
            self.source_tokens = np.zeros((len(rows) + 1, num_sources), dtype=np.int64)
            np.cumsum(per, axis=0, out=self.source_tokens[1:])
        self.frames, self._sizes = wire.frames(
            rnd.epoch,
            rnd.step,
            rnd.offsets,
            rnd.shifts,
            rows,
            cols,
            store.meta.dtype,
            store.dtype.itemsize,
            own,
            sources,
            cut,
        )
        # where every row lies in the chunks (a row crossing chunks: a piece per chunk)
        self.program, self.piece_lo = splice.program(
            self.starts, store.chunk_starts, rows, cols * size, size, self._sizes
        )
        # tokens in batches [0, i): a span's count is one subtraction
        token_lo = np.zeros_like(cut)
        np.cumsum(rows * cols, out=token_lo[1:])
        self.token_lo = token_lo.tolist()

    # What only the slower paths (documents, chunks not resident) read: made on first use.
    @cached_property
    def row_lo(self) -> list[int]:
        """Batch i is rows [row_lo[i], row_lo[i + 1]) of the round's flat row arrays."""
        return self._cut.tolist()

    @cached_property
    def frame_at(self) -> list[int]:
        """Frame k is frames[frame_at[k]:frame_at[k + 1]]."""
        return [0, *np.cumsum(self._sizes).tolist()]

    def row_pieces(self, i: int) -> np.ndarray:
        """Batch i's rows as pieces of chunks: its part of `program` but head and tail."""
        return self.program[self.piece_lo[i] + 1 : self.piece_lo[i + 1] - 1]

    def head(self, i: int) -> bytes:
        return self.frames[self.frame_at[2 * i] : self.frame_at[2 * i + 1]]

    def tail(self, i: int) -> bytes:
        return self.frames[self.frame_at[2 * i + 1] : self.frame_at[2 * i + 2]]

    def __len__(self) -> int:
        return len(self.cols)


def _reach(spans: list[Span]) -> tuple[LocatedRound, int, int] | None:
    """Consecutive spans as (their first round, first batch, batches): equal (rounds
    compare by identity) for the same batches however they are cut into spans."""
    return (spans[0][0], spans[0][1], sum(j - i for _, i, j in spans)) if spans else None


def spans_chunks(spans: list[Span]) -> set[int]:
    """The chunks spans touch (their pieces' keys, the frames' -1 left out)."""
    chunks: set[int] = set()
    for lr, i, j in spans:
        chunks.update(lr.program[lr.piece_lo[i] : lr.piece_lo[j], 0].tolist())
    chunks.discard(-1)
    return chunks


def chunk_uses(spans: list[Span]) -> tuple[list[int], dict[int, int]]:
    """The chunks spans touch, in the order their rows first need them (a row crossing
    into the next chunks needs those at its own place in the order: the program's), and
    for each the last batch that needs it (0 = the spans' first batch).

    One pass over the spans' pieces laid end to end: each chunk's first and last piece
    by ufunc.at into arrays indexed by chunk (no sort of the pieces: a remote stream's
    deep look is thousands of batches every few bursts; np.unique per span took as long
    as building the bursts in between), then the last piece's batch by one searchsorted.
    """
    keys, ends = [], []  # ends: each batch's end, in pieces along the spans laid end to end
    at = 0
    for lr, i, j in spans:
        lo, hi = lr.piece_lo[i], lr.piece_lo[j]
        keys.append(lr.program[lo:hi, 0])
        ends.append(np.asarray(lr.piece_lo[i + 1 : j + 1], dtype=np.int64) + (at - lo))
        at += hi - lo
    if not keys:
        return [], {}
    flat = np.concatenate(keys)
    rows = np.flatnonzero(flat >= 0)  # the row pieces, not the frames
    if not rows.size:
        return [], {}
    chunks = flat[rows]
    first = np.full(int(chunks.max()) + 1, at, dtype=np.int64)
    np.minimum.at(first, chunks, rows)
    last = np.full(first.size, -1, dtype=np.int64)
    np.maximum.at(last, chunks, rows)
    ids = np.flatnonzero(last >= 0)
    ids = ids[np.argsort(first[ids])]
    batch = np.searchsorted(np.concatenate(ends), last[ids], side="right")
    order = ids.tolist()
    return order, dict(zip(order, batch.tolist(), strict=True))


class Pinned:
    """Chunks pinned in the cache for a burst: their ids (ascending) and byte views."""

    def __init__(self, entries: list[Any], keys: list[int] | np.ndarray) -> None:
        self.entries = entries  # to release
        self.keys = np.asarray(keys, dtype=np.int64)
        self.views = [e.view for e in entries]

    def rows(self, lr: LocatedRound, i: int) -> bytes:
        """Batch i's rows of tokens."""
        return splice.splice([(lr.row_pieces(i), b"")], self.keys, self.views)

    def message(self, spans: list[Span]) -> bytes:
        """Batches [i, j) of each span's round, framed: a message."""
        parts = [(lr.program[lr.piece_lo[i] : lr.piece_lo[j]], lr.frames) for lr, i, j in spans]
        return splice.splice(parts, self.keys, self.views)


def pin_views(ds: Dataset, cache: ChunkCache, chunks: list[int]) -> Pinned | None:
    """Pin `chunks` (ascending) if all are cached; else None."""
    keys = ds.chunk_keys
    entries = cache.pin_resident([keys[c] for c in chunks])
    if entries is None:
        return None
    return Pinned(entries, chunks)


def gather(ds: Dataset, cache: ChunkCache, pieces: np.ndarray) -> bytes:
    """A batch's rows from its pieces of the round's program (LocatedRound.row_pieces),
    loading chunks as needed: chunk by chunk, one pinned at a time (the cache's
    no-deadlock rule)."""
    store = ds.store
    rows = pieces.tolist()  # (chunk, byte offset, byte count) each
    at = [0, *np.cumsum(pieces[:, 2]).tolist()]  # where each piece goes in the rows
    out = bytearray(at[-1])
    by_chunk: dict[int, list[int]] = {}
    for k, (c, _, _) in enumerate(rows):
        by_chunk.setdefault(c, []).append(k)
    for c in sorted(by_chunk):
        load = partial(store.read_chunk, c)
        with cache.pinned(ds.chunk_key(c), store.chunk_nbytes(c), load) as chunk:
            view = chunk.data.cast("B")
            for k in by_chunk[c]:
                _, src, n = rows[k]
                out[at[k] : at[k] + n] = view[src : src + n]
    return bytes(out)


class MessageBuilder:
    """One stream's rounds of batch plans -> serialized messages, a burst at a time.

    Called from one thread at a time. Rounds are located as they are reached, and
    after each burst the chunks of the next burst's batches are read ahead,
    so a stream usually finds its chunks resident and builds on the event loop. Read
    ahead is by batches, not rounds: a rank's round spans batch_size x world_size
    windows per step, most of an epoch for a large job, far more than the cache.
    """

    def __init__(
        self,
        ds: Dataset,
        plan: sampling.DatasetSampler | MixtureSampler,
        rounds: Iterator[sampling.Round],
        per_message: int,
        cache: ChunkCache,
        metrics: ServerMetrics,
        documents: BatchEnds | None = None,
        then: Iterator[sampling.Round] | None = None,
    ) -> None:
        """`then`: the rounds of this rank's next epoch from its start (lazy: only a
        remote store's deep read-ahead looks at its first batches, as this one ends)."""
        self.ds, self.plan, self.cache, self.metrics = ds, plan, cache, metrics
        self.documents = documents  # each batch's document ends, when the request asks
        self.per_message = per_message
        self.message_bytes = (
            per_message
            * plan.batch_size
            * (plan.seq_len + plan.max_shift)
            * ds.store.dtype.itemsize
        )
        self.burst_messages = max(1, min(BURST_MESSAGES, BURST_BYTES // self.message_bytes))
        self.read_ahead_batches = max(READ_AHEAD_BATCHES, self.burst_messages * per_message)
        # this rank's batches per shuffle group (a step takes batch_size x world_size windows;
        # a mixture's sources have groups of their own: DEEP_BATCHES)
        per_group = 0
        if isinstance(plan, sampling.DatasetSampler):
            group_windows = plan.windows_per_block * (
                plan.spec.shuffle_blocks if plan.shuffle else 1
            )
            per_group = -(-group_windows // (plan.batch_size * plan.world_size))
        self.deep = min(
            MAX_DEEP_BATCHES, max(DEEP_BATCHES, DEEP_GROUPS * per_group + self.read_ahead_batches)
        )
        self._source = rounds
        self._then = then
        self._then_rounds: list[LocatedRound] = []  # the next epoch's first rounds, located
        self._exhausted = False
        self._rounds: deque[LocatedRound] = deque()  # located, not yet (all) sent
        self._pos = 0  # next batch of the first round
        self._bursts = 0  # bursts built so far
        self._asked: dict[int, int] = {}  # chunk -> burst when last read ahead
        self._near: tuple[Any, set[int]] = (None, set())  # the last read-ahead's batches
        self._waiting: list[int] = []  # chunks read-ahead left out for want of room
        # the last read-ahead's chunks and the burst the first of them is due to be asked
        # for again: until then, a read-ahead of the same chunks has nothing to ask
        self._quiet: tuple[list[int], int] | None = None
        # the last burst's chunks, their keys and count by dataset, as an array (_pin)
        self._pins: tuple[list[int], list[Hashable], dict[str, int], np.ndarray] | None = None
        self._at = 0  # the batch (of this stream) the last read-ahead counted from
        self._needed: dict[int, int] = {}  # chunk -> last batch needing it (last deep look)
        self._look: list[int] = []  # the last deep look's chunks, in order of first use
        # A mixture's messages, each as its spans (one entry per message built, in order):
        # the servicer counts their tokens by source (LocatedRound.source_tokens) once they
        # are written (service.SourceCounters).
        self.by_source: deque[list[Span]] | None = None
        self._k = 0  # a mixture's number of sources
        if isinstance(plan, MixtureSampler):
            self.by_source = deque()
            self._k = len(plan.spec.sources)
        self._read_ahead((0, 0))

    @property
    def finished(self) -> bool:
        return self._exhausted and not self._rounds

    def _spans(self, n: int, cursor: tuple[int, int]) -> tuple[list[Span], tuple[int, int]]:
        """The next n batches from `cursor` (round, batch) as spans of rounds, locating
        rounds as they are reached, and the cursor after them."""
        spans: list[Span] = []
        k, pos = cursor
        while n:
            if k == len(self._rounds):
                rnd = None if self._exhausted else next(self._source, None)
                if rnd is None:
                    self._exhausted = True
                    break
                self._rounds.append(LocatedRound(self.ds, rnd, self.plan.seq_len, self._k))
            lr = self._rounds[k]
            j = min(len(lr), pos + n)
            spans.append((lr, pos, j))
            n -= j - pos
            k, pos = (k + 1, 0) if j == len(lr) else (k, j)
        return spans, (k, pos)

    def _read_ahead(self, cursor: tuple[int, int], used: set[int] | None = None) -> None:
        """Read ahead the chunks of the `read_ahead_batches` batches from `cursor` (in an
        unshuffled order, the chunk after them too; remote stores: every few bursts, two
        shuffle groups' worth, nearest first), and those an earlier call left out for want
        of room. Chunks asked for in the last few bursts are not asked again, unless the
        cache has a read-ahead budget and they are that near: a read-ahead into the budget
        evicts nothing, so asking again only makes sure a chunk evicted since is loaded.
        A deep look warms every cached chunk it saw by its first use, those not asked
        again too.
        Chunks of `used` (the burst just built) those batches do not need go to the cold
        end of the cache's order: the stream is past them (cache.cool), unless the last
        deep look saw a later batch needing them (a chunk a row crosses into may be a
        block of the next shuffle group, or of this epoch's next one)."""
        store = self.ds.store
        k, pos = cursor  # the batches since the last call: this burst's
        self._at += pos - self._pos + sum(len(self._rounds[r]) for r in range(k))
        spans = self._spans(self.read_ahead_batches, cursor)[0]
        near = spans_chunks(spans)
        self._near = (_reach(spans), near)  # usually the next burst's batches: it reuses them
        warm: list[int] | None = None
        if store.remote and self._bursts % DEEP_EVERY == 0:
            spans = self._spans(self.deep, cursor)[0]
            if self._exhausted:  # the epoch ends within reach: the next one's start too
                spans += self._then_spans(self.deep - sum(j - i for _, i, j in spans))
            chunks, last = chunk_uses(spans)
            self._needed = {c: self._at + b for c, b in last.items()}
            self._look = warm = list(chunks)
        else:
            chunks = sorted(near)
        if used:
            past = [c for c in used - near if self._needed.get(c, -1) < self._at]
            self.cache.cool([self.ds.chunk_key(c) for c in past])
        if not self.plan.shuffle and chunks and max(chunks) + 1 < store.num_chunks:
            chunks.append(max(chunks) + 1)
        if self._waiting:
            asked = set(chunks)
            chunks += [c for c in self._waiting if c not in asked]
        self._bursts += 1
        if len(self._asked) > 4096:
            self._asked.clear()
            self._quiet = None
        again = near if self.cache.readahead_capacity else set()  # asked at every burst
        # The same chunks as the last call, none asked for ASK_AGAIN bursts ago yet: the
        # loop below would skip every one (a stream inside a shuffle group, the usual
        # case; a mixture's bursts need every source's group: ~2.6x a dataset's chunks)
        quiet = self._quiet
        if (
            warm is None
            and not again
            and quiet is not None
            and self._bursts < quiet[1]
            and chunks == quiet[0]
        ):
            return
        due = self._bursts + ASK_AGAIN  # the burst the first of `chunks` falls due again
        wanted = []
        for c in chunks:
            if c not in again:
                at = self._asked.get(c, -ASK_AGAIN)
                if self._bursts - at < ASK_AGAIN:
                    if at + ASK_AGAIN < due:
                        due = at + ASK_AGAIN
                    continue
            self._asked[c] = self._bursts
            if nbytes := store.chunk_nbytes(c):
                wanted.append((c, (self.ds.chunk_key(c), nbytes, partial(store.read_chunk, c))))
        # in order of need: the nearest load first and end warmest (a deep look warms
        # every chunk it saw, those asked for in the last few bursts too)
        keys: list[Hashable] | None = None if warm is None else [self.ds.chunk_key(c) for c in warm]
        left: set[Hashable] = set()
        if wanted or keys is not None:  # (else the cache has nothing to do)
            left = set(self.cache.read_ahead_all([w for _, w in wanted], warm=keys))
        self._waiting = [c for c, w in wanted if w[0] in left][:WAITING_CHUNKS]
        for c in self._waiting:
            del self._asked[c]
        # a chunk left waiting was forgotten (asked again next time): no quiet calls then
        self._quiet = (chunks, -1 if self._waiting else due)

    def _then_spans(self, n: int) -> list[Span]:
        """The next epoch's first n batches (as far as it has them), located once."""
        spans: list[Span] = []
        k = 0
        while n > 0:
            if k == len(self._then_rounds):
                rnd = None if self._then is None else next(self._then, None)
                if rnd is None:
                    break
                self._then_rounds.append(LocatedRound(self.ds, rnd, self.plan.seq_len))
            lr = self._then_rounds[k]
            spans.append((lr, 0, min(n, len(lr))))
            n -= len(lr)
            k += 1
        return spans

    def _peek(self, n: int) -> tuple[list[list[Span]], tuple[int, int]]:
        """The next n messages as spans of rounds, and the cursor after them."""
        messages = []
        cursor = (0, self._pos)
        for _ in range(n):
            spans, cursor = self._spans(self.per_message, cursor)
            if not spans:
                break
            messages.append(spans)
        return messages, cursor

    def _advance(self, cursor: tuple[int, int]) -> None:
        k, self._pos = cursor
        for _ in range(k):
            self._rounds.popleft()

    def next_burst(self, inline: bool = False) -> list[Message]:
        """Up to BURST_MESSAGES messages (BURST_BYTES in all); empty at the end or,
        `inline`, when a chunk would have to be loaded (nothing is consumed then).

        A burst is the unit of pinning and of a thread-pool round trip: the hop to a
        worker and back costs more than building one small message.
        """
        t0 = time.perf_counter()
        messages, cursor = self._peek(self.burst_messages)
        if not messages:
            return []
        spans = [span for spans in messages for span in spans]
        chunks = self._near[1] if self._near[0] == _reach(spans) else spans_chunks(spans)
        pinned = self._pin(sorted(chunks))
        if pinned is None and inline:  # leave the burst to a worker thread
            return []
        try:
            burst = [self._message(spans, pinned) for spans in messages]
        finally:
            if pinned is not None:
                self.cache.release_all(pinned.entries)
        self._read_ahead(cursor, chunks)  # before the cursor moves: it counts from the first round
        self._advance(cursor)
        batches = sum(g[1] for g in burst)
        self.metrics.batch_build_seconds.observe((time.perf_counter() - t0) / batches)
        return burst

    def _pin(self, chunks: list[int]) -> Pinned | None:
        """pin_views, with what only depends on the chunks (their keys, the keys' count by
        dataset) made once for a run of bursts over the same chunks (a shuffle group's:
        for a mixture, a group of every source)."""
        memo = self._pins
        if memo is None or memo[0] != chunks:
            keys: list[Hashable] = [self.ds.chunk_keys[c] for c in chunks]
            ids = np.asarray(chunks, dtype=np.int64)
            memo = self._pins = (chunks, keys, count_by_dataset(keys), ids)
        entries = self.cache.pin_resident(memo[1], memo[2])
        return None if entries is None else Pinned(entries, memo[3])

    def _message(self, spans: list[Span], pinned: Pinned | None) -> Message:
        batches = sum(j - i for _, i, j in spans)
        tokens = sum(lr.token_lo[j] - lr.token_lo[i] for lr, i, j in spans)
        if self.by_source is not None:  # counted by source when written (no numpy call here)
            self.by_source.append(spans)
        if pinned is not None and self.documents is None:
            data = pinned.message(spans)
        else:
            data = b"".join(part for span in spans for part in self._batches(span, pinned))
        return data, batches, tokens, tokens * self.ds.store.dtype.itemsize

    def _batches(self, span: Span, pinned: Pinned | None) -> Iterator[Any]:
        """A span's batches as pieces to join: with their document ends, or with rows
        loaded chunk by chunk (not all resident)."""
        lr, i, j = span
        for b in range(i, j):
            if pinned is not None:
                rows = pinned.rows(lr, b)
            else:
                rows = gather(self.ds, self.cache, lr.row_pieces(b))
            if self.documents is None:
                yield from (lr.head(b), rows, lr.tail(b))
            else:
                starts = lr.starts[lr.row_lo[b] : lr.row_lo[b + 1]]
                yield from self.documents.parts(lr.head(b), [rows], lr.tail(b), starts, lr.cols[b])
