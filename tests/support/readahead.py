"""A stream's bursts against a real cache, every read-ahead let land before the next:
the read-ahead policy checked over a local store (tests/server/test_readahead.py) and
over real object storage (tests/core/test_stores_s3.py)."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import CollectorRegistry

from tokenfeed.core.request import SamplingSpec
from tokenfeed.server import assembly
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Catalog, Dataset
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.service import sampler_for

from support import wait_until
from support.stores import make_positional_store


def benchmark_shaped(
    root: str | Path, name: str, readahead_threads: int
) -> tuple[Dataset, ChunkCache]:
    """The shape of benchmarks/store_sources.py: store `name` of 24 chunks under `root`
    (a local folder or an s3:// prefix), and a cache that holds 18 of them with a
    read-ahead budget of 10."""
    per = 16_384
    make_positional_store(f"{root}/{name}", 24 * per, per)  # type: ignore[arg-type]
    ds = Catalog(root).get(name)
    nbytes = ds.store.chunk_nbytes(0)
    cache = ChunkCache(
        18 * nbytes, readahead_bytes=10 * nbytes, readahead_threads=readahead_threads
    )
    return ds, cache


def drive(ds: Dataset, cache: ChunkCache, spec: SamplingSpec, epochs: int) -> list[int]:
    """Each epoch's bursts, every read-ahead landed before the next: the bursts that
    had to wait for a chunk anyway (their numbers, counted over all epochs)."""
    sampler = sampler_for(spec, ds)
    metrics = ServerMetrics(CollectorRegistry())
    waited, n = [], 0
    for epoch in range(epochs):
        mb = assembly.MessageBuilder(
            ds,
            sampler,
            sampler.rounds(epoch, 0),
            1,
            cache,
            metrics,
            then=sampler.rounds(epoch + 1, 0),
        )
        while True:
            wait_until(lambda: cache.loading == 0, 30, "read-aheads")
            misses = cache.stats.misses
            if not mb.next_burst():
                break
            mb.settle()  # as the feeder's next burst does, right after this one is sent
            n += 1
            if cache.stats.misses > misses:
                waited.append(n)
    return waited
