"""A stream's read-ahead (readahead.ReadaheadPolicy) against the real cache.

`chunk_uses` is checked against a row-by-row count; the policy on its own, one call
at a time, against chunks counted row by row; and by driving a stream's bursts over a
local store whose files are marked remote (the deep look is a remote store's) and
letting every read-ahead land after each burst: then a burst waits for a chunk (a
cache miss) only when the policy asked too late or let a needed chunk go, whatever
the machine's speed. The same over real S3 is in test_stores_s3.py.
"""

from __future__ import annotations

from collections.abc import Hashable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from tokenfeed.core import sampling
from tokenfeed.core.request import SamplingSpec
from tokenfeed.server import assembly, readahead, rounds
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Catalog, Dataset
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.service import sampler_for

from support import wait_until
from support.readahead import benchmark_shaped, drive
from support.stores import make_positional_store

TOKENS, PER_CHUNK = 20_000, 700


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    root = tmp_path_factory.mktemp("readahead")
    make_positional_store(root / "s", TOKENS, PER_CHUNK)
    return Catalog(root).get("s")


def by_rows(ds: Dataset, spans: list[rounds.Span]) -> tuple[list[int], dict[int, int]]:
    """chunk_uses, counted row by row."""
    order: dict[int, None] = {}
    last: dict[int, int] = {}
    base = 0
    for lr, i, j in spans:
        for b in range(i, j):
            for r in range(lr.row_lo[b], lr.row_lo[b + 1]):
                for c in row_chunks(ds, lr, r, lr.cols[b]):
                    order.setdefault(c, None)
                    last[c] = base + b - i
        base += j - i
    return list(order), last


def row_chunks(ds: Dataset, lr: rounds.LocatedRound, r: int, cols: int) -> list[int]:
    """The non-empty chunks row r's tokens lie in, in order."""
    s, bounds = int(lr.starts[r]), ds.store.chunk_starts.tolist()
    return [
        c
        for c in range(len(bounds) - 1)
        if bounds[c] < s + cols and bounds[c + 1] > max(s, bounds[c])
    ]


@given(
    data=st.data(),
    seq_len=st.sampled_from([16, 300, 900, 1500]),  # rows within one chunk .. over three
    rows=st.integers(1, 5),
)
def test_chunk_uses_counts_like_rows_one_by_one(
    small: Dataset, data: st.DataObject, seq_len: int, rows: int
) -> None:
    spans: list[rounds.Span] = []
    for _ in range(data.draw(st.integers(1, 3))):
        batches = data.draw(st.integers(1, 6))
        starts = np.array(
            data.draw(
                st.lists(
                    st.lists(st.integers(0, TOKENS - seq_len - 2), min_size=rows, max_size=rows),
                    min_size=batches,
                    max_size=batches,
                )
            ),
            dtype=np.int64,
        )
        rnd = sampling.Round(0, 0, list(range(batches)), [1] * batches, [rows] * batches, starts)
        lr = rounds.LocatedRound(small, rnd, seq_len)
        i = data.draw(st.integers(0, batches - 1))
        spans.append((lr, i, data.draw(st.integers(i + 1, batches))))
    assert readahead.chunk_uses(spans) == by_rows(small, spans)


def test_a_remote_stream_never_waits_once_its_read_aheads_land(tmp_path: Path) -> None:
    """The store is 24 chunks, the cache holds 18 and the read-ahead budget 10 (the
    shape of benchmarks/store_sources.py): every chunk of a shuffle group and the next
    is asked for while the stream can still use it, and none it needs soon is evicted
    (before: a first use at a group's start evicted the next group's chunks, a cooled
    chunk was a block of the next group, a chunk left out for want of room waited 8
    bursts to be asked again: 5 of the 1150 bursts of 3 epochs waited)."""
    ds, cache = benchmark_shaped(tmp_path, "s", readahead_threads=4)
    ds.store.files.remote = True  # taken for object storage's: the deep look is theirs
    assert ds.store.remote
    try:
        spec = SamplingSpec(dataset="s", seq_len=64, batch_size=4, shuffle=True, seed=1)
        assert drive(ds, cache, spec, epochs=3) == []
        assert cache.stats.ahead_used > 0
        assert cache.stats.evictions > 0
    finally:
        cache.close()


