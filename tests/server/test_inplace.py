"""Rows read in place (server/inplace.py): bursts built on the event loop from the files a
stream keeps open, where the page cache holds the rows, are the bytes a worker thread
builds; a file cut while kept open is DATA_LOSS naming it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tokenfeed.core.errors import DataLoss
from tokenfeed.core.request import SamplingSpec
from tokenfeed.server import inplace
from tokenfeed.server.assembly import MessageBuilder
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Catalog
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.mixtures import MixtureSpace
from tokenfeed.server.service import mixture_sampler_for, sampler_for

from support.stores import make_positional_store


def drive(pipe: MessageBuilder, limit: int = 10**9) -> tuple[list[bytes], float]:
    """The stream's messages as the servicer builds them (each burst tried on the event
    loop first, then on a worker thread), and the share of bursts the first try built."""
    out: list[bytes] = []
    inline = bursts = 0
    while len(out) < limit:
        burst = pipe.next_burst(inline=True)
        inline += bool(burst)
        if not burst:
            burst = pipe.next_burst()
        if not burst:
            break
        bursts += 1
        out += [data for data, _, _, _ in burst]
    return out, inline / max(1, bursts)


def build(
    ds, sampler, rank: int = 0, limit: int = 10**9
) -> tuple[list[bytes], float, MessageBuilder]:
    cache = ChunkCache(1 << 22)
    pipe = MessageBuilder(
        ds, sampler, sampler.rounds(0, rank), 1, cache, ServerMetrics(CollectorRegistry())
    )
    try:
        out, inline = drive(pipe, limit)
    finally:
        pipe.close()
        cache.close()
    return out, inline, pipe


def test_bursts_read_in_place_on_the_event_loop_are_the_bytes_loaded_chunks_give(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of a job of 16 reads its rows in place; once its files are open, its bursts
    are built on the event loop (the files were just written: in the page cache), and
    every message is the one the whole-chunk path builds."""
    make_positional_store(tmp_path / "s", 200_000, 10_000, dtype="uint16")
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(
        dataset="s", seq_len=90, batch_size=2, world_size=16, shuffle=True, seed=3, split_rate=1.0
    )
    sampler = sampler_for(spec, ds)
    in_place, inline, pipe = build(ds, sampler, rank=5)
    assert pipe.files is not None
    monkeypatch.setattr(inplace, "IN_PLACE_WORLD_SIZE", 1 << 40)
    whole, _, pipe = build(ds, sampler, rank=5)
    assert pipe.files is None
    assert len(in_place) > 20
    assert in_place == whole
    if hasattr(os, "RWF_NOWAIT"):
        assert inline >= 0.5  # the bursts whose files the one before opened


def test_a_mixture_counts_by_source_only_the_bursts_it_built(tmp_path: Path) -> None:
    """A burst tried on the event loop and left to a worker thread is counted once: the
    stream's by-source record holds one entry per message built (2 sources x 8 ranks:
    read in place)."""
    names = ["a", "b"]
    for n in names:
        make_positional_store(tmp_path / n, 100_000, 10_000, dtype="uint16")
    catalog = Catalog(tmp_path)
    sources = [catalog.get(n) for n in names]
    spec = SamplingSpec(
        dataset="",
        sources=tuple((n, float(1 + i % 3)) for i, n in enumerate(names)),
        seq_len=90,
        batch_size=4,
        world_size=8,
        shuffle=True,
    )
    sampler = mixture_sampler_for(spec, sources)
    out, inline, pipe = build(MixtureSpace.of(sources), sampler, limit=60)
    assert pipe.files is not None
    assert pipe.by_source is not None
    assert len(pipe.by_source) == len(out) >= 60
    if hasattr(os, "RWF_NOWAIT"):
        assert inline > 0


def test_a_file_cut_while_kept_open_is_data_loss_naming_it(tmp_path: Path) -> None:
    """The stream keeps its chunk file open between bursts; cut after that, the event
    loop's try builds nothing (a read without waiting stops at the file's end) and the
    worker thread's read ends the stream with DATA_LOSS naming the chunk."""
    store = make_positional_store(tmp_path / "s", 20_000, 20_000, dtype="uint16")
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(dataset="s", seq_len=90, batch_size=2, world_size=16, split_rate=1.0)
    sampler = sampler_for(spec, ds)
    cache = ChunkCache(1 << 22)
    pipe = MessageBuilder(
        ds, sampler, sampler.rounds(0, 0), 1, cache, ServerMetrics(CollectorRegistry())
    )
    try:
        assert pipe.files is not None
        assert pipe.next_burst(inline=True) == []  # no file open yet: a worker's burst
        assert pipe.next_burst()
        os.truncate(store.chunk_path(0), 1_000)
        assert pipe.next_burst(inline=True) == []
        with pytest.raises(DataLoss, match=r"chunk(_000000\.bin| 0)"):
            pipe.next_burst()
    finally:
        pipe.close()
        cache.close()
