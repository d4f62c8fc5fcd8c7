"""The chunk cache on its own: single flight, byte bound, pins, failures, read-ahead."""

from __future__ import annotations

import random
import threading
from functools import partial
from pathlib import Path

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tokenfeed.core.errors import ChecksumMismatch, DataLoss, FailedPrecondition
from tokenfeed.core.store import memory
from tokenfeed.server.cache import ChunkCache, count_by_dataset
from tokenfeed.server.metrics import ServerMetrics

from support import wait_until
from support.stores import make_positional_store


def chunk(key: int, nbytes: int) -> np.ndarray:
    return np.full(nbytes, key % 251, dtype=np.uint8)


def test_hit_miss_and_lru_eviction() -> None:
    metrics = ServerMetrics(CollectorRegistry())
    cache = ChunkCache(300, metrics)
    for k in (1, 2, 3):
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)) as data:
            assert data[0] == k
    with cache.pinned(1, 100, lambda: chunk(1, 100)):  # hit; 1 becomes most recent
        pass
    with cache.pinned(4, 100, lambda: chunk(4, 100)):  # evicts 2, the least recent
        pass
    assert 2 not in cache
    assert 1 in cache
    assert 3 in cache
    assert 4 in cache
    assert cache.stats.hits == 1
    assert cache.stats.misses == 4
    assert cache.stats.evictions == 1
    assert cache.resident_bytes == 300
    reg = metrics.registry
    assert reg.get_sample_value("tokenfeed_cache_hits_total") == 1
    assert reg.get_sample_value("tokenfeed_cache_evictions_total") == 1
    assert reg.get_sample_value("tokenfeed_cache_resident_bytes") == 300
    assert reg.get_sample_value("tokenfeed_cache_capacity_bytes") == 300
    cache.close()


def test_concurrent_requests_share_one_load() -> None:
    cache = ChunkCache(1 << 20)
    release = threading.Event()
    loads = []

    def load() -> np.ndarray:
        loads.append(1)
        release.wait(30)
        return chunk(7, 1000)

    seen = []

    def reader() -> None:
        with cache.pinned("k", 1000, load) as data:
            seen.append(int(data[0]))

    threads = [threading.Thread(target=reader) for _ in range(16)]
    for t in threads:
        t.start()
    # every reader has asked (misses are counted before waiting) before the load ends
    wait_until(lambda: cache.stats.misses + cache.stats.hits >= 16, 30, "16 readers asking")
    release.set()
    for t in threads:
        t.join(30)
    assert len(loads) == 1
    assert seen == [7] * 16
    assert cache.stats.loads == 1
    cache.close()


def test_chunk_larger_than_cache_is_a_clear_error() -> None:
    cache = ChunkCache(100)
    with (
        pytest.raises(FailedPrecondition, match="--cache-bytes"),
        cache.pinned(("ds", 0, 3), 101, lambda: chunk(3, 101)),
    ):
        pass
    cache.close()


def test_failed_load_reaches_every_waiter_is_counted_and_not_cached() -> None:
    metrics = ServerMetrics(CollectorRegistry())
    cache = ChunkCache(1000, metrics)
    release = threading.Event()

    def bad() -> np.ndarray:
        release.wait(30)
        raise ChecksumMismatch("chunk 0 is corrupt (checksum ...)")

    errors = []

    def reader() -> None:
        try:
            with cache.pinned(0, 10, bad):
                pass
        except DataLoss as e:
            errors.append(e.message)

    threads = [threading.Thread(target=reader) for _ in range(4)]
    for t in threads:
        t.start()
    wait_until(lambda: cache.stats.misses >= 4, 30, "4 readers waiting for the load")
    release.set()
    for t in threads:
        t.join(30)
    assert len(errors) == 4
    assert all("corrupt" in m for m in errors)
    assert metrics.registry.get_sample_value("tokenfeed_cache_checksum_failures_total") == 1
    assert metrics.registry.get_sample_value("tokenfeed_cache_load_failures_total") == 1
    assert cache.resident_bytes == 0

    def missing() -> np.ndarray:
        raise DataLoss("chunk 1 is missing")

    with pytest.raises(DataLoss, match="missing"), cache.pinned(1, 10, missing):
        pass  # a missing chunk is a load failure, not a checksum failure
    assert metrics.registry.get_sample_value("tokenfeed_cache_checksum_failures_total") == 1
    assert metrics.registry.get_sample_value("tokenfeed_cache_load_failures_total") == 2
    with cache.pinned(0, 10, lambda: chunk(0, 10)) as data:  # fixed on disk: loads again
        assert data.nbytes == 10
    cache.close()


