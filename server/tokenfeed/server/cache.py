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

Pure threading and numpy: no gRPC, no store format (callers pass a `load` function).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenfeed.core.errors import ChecksumMismatch, DataLoss, FailedPrecondition

if TYPE_CHECKING:
    from tokenfeed.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

Loader = Callable[[], np.ndarray]


@dataclass
class _Entry:
    nbytes: int
    pins: int = 0
    data: np.ndarray | None = None
    view: memoryview | None = None  # `data` as bytes, made once: slicing it is cheap
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    loads: int = 0  # chunk loads started (read-ahead included)
    evictions: int = 0
    failures: int = 0
    prefetches: int = 0  # loads started by read-ahead


class ChunkCache:
    """LRU of chunks keyed by any hashable, bounded in bytes."""

    def __init__(
        self,
        capacity_bytes: int,
        metrics: ServerMetrics | None = None,
        readahead_threads: int = 2,
    ) -> None:
        if capacity_bytes <= 0:
            raise FailedPrecondition(f"cache capacity must be positive, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.metrics = metrics
        self.stats = CacheStats()
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # LRU first
        self._used = 0  # bytes of all entries, ready or loading
        self._cond = threading.Condition()
        self._pool = ThreadPoolExecutor(readahead_threads, thread_name_prefix="tokenfeed-readahead")
        self._closed = False
        if metrics is not None:
            metrics.cache_capacity_bytes.set(capacity_bytes)
            metrics.cache_resident_bytes.set(0)

    # ------------------------------------------------------------------ public

    @property
    def resident_bytes(self) -> int:
        with self._cond:
            return self._used

    def __contains__(self, key: Hashable) -> bool:
        with self._cond:
            e = self._entries.get(key)
            return e is not None and e.data is not None

    @contextmanager
    def pinned(self, key: Hashable, nbytes: int, load: Loader) -> Iterator[np.ndarray]:
        """The chunk `key`, loaded by `load()` if absent, held in the cache while in use."""
        entry = self._acquire(key, nbytes, load)
        try:
            yield entry.data  # type: ignore[misc]
        finally:
            self._release(entry)

    @property
    def pinned_count(self) -> int:
        """Chunks currently pinned (in use by a batch being built, or being waited for)."""
        with self._cond:
            return sum(1 for e in self._entries.values() if e.pins)

    def pin_resident(self, keys: list[Hashable]) -> list[_Entry] | None:
        """Pin all of `keys` at once if every one is loaded, else pin nothing (None).

        The fast path for a batch whose chunks are all cached: one lock round trip
        instead of one per chunk. It never waits, so holding several pins is safe.
        Release with `release_all`; the arrays are `entry.data`.
        """
        with self._cond:
            entries = []
            for key in keys:
                e = self._entries.get(key)
                if e is None or e.data is None:
                    return None
                entries.append(e)
            for key, e in zip(keys, entries, strict=True):
                e.pins += 1
                self._entries.move_to_end(key)
            self.stats.hits += len(entries)
        if self.metrics is not None:
            self.metrics.cache_hits.inc(len(entries))
            self._by_dataset(self.metrics.cache_dataset_hits, keys)
        return entries

    def release_all(self, entries: list[_Entry]) -> None:
        with self._cond:
            for e in entries:
                e.pins -= 1
            self._cond.notify_all()

    def prefetch(self, key: Hashable, nbytes: int, load: Loader) -> bool:
        """Start loading `key` in the background unless present, in flight or no room.

        Never blocks and never evicts a pinned chunk; returns whether a load started.
        The chunk joins at the cold end of the LRU order and moves up when first used:
        a read-ahead guess (a slow stream's far future, say) must not push out what
        streams are using now.
        """
        self._check_fits(key, nbytes)
        with self._cond:
            if self._closed or key in self._entries:
                return False
            if not self._make_room(nbytes, wait=False):
                return False
            entry = self._insert(key, nbytes)
            self._entries.move_to_end(key, last=False)
            self.stats.prefetches += 1
        try:
            self._pool.submit(self._load, key, entry, load)
        except RuntimeError:  # pool shut down concurrently
            self._fail(key, entry, DataLoss("cache closed"), log_it=False)
        return True

    def clear(self) -> None:
        """Drop every unpinned chunk (used chunks go when released)."""
        with self._cond:
            for key, e in list(self._entries.items()):
                if e.pins == 0 and e.data is not None:
                    self._evict(key, e)

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

    def _acquire(self, key: Hashable, nbytes: int, load: Loader) -> _Entry:
        self._check_fits(key, nbytes)
        with self._cond:
            entry = self._entries.get(key)
            if entry is not None:
                entry.pins += 1
                self._entries.move_to_end(key)
                leader = False
                if entry.data is not None:
                    self.stats.hits += 1
                    if self.metrics is not None:
                        self.metrics.cache_hits.inc()
                        self._by_dataset(self.metrics.cache_dataset_hits, [key])
                    return entry
            else:
                self._make_room(nbytes, wait=True)
                # Re-check: another thread may have started this load while we waited.
                entry = self._entries.get(key)
                leader = entry is None
                if leader:
                    entry = self._insert(key, nbytes)
                assert entry is not None
                entry.pins += 1
            self.stats.misses += 1
            if self.metrics is not None:
                self.metrics.cache_misses.inc()
                self._by_dataset(self.metrics.cache_dataset_misses, [key])
        if leader:
            self._load(key, entry, load)
        entry.done.wait()
        if entry.error is not None:
            self._release(entry)
            raise entry.error
        return entry

    def _release(self, entry: _Entry) -> None:
        with self._cond:
            entry.pins -= 1
            if entry.pins == 0:
                self._cond.notify_all()

    def _insert(self, key: Hashable, nbytes: int) -> _Entry:
        if self.metrics is not None and isinstance(key, tuple) and isinstance(key[0], str):
            # a dataset's hit and miss series exist (at 0) from its first chunk load on
            self.metrics.cache_dataset_hits.labels(dataset=key[0])
            self.metrics.cache_dataset_misses.labels(dataset=key[0])
        entry = _Entry(nbytes)
        self._entries[key] = entry
        self._used += nbytes
        self.stats.loads += 1
        self._gauge()
        return entry

    def _make_room(self, nbytes: int, wait: bool) -> bool:
        """Evict LRU unpinned chunks until `nbytes` fit (lock held); wait for pins if asked."""
        while self._used + nbytes > self.capacity:
            victim = next(
                ((k, e) for k, e in self._entries.items() if e.pins == 0 and e.data is not None),
                None,
            )
            if victim is not None:
                self._evict(*victim)
            elif not wait:
                return False
            else:
                self._cond.wait()
        return True

    def _evict(self, key: Hashable, entry: _Entry) -> None:
        del self._entries[key]
        self._used -= entry.nbytes
        entry.data = entry.view = None
        self.stats.evictions += 1
        if self.metrics is not None:
            self.metrics.cache_evictions.inc()
        self._gauge()
        self._cond.notify_all()

    def _load(self, key: Hashable, entry: _Entry, load: Loader) -> None:
        t0 = time.perf_counter()
        try:
            data = load()
            if data.nbytes != entry.nbytes:
                raise DataLoss(f"chunk {key!r} loaded {data.nbytes} bytes, expected {entry.nbytes}")
        except BaseException as e:  # noqa: BLE001 - handed to every waiter
            self._fail(key, entry, e, log_it=True)
            return
        if self.metrics is not None:
            self.metrics.chunk_load_seconds.observe(time.perf_counter() - t0)
        view = data.data.cast("B")
        with self._cond:
            entry.data, entry.view = data, view
            entry.done.set()
            self._cond.notify_all()

    def _fail(self, key: Hashable, entry: _Entry, error: BaseException, log_it: bool) -> None:
        with self._cond:
            if self._entries.get(key) is entry:
                del self._entries[key]
                self._used -= entry.nbytes
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

    @staticmethod
    def _by_dataset(counter: Any, keys: list[Hashable]) -> None:
        """Count keys by dataset (a key's first part when it is a (name, ...) tuple)."""
        if len(keys) == 1:
            name = keys[0][0] if isinstance(keys[0], tuple) else None
            if isinstance(name, str):
                counter.labels(dataset=name).inc()
            return
        names: dict[str, int] = {}
        for k in keys:
            if isinstance(k, tuple) and isinstance(k[0], str):
                names[k[0]] = names.get(k[0], 0) + 1
        for name, n in names.items():
            counter.labels(dataset=name).inc(n)

    def _gauge(self) -> None:
        if self.metrics is not None:
            self.metrics.cache_resident_bytes.set(self._used)
