"""Rows read in place (server/inplace.py): bursts built on the event loop from the files a
stream keeps open, where the page cache holds the rows, are the bytes a worker thread
builds; a file cut while kept open is DATA_LOSS naming it."""

from __future__ import annotations

import os
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tokenfeed.core import native
from tokenfeed.core.errors import DataLoss
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import DatasetSampler
from tokenfeed.server import assembly, descriptors, inplace, rounds, service
from tokenfeed.server.assembly import MessageBuilder
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Catalog, Dataset
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.mixtures import MixtureSpace
from tokenfeed.server.service import mixture_sampler_for, sampler_for
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import wait_until
from support.feeders import feeder_params, running_feeder
from support.stores import make_positional_store


def _job_of_16(tmp_path: Path, tokens: int) -> tuple[Dataset, DatasetSampler]:
    """A uint16 store of `tokens` in chunks of 10,000 and the sampler of a shuffled job
    of 16 ranks over it (a rank of it reads in place)."""
    make_positional_store(tmp_path / "s", tokens, 10_000, dtype="uint16")
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(
        dataset="s", seq_len=90, batch_size=2, world_size=16, shuffle=True, seed=3, split_rate=1.0
    )
    return ds, sampler_for(spec, ds)


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
    ds, sampler = _job_of_16(tmp_path, 200_000)
    in_place, inline, pipe = build(ds, sampler, rank=5)
    assert pipe.files is not None
    monkeypatch.setattr(inplace, "IN_PLACE_WORLD_SIZE", 1 << 40)
    whole, _, pipe = build(ds, sampler, rank=5)
    assert pipe.files is None
    assert len(in_place) > 20
    assert in_place == whole
    if hasattr(os, "RWF_NOWAIT"):
        assert inline >= 0.5  # the bursts whose files the one before opened