def test_pinned_chunk_is_not_evicted_a_loader_waits_for_it() -> None:
    cache = ChunkCache(100)
    got_b = threading.Event()
    with cache.pinned("a", 100, lambda: chunk(1, 100)) as a:

        def reader() -> None:
            with cache.pinned("b", 100, lambda: chunk(2, 100)):
                got_b.set()

        t = threading.Thread(target=reader)
        t.start()
        assert not got_b.wait(0.2)  # no room while "a" is pinned
        assert "a" in cache
        assert int(a[0]) == 1
        assert not cache.readahead("c", 100, lambda: chunk(3, 100))  # read-ahead never waits
    t.join(30)
    assert got_b.is_set()
    assert "a" not in cache
    assert "b" in cache
    cache.close()


def test_prefetch_loads_in_background_and_counts_as_a_hit_later() -> None:
    cache = ChunkCache(1000)
    assert cache.readahead("x", 10, lambda: chunk(5, 10))
    assert not cache.readahead("x", 10, lambda: chunk(5, 10))  # already there / in flight
    with cache.pinned("x", 10, lambda: chunk(99, 10)) as data:  # waits for the read-ahead
        assert int(data[0]) == 5
    assert cache.stats.loads == 1
    cache.close()


def test_readahead_does_not_push_out_chunks_in_use() -> None:
    """A prefetched chunk waits at the cold end of the LRU order until it is used, so
    a read-ahead guess is evicted before what streams are reading now."""
    cache = ChunkCache(300)
    for k in (1, 2):
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    assert cache.readahead(3, 100, lambda: chunk(3, 100))
    with cache.pinned(3, 100, lambda: chunk(3, 100)):  # waits for the load to finish
        pass
    assert cache.readahead(4, 100, lambda: chunk(4, 100))  # full: evicts 1, the coldest used
    with cache.pinned(4, 100, lambda: chunk(4, 100)):
        pass
    assert 1 not in cache
    assert 2 in cache
    assert 3 in cache
    assert 4 in cache
    assert cache.readahead(5, 100, lambda: chunk(5, 100))  # evicts 2
    loaded(cache, 5)  # (a load in flight stays)
    assert cache.readahead(6, 100, lambda: chunk(6, 100))  # evicts 5, never used, not 3 or 4
    with cache.pinned(6, 100, lambda: chunk(6, 100)):
        pass
    assert 3 in cache
    assert 4 in cache
    assert 6 in cache
    assert 5 not in cache
    cache.close()


def loaded(cache: ChunkCache, key: object) -> None:
    wait_until(lambda: key in cache, 30, f"chunk {key!r} to load")


