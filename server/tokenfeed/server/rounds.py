"""A stream's sampling rounds, found in the store's chunks and encoded around their tokens.

The sampling engine plans a stream's batches in Rounds (up to a few thousand
consecutive batches as arrays). Everything that can be done for a whole round is done
once per round, in a few numpy calls (`LocatedRound`): the chunk and byte offset where
every row starts, which rows cross a chunk boundary, every batch's encoding around its
tokens (wire.frames), and the round as a splice program: (chunk, byte offset, byte
count) per row, the frames between them (splice.py).

A stream reads its rounds as spans, batches [i, j) of one round (`Span`), from a
cursor (round, batch) in its `RoundQueue`: assembly builds messages from the next
spans, read-ahead looks at the spans after them (readahead.py).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from functools import cached_property

import numpy as np

from tokenfeed.core import sampling
from tokenfeed.core.store.reader import StoreReader
from tokenfeed.server import splice, wire
from tokenfeed.server.datasets import Dataset

Span = tuple["LocatedRound", int, int]  # batches [i, j) of a round
Cursor = tuple[int, int]  # (round of the queue, batch of that round)
Reach = tuple["LocatedRound", int, int]  # (first round, first batch, batches)


class LocatedRound:
    """A sampling Round found in the store's chunks and encoded around its tokens.

    Batch i is rows [row_lo[i], row_lo[i + 1]) of the round's flat row arrays, and
    goes on the wire as head(i) + its rows' tokens + tail(i): pieces
    [piece_lo[i], piece_lo[i + 1]) of `program` (splice.py; key -1 reads `frames`,
    wire.frames' heads and tails one after another).
    """

    def __init__(self, ds: Dataset, rnd: sampling.Round, seq_len: int) -> None:
        store, size = ds.store, ds.store.dtype.itemsize
        # the round's lists as arrays once (each conversion costs what the arithmetic does)
        rows = np.asarray(rnd.rows, dtype=np.int64)
        cols = np.add(rnd.shifts, seq_len, dtype=np.int64)
        self.cols: list[int] = cols.tolist()
        cut = np.zeros(len(rows) + 1, dtype=np.int64)  # batch i: rows [cut[i], cut[i + 1])
        np.cumsum(rows, out=cut[1:])
        self._cut = cut
        # Only a round's last batch can be short, so its rows are a prefix of the flat array.
        n = int(cut[-1])
        own = rnd.starts.ravel()[:n]  # in each row's store (a mixture's: its source's)
        sources = None if rnd.sources is None else rnd.sources.ravel()[:n]
        self.starts = ds.virtual(own, sources)  # where assembly finds the rows
        self.sources = sources  # a mixture's: each row's source index
        self._cols = cols
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
        self.token_lo: list[int] = token_lo.tolist()

    # What only the slower paths (documents, chunks not resident) read: made on first use.
    @cached_property
    def row_lo(self) -> list[int]:
        """Batch i is rows [row_lo[i], row_lo[i + 1]) of the round's flat row arrays."""
        return self._cut.tolist()

    @cached_property
    def frame_at(self) -> list[int]:
        """Frame k is frames[frame_at[k]:frame_at[k + 1]]."""
        return [0, *np.cumsum(self._sizes).tolist()]

    def source_tokens(self, i: int, j: int, k: int) -> np.ndarray:
        """A mixture's tokens of batches [i, j) by source, int64 [k]: one count of the
        span's rows (a round's rows by source for every batch would be O(batches x k))."""
        lo, hi = self._cut[i], self._cut[j]
        assert self.sources is not None
        rows = self.sources[lo:hi]
        cols = self._cols[i:j]
        if (cols == cols[0]).all():  # one shift: every row the same width
            return np.bincount(rows, minlength=k) * cols[0]
        per_row = np.repeat(cols, np.diff(self._cut[i : j + 1]))
        return np.bincount(rows, weights=per_row, minlength=k).astype(np.int64)

    def row_pieces(self, i: int) -> np.ndarray:
        """Batch i's rows as pieces of chunks: its part of `program` but head and tail."""
        return self.program[self.piece_lo[i] + 1 : self.piece_lo[i + 1] - 1]

    def head(self, i: int) -> bytes:
        return self.frames[self.frame_at[2 * i] : self.frame_at[2 * i + 1]]

    def tail(self, i: int) -> bytes:
        return self.frames[self.frame_at[2 * i + 1] : self.frame_at[2 * i + 2]]

    def __len__(self) -> int:
        return len(self.cols)


def reach(spans: list[Span]) -> Reach | None:
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


# A chunk a stream loading whole chunks needs only within its first HEAD_BYTES (the
# head its rows cross into from the chunk before), and within a HEAD_SHARE of it, has
# those bytes read from its file instead of being loaded whole: one row's tail, not 32
# MiB read, copied and checked. A small chunk is loaded whole as before.
HEAD_BYTES = 64 << 10
HEAD_SHARE = 16


def spans_heads(store: StoreReader, spans: list[Span]) -> dict[int, int]:
    """The chunks `spans` need only a head of (HEAD_BYTES), each with the bytes from its
    start they reach. A block's last windows run a token or a row past its chunk into
    the next one (docs/sampling.md, "Block shuffle"): a shuffle group's rows need its
    blocks' chunks and the heads of as many others."""
    parts = [lr.program[lr.piece_lo[i] : lr.piece_lo[j]] for lr, i, j in spans]
    if not parts:
        return {}
    pieces = np.concatenate(parts)
    pieces = pieces[pieces[:, 0] >= 0]
    if not pieces.size:
        return {}
    chunks, which = np.unique(pieces[:, 0], return_inverse=True)
    reach = np.zeros(chunks.size, dtype=np.int64)
    np.maximum.at(reach, which, pieces[:, 1] + pieces[:, 2])
    small = reach <= HEAD_BYTES
    return {
        c: r
        for c, r in zip(chunks[small].tolist(), reach[small].tolist(), strict=True)
        if r * HEAD_SHARE <= store.chunk_nbytes(c)
    }


class RoundQueue:
    """One stream's rounds, located as they are reached and dropped once sent.

    Read as spans from a cursor (round of the queue, batch of that round); `start` is
    the first batch not sent yet. Looking ahead (read-ahead looks shuffle groups ahead
    of a remote stream) locates the rounds it reaches; they wait here until sent.
    """

    def __init__(
        self,
        ds: Dataset,
        rounds: Iterator[sampling.Round],
        seq_len: int,
    ) -> None:
        self.ds = ds
        self.seq_len = seq_len
        self._source = rounds
        self._rounds: deque[LocatedRound] = deque()  # located, not yet (all) sent
        self._pos = 0  # the first batch not sent of the first round
        self.exhausted = False  # every round of the source is located

    @property
    def start(self) -> Cursor:
        """The cursor of the first batch not sent yet."""
        return (0, self._pos)

    @property
    def finished(self) -> bool:
        return self.exhausted and not self._rounds

    def spans(self, n: int, cursor: Cursor) -> tuple[list[Span], Cursor]:
        """The next n batches from `cursor` as spans of rounds (fewer at the end of the
        rounds), locating rounds as they are reached, and the cursor after them."""
        spans: list[Span] = []
        k, pos = cursor
        while n:
            if k == len(self._rounds):
                rnd = None if self.exhausted else next(self._source, None)
                if rnd is None:
                    self.exhausted = True
                    break
                self._rounds.append(LocatedRound(self.ds, rnd, self.seq_len))
            lr = self._rounds[k]
            j = min(len(lr), pos + n)
            spans.append((lr, pos, j))
            n -= j - pos
            k, pos = (k + 1, 0) if j == len(lr) else (k, j)
        return spans, (k, pos)

    def advance(self, cursor: Cursor) -> int:
        """Mark the batches before `cursor` sent; returns how many batches that is."""
        k, pos = cursor
        moved = pos - self._pos
        for _ in range(k):
            moved += len(self._rounds.popleft())
        self._pos = pos
        return moved