def test_a_stream_reading_in_place_grows_its_bursts_within_the_byte_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Bursts of a stream reading in place: one message, then BURST_MESSAGES doubling to
    IN_PLACE_BURST_MESSAGES, fewer where BURST_BYTES binds; a stream loading whole
    chunks keeps BURST_MESSAGES. Either way every message is the same."""
    ds, sampler = _job_of_16(tmp_path, 400_000)

    def sizes(pipe: MessageBuilder) -> tuple[list[int], list[bytes]]:
        got: list[int] = []
        out: list[bytes] = []
        try:
            while burst := pipe.next_burst():
                got.append(len(burst))
                out += [data for data, _, _, _ in burst]
        finally:
            pipe.close()
            pipe.cache.close()
        return got, out

    def pipe(per_message: int = 1) -> MessageBuilder:
        return MessageBuilder(
            ds,
            sampler,
            sampler.rounds(0, 5),
            per_message,
            ChunkCache(1 << 22),
            ServerMetrics(CollectorRegistry()),
        )

    grown, in_place = sizes(pipe())
    assert grown[:6] == [1, 4, 8, 16, 16, 16]
    assert max(grown) == assembly.IN_PLACE_BURST_MESSAGES
    # messages of 4 batches of 2 x 91 tokens, 1,456 bytes: BURST_BYTES allows 5 a burst
    monkeypatch.setattr(assembly, "BURST_BYTES", 5 * 1_456)
    assert sizes(pipe(per_message=4))[0][:4] == [1, 4, 5, 5]
    monkeypatch.setattr(inplace, "IN_PLACE_WORLD_SIZE", 1 << 40)
    kept, whole = sizes(pipe())
    assert kept[:4] == [1, 4, 4, 4]
    assert whole == in_place


def test_a_paced_stream_reading_in_place_goes_back_to_small_bursts(tmp_path: Path) -> None:
    """A burst that waited to be written (`paced`): the next is BURST_MESSAGES, and the
    bursts grow again from there while none waits."""
    ds, sampler = _job_of_16(tmp_path, 400_000)
    cache = ChunkCache(1 << 22)
    metrics = ServerMetrics(CollectorRegistry())
    pipe = MessageBuilder(ds, sampler, sampler.rounds(0, 5), 1, cache, metrics)
    sizes: list[int] = []
    try:
        while len(sizes) < 8 and (burst := pipe.next_burst()):
            sizes.append(len(burst))
            if len(sizes) in (4, 5):  # the 4th and the 5th waited for their reader
                pipe.paced()
    finally:
        pipe.close()
        cache.close()
    assert sizes == [1, 4, 8, 16, 4, 4, 8, 16]


@pytest.mark.parametrize("waits", [False, True])
def test_the_feeder_keeps_the_bursts_of_a_stream_whose_writes_wait_small(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waits: bool
) -> None:
    """On a feeder, a stream reading in place whose bursts take PACED_SECONDS or more to
    write (its client reads slower than they come) sends bursts of BURST_MESSAGES; one
    whose writes never take that long grows them. (PACED_SECONDS 0 stands for a client
    whose every burst waits, a huge one for a client that never makes one wait.) The
    feeder times each burst it builds: the count of its build-time histogram."""
    make_positional_store(tmp_path / "s", 400_000, 10_000, dtype="uint16")
    monkeypatch.setattr(service, "PACED_SECONDS", 0.0 if waits else 1e9)
    p = feeder_params(
        dataset="s", seq_len=90, batch_size=2, world_size=16, shuffle=True, seed=3, split_rate=1.0
    )
    with running_feeder(tmp_path) as f, grpc.insecure_channel(f.address) as ch:
        call = pb_grpc.FeederStub(ch).StreamBatches(pb.StreamBatchesRequest(params=p, rank=5))
        batches = sum(len(m.batches) for m in call)  # the rank's whole epoch
        bursts = f.registry.get_sample_value("tokenfeed_batch_build_seconds_count")
    assert batches > 100
    if waits:  # 1, then 4 at a time
        assert bursts >= 1 + (batches - 1) / assembly.BURST_MESSAGES
    else:  # 1, 4, 8, then 16 at a time
        assert bursts < batches / 8


def test_a_streams_first_burst_opens_only_its_own_files(tmp_path: Path) -> None:
    """A stream's first batch waits for its own rows only: the files of the bursts
    ahead are opened after its next burst built on a worker thread, not before the
    first batch goes out (a storm of starts would open them for every rank first)."""
    ds, sampler = _job_of_16(tmp_path, 400_000)
    pool = inplace.FilePool()
    cache = ChunkCache(1 << 22)
    pipe = MessageBuilder(
        ds, sampler, sampler.rounds(0, 5), 1, cache, ServerMetrics(CollectorRegistry()), files=pool
    )
    try:
        assert len(pipe.next_burst()) == 1
        own = len(pool)
        assert 1 <= own <= 2 * sampler.spec.batch_size  # a row crossing chunks reads two files
        assert len(pipe.next_burst()) == assembly.BURST_MESSAGES
        assert len(pool) > 2 * own  # the next bursts' files, opened ahead
    finally:
        pipe.close()
        cache.close()


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


def _open_under(root: Path) -> list[str]:
    """What this process's descriptors have open under `root`. Only those: a test's
    other descriptors come and go meanwhile (a collected object's, a thread's), and a
    number closed and opened again would make a set of numbers lie."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (or the listing's own descriptor)
            continue
        if target.startswith(f"{root}/"):
            out.append(target)
    return sorted(out)


def _open_counter(tmp_path: Path, n: int) -> tuple[list[Path], Callable[[list[Path]], object]]:
    """`n` files, and an opener for FilePool keyed by path index (fd, 0, size, ...)."""
    paths = []
    for i in range(n):
        path = tmp_path / f"f{i}"
        path.write_bytes(bytes([i]) * 10)
        paths.append(path)

    def opened(path: Path) -> inplace.Opened:
        fd = os.open(path, os.O_RDONLY)
        st = os.fstat(fd)
        return fd, 0, 10, str(path), (st.st_dev, st.st_ino, st.st_size)

    return paths, lambda keys: lambda at: [opened(paths[keys[i]]) for i in at]