def test_readahead_budget_keeps_used_chunks_and_read_aheads_apart() -> None:
    """With a budget, read-ahead chunks wait outside the cache until first used: they
    push out neither the chunks in use nor each other; a first use moves one into the
    cache, which evicts its least recent chunk at the next read-ahead, load or cool."""
    metrics = ServerMetrics(CollectorRegistry())
    cache = ChunkCache(300, metrics, readahead_bytes=200)
    for k in (1, 2, 3):
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    assert cache.readahead(4, 100, lambda: chunk(4, 100))
    assert cache.readahead(5, 100, lambda: chunk(5, 100))
    assert not cache.readahead(6, 100, lambda: chunk(6, 100))  # the budget is full: skipped
    loaded(cache, 4)
    loaded(cache, 5)
    assert all(k in cache for k in (1, 2, 3, 4, 5))
    assert 6 not in cache
    assert cache.resident_bytes == 300
    assert cache.readahead_bytes == 200
    reg = metrics.registry
    assert reg.get_sample_value("tokenfeed_readahead_bytes") == 200
    assert reg.get_sample_value("tokenfeed_readahead_capacity_bytes") == 200
    with cache.pinned(4, 100, lambda: chunk(99, 100)) as data:  # first use
        assert int(data[0]) == 4
    assert all(k in cache for k in (1, 2, 3, 4, 5))  # the bytes only moved: 500 in all
    assert cache.resident_bytes == 400
    assert cache.readahead_bytes == 100
    assert cache.readahead(6, 100, lambda: chunk(6, 100))  # room again; 1 goes first
    loaded(cache, 6)
    assert 1 not in cache
    assert all(k in cache for k in (2, 3, 4, 5, 6))
    assert cache.resident_bytes == 300
    assert cache.readahead_bytes == 200
    entries = cache.pin_resident([5, 6])  # the all-resident fast path moves them too
    assert entries is not None
    cache.release_all(entries)
    assert cache.readahead_bytes == 0
    assert cache.resident_bytes == 500
    cache.cool([])  # a stream's cool settles the debt: the least recent go
    assert cache.resident_bytes == 300
    assert 2 not in cache
    assert 3 not in cache
    assert cache.stats.ahead_used == 3
    assert cache.stats.loads == 6
    cache.close()


def test_readahead_waits_for_pins_nowhere_and_stays_within_both_bounds() -> None:
    """A read-ahead chunk first used while every cached chunk is pinned joins the cache
    anyway (nothing waits); the cache is over its bound by what left the read-ahead
    room, and back within it at the next load."""
    cache = ChunkCache(200, readahead_bytes=100)
    assert cache.readahead("r", 100, lambda: chunk(7, 100))
    loaded(cache, "r")
    with (
        cache.pinned("a", 100, lambda: chunk(1, 100)),
        cache.pinned("b", 100, lambda: chunk(2, 100)),
        cache.pinned("r", 100, lambda: chunk(99, 100)) as data,
    ):
        assert int(data[0]) == 7
        assert cache.resident_bytes == 300
        assert cache.readahead_bytes == 0
    with cache.pinned("c", 100, lambda: chunk(3, 100)):
        assert cache.resident_bytes == 200
    cache.close()


def test_pin_resident_moves_a_read_ahead_without_evicting_what_it_pins() -> None:
    cache = ChunkCache(200, readahead_bytes=100)
    for k in ("a", "b"):
        with cache.pinned(k, 100, lambda: chunk(1, 100)):
            pass
    assert cache.readahead("r", 100, lambda: chunk(7, 100))
    loaded(cache, "r")
    entries = cache.pin_resident(["r", "a"])  # "a" is the least recent, but pinned here
    assert entries is not None
    assert [int(e.data[0]) for e in entries] == [7, 1]
    cache.release_all(entries)
    cache.cool([])
    assert "a" in cache
    assert "r" in cache
    assert "b" not in cache
    cache.close()


def test_a_first_use_leaves_evicting_to_the_streams_cool() -> None:
    """A burst crossing into a new shuffle group pins the old group's chunks and the new
    group's: a first use there must not evict the one unpinned chunk the new group needs
    later ("x"), but wait for the stream to cool the old group's ("a", "b")."""
    cache = ChunkCache(300, readahead_bytes=100)
    for k in ("x", "a", "b"):  # x least recent: the new group needs it only later
        with cache.pinned(k, 100, lambda: chunk(1, 100)):
            pass
    assert cache.readahead("r", 100, lambda: chunk(2, 100))
    loaded(cache, "r")
    entries = cache.pin_resident(["a", "b", "r"])  # the burst at the boundary
    assert entries is not None
    cache.release_all(entries)
    assert all(k in cache for k in ("x", "a", "b", "r"))
    assert cache.resident_bytes == 400
    cache.cool(["a", "b"])  # the stream is past the old group
    assert cache.resident_bytes == 300
    assert "b" not in cache
    assert all(k in cache for k in ("x", "a", "r"))
    cache.close()


