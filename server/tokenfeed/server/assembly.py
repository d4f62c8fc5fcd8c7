"""A stream's rank batches -> serialized StreamBatches messages, from the shared chunk cache.

The feeder's hot path. A stream's rounds are located once each (rounds.py: where
every row lies in the chunks, every batch's frames, the round as a splice program), so
what is left per message is one call (splice.py, in C) that copies its pieces once
into the message, with no Python object per row.

Cache rules (cache.py): a burst of messages pins all its chunks at once, and only
when every one is resident (it never waits holding pins); otherwise it copies chunk
by chunk, one pin at a time, loading or waiting for each (`gather`). After each burst
the stream's read-ahead (readahead.py) asks for the chunks of the batches after it.

Where a burst is built is the servicer's choice (service.py): on the event loop
(`inline`: from resident chunks only, never waiting) or on a worker thread.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from functools import partial

import numpy as np

from tokenfeed.core import sampling
from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.server import inplace, splice
from tokenfeed.server.cache import ChunkCache, Entry, count_by_dataset
from tokenfeed.server.datasets import Dataset
from tokenfeed.server.documents import BatchEnds
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.readahead import ReadaheadPolicy
from tokenfeed.server.rounds import (
    LocatedRound,
    RoundQueue,
    Span,
    spans_chunks,
    spans_heads,
)

# A burst is built in one go: one pin of its chunks, one thread-pool round trip, which
# costs more than building one small message. Past a few messages a burst saves no
# more (the round trip is already shared) and only makes the streams' turns on the
# event loop and the threads coarser: one stream's burst delays the others'.
BURST_MESSAGES = 4  # messages per burst...
# ...unless they reach this size first: large messages share the round trip already,
# and a burst's messages are all held in memory until written.
BURST_BYTES = 1 << 20
# A stream reading in place (inplace.py) pays more per burst: its files taken from the
# pool and given back, the try on the event loop, and the thread hop when that fails.
# Its bursts grow (BURST_MESSAGES, then doubling) to this many messages, within
# BURST_BYTES, so that more batches share those costs. Its first bursts stay small, so
# that streams starting together get their first batches as soon as before. A stream
# whose client reads slower than its bursts come (`paced`) does not grow them: a
# burst's messages wait in memory until written, and for 1,024 paced streams bursts of
# 16 held 3-4 times the memory of bursts of 4.
IN_PLACE_BURST_MESSAGES = 16

# A stream reading in place opens the files of this many bursts ahead after a burst
# built on a worker thread: a rank of a job of 1,024 crosses a shuffle group's chunks
# in two bursts, so with one burst's files open ahead every other burst went to a
# worker to open the next group's; with four, one in five does.
OPEN_AHEAD = 4

# A client that does not say how large a message it accepts gets gRPC's default
# receive limit (StreamBatchesRequest.max_message_bytes; docs/serving.md, "Limits").
DEFAULT_CLIENT_MESSAGE_BYTES = 4 << 20

Message = tuple[bytes, int, int, int]  # (serialized response, batches, tokens, payload bytes)


def fit_client_limit(
    per_message: int,
    max_message_bytes: int,
    rows: int,
    cols: int,
    itemsize: int,
    document_ends: bool = False,
) -> int:
    """Batches per message so that no message exceeds the client's receive limit
    (StreamBatchesRequest.max_message_bytes; unset = gRPC's default 4 MiB). A batch
    takes its tokens plus at most 10 bytes per window start and 128 of fields, and with
    `document_ends` up to 4 bytes more per token (every token ending a document)."""
    limit = max_message_bytes or DEFAULT_CLIENT_MESSAGE_BYTES
    if limit < 0:
        raise InvalidArgument(f"max_message_bytes must be non-negative, got {limit}")
    batch_bytes = rows * cols * (itemsize + 4 * document_ends) + 10 * rows + 128
    if batch_bytes > limit:
        raise InvalidArgument(
            f"one batch ({rows} rows x {cols} tokens x {itemsize} bytes"
            + (", and up to 4 bytes of document ends per token" if document_ends else "")
            + f") takes up to "
            f"{batch_bytes} bytes on the wire, more than the client accepts: "
            f"max_message_bytes={limit}"
            + (" (unset: gRPC's default 4 MiB receive limit)" if not max_message_bytes else "")
            + "; lower batch_size or seq_len, or raise the client's max receive message "
            "length and send it as max_message_bytes"
        )
    return min(per_message, limit // batch_bytes)


class Pinned:
    """Chunks pinned in the cache for a burst: their ids (ascending) and byte views;
    `release()` lets go. (inplace.InPlace is the same for rows read from the files.)"""

    def __init__(
        self,
        keys: list[int] | np.ndarray,
        views: list[memoryview | None],
        release: Callable[[], None],
    ) -> None:
        self.keys = np.asarray(keys, dtype=np.int64)
        self.views = views
        self.release = release

    @classmethod
    def cached(
        cls, cache: ChunkCache, entries: list[Entry], keys: list[int] | np.ndarray
    ) -> Pinned:
        views = [e.view for e in entries]
        return cls(keys, views, partial(cache.release_all, entries))

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
    return Pinned.cached(cache, entries, chunks)


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
    """One stream's rounds of rank batches -> serialized messages, a burst at a time.

    Called from one thread at a time. Rounds are located as they are reached
    (rounds.RoundQueue), and after each burst the stream's read-ahead asks for the
    chunks of the batches after it (readahead.ReadaheadPolicy), so a stream usually
    finds its chunks resident and builds on the event loop.
    """

    def __init__(
        self,
        ds: Dataset,
        sampler: sampling.DatasetSampler | MixtureSampler,
        rounds: Iterator[sampling.Round],
        per_message: int,
        cache: ChunkCache,
        metrics: ServerMetrics,
        documents: BatchEnds | None = None,
        then: Iterator[sampling.Round] | None = None,
        files: inplace.FilePool | None = None,
    ) -> None:
        """`then`: the rounds of this rank's next epoch from its start (lazy: only a
        remote store's deep read-ahead looks at its first batches, as this one ends);
        `files`: the feeder's open chunk files, shared by its streams (else its own)."""
        self.ds, self.sampler, self.cache, self.metrics = ds, sampler, cache, metrics
        self.documents = documents  # each batch's document ends, when the request asks
        self.per_message = per_message
        self.message_bytes = (
            per_message
            * sampler.batch_size
            * (sampler.seq_len + sampler.max_shift)
            * ds.store.dtype.itemsize
        )
        self.burst_messages = max(1, min(BURST_MESSAGES, BURST_BYTES // self.message_bytes))
        # A mixture's messages, each as its spans (one entry per message built, in order):
        # the servicer counts their tokens by source (LocatedRound.source_tokens) once they
        # are written (source_counters.py).
        self.by_source: deque[list[Span]] | None = None
        sources = 0
        if isinstance(sampler, MixtureSampler):
            self.by_source = deque()
            sources = len(sampler.spec.sources)
        self.rounds = RoundQueue(ds, rounds, sampler.seq_len)
        # the last burst's chunks, their keys and count by dataset, as an array (_pin)
        self._pins: tuple[list[int], list[Hashable], dict[str, int], np.ndarray] | None = None
        self.readahead = ReadaheadPolicy(
            ds, sampler, self.rounds, cache, self.burst_messages * per_message, then
        )
        # a rank of a large job, or of a mixture of many sources, reads its rows from
        # the chunk files (inplace.py)
        self.pool = files if files is not None else inplace.FilePool()
        self.files: inplace.ChunkFiles | None = None
        self._guard = threading.Lock()  # close() from the event loop, bursts on threads
        self._building = self._closed = False
        # A stream's first burst whose chunks are not all cached is one message read in
        # place (inplace.py): its first batch waits for a few rows, not for whole chunks
        # to be read and checksummed. The read-ahead asked for after it loads them
        # whole, and the next bursts use them (or wait for them, checksum checked).
        self._first = True
        # The first burst's read-ahead (locating the next burst's rows: about as long
        # as the first burst itself) is made as the next burst starts, while the first
        # batch is on its way; that burst needs the same rows located anyway.
        self._later: tuple[int, set[int]] | None = None
        # the last _peek's messages, cursor and chunks, until the stream advances: a burst
        # tried on the event loop and left to a worker thread is peeked once
        self._peeked: tuple[int, list[list[Span]], tuple[int, int], set[int]] | None = None
        shares = sampler.world_size * max(1, sources)
        if shares >= inplace.IN_PLACE_WORLD_SIZE and ds.store.in_place:
            self.files = inplace.ChunkFiles(ds, self.pool)
            self.burst_messages = max(
                1, min(IN_PLACE_BURST_MESSAGES, BURST_BYTES // self.message_bytes)
            )
        elif not ds.store.in_place:  # (else after the first burst: not to slow its reads)
            self.readahead.look_ahead()
        # the next burst's messages after the first: BURST_MESSAGES, doubling to burst_messages
        self._burst = min(BURST_MESSAGES, self.burst_messages)

    @property
    def finished(self) -> bool:
        return self.rounds.finished

    def close(self) -> None:
        """The stream ended: close the chunk files it reads in place (once the burst a
        worker thread may still be building is done)."""
        with self._guard:
            self._closed = True
            if self._building:
                return  # next_burst closes them as it ends
        if self.files is not None:
            self.files.close()

    def _peek(self, n: int) -> tuple[list[list[Span]], tuple[int, int], set[int]]:
        """The next n messages as spans of rounds, the cursor after them and their chunks
        (remembered until the stream advances)."""
        if self._peeked is not None and self._peeked[0] == n:
            return self._peeked[1:]
        messages = []
        cursor = self.rounds.start
        for m in range(n):
            # A stream's first message holds one batch: the client's first batch waits
            # for its own bytes, not for a full message's copy, transfer and decoding.
            batches = 1 if self._first and m == 0 else self.per_message
            spans, cursor = self.rounds.spans(batches, cursor)
            if not spans:
                break
            messages.append(spans)
        chunks = self.readahead.chunks_of([span for spans in messages for span in spans])
        self._peeked = (n, messages, cursor, chunks)
        return messages, cursor, chunks

    def next_burst(self, inline: bool = False, read_files: bool = True) -> list[Message]:
        """Up to BURST_MESSAGES messages (BURST_BYTES in all); empty at the end or,
        `inline`, when a chunk would have to be loaded (nothing is consumed then); with
        `read_files` False, also when its rows would be read in place.

        A burst is the unit of pinning and of a thread-pool round trip: the hop to a
        worker and back costs more than building one small message.
        """
        with self._guard:
            if self._closed:
                return []
            self._building = True
        try:
            return self._next_burst(inline, read_files)
        finally:
            with self._guard:
                self._building = False
                closed = self._closed
            if closed and self.files is not None:
                self.files.close()

    def paced(self) -> None:
        """The stream's last burst waited to be written (its client reads slower than
        the bursts come): its next bursts are BURST_MESSAGES again, growing only once a
        burst is written without waiting."""
        self._burst = min(BURST_MESSAGES, self.burst_messages)

    def settle(self) -> None:
        """Make the read-ahead the first burst left for later (the next burst makes it
        first otherwise)."""
        if self._later is not None:
            later, self._later = self._later, None
            self.readahead.look_ahead(*later)

    def _next_burst(self, inline: bool, read_files: bool = True) -> list[Message]:
        t0 = time.perf_counter()
        self.settle()
        messages, cursor, chunks = self._peek(1 if self._first else self._burst)
        if not messages:
            return []
        order = sorted(chunks)
        pinned: Pinned | inplace.InPlace | None = self._pin(order)
        if pinned is None and inline:
            # rows read in place on the event loop from files open already, where the
            # page cache holds them all; else the burst is left to a worker thread
            pinned = None if self.files is None or not read_files else self.files.kept(order)
            if pinned is None:
                return []
            try:
                burst = [self._message(spans, pinned) for spans in messages]
            except inplace.WouldBlock:
                return []
            finally:
                pinned.release()
            return self._sent(burst, messages, cursor, chunks, t0, inline)
        if pinned is None and self.files is not None:
            pinned = self.files.burst(order)
        elif pinned is None and self._first and self.ds.store.in_place:
            # a first burst's files, read in place (see __init__)
            pinned = inplace.ChunkFiles(self.ds, self.pool, attach=False).burst(order)
        elif pinned is None and self.ds.store.in_place and self.readahead.shuffle:
            pinned = self._pin_heads(order, [s for spans in messages for s in spans])
        try:
            burst = [self._message(spans, pinned) for spans in messages]
        finally:
            if pinned is not None:
                pinned.release()
        return self._sent(burst, messages, cursor, chunks, t0, inline)

    def _sent(
        self,
        burst: list[Message],
        messages: list[list[Span]],
        cursor: tuple[int, int],
        chunks: set[int],
        t0: float,
        inline: bool,
    ) -> list[Message]:
        """A burst built: the stream moves past it, and its read-ahead looks on (reading in
        place off the event loop: the next burst's files are opened)."""
        first, self._first = self._first, False
        if not first:
            self._burst = min(2 * self._burst, self.burst_messages)
        if self.by_source is not None:  # counted by source when written (no numpy call here)
            self.by_source.extend(messages)
        moved = self.rounds.advance(cursor)
        self._peeked = None
        if self.files is None and first:  # the next burst asks, once this one is sent
            self._later = (moved, chunks)
        elif self.files is None:  # a stream reading in place never loads a chunk whole
            self.readahead.look_ahead(moved, chunks)
        elif not inline and not first:  # the next bursts' files, to be read on the loop
            # (not after a first burst: its batch waits for this; the next burst opens them)
            ahead = OPEN_AHEAD * self._burst * self.per_message
            self.files.ahead(sorted(spans_chunks(self.rounds.spans(ahead, self.rounds.start)[0])))
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
        return None if entries is None else Pinned.cached(self.cache, entries, memo[3])

    def _pin_heads(self, chunks: list[int], spans: list[Span]) -> Pinned | None:
        """The burst's chunks pinned but those it needs only the head of (a row crossing
        into them: rounds.spans_heads), whose heads are read from their files instead of
        loading them whole; None if there is no such chunk missing from the cache.
        Shuffled streams only: a stream in window order reads the next chunk whole
        right after its head, and a head is read without the chunk's checksum, which
        its load checks before any more of it is sent."""
        keys = self.ds.chunk_keys
        heads = spans_heads(self.ds.store, spans)
        read = [c for c in chunks if c in heads and keys[c] not in self.cache]
        if not read:
            return None
        rest = [c for c in chunks if c not in read]
        entries = self.cache.pin_resident([keys[c] for c in rest])
        if entries is None:  # loaded one at a time first (pinning none while waiting)
            store = self.ds.store
            for c in (c for c in rest if keys[c] not in self.cache):
                with self.cache.pinned(
                    keys[c], store.chunk_nbytes(c), partial(store.read_chunk, c)
                ):
                    pass
            entries = self.cache.pin_resident([keys[c] for c in rest])
            if entries is None:  # evicted meanwhile (a cache of a few chunks): chunk by chunk
                return None
        try:
            got = {c: memoryview(inplace.read_head(self.ds.store, c, heads[c])) for c in read}
        except BaseException:
            self.cache.release_all(entries)
            raise
        views = iter([e.view for e in entries])
        return Pinned(
            chunks,
            [got[c] if c in got else next(views) for c in chunks],
            partial(self.cache.release_all, entries),
        )

    def _message(self, spans: list[Span], pinned: Pinned | inplace.InPlace | None) -> Message:
        batches = sum(j - i for _, i, j in spans)
        tokens = sum(lr.token_lo[j] - lr.token_lo[i] for lr, i, j in spans)
        if pinned is not None and self.documents is None:
            data = pinned.message(spans)
        else:
            data = b"".join(part for span in spans for part in self._batches(span, pinned))
        return data, batches, tokens, tokens * self.ds.store.dtype.itemsize

    def _batches(self, span: Span, pinned: Pinned | inplace.InPlace | None) -> Iterator[bytes]:
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
