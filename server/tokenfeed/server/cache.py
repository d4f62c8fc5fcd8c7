"""The chunk cache: one LRU of token chunks shared by every stream and dataset.

Why one cache: every trainer rank of a job reads the same chunks in the same epoch
order, so a chunk read from disk once serves them all. The cache is bounded in bytes
(loads in flight count too), loads each chunk once however many threads ask for it
(the others wait for that load: single flight), and reads ahead in the background.

Rules that keep it deadlock-free and within its bound:

* a caller pins at most one chunk at a time (`with cache.pinned(...)`), and never
  waits for anything while holding a pin: it copies what it needs and lets go;
* a pinned chunk is never evicted; a loader that finds no room waits until a pin
  is released (read-ahead never waits: it simply skips);
* a failed load (`DataLoss` from the loader: a missing, short or corrupt chunk) is
  not cached; it is raised to every caller waiting for that load, logged and counted
  (checksum mismatches apart too), and the next request tries again.

Read-ahead budget (`readahead_bytes`, the feeder's --readahead-bytes; 0 = none): a
chunk read ahead waits in room of its own, outside the LRU, until a stream first uses
it; only then does it join the cache, which evicts its least recent chunks to make room.
So read-ahead can start loading the next shuffle group's chunks long before they are
needed (object storage answers tens of ms late) without pushing out the chunks streams
are reading now, and without read-aheads pushing out each other. Memory stays within
capacity + readahead_bytes. A read-ahead that finds its room full is skipped (asked
again later), unless the oldest chunk waiting there has been waiting `stale_seconds`
unused: a guess that did not come true (its stream went away) gives its room up.
The eviction a first use calls for waits for the next load, read-ahead or `cool`: a
burst crossing into a new shuffle group pins the old group's chunks and the new one's,
so at that moment the only chunks left to evict are the ones the new group needs later
(evicted then, they would be loaded again at once, a stall each on object storage);
once the stream has cooled the old group's chunks, those go first.
Without a budget, a read-ahead chunk takes cache room, at the cold end of the LRU order.

A load in flight counts its chunk plus `load_overhead` bytes (the feeder gives the object
storage client's buffers per GET; at most the chunk's size), in the bound of the room it
loads into, until it lands: with GETs in flight the memory stays within the bounds too.

A load that takes the room of chunks it evicted reuses one's memory map when the store
reads into one (core/store/memory.py: a new map's pages are faulted in and zeroed, in a
virtual machine supplied again by the host, 4-10x the CPU of reading into a used one):
only a map no view of the evicted chunk still refers to, and only within the operation
that evicted it, so memory stays within the bounds above.

Pure threading and numpy: no gRPC, no store format (callers pass a `load` function).
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenfeed.core.errors import ChecksumMismatch, DataLoss, FailedPrecondition
from tokenfeed.core.store import memory

if TYPE_CHECKING:
    from tokenfeed.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

Loader = Callable[[], np.ndarray]


@dataclass
class Entry:
    nbytes: int
    held: int = 0  # bytes counted for it: nbytes, plus the load's overhead while it loads
    pins: int = 0
    data: np.ndarray | None = None
    view: memoryview | None = None  # `data` as bytes, made once: slicing it is cheap
    ahead: bool = False  # read ahead, not used yet: counted in the read-ahead room
    since: float = 0.0  # when it was read ahead (time.monotonic)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)
    spare: mmap.mmap | None = None  # an evicted chunk's map for this load to read into


def count_by_dataset(keys: list[Hashable]) -> dict[str, int]:
    """How many of `keys` each dataset has (a key's first part when it is a (name, ...)
    tuple; other keys are no dataset's): what a pin counts in the per-dataset hits."""
    names: dict[str, int] = {}
    for k in keys:
        if isinstance(k, tuple) and isinstance(k[0], str):
            names[k[0]] = names.get(k[0], 0) + 1
    return names


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    loads: int = 0  # chunk loads started (read-ahead included)
    evictions: int = 0
    failures: int = 0
    readaheads: int = 0  # loads started by read-ahead
    ahead_used: int = 0  # chunks read ahead into the budget that a stream then used
    ahead_dropped: int = 0  # ... that were dropped unused (stale_seconds)


class ChunkCache:
    """LRU of chunks keyed by any hashable, bounded in bytes."""

    def __init__(
        self,
        capacity_bytes: int,
        metrics: ServerMetrics | None = None,
        readahead_threads: int = 2,
        readahead_bytes: int = 0,
        load_overhead: int = 0,
        stale_seconds: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if capacity_bytes <= 0:
            raise FailedPrecondition(f"cache capacity must be positive, got {capacity_bytes}")
        if readahead_bytes < 0:
            raise FailedPrecondition(f"read-ahead budget must be >= 0, got {readahead_bytes}")
        self.capacity = capacity_bytes
        self.readahead_capacity = readahead_bytes
        # Bytes a load holds beyond its chunk while in flight (an object storage client's
        # buffers): counted with its chunk until it lands, so they stay within the bounds.
        self.load_overhead = load_overhead
        self.stale_seconds = stale_seconds
        self._clock = clock
        self.metrics = metrics
        self._children: dict[tuple[Any, str], Any] = {}  # (counter, dataset) -> child
        self.stats = CacheStats()
        self._entries: OrderedDict[Hashable, Entry] = OrderedDict()  # LRU first
        # maps of chunks evicted by the operation holding the lock, for its load to reuse
        self._spares: list[mmap.mmap] = []
        self._used = 0  # bytes of the cache's entries (not read-ahead ones), ready or loading
        self._ahead = 0  # bytes of entries waiting in the read-ahead room, ready or loading
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(readahead_threads, thread_name_prefix="tokenfeed-readahead")
        self._closed = False
        if metrics is not None:
            metrics.cache_capacity_bytes.set(capacity_bytes)
            metrics.cache_resident_bytes.set(0)
            metrics.readahead_capacity_bytes.set(readahead_bytes)
            metrics.readahead_bytes.set(0)

    # ------------------------------------------------------------------ public

    @property
    def resident_bytes(self) -> int:
        """Bytes held by the cache proper (chunks in use or used), loading ones included
        (with their load's overhead)."""
        with self._cond:
            return self._used

    @property
    def readahead_bytes(self) -> int:
        """Bytes of chunks read ahead and not used yet (in the read-ahead budget)."""
        with self._cond:
            return self._ahead

    @property
    def loading(self) -> int:
        """Chunk loads in flight, read-aheads included."""
        with self._cond:
            return sum(1 for e in self._entries.values() if e.data is None)

    def eviction_order(self) -> list[Hashable]:
        """The keys of the cache proper's chunks (read-ahead ones apart), in the order
        evictions take them (pins aside): coldest first."""
        with self._cond:
            return [k for k, e in self._entries.items() if not e.ahead]

    def __contains__(self, key: Hashable) -> bool:
        with self._cond:
            e = self._entries.get(key)
            return e is not None and e.data is not None

    @contextmanager
    def pinned(self, key: Hashable, nbytes: int, load: Loader) -> Iterator[np.ndarray]:
        """The chunk `key`, loaded by `load()` if absent, held in the cache while in use."""
        entry = self._acquire(key, nbytes, load)
        try:
            assert entry.data is not None  # loaded: _acquire raised otherwise
            yield entry.data
        finally:
            self._release(entry)

    @property
    def pinned_count(self) -> int:
        """Chunks currently pinned (in use by a batch being built, or being waited for)."""
        with self._cond:
            return sum(1 for e in self._entries.values() if e.pins)

    def pin_resident(
        self, keys: list[Hashable], by_dataset: dict[str, int] | None = None
    ) -> list[Entry] | None:
        """Pin all of `keys` at once if every one is loaded, else pin nothing (None).

        The fast path for a batch whose chunks are all cached: one lock round trip
        instead of one per chunk. It never waits, so holding several pins is safe.
        Release with `release_all`; the arrays are `entry.data`. `by_dataset`:
        count_by_dataset(keys), when the caller has it (a stream pins the same chunks
        burst after burst: a mixture's, several datasets' shuffle groups).
        """
        with self._cond:
            entries = []
            ahead = []
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.data is None:
                    return None
                entries.append(e)
                if e.ahead:
                    ahead.append(e)
            for key, e in zip(keys, entries, strict=True):
                e.pins += 1
                self._entries.move_to_end(key)
            for e in ahead:  # after pinning all: a promotion evicts only unpinned chunks
                self._promote(e)
            self.stats.hits += len(entries)
        if self.metrics is not None:
            self.metrics.cache_hits.inc(len(entries))
            counts = count_by_dataset(keys) if by_dataset is None else by_dataset
            self._by_dataset(self.metrics.cache_dataset_hits, counts)
        return entries

    def release_all(self, entries: list[Entry]) -> None:
        with self._cond:
            for e in entries:
                e.pins -= 1
            self._cond.notify_all()

    def readahead_all(
        self, wanted: list[tuple[Hashable, int, Loader]], warm: list[Hashable] | None = None
    ) -> list[Hashable]:
        """`readahead` for chunks in the order a stream will first need them: loads
        start nearest first (the read-ahead room fills with what is needed first), and
        the chunks already cached are warmed farthest first, so the nearest ends warmest
        and the room a load needs is taken from the chunks needed last (or not at all).
        `warm`, when given, is the order to warm by instead of `wanted`'s (a caller that
        asks for some chunks less often than it learns when they are needed).
        Returns the keys left out for want of room (neither cached nor loading), nearest
        first: once one is left out, so are the ones after it (none jumps the queue).
        """
        left: list[Hashable] = []
        with self._cond:  # re-entrant: readahead takes it again
            for key in reversed([w[0] for w in wanted] if warm is None else warm):
                e = self._entries.get(key)
                if e is not None and not e.ahead:
                    self._entries.move_to_end(key)
            for key, n, load in wanted:
                if key in self._entries:
                    continue
                if left or not self.readahead(key, n, load, warm=False):
                    left.append(key)
        return left

    def readahead(self, key: Hashable, nbytes: int, load: Loader, *, warm: bool = True) -> bool:
        """Start loading `key` in the background unless present, in flight or no room.

        Never blocks and never evicts a pinned chunk; returns whether a load started.
        A chunk already cached moves to the warm end of the LRU order (unless `warm` is
        False): a stream will need it soon, so room is made from chunks it will not.
        With a read-ahead budget the chunk waits in it until first used (see the module
        docstring); without one it joins at the cold end of the LRU order and moves up
        when first used: a read-ahead guess (a slow stream's far future, say) must not
        push out what streams are using now.
        """
        self._check_fits(key, nbytes)
        with self._cond:
            if self._closed:
                return False
            if (present := self._entries.get(key)) is not None:
                if warm and not present.ahead:  # needed soon: room is made elsewhere first
                    self._entries.move_to_end(key)
                return False
            try:
                if self.readahead_capacity:
                    self._make_room(0, wait=False)  # first uses may have left the cache over
                    if not self._make_ahead_room(nbytes + self._overhead(nbytes)):
                        return False
                    entry = self._insert(key, nbytes, ahead=True)
                else:
                    if not self._make_room(self._loading_cost(nbytes), wait=False):
                        return False
                    entry = self._insert(key, nbytes)
                    self._entries.move_to_end(key, last=False)
            finally:
                self._spares.clear()
            self.stats.readaheads += 1
        try:
            self._pool.submit(self._load, key, entry, load)
        except RuntimeError:  # pool shut down concurrently
            self._fail(key, entry, DataLoss("cache closed"), log_it=False)
        return True

    def cool(self, keys: list[Hashable]) -> None:
        """Move `keys` (those cached) to the cold end of the LRU order: a stream is done
        with them for a while (its shuffle group moved on), so they go first when room
        is needed, before chunks it has not reached yet. Any later use warms them again.

        Plain LRU keeps exactly the wrong chunks when the cache holds less than an
        epoch: the ones the epoch has already used, evicting the ones still to come.
        A cache left over its bound by first uses evicts now, cooled chunks first.
        """
        with self._cond:
            for key in keys:
                e = self._entries.get(key)
                if e is not None and not e.ahead:
                    self._entries.move_to_end(key, last=False)
            self._make_room(0, wait=False)
            self._spares.clear()

    def clear(self) -> None:
        """Drop every unpinned chunk (used chunks go when released)."""
        with self._cond:
            for key, e in list(self._entries.items()):
                if e.pins == 0 and e.data is not None:
                    self._evict(key, e)
            self._spares.clear()

    def close(self) -> None:
        with self._cond:
            self._closed = True
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.clear()

    # ---------------------------------------------------------------- internals

    def _check_fits(self, key: Hashable, nbytes: int) -> None:
        if nbytes > self.capacity:
            raise FailedPrecondition(
                f"chunk {key[-1] if isinstance(key, tuple) else key} is {nbytes} bytes, more "
                f"than the whole chunk cache ({self.capacity} bytes); restart the feeder "
                f"with a larger --cache-bytes (at least a few chunks)"
            )

    def _acquire(self, key: Hashable, nbytes: int, load: Loader) -> Entry:
        self._check_fits(key, nbytes)
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                entry.pins += 1
                self._entries.move_to_end(key)
                if entry.ahead:
                    self._promote(entry)
                leader = False
                if entry.data is not None:
                    self.stats.hits += 1
                    if self.metrics is not None:
                        self.metrics.cache_hits.inc()
                        self._by_dataset(self.metrics.cache_dataset_hits, count_by_dataset([key]))
                    return entry
            else:
                self._make_room(self._loading_cost(nbytes), wait=True)
                # Re-check: another thread may have started this load while we waited.
                entry = self._entries.get(key)
                leader = entry is None
                if leader:
                    entry = self._insert(key, nbytes)
                self._spares.clear()
                assert entry is not None
                entry.pins += 1
                if entry.ahead:  # read ahead by another thread while we waited for room
                    self._promote(entry)
            self.stats.misses += 1
            if self.metrics is not None:
                self.metrics.cache_misses.inc()
                self._by_dataset(self.metrics.cache_dataset_misses, count_by_dataset([key]))
        if leader:
            self._load(key, entry, load)
        entry.done.wait()
        if entry.error is not None:
            self._release(entry)
            raise entry.error
        return entry

    def _release(self, entry: Entry) -> None:
        with self._cond:
            entry.pins -= 1
            if entry.pins == 0:
                self._cond.notify_all()

    def _insert(self, key: Hashable, nbytes: int, ahead: bool = False) -> Entry:
        if self.metrics is not None and isinstance(key, tuple) and isinstance(key[0], str):
            # a dataset's hit and miss series exist (at 0) from its first chunk load on
            self._child(self.metrics.cache_dataset_hits, key[0])
            self._child(self.metrics.cache_dataset_misses, key[0])
        held = nbytes + self._overhead(nbytes) if ahead else self._loading_cost(nbytes)
        entry = Entry(nbytes, held, ahead=ahead, since=self._clock() if ahead else 0.0)
        entry.spare = next((m for m in self._spares if len(m) == max(nbytes, 1)), None)
        self._spares.clear()
        self._entries[key] = entry
        self._count(entry)
        self.stats.loads += 1
        return entry

    def _promote(self, entry: Entry) -> None:
        """A read-ahead chunk's first use (lock held, `entry` pinned): it moves from the
        read-ahead room into the cache, which may be over its bound until the next load,
        read-ahead or `cool` evicts (the bytes only moved: the sum of both bounds holds).
        Not now: the caller pins a burst's chunks, often all the cache holds but the few
        it needs next (module docstring)."""
        self._uncount(entry)
        entry.ahead = False
        self._count(entry)
        self.stats.ahead_used += 1

    def _fits_ahead(self, nbytes: int) -> bool:
        """Within the room, and both together within the sum of the bounds (the cache
        may still be over its own after a first use, when all it holds is pinned)."""
        return (
            self._ahead + nbytes <= self.readahead_capacity
            and self._used + self._ahead + nbytes <= self.capacity + self.readahead_capacity
        )

    def _make_ahead_room(self, nbytes: int) -> bool:
        """Whether `nbytes` fit in the read-ahead room (lock held), after dropping chunks
        that have waited there unused for stale_seconds, oldest first."""
        if nbytes > self.readahead_capacity:
            return False
        if self._fits_ahead(nbytes):
            return True
        now = self._clock()
        stale = [
            (k, e)
            for k, e in self._entries.items()
            if e.ahead and e.pins == 0 and e.data is not None
            if now - e.since >= self.stale_seconds
        ]
        for k, e in sorted(stale, key=lambda ke: ke[1].since):
            self._evict(k, e)
            self.stats.ahead_dropped += 1
            if self._fits_ahead(nbytes):
                return True
        return False

    def _make_room(self, nbytes: int, wait: bool) -> bool:
        """Evict LRU unpinned chunks until `nbytes` fit (lock held); wait for pins if asked."""
        while self._used + nbytes > self.capacity:
            victim = next(
                (
                    (k, e)
                    for k, e in self._entries.items()
                    if e.pins == 0 and e.data is not None and not e.ahead
                ),
                None,
            )
            if victim is not None:
                self._evict(*victim)
            elif not wait:
                return False
            else:
                self._cond.wait()
        return True

    def _evict(self, key: Hashable, entry: Entry) -> None:
        del self._entries[key]
        self._uncount(entry)
        data, entry.data, entry.view = entry.data, None, None
        if (spare := memory.spare_map(data)) is not None:
            gone = weakref.ref(data)
            del data
            if gone() is None:  # no view of the chunk is left anywhere: its map is free
                self._spares.append(spare)
        self.stats.evictions += 1
        if self.metrics is not None:
            self.metrics.cache_evictions.inc()
        self._gauge()
        self._cond.notify_all()

    def _load(self, key: Hashable, entry: Entry, load: Loader) -> None:
        t0 = time.perf_counter()
        memory.hand(entry.spare)  # the store reads into it when it reads into a map
        entry.spare = None
        try:
            data = load()
            if data.nbytes != entry.nbytes:
                raise DataLoss(f"chunk {key!r} loaded {data.nbytes} bytes, expected {entry.nbytes}")
        except BaseException as e:  # handed to every waiter
            self._fail(key, entry, e, log_it=True)
            return
        finally:
            memory.hand(None)
        if self.metrics is not None:
            self.metrics.chunk_load_seconds.observe(time.perf_counter() - t0)
        view = data.data.cast("B")
        with self._cond:
            self._uncount(entry)  # landed: the load's overhead is given back
            entry.held = entry.nbytes
            self._count(entry)
            entry.data, entry.view = data, view
            entry.done.set()
            self._cond.notify_all()

    def _fail(self, key: Hashable, entry: Entry, error: BaseException, log_it: bool) -> None:
        with self._cond:
            if self._entries.get(key) is entry:
                del self._entries[key]
                self._uncount(entry)
                self._gauge()
            entry.error = error
            entry.done.set()
            self.stats.failures += 1
            self._cond.notify_all()
        if log_it:
            if self.metrics is not None:
                self.metrics.cache_load_failures.inc()
                if isinstance(error, ChecksumMismatch):
                    self.metrics.cache_checksum_failures.inc()
            msg = getattr(error, "message", None) or repr(error)
            log.error("chunk load failed for %r: %s", key, msg)

    def _overhead(self, nbytes: int) -> int:
        """A load's overhead: at most its chunk's size (a small object's GET holds little)."""
        return min(self.load_overhead, nbytes)

    def _loading_cost(self, nbytes: int) -> int:
        """What a load into the cache proper counts while in flight; never more than the
        whole cache, so a chunk as large as the cache can still load."""
        return min(nbytes + self._overhead(nbytes), max(self.capacity, nbytes))

    def _count(self, entry: Entry) -> None:
        if entry.ahead:
            self._ahead += entry.held
        else:
            self._used += entry.held
        self._gauge()

    def _uncount(self, entry: Entry) -> None:
        if entry.ahead:
            self._ahead -= entry.held
        else:
            self._used -= entry.held

    def _by_dataset(self, counter: Any, counts: dict[str, int]) -> None:
        """Add `counts` (count_by_dataset's) to each dataset's child of `counter`."""
        for name, n in counts.items():
            self._child(counter, name).inc(n)

    def _child(self, counter: Any, dataset: str) -> Any:
        """`counter.labels(dataset=...)`, looked up once: labels() validates and locks,
        and a burst counts its hits per dataset."""
        child = self._children.get((counter, dataset))
        if child is None:
            child = self._children[counter, dataset] = counter.labels(dataset=dataset)
        return child

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.cache_resident_bytes.set(self._used)
            self.metrics.readahead_bytes.set(self._ahead)