def test_readahead_all_loads_nearest_first_and_warms_nearest_last() -> None:
    """Chunks asked for in the order a stream needs them: the budget takes the nearest
    ones not cached, the others are returned (and none after the first left out jumps
    the queue); the cached ones are warmed so that the nearest is evicted last."""
    cache = ChunkCache(300, readahead_bytes=250)
    for k in (1, 2, 3):
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    want = [2, 8, 1, 9, 7, 10]  # 8 and 9 fill 200 of the 250; 10 would fit, 7 not
    sizes = {2: 100, 8: 100, 1: 100, 9: 100, 7: 100, 10: 50}
    left = cache.readahead_all([(k, sizes[k], lambda k=k: chunk(k, sizes[k])) for k in want])
    assert left == [7, 10]
    assert cache.stats.readaheads == 2
    loaded(cache, 8)
    loaded(cache, 9)
    for k in (4, 5):  # two loads: the coldest go, 3 (not asked for) first, then 1
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    assert 3 not in cache
    assert 1 not in cache
    assert 2 in cache
    cache.close()


def test_readahead_all_warms_by_the_order_given_not_only_what_it_asks_for() -> None:
    """A stream asks for a chunk again only every few bursts, but each look tells when
    every chunk is needed: `warm` ranks all the cached ones it names (the nearest ends
    warmest), those not asked for this time too, so a load evicts the farthest first."""
    cache = ChunkCache(400, readahead_bytes=100)
    for k in (1, 2, 3, 4):
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    # the look: 4 first, then 1, then 3; 2 not at all. Only 5 is asked for (loaded ahead).
    left = cache.readahead_all([(5, 100, lambda: chunk(5, 100))], warm=[4, 5, 1, 3])
    assert left == []
    loaded(cache, 5)
    for k in (6, 7, 8):  # three loads: 2 (not needed) goes, then 3 and 1, the farthest
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
        if k == 6:
            assert 2 not in cache
            assert all(c in cache for c in (1, 3, 4, 5))
        if k == 7:
            assert 3 not in cache
            assert all(c in cache for c in (1, 4, 5))
    assert 1 not in cache
    assert 4 in cache
    assert 5 in cache
    cache.close()


def test_a_load_in_flight_counts_its_overhead_until_it_lands() -> None:
    """An object storage GET holds buffers beside its chunk while in flight: they count
    in the bound of the room the chunk loads into, and are given back when it lands."""
    gate = threading.Event()

    def slow(k: int) -> np.ndarray:
        gate.wait(30)
        return chunk(k, 100)

    cache = ChunkCache(300, readahead_bytes=350, load_overhead=50)
    assert cache.readahead(1, 100, lambda: slow(1))
    assert cache.readahead(2, 100, lambda: slow(2))
    assert cache.readahead_bytes == 300
    assert cache.loading == 2
    assert not cache.readahead(3, 100, lambda: chunk(3, 100))  # 450 > 350: no room
    gate.set()
    wait_until(lambda: cache.loading == 0, 30, "read-aheads")
    assert cache.readahead_bytes == 200
    assert cache.readahead(3, 100, lambda: chunk(3, 100))  # 350: room again
    for k in (4, 5, 6):  # 6 in flight (150) did not fit beside 4 and 5: 4 went
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    assert cache.resident_bytes == 200
    assert 4 not in cache
    seen: list[int] = []

    def watched() -> np.ndarray:
        seen.append(cache.resident_bytes)  # while this load is in flight
        return chunk(7, 100)

    with cache.pinned(7, 100, watched):
        assert seen == [250]
        assert cache.resident_bytes == 200
    assert 5 not in cache
    assert 6 in cache
    cache.close()