def test_every_deep_look_ranks_the_cached_chunks_it_saw_by_their_first_use(
    tmp_path: Path,
) -> None:
    """Right after a remote stream's deep look, the chunks it saw that are cached stand
    in the cache's eviction order by when the look needs them first: the farthest goes
    first, the nearest last, a chunk asked for a few bursts ago (the stream asks less
    often than it looks) included (before: such a chunk kept its older place, colder
    than chunks needed after it, and was evicted and loaded again shortly before use)."""
    ds, cache = benchmark_shaped(tmp_path, "s", readahead_threads=4)
    ds.store.files.remote = True
    spec = SamplingSpec(dataset="s", seq_len=64, batch_size=4, shuffle=True, seed=1)
    sampler = sampler_for(spec, ds)
    metrics = ServerMetrics(CollectorRegistry())
    looks = 0
    try:
        for epoch in range(2):
            mb = assembly.MessageBuilder(
                ds,
                sampler,
                sampler.rounds(epoch, 0),
                1,
                cache,
                metrics,
                then=sampler.rounds(epoch + 1, 0),
            )
            look = mb.readahead.look
            while True:
                wait_until(lambda: cache.loading == 0, 30, "read-aheads")
                if not mb.next_burst():
                    break
                mb.settle()
                if mb.readahead.look is look:
                    continue
                look = mb.readahead.look
                rank = {ds.chunk_key(c): i for i, c in enumerate(look)}
                cached = [k for k in cache.eviction_order() if k in rank]
                assert cached == sorted(cached, key=lambda k: -rank[k])
                looks += 1
        assert looks > 10
    finally:
        cache.close()


