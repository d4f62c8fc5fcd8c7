"""A stream's read-ahead (assembly.MessageBuilder._read_ahead) against the real cache.

`chunk_uses` is checked against a row-by-row count; the policy by driving a stream's
bursts over a local store whose files are marked remote (the deep look is a remote
store's) and letting every read-ahead land after each burst: then a burst waits for
a chunk (a cache miss) only when the policy asked too late or let a needed chunk go,
whatever the machine's speed. The same over real S3 is in test_stores_s3.py.
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
from tokenfeed.server import assembly
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Catalog, Dataset
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.service import plan_for

from support import wait_until
from support.readahead import benchmark_shaped, drive
from support.stores import make_positional_store

TOKENS, PER_CHUNK = 20_000, 700


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Dataset:
    root = tmp_path_factory.mktemp("readahead")
    make_positional_store(root / "s", TOKENS, PER_CHUNK)
    return Catalog(root).get("s")


def by_rows(ds: Dataset, spans: list[assembly.Span]) -> tuple[list[int], dict[int, int]]:
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


def row_chunks(ds: Dataset, lr: assembly.LocatedRound, r: int, cols: int) -> list[int]:
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
    spans: list[assembly.Span] = []
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
        lr = assembly.LocatedRound(small, rnd, seq_len)
        i = data.draw(st.integers(0, batches - 1))
        spans.append((lr, i, data.draw(st.integers(i + 1, batches))))
    assert assembly.chunk_uses(spans) == by_rows(small, spans)


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
        assert cache.stats.ahead_used > 0 and cache.stats.evictions > 0
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
    plan = plan_for(spec, ds)
    metrics = ServerMetrics(CollectorRegistry())
    looks = 0
    try:
        for epoch in range(2):
            mb = assembly.MessageBuilder(
                ds, plan, plan.rounds(epoch, 0), 1, cache, metrics, then=plan.rounds(epoch + 1, 0)
            )
            look = mb._look
            while True:
                wait_until(lambda: cache.loading == 0, 30, "read-aheads")
                if not mb.next_burst():
                    break
                if mb._look is look:
                    continue
                look = mb._look
                rank = {ds.chunk_key(c): i for i, c in enumerate(look)}
                cached = [k for k in cache.eviction_order() if k in rank]
                assert cached == sorted(cached, key=lambda k: -rank[k])
                looks += 1
        assert looks > 10
    finally:
        cache.close()


class _Recording(ChunkCache):
    """The real cache, recording the keys every read_ahead_all call asks for."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.asks: list[list[Hashable]] = []

    def read_ahead_all(
        self, wanted: list[tuple[Hashable, int, Any]], warm: list[Hashable] | None = None
    ) -> list[Hashable]:
        self.asks.append([w[0] for w in wanted])
        return super().read_ahead_all(wanted, warm)


@pytest.mark.parametrize("per_message", [1, 3])
def test_a_quiet_read_ahead_asks_what_the_whole_loop_asks(small: Dataset, per_message: int) -> None:
    """A read-ahead of the same chunks as the last one, before any of them is due to be
    asked for again, returns early (MessageBuilder._quiet): every burst must ask the
    cache for exactly what the whole per-chunk loop asks (forced by forgetting
    `_quiet` before each burst), and the caches must end alike. The cache holds 14 of
    the 29 chunks, so chunks are evicted and asked for again as the stream goes on."""
    spec = SamplingSpec(dataset="s", seq_len=16, batch_size=8, shuffle=True, seed=3)
    plan = plan_for(spec, small)
    metrics = ServerMetrics(CollectorRegistry())
    runs, quiet = [], 0
    for forget in (False, True):
        cache = _Recording(14 * small.store.chunk_nbytes(0))
        mb = assembly.MessageBuilder(small, plan, plan.rounds(0, 0), per_message, cache, metrics)
        per_burst = []
        try:
            while True:
                wait_until(lambda: cache.loading == 0, 30, "read-aheads")  # noqa: B023
                if forget:
                    mb._quiet = None
                before, last = len(cache.asks), mb._quiet
                if not mb.next_burst():
                    break
                quiet += mb._quiet is last and not forget  # this burst's returned early
                per_burst.append([k for ask in cache.asks[before:] for k in ask])
        finally:
            cache.close()
        s = cache.stats
        runs.append((per_burst, (s.hits, s.misses, s.loads, s.evictions, s.read_aheads)))
    assert runs[0] == runs[1]
    assert quiet > 0 and runs[0][1][3] > 0  # some returned early; chunks were evicted