def test_cooled_chunks_go_first_and_warm_up_again_when_used() -> None:
    cache = ChunkCache(300)
    for k in (1, 2, 3):
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    cache.cool([3, 2, "absent"])  # a stream is past 2 and 3: they go before 1
    with cache.pinned(2, 100, lambda: chunk(2, 100)):  # ...but 2 is used again: warm
        pass
    with cache.pinned(4, 100, lambda: chunk(4, 100)):  # evicts 3, the coldest
        pass
    assert 3 not in cache
    assert all(k in cache for k in (1, 2, 4))
    cache.close()


def test_readahead_of_a_cached_chunk_warms_it() -> None:
    """A stream about to need a cached chunk asks for it ahead: it moves to the warm
    end, so the room the next load needs is taken from chunks not needed soon."""
    cache = ChunkCache(300)
    for k in (1, 2, 3):
        with cache.pinned(k, 100, lambda k=k: chunk(k, 100)):
            pass
    assert not cache.readahead(1, 100, lambda: chunk(1, 100))  # cached: no load, warmed
    with cache.pinned(4, 100, lambda: chunk(4, 100)):  # evicts 2, not 1
        pass
    assert 2 not in cache
    assert all(k in cache for k in (1, 3, 4))
    assert cache.stats.loads == 4
    cache.close()


def test_readahead_nobody_used_gives_its_room_up_once_stale() -> None:
    now = [0.0]
    cache = ChunkCache(1000, readahead_bytes=100, stale_seconds=60, clock=lambda: now[0])
    assert cache.readahead("old", 100, lambda: chunk(1, 100))
    loaded(cache, "old")
    now[0] = 59.0
    assert not cache.readahead("new", 100, lambda: chunk(2, 100))  # not stale yet: skipped
    now[0] = 60.0
    assert cache.readahead("new", 100, lambda: chunk(2, 100))  # "old" dropped unused
    loaded(cache, "new")
    assert "old" not in cache
    assert cache.stats.ahead_dropped == 1
    assert cache.readahead_bytes == 100
    assert cache.resident_bytes == 0
    assert not cache.readahead("huge", 101, lambda: chunk(3, 101))  # never fits the budget
    cache.close()


