"""A stream's read-ahead: which chunks to load, or warm, ahead of its next batches.

Every stream (assembly.MessageBuilder) owns a `ReadaheadPolicy` and calls
`look_ahead` at its start and after each burst it builds; the policy asks the shared
cache for chunks (cache.readahead_all), which loads them in the background where they
fit and never waits. Read-ahead counts batches, not rounds: a rank's round spans
batch_size x world_size windows a step, for a large job most of an epoch, far more
than the cache holds.

- **Near**: the chunks of the next `batches` batches (the next burst's at least), so
  the next burst usually finds them resident and is built on the event loop; in
  window order (no shuffle) the chunk after them too, as a stream reads a store
  front to back. Shuffled, not a local chunk those batches need only the head of (a
  row crossing into it from a block's chunk: rounds.spans_heads): the burst reads
  that from its file.
- **Deep look** (stores whose chunks come over the network, s3://): every DEEP_EVERY
  bursts, the chunks of the next DEEP_GROUPS shuffle groups' worth of batches (into
  the next epoch's first batches when this one ends within reach), in order of first
  use: loads start nearest first, and the chunks already cached are warmed by their
  first use, so the room a load needs is taken from the chunks needed last. Shuffle
  groups: docs/sampling.md, "Block shuffle".
- **Cooling**: the chunks a burst used that the next batches do not need go to the
  cold end of the cache's order (cache.cool): the stream is past them. Not those the
  last deep look saw a later batch needing: a chunk a row crosses into may be a block
  of the next shuffle group.
- **Asking less**: a chunk asked for is not asked again for ASK_AGAIN bursts, unless
  the cache has a read-ahead budget (then the near chunks are asked at every burst:
  into the budget nothing is evicted, and asking again makes sure a chunk evicted
  since is loaded); chunks left out for want of room are asked again at the next
  burst. A burst whose chunks are the last ask's, none due again yet, asks nothing.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from functools import partial

import numpy as np

from tokenfeed.core import sampling
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Dataset
from tokenfeed.server.rounds import (
    Reach,
    RoundQueue,
    Span,
    reach,
    spans_chunks,
    spans_heads,
)

# Near: at least this many batches past the last burst. A burst is 4 messages, so at
# one batch a message this is the next two bursts: a chunk from local disk (a few ms)
# has a burst's building and writing to land before it is needed. Fewer, and a burst
# finds a chunk missing and waits for it on a worker thread; more, and read-ahead
# without a budget (it loads into the cold end of the cache) takes room from chunks
# in use for chunks needed later.
READAHEAD_BATCHES = 8
# A chunk asked for is then cached or loading: asking again at every burst would only
# take the cache's lock for each chunk of the stream's shuffle group, burst after
# burst. After ASK_AGAIN bursts it is asked again, which catches a chunk evicted since:
# more, and such a chunk is noticed later, nearer its use; fewer, more lock traffic.
ASK_AGAIN = 8
# Chunks left out for want of room are asked again at the next burst, not ASK_AGAIN
# bursts later (too late for the group the stream is entering): up to this many,
# nearest first. 16 is two shuffle groups of the default 8 blocks, the deep look's
# reach; more would be asked at every burst with no room to load them in.
WAITING_CHUNKS = 16
# Deep look: DEEP_GROUPS shuffle groups ahead, so a group's chunks start loading a
# whole group before the stream reaches it. A GET costs tens of ms before its first
# byte and a 32 MiB chunk a few hundred, and a stream serving from cache can cross a
# group faster: one group ahead, it reaches a group before its chunks land. More
# groups would ask for chunks the read-ahead budget (about a group's chunks by
# default) has no room for yet.
DEEP_GROUPS = 2
# ... every DEEP_EVERY bursts: a look is a pass over thousands of batches' pieces
# (chunk_uses: about 0.4 ms for 2000 batches of 16 rows), more than building a burst
# costs; once every 16 bursts it stays a small share, and 16 bursts are a small part
# of the two groups it looks over, so the look is never late by much.
DEEP_EVERY = 16
# ... over at least DEEP_BATCHES batches, so the look reaches well past where the
# stream will be at the next look (16 bursts; at the client's default of ~1 MiB a
# message, a burst is one message of at most 64 batches), also when its groups are
# small or unknown here (a mixture's sources have groups of their own).
DEEP_BATCHES = 1024
# ... and at most MAX_DEEP_BATCHES: the look's cost and the rounds it locates (held
# until sent) grow with its batches, and a small job's shuffle group can be hundreds
# of thousands of batches, whose chunks the read-ahead budget could not hold anyway.
MAX_DEEP_BATCHES = 16384
# When each chunk was last asked for is remembered for this many chunks, then
# forgotten at once: a long stream over a large store would grow the memo without
# bound, and forgetting costs one more ask of each chunk.
ASKED_LIMIT = 4096


def group_batches(sampler: sampling.DatasetSampler | MixtureSampler) -> int:
    """This rank's batches per shuffle group (a step takes batch_size x world_size
    windows); 0 for a mixture, whose sources have groups of their own."""
    if not isinstance(sampler, sampling.DatasetSampler):
        return 0
    group_windows = sampler.windows_per_block * (
        sampler.spec.shuffle_blocks if sampler.shuffle else 1
    )
    return -(-group_windows // (sampler.batch_size * sampler.world_size))


def deep_batches(group: int, near: int) -> int:
    """The batches a deep look covers: DEEP_GROUPS groups of `group` batches past the
    `near` ones, within [DEEP_BATCHES, MAX_DEEP_BATCHES]."""
    return min(MAX_DEEP_BATCHES, max(DEEP_BATCHES, DEEP_GROUPS * group + near))


def chunk_uses(spans: list[Span]) -> tuple[list[int], dict[int, int]]:
    """The chunks spans touch, in the order their rows first need them (a row crossing
    into the next chunks needs those at its own place in the order: the program's), and
    for each the last batch that needs it (0 = the spans' first batch).

    One pass over the spans' pieces laid end to end: each chunk's first and last piece
    by ufunc.at into arrays indexed by chunk (no sort of the pieces: a deep look is
    thousands of batches every few bursts, and np.unique per span cost as much as
    building the bursts in between), then the last piece's batch by one searchsorted.
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
    order: list[int] = ids.tolist()
    return order, dict(zip(order, batch.tolist(), strict=True))


class ReadaheadPolicy:
    """One stream's read-ahead (module docstring): `look_ahead` after every burst.

    `rounds` is the stream's queue, read from its start; `then`, the rounds of this
    rank's next epoch from its start (lazy: only a deep look reaches them, as this
    epoch ends).
    """

    def __init__(
        self,
        ds: Dataset,
        sampler: sampling.DatasetSampler | MixtureSampler,
        rounds: RoundQueue,
        cache: ChunkCache,
        burst_batches: int,
        then: Iterator[sampling.Round] | None = None,
    ) -> None:
        self.ds, self.rounds, self.cache = ds, rounds, cache
        self.shuffle = sampler.shuffle
        self.batches = max(READAHEAD_BATCHES, burst_batches)  # the near look's
        self.deep = deep_batches(group_batches(sampler), self.batches)  # a deep look's
        self._then = RoundQueue(ds, iter(()) if then is None else then, sampler.seq_len)
        self._bursts = 0  # calls so far: one at the start, then one per burst
        self._at = 0  # the stream's batch the last call looked from
        self._asked: dict[int, int] = {}  # chunk -> call (`_bursts`) when last asked for
        self._near: tuple[Reach | None, set[int]] = (None, set())  # the last near look's
        self._waiting: list[int] = []  # chunks left out for want of room, nearest first
        # the last call's chunks and the call at which the first of them falls due to be
        # asked again: until then, a call with the same chunks has nothing to ask
        self._quiet: tuple[list[int], int] | None = None
        self._needed: dict[int, int] = {}  # chunk -> the last batch needing it (deep look)
        self.look: list[int] = []  # the last deep look's chunks, in order of first use

    def chunks_of(self, spans: list[Span]) -> set[int]:
        """The chunks of `spans`: the last near look's when it saw the same batches (the
        next burst's, usually)."""
        seen, chunks = self._near
        return chunks if seen is not None and seen == reach(spans) else spans_chunks(spans)

    def look_ahead(self, moved: int = 0, used: set[int] | None = None) -> None:
        """Ask the cache for the chunks the stream needs next, it having moved `moved`
        batches on since the last call, with a burst that used the chunks `used`."""
        store = self.ds.store
        self._at += moved
        start = self.rounds.start
        spans = self.rounds.spans(self.batches, start)[0]
        near = spans_chunks(spans)
        self._near = (reach(spans), near)
        warm: list[int] | None = None
        if store.remote and self._bursts % DEEP_EVERY == 0:
            spans = self.rounds.spans(self.deep, start)[0]
            if self.rounds.exhausted:  # the epoch ends within reach: the next one's start too
                spans += self._then.spans(self.deep - sum(j - i for _, i, j in spans), (0, 0))[0]
            chunks, last = chunk_uses(spans)
            self._needed = {c: self._at + b for c, b in last.items()}
            self.look = warm = list(chunks)
        else:
            chunks = sorted(near)
            key, cache = self.ds.chunk_key, self.cache
            if store.in_place and self.shuffle and any(key(c) not in cache for c in chunks):
                # a chunk only a row's tail crosses into is read from its file
                # (assembly.py); looked for only when a chunk is missing: finding heads
                # costs more than a burst of cached chunks saves by it
                chunks = sorted(near.difference(spans_heads(store, spans)))
        if used:
            past = [c for c in used - near if self._needed.get(c, -1) < self._at]
            self.cache.cool([self.ds.chunk_key(c) for c in past])
        if not self.shuffle and chunks and max(chunks) + 1 < store.num_chunks:
            chunks.append(max(chunks) + 1)
        if self._waiting:
            asked = set(chunks)
            chunks += [c for c in self._waiting if c not in asked]
        self._ask(chunks, near, warm)

    def _ask(self, chunks: list[int], near: set[int], warm: list[int] | None) -> None:
        """Ask the cache for `chunks` (nearest first) but those asked lately, and warm
        `warm` (a deep look's chunks) by their first use."""
        store = self.ds.store
        self._bursts += 1
        if len(self._asked) > ASKED_LIMIT:
            self._asked.clear()
            self._quiet = None
        again = near if self.cache.readahead_capacity else set()  # asked at every burst
        # The same chunks as the last call, none asked for ASK_AGAIN bursts ago yet: the
        # loop below would skip every one (a stream inside a shuffle group, the usual
        # case; a mixture's bursts need every source's group)
        quiet = self._quiet
        if (
            warm is None
            and not again
            and quiet is not None
            and self._bursts < quiet[1]
            and chunks == quiet[0]
        ):
            return
        due = self._bursts + ASK_AGAIN  # the call at which the first of `chunks` falls due
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
            left = set(self.cache.readahead_all([w for _, w in wanted], warm=keys))
        self._waiting = [c for c, w in wanted if w[0] in left][:WAITING_CHUNKS]
        for c in self._waiting:
            del self._asked[c]
        # a chunk left waiting was forgotten (asked again next time): no quiet calls then
        self._quiet = (chunks, -1 if self._waiting else due)