class _Recording(ChunkCache):
    """The real cache, recording the keys every readahead_all call asks for, and the
    order it is asked to warm by."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asks: list[list[Hashable]] = []
        self.warms: list[list[Hashable] | None] = []

    def readahead_all(
        self, wanted: list[tuple[Hashable, int, Any]], warm: list[Hashable] | None = None
    ) -> list[Hashable]:
        self.asks.append([w[0] for w in wanted])
        self.warms.append(warm)
        return super().readahead_all(wanted, warm)


@pytest.mark.parametrize("per_message", [1, 3])
def test_a_quiet_readahead_asks_what_the_whole_loop_asks(small: Dataset, per_message: int) -> None:
    """A read-ahead of the same chunks as the last one, before any of them is due to be
    asked for again, returns early (ReadaheadPolicy._quiet): every burst must ask the
    cache for exactly what the whole per-chunk loop asks (forced by forgetting
    `_quiet` before each burst), and the caches must end alike. The cache holds 14 of
    the 29 chunks, so chunks are evicted and asked for again as the stream goes on."""
    spec = SamplingSpec(dataset="s", seq_len=16, batch_size=8, shuffle=True, seed=3)
    sampler = sampler_for(spec, small)
    metrics = ServerMetrics(CollectorRegistry())
    runs, quiet = [], 0
    for forget in (False, True):
        cache = _Recording(14 * small.store.chunk_nbytes(0))
        mb = assembly.MessageBuilder(
            small, sampler, sampler.rounds(0, 0), per_message, cache, metrics
        )
        per_burst = []
        try:
            while True:
                wait_until(lambda: cache.loading == 0, 30, "read-aheads")  # noqa: B023
                if forget:
                    mb.readahead._quiet = None
                before, last = len(cache.asks), mb.readahead._quiet
                if not mb.next_burst():
                    break
                mb.settle()  # the first burst's read-ahead, before the loads are awaited
                quiet += mb.readahead._quiet is last and not forget  # this burst's returned early
                per_burst.append([k for ask in cache.asks[before:] for k in ask])
        finally:
            cache.close()
        s = cache.stats
        runs.append((per_burst, (s.hits, s.misses, s.loads, s.evictions, s.readaheads)))
    assert runs[0] == runs[1]
    assert quiet > 0
    assert runs[0][1][3] > 0


# ------------------------------------------------------------ the policy on its own


def test_a_deep_look_covers_two_groups_past_the_near_batches_within_its_bounds() -> None:
    assert readahead.deep_batches(0, 8) == readahead.DEEP_BATCHES  # a mixture: no groups
    assert readahead.deep_batches(600, 8) == 2 * 600 + 8
    assert readahead.deep_batches(10**6, 8) == readahead.MAX_DEEP_BATCHES


def keys(ds: Dataset, chunks: list[int]) -> list[Hashable]:
    return [ds.chunk_key(c) for c in chunks]


def policy_over(
    ds: Dataset, spec: SamplingSpec, cache: ChunkCache, then: bool = False
) -> tuple[rounds.RoundQueue, readahead.ReadaheadPolicy]:
    """A stream's round queue at the start of epoch 0 and its read-ahead policy (a
    burst of 4 batches), no message builder around them."""
    sampler = sampler_for(spec, ds)
    queue = rounds.RoundQueue(ds, sampler.rounds(0, 0), sampler.seq_len)
    policy = readahead.ReadaheadPolicy(
        ds, sampler, queue, cache, 4, sampler.rounds(1, 0) if then else None
    )
    return queue, policy


def load(cache: ChunkCache, ds: Dataset, chunks: list[int]) -> None:
    """Load `chunks` into the cache, in this order (the last ends warmest)."""
    for c in chunks:
        nbytes = ds.store.chunk_nbytes(c)
        with cache.pinned(ds.chunk_key(c), nbytes, lambda c=c: ds.store.read_chunk(c)):
            pass


@pytest.mark.parametrize("shuffle", [True, False])
def test_the_near_look_asks_for_the_next_batches_chunks(small: Dataset, shuffle: bool) -> None:
    """At the start: the chunks of the first `batches` batches, nearest first; in
    window order the chunk after them too (a stream reads the store front to back)."""
    cache = _Recording(64 * small.store.chunk_nbytes(0))
    spec = SamplingSpec(dataset="s", seq_len=300, batch_size=4, shuffle=shuffle, seed=2)
    queue, policy = policy_over(small, spec, cache)
    try:
        policy.look_ahead()
        near = sorted(set(by_rows(small, queue.spans(policy.batches, queue.start)[0])[0]))
        want = near if shuffle else [*near, max(near) + 1]
        assert cache.asks == [keys(small, want)]
        assert cache.warms == [None]
        assert policy.batches == readahead.READAHEAD_BATCHES
    finally:
        cache.close()


@pytest.mark.parametrize("budget", [0, 16])
def test_a_chunk_asked_for_is_asked_again_after_ask_again_calls_or_at_each_with_a_budget(
    small: Dataset, budget: int
) -> None:
    """Without a read-ahead budget the same near chunks are asked for once per
    ASK_AGAIN calls (in between, the cached or loading chunks are left alone); with
    one, at every call (nothing is evicted for them, and a chunk evicted since loads)."""
    nbytes = small.store.chunk_nbytes(0)
    cache = _Recording(64 * nbytes, readahead_bytes=budget * nbytes)
    spec = SamplingSpec(dataset="s", seq_len=16, batch_size=4, shuffle=True, seed=2)
    _, policy = policy_over(small, spec, cache)
    try:
        for _ in range(readahead.ASK_AGAIN + 1):
            policy.look_ahead()
            wait_until(lambda: cache.loading == 0, 30, "read-aheads")
        calls = readahead.ASK_AGAIN + 1 if budget else 2
        assert len(cache.asks) == calls
        assert cache.asks == [cache.asks[0]] * calls
        assert cache.asks[0]
        assert cache.stats.readaheads == len(cache.asks[0])
    finally:
        cache.close()


def test_chunks_left_out_for_want_of_room_are_asked_again_at_the_next_call(
    small: Dataset,
) -> None:
    """A cache full of pinned chunks leaves every near chunk out; once the pins go, the
    next call asks for them again (not ASK_AGAIN calls later) and they load."""
    cache = _Recording(3 * small.store.chunk_nbytes(0))
    spec = SamplingSpec(dataset="s", seq_len=16, batch_size=4, shuffle=False)
    _, policy = policy_over(small, spec, cache)
    far = [small.store.num_chunks - c for c in (1, 2, 3)]  # not the stream's first chunks
    try:
        load(cache, small, far)
        entries = cache.pin_resident(keys(small, far))
        assert entries is not None
        policy.look_ahead()
        assert cache.asks
        assert cache.stats.readaheads == 0
        cache.release_all(entries)
        policy.look_ahead()
        wait_until(lambda: cache.loading == 0, 30, "read-aheads")
        assert cache.asks == [cache.asks[0]] * 2
        assert all(k in cache for k in cache.asks[0])
    finally:
        cache.close()


def test_a_used_chunk_the_next_batches_do_not_need_goes_to_the_cold_end(small: Dataset) -> None:
    """Of the chunks a burst used, those the next batches need are warmed by the ask
    and the others cooled: first in the eviction order (the chunks read ahead wait in
    the budget, outside that order)."""
    nbytes = small.store.chunk_nbytes(0)
    cache = _Recording(64 * nbytes, readahead_bytes=16 * nbytes)
    spec = SamplingSpec(dataset="s", seq_len=16, batch_size=4, shuffle=False)
    queue, policy = policy_over(small, spec, cache)
    try:
        near = set(by_rows(small, queue.spans(policy.batches, queue.start)[0])[0])
        first, past, other = min(near), small.store.num_chunks - 1, small.store.num_chunks - 2
        assert past not in near
        assert other not in near
        load(cache, small, [first, other, past])  # coldest first: first, other, past
        policy.look_ahead(0, used={first, past})
        order = cache.eviction_order()
        assert order[0] == small.chunk_key(past)
        assert order.index(small.chunk_key(other)) < order.index(small.chunk_key(first))
    finally:
        cache.close()


def test_a_deep_look_at_an_epochs_end_reaches_into_the_next_epoch(tmp_path: Path) -> None:
    """A remote stream 5 batches before its epoch's end: the deep look sees those 5
    batches' chunks and then the next epoch's first batches', in order of first use,
    and the cache is asked to warm by that order."""
    ds, shaped = benchmark_shaped(tmp_path, "s", readahead_threads=2)
    shaped.close()
    ds.store.files.remote = True
    spec = SamplingSpec(dataset="s", seq_len=64, batch_size=4, shuffle=True, seed=1)
    sampler = sampler_for(spec, ds)
    cache = _Recording(shaped.capacity, readahead_bytes=shaped.readahead_capacity)
    queue, policy = policy_over(ds, spec, cache, then=True)
    try:
        total = sum(j - i for _, i, j in queue.spans(10**9, queue.start)[0])
        moved = queue.advance(queue.spans(total - 5, queue.start)[1])
        assert moved == total - 5
        policy.look_ahead(moved)  # the first call: a deep look
        tail = queue.spans(policy.deep, queue.start)[0]
        assert sum(j - i for _, i, j in tail) == 5
        then = rounds.RoundQueue(ds, sampler.rounds(1, 0), sampler.seq_len)
        head = then.spans(policy.deep - 5, then.start)[0]
        want = by_rows(ds, tail + head)[0]
        assert policy.look == want
        assert cache.warms == [keys(ds, want)]
        assert set(want) > set(by_rows(ds, tail)[0])  # the next epoch adds chunks
    finally:
        cache.close()


def test_chunk_heads_are_looked_for_only_when_a_near_chunk_is_missing(
    small: Dataset, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Finding the chunks a shuffled stream needs only the head of (rounds.spans_heads)
    costs more than a burst of cached chunks: the near look does it only when one of
    its chunks is not in the cache, the only time it changes what is asked for."""
    calls: list[int] = []

    def counted(*args: Any) -> dict[int, int]:
        calls.append(1)
        return rounds.spans_heads(*args)

    monkeypatch.setattr(readahead, "spans_heads", counted)
    cache = ChunkCache(64 * small.store.chunk_nbytes(0))
    spec = SamplingSpec(dataset="s", seq_len=300, batch_size=4, shuffle=True, seed=2)
    queue, policy = policy_over(small, spec, cache)
    try:
        near = sorted(set(by_rows(small, queue.spans(policy.batches, queue.start)[0])[0]))
        load(cache, small, near[1:])
        policy.look_ahead()  # one near chunk missing
        assert calls == [1]
        load(cache, small, near[:1])
        policy.look_ahead()  # every near chunk cached
        assert calls == [1]
    finally:
        cache.close()