@pytest.mark.parametrize(
    ("seed", "ahead", "overhead"),
    [(0, 0, 0), (1, 0, 0), (2, 0, 0), (0, 3_000, 0), (1, 3_000, 0), (2, 0, 300), (2, 3_000, 300)],
)
def test_byte_bound_holds_under_a_random_workload(seed: int, ahead: int, overhead: int) -> None:
    """The cache stays within its bound; with a read-ahead budget, read-aheads stay
    within theirs and both together within the sum (a first use may move a chunk from
    one to the other while everything else is pinned); loads in flight count their
    overhead in all of it."""
    capacity = 5_000
    cache = ChunkCache(capacity, readahead_bytes=ahead, load_overhead=overhead)
    sizes = {k: random.Random(k).randint(1, 2_000) for k in range(40)}
    violations: list[int] = []
    wrong: list[int] = []

    def over() -> int | None:
        with cache._cond:  # both at one instant (the lock is re-entrant)
            used, pending = cache.resident_bytes, cache.readahead_bytes
        if ahead == 0:
            return used if used > capacity or pending else None
        return used + pending if pending > ahead or used + pending > capacity + ahead else None

    def load(k: int) -> np.ndarray:
        if (bad := over()) is not None:
            violations.append(bad)
        return chunk(k, sizes[k])

    def worker(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        for _ in range(300):
            k = rng.randrange(40)
            p = rng.random()
            if p < 0.15:
                cache.readahead(k, sizes[k], lambda k=k: load(k))
                continue
            if p < 0.2:
                ks = rng.sample(range(40), 4)
                cache.readahead_all([(j, sizes[j], lambda j=j: load(j)) for j in ks])
                continue
            if p < 0.25:
                cache.cool(rng.sample(range(40), 3))
                continue
            with cache.pinned(k, sizes[k], lambda k=k: load(k)) as data:
                if data.nbytes != sizes[k] or int(data[0]) != k % 251:
                    wrong.append(k)
            if (bad := over()) is not None:
                violations.append(bad)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    cache.close()
    assert not violations
    assert not wrong
    assert cache.stats.evictions > 0  # the workload really was bigger than the cache


def test_a_pin_counts_its_hits_by_dataset_given_or_counted() -> None:
    """pin_resident counts each dataset's hits from the keys (count_by_dataset), or from
    the counts a caller made once for the same keys (a stream's run of bursts over one
    shuffle group); keys that are no dataset's count in the total only."""
    metrics = ServerMetrics(CollectorRegistry())
    cache = ChunkCache(10_000, metrics)
    keys = [("a", 0, 1), ("b", 0, 0), ("a", 0, 2), 7]
    for k in keys:
        with cache.pinned(k, 100, lambda: chunk(1, 100)):
            pass
    assert count_by_dataset(keys) == {"a": 2, "b": 1}
    for by_dataset in (None, count_by_dataset(keys)):
        entries = cache.pin_resident(keys, by_dataset)
        assert entries is not None
        cache.release_all(entries)
    reg = metrics.registry

    def hits(name: str) -> float | None:
        return reg.get_sample_value("tokenfeed_cache_dataset_hits_total", {"dataset": name})

    assert hits("a") == 4
    assert hits("b") == 2
    assert reg.get_sample_value("tokenfeed_cache_hits_total") == 8
    cache.close()


def _map_of(data: np.ndarray) -> object:
    return memory.spare_map(data)


def test_a_load_reads_into_the_map_of_the_chunk_it_evicted(tmp_path: Path) -> None:
    # Real chunk files: each load reads into its own anonymous map, except when it takes
    # the room of an evicted chunk nothing refers to any more: then into that one's map.
    store = make_positional_store(tmp_path / "s", 4_000, 1_000)
    cache = ChunkCache(2 * 4_000)  # two chunks of uint32
    maps = []
    for c in (0, 1, 2):
        with cache.pinned(c, 4_000, partial(store.read_chunk, c)) as data:
            maps.append(_map_of(data))
            assert np.array_equal(data, np.arange(c * 1_000, (c + 1) * 1_000))
    assert maps[0] is not None
    assert maps[1] is not maps[0]
    assert maps[2] is maps[0]  # chunk 2 evicted chunk 0 and took its map
    assert 0 not in cache
    assert cache.resident_bytes == 2 * 4_000
    cache.close()


def test_a_map_a_view_still_refers_to_is_never_reused(tmp_path: Path) -> None:
    store = make_positional_store(tmp_path / "s", 4_000, 1_000)
    cache = ChunkCache(2 * 4_000)
    with cache.pinned(0, 4_000, partial(store.read_chunk, 0)) as data:
        kept = data[10:20]  # a view outliving the pin (and the chunk's eviction)
        first = _map_of(data)
    del data
    for c in (1, 2, 3):
        with cache.pinned(c, 4_000, partial(store.read_chunk, c)) as data:
            assert _map_of(data) is not first
            assert np.array_equal(data, np.arange(c * 1_000, (c + 1) * 1_000))
    assert np.array_equal(kept, np.arange(10, 20))  # not overwritten
    cache.close()


def test_a_spare_map_unused_by_the_load_is_dropped(tmp_path: Path) -> None:
    # A load of another size, or one that fails, maps anew; the spare is not kept.
    store = make_positional_store(tmp_path / "s", 3_500, 1_000)  # chunk 3: 500 tokens
    cache = ChunkCache(2 * 4_000)
    for c in (0, 1):
        with cache.pinned(c, 4_000, partial(store.read_chunk, c)):
            pass
    with cache.pinned(3, 2_000, partial(store.read_chunk, 3)) as data:
        assert np.array_equal(data, np.arange(3_000, 3_500))
    assert cache._spares == []
    assert memory._given.spare is None

    def broken() -> np.ndarray:
        raise DataLoss("chunk 9 is gone")

    with pytest.raises(DataLoss, match="chunk 9"), cache.pinned(9, 4_000, broken):
        pass
    assert memory._given.spare is None
    cache.close()