def test_the_pool_keeps_its_bound_and_closes_least_recently_taken_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Capacity KEEP_FILES per attached stream (at least POOL_FILES); a file a burst
    holds is never closed; beyond the bound the least recently taken go first; with no
    stream attached nothing stays open."""
    monkeypatch.setattr(inplace, "POOL_FILES", 4)
    monkeypatch.setattr(inplace, "KEEP_FILES", 3)
    _, opener = _open_counter(tmp_path, 12)
    pool = inplace.FilePool()
    assert pool.capacity == 0
    pool.attach()
    assert pool.capacity == 4  # the floor
    for k in range(6):
        table = pool.take([k], opener([k]))
        assert table is not None
        assert os.pread(int(table[0, 0]), 1, 0) == bytes([k])
        pool.give_back([k])
    assert len(pool) == 4
    assert pool.take([0], None) is None  # closed: least recently taken
    held = pool.take([2, 3], None)  # open still: held by a "burst"
    assert held is not None
    pool.open([6, 7, 8, 9], opener([6, 7, 8, 9]))  # read-ahead of opens, then trimmed
    assert len(pool) == 4
    assert pool.take([2, 3], None) is not None  # held ones survive any trim
    pool.give_back([2, 3])
    pool.attach()
    pool.attach()  # three streams: 9 files
    assert pool.capacity == 9
    pool.open(list(range(12)), opener(list(range(12))))
    assert len(pool) == 9
    pool.detach()
    pool.detach()
    assert len(pool) == 4  # back to the floor
    assert pool.take([2, 3], None) is not None  # still open: held since `held`
    pool.give_back([2, 3])
    pool.give_back([2, 3])  # `held`'s
    pool.detach()
    assert len(pool) == 0
    assert _open_under(tmp_path) == []


def test_a_failed_open_holds_nothing(tmp_path: Path) -> None:
    _, opener = _open_counter(tmp_path, 3)
    pool = inplace.FilePool()
    pool.attach()

    def failing(at: list[int]) -> list[inplace.Opened | DataLoss]:
        opened = opener([0, 1, 2])([i for i in at if i != 2])  # type: ignore[operator]
        return [*opened, DataLoss("s: chunk chunk_000002.bin is missing")]

    with pytest.raises(DataLoss, match="chunk_000002"):
        pool.take([0, 1, 2], failing)
    assert pool.take([0, 1], None) is not None  # opened with it, kept: held by none
    pool.give_back([0, 1])
    pool.detach()
    assert len(pool) == 0  # given back, then closed


def test_a_bursts_chunk_files_are_opened_in_one_call_with_one_stat_each(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lone rank of a large job opens about a chunk file per batch: a burst's files are
    opened in one call (the GIL let go once, descriptors.py), each with the one fstat
    that checks its size and gives the identity the pool keeps it by (`_same`)."""
    ds, _ = _job_of_16(tmp_path, 200_000)
    calls: list[list[str]] = []
    stats: list[int] = []
    open_files, fstat = descriptors.open_files, os.fstat

    def counted_open(paths: list[str], advise_random: bool = False) -> list[descriptors.Opened]:
        calls.append(list(paths))
        return open_files(paths, advise_random)

    def counted_stat(fd: int) -> os.stat_result:
        stats.append(fd)
        return fstat(fd)

    monkeypatch.setattr(descriptors, "open_files", counted_open)
    monkeypatch.setattr(os, "fstat", counted_stat)
    pool = inplace.FilePool()
    files = inplace.ChunkFiles(ds, pool)
    chunks = list(range(ds.store.num_chunks))
    assert len(chunks) > 1
    with native.disabled():  # the reference, whose system calls Python sees
        files.ahead(chunks)
    held = files.kept(chunks)
    assert held is not None
    assert [len(c) for c in calls] == [len(chunks)]
    assert len(stats) == len(chunks) == len(set(held.fds.tolist()))
    held.release()
    files.close()
    assert _open_under(tmp_path) == []


def test_streams_share_the_pools_files_and_leave_none_open(tmp_path: Path) -> None:
    """Two ranks of a job of 16 on one feeder's pool: the second opens no file the first
    has open, both read the bytes the whole-chunk path builds, and once both end no
    descriptor is left."""
    ds, sampler = _job_of_16(tmp_path, 200_000)
    pool = inplace.FilePool()
    cache = ChunkCache(1 << 22)
    pipes = [
        MessageBuilder(
            ds,
            sampler,
            sampler.rounds(0, r),
            1,
            cache,
            ServerMetrics(CollectorRegistry()),
            files=pool,
        )
        for r in (3, 4)
    ]
    out = [drive(p)[0] for p in pipes]
    opened = len(pool)
    assert 0 < opened <= ds.store.num_chunks  # each chunk's file once, for both ranks
    assert len(_open_under(tmp_path)) == opened
    for p in pipes:
        p.close()
    cache.close()
    assert len(pool) == 0
    assert _open_under(tmp_path) == []
    for r, got in zip((3, 4), out, strict=True):
        assert got == build(ds, sampler, rank=r)[0]


def test_a_pooled_file_cut_is_data_loss_naming_it_for_the_next_stream(tmp_path: Path) -> None:
    """A chunk file cut while the pool holds it open: a later stream reading it ends
    with DATA_LOSS naming the chunk, as it would opening it."""
    store = make_positional_store(tmp_path / "s", 20_000, 20_000, dtype="uint16")
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(dataset="s", seq_len=90, batch_size=2, world_size=16, split_rate=1.0)
    sampler = sampler_for(spec, ds)
    pool = inplace.FilePool()
    cache = ChunkCache(1 << 22)

    def pipe(rank: int) -> MessageBuilder:
        metrics = ServerMetrics(CollectorRegistry())
        return MessageBuilder(ds, sampler, sampler.rounds(0, rank), 1, cache, metrics, files=pool)

    first = pipe(0)
    assert first.next_burst()  # opens chunk 0's file into the pool
    os.truncate(store.chunk_path(0), 1_000)
    second = pipe(1)
    try:
        with pytest.raises(DataLoss, match=r"chunk(_000000\.bin| 0)"):
            drive(second)
    finally:
        first.close()
        second.close()
        cache.close()


def test_the_last_stream_leaves_pool_files_open_for_keep_seconds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With keep_seconds, the last stream's end keeps POOL_FILES files: a stream within
    that time takes them without opening any (each checked to be the same file first,
    so never on the event loop's try), and once it has passed they are closed."""
    monkeypatch.setattr(inplace, "POOL_FILES", 4)
    monkeypatch.setattr(inplace, "KEEP_FILES", 3)
    _, opener = _open_counter(tmp_path, 8)
    opens: list[int] = []

    def counted(keys: list[int]) -> inplace.OpenFiles:
        def open_files(at: list[int]) -> list[inplace.Opened | DataLoss]:
            opens.extend(keys[i] for i in at)
            return opener(keys)(at)  # type: ignore[operator,no-any-return]

        return open_files

    now = [0.0]
    pool = inplace.FilePool(keep_seconds=30, clock=lambda: now[0])
    assert pool.expire() is None
    pool.attach()
    pool.attach()
    pool.open(list(range(6)), counted(list(range(6))))
    assert len(pool) == 6
    pool.detach()
    assert len(pool) == 4  # the floor for one stream
    pool.detach()
    assert len(pool) == 4  # the floor still, kept for no stream
    now[0] = 10.0
    assert pool.expire() == 20.0
    assert len(pool) == 4
    pool.attach()
    assert pool.take([4, 5], None) is None  # kept for no stream: checked off the loop only
    opens.clear()
    table = pool.take([4, 5], counted([4, 5]))
    assert table is not None
    assert opens == []
    assert [os.pread(int(fd), 1, 0) for fd in table[:, 0]] == [b"\x04", b"\x05"]
    assert pool.take([4, 5], None) is not None  # checked while a stream reads: as it is
    pool.give_back([4, 5])
    pool.give_back([4, 5])
    pool.detach()
    assert pool.expire() == 30.0  # the time starts again at the last stream's end
    now[0] = 40.0
    assert pool.expire() is None
    assert len(pool) == 0
    assert _open_under(tmp_path) == []


def _replace(path: Path, data: bytes) -> None:
    new = path.with_name(path.name + ".new")
    new.write_bytes(data)
    os.replace(new, path)


@pytest.mark.parametrize("change", ["replaced", "cut", "removed"])
def test_a_file_changed_while_kept_for_no_stream_is_what_an_open_finds(
    tmp_path: Path, change: str
) -> None:
    """A chunk file replaced, cut or removed while the feeder's pool keeps it open for
    no stream: the next stream reads the new file (the rows a fresh pool reads), or
    ends with DATA_LOSS naming the chunk, as if the pool had closed it."""
    store = make_positional_store(tmp_path / "s", 20_000, 20_000, dtype="uint16")
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(dataset="s", seq_len=90, batch_size=2, world_size=16, split_rate=1.0)
    sampler = sampler_for(spec, ds)
    pool = inplace.FilePool(keep_seconds=30)
    cache = ChunkCache(1 << 22)

    def stream() -> list[bytes]:
        metrics = ServerMetrics(CollectorRegistry())
        pipe = MessageBuilder(ds, sampler, sampler.rounds(0, 0), 1, cache, metrics, files=pool)
        try:
            return drive(pipe, 20)[0]
        finally:
            pipe.close()

    try:
        first = stream()
        assert len(pool) == 1  # chunk 0's file, kept for no stream
        path = store.chunk_path(0)
        if change == "replaced":  # the same size, other tokens
            tokens = np.frombuffer(path.read_bytes(), "<u2") + 7
            _replace(path, tokens.astype("<u2").tobytes())
            second = stream()
            assert second != first
            assert second == build(ds, sampler, limit=20)[0]  # what opening it reads
        else:
            if change == "cut":
                os.truncate(path, 1_000)
            else:
                path.unlink()
            with pytest.raises(DataLoss, match=r"chunk(_000000\.bin| 0)"):
                stream()
    finally:
        pool.close()
        cache.close()
    assert _open_under(tmp_path) == []


def test_a_feeder_keeps_a_mixtures_files_between_streams_then_closes_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a real feeder: a mixture of 20 sources read in place leaves its files open
    when its stream ends; the next stream (another rank) reads them, opening none; the
    feeder closes them once no stream has read in place for KEEP_SECONDS."""
    monkeypatch.setattr(service, "KEEP_SECONDS", 0.5)
    names = [f"s{i}" for i in range(20)]
    for name in names:
        make_positional_store(tmp_path / name, 3_000, 1_000, dtype="uint16")
    params = pb.SamplingParams(dataset="", seq_len=16, stride=16, batch_size=4, world_size=2)
    for name in names:
        params.sources.add(name=name, weight=1.0)
    with running_feeder(tmp_path) as f, grpc.insecure_channel(f.address) as channel:
        stub = pb_grpc.FeederStub(channel)
        pool = f.server.service.files

        def stream(rank: int) -> int:
            request = pb.StreamBatchesRequest(params=params, rank=rank)
            return sum(len(m.batches) for m in islice(stub.StreamBatches(request), 30))

        assert stream(0) == 30
        wait_until(lambda: f.server.service.active_streams == 0, 10, "the stream's end")
        kept = len(pool)
        assert kept >= 20  # a file of each source at least
        assert len(_open_under(tmp_path)) >= kept
        rows = dict(pool._files)  # a file closed and opened again would be a new row
        assert stream(1) == 30
        assert all(pool._files.get(key) is row for key, row in rows.items())
        wait_until(lambda: len(pool) == 0, 10, "the kept files closed")


def test_a_small_job_reads_the_head_a_row_crosses_into_instead_of_loading_the_chunk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block's last windows run a token past its chunk: a stream loading whole chunks
    reads that head from the next chunk's file instead of loading it: through a cache
    smaller than the store it loads fewer chunks, and sends the same bytes."""
    make_positional_store(tmp_path / "s", 16 << 18, 1 << 18)  # 16 chunks of 1 MiB
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(dataset="s", seq_len=1024, batch_size=8, shuffle=True, seed=3)
    sampler = sampler_for(spec, ds)

    def stream() -> tuple[list[bytes], int]:
        cache = ChunkCache(10 << 20)  # 10 of the 16 chunks
        pipe = MessageBuilder(
            ds, sampler, sampler.rounds(0, 0), 4, cache, ServerMetrics(CollectorRegistry())
        )
        try:
            out = []
            while burst := pipe.next_burst():
                out += [data for data, _, _, _ in burst]
                wait_until(lambda: cache.loading == 0, 30, "read-aheads")
            return out, cache.stats.loads
        finally:
            pipe.close()
            cache.close()

    heads, loads = stream()
    monkeypatch.setattr(rounds, "HEAD_BYTES", 0)
    whole, whole_loads = stream()
    assert heads == whole
    assert len(heads) > 100
    assert loads < whole_loads  # 22 against 28 here


def test_a_head_of_a_cut_or_missing_chunk_file_is_data_loss_naming_it(tmp_path: Path) -> None:
    store = make_positional_store(tmp_path / "s", 4_000, 1_000)
    assert inplace.read_head(store, 1, 64) == np.arange(1_000, 1_016, dtype=np.uint32).tobytes()
    os.truncate(tmp_path / "s" / "chunk_000001.bin", 100)
    with pytest.raises(DataLoss, match=r"chunk_000001\.bin has 100 bytes"):
        inplace.read_head(store, 1, 64)
    os.unlink(tmp_path / "s" / "chunk_000002.bin")
    with pytest.raises(DataLoss, match=r"chunk_000002\.bin is missing"):
        inplace.read_head(store, 2, 64)


def test_a_head_is_read_from_a_file_advised_random_access(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A head is a token or a row: without the advice the kernel reads ahead up to the
    device's read_ahead_kb around it (8 MiB on some VMs)."""
    store = make_positional_store(tmp_path / "s", 4_000, 1_000)
    advice: list[int] = []
    fadvise = os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, what: int) -> None:
        advice.append(what)
        fadvise(fd, offset, length, what)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    with native.disabled():  # the reference, whose system calls Python sees
        assert inplace.read_head(store, 1, 4) == np.arange(1_000, 1_001, dtype="<u4").tobytes()
    assert advice == [os.POSIX_FADV_RANDOM]
