"""The message splice (server/splice.py): the C version against its Python reference,
through the one switch of the compiled loops (tokenfeed.core.native)."""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import native
from tokenfeed.server import splice

EXTENSIONS = ("tokenfeed.server._native", "tokenfeed.core._keyed")
COMPILED = native.enabled() and native.built("tokenfeed.server._native")
compiled = pytest.mark.skipif(
    not COMPILED, reason="the compiled loops are off or not built (TOKENFEED_PURE_PYTHON=1)"
)


def test_the_c_extensions_are_built_and_on_unless_told_not_to() -> None:
    """The package builds its C extensions (hatch_build.py) and runs them, unless
    TOKENFEED_PURE_PYTHON=1 (at install: not built; at run time: off)."""
    if os.environ.get(native.ENV) == "1":
        assert not native.enabled()
    else:
        assert native.enabled()
        assert all(native.built(m) for m in EXTENSIONS)
        with native.disabled():
            assert not native.enabled()
        assert native.enabled()


@pytest.fixture(params=["C", "Python"])
def loops(request: pytest.FixtureRequest) -> Iterator[str]:
    """The test once with the compiled loops (where they run), once with the
    references."""
    if request.param == "C" and not COMPILED:
        pytest.skip("the compiled loops are off or not built")
    with native.disabled() if request.param == "Python" else contextlib.nullcontext():
        yield request.param


def both_ways(f, *args):
    """f(*args) with the compiled loops (where they run) and with the references."""
    got = f(*args)
    with native.disabled():
        return got, f(*args)


@st.composite
def programs(draw: st.DrawFn) -> tuple[list[tuple[np.ndarray, bytes]], np.ndarray, list, bytes]:
    """Sources (views under ascending keys, per-part blobs) and pieces inside them,
    with the bytes they splice to, computed by hand."""
    keys = sorted(draw(st.sets(st.integers(0, 1 << 40), max_size=5)))
    views = [draw(st.binary(max_size=64)) for _ in keys]
    parts, want = [], b""
    for _ in range(draw(st.integers(0, 4))):
        blob = draw(st.binary(max_size=32))
        rows = []
        for _ in range(draw(st.integers(0, 6))):
            j = draw(st.integers(-1, len(keys) - 1))  # -1: the blob
            src = blob if j < 0 else views[j]
            a = draw(st.integers(0, len(src)))
            b = draw(st.integers(a, len(src)))
            rows.append((-1 if j < 0 else keys[j], a, b - a))
            want += src[a:b]
        program = np.array(rows, dtype=np.int64).reshape(-1, 3)
        parts.append((program, blob))
    # chunk views are memoryviews of cached arrays in the server
    mem = [memoryview(np.frombuffer(v, dtype=np.uint8)) for v in views]
    return parts, np.array(keys, dtype=np.int64), mem, want


@given(programs())
def test_splice_copies_every_piece_in_order(case) -> None:
    parts, keys, views, want = case
    assert both_ways(splice.splice, parts, keys, views) == (want, want)


@pytest.mark.parametrize(
    "piece",
    [(7, 0, 1), (3, 4, 1), (3, -1, 1), (3, 0, -1), (-1, 2, 1)],
    ids=["unknown key", "past the end", "negative offset", "negative count", "past the blob"],
)
def test_a_piece_outside_its_source_is_refused(loops, piece) -> None:
    parts = [(np.array([(3, 0, 2), piece], dtype=np.int64), b"ab")]
    with pytest.raises(ValueError, match="splice"):
        splice.splice(parts, np.array([3], dtype=np.int64), [b"wxyz"])


@compiled
def test_the_c_splice_checks_its_arrays() -> None:
    keys = np.array([3], dtype=np.int64)
    with pytest.raises(TypeError, match="shape"):
        splice.splice([(np.zeros((2, 2), dtype=np.int64), b"")], keys, [b"x"])
    with pytest.raises(TypeError, match="int64"):
        splice.splice([(np.zeros((2, 3), dtype=np.int32), b"")], keys, [b"x"])
    with pytest.raises(ValueError, match="1 keys but 2 views"):
        splice.splice([], keys, [b"x", b"y"])


@contextlib.contextmanager
def as_files(views: list, base: int = 3) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Each view written to a file of its own behind `base` bytes of padding: (fds,
    bases, sizes) for splice_files."""
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        fds = []
        try:
            for i, v in enumerate(views):
                path = os.path.join(d, str(i))
                with open(path, "wb") as f:
                    f.write(b"\xee" * base + bytes(v) + b"\xee")
                fds.append(os.open(path, os.O_RDONLY))
            yield (
                np.array(fds, dtype=np.int64),
                np.full(len(views), base, dtype=np.int64),
                np.array([len(v) for v in views], dtype=np.int64),
            )
        finally:
            for fd in fds:
                os.close(fd)


@given(programs())
def test_splice_files_reads_every_piece_in_order(case) -> None:
    """The same splice with the chunks' bytes read from files (rows read in place)."""
    parts, keys, views, want = case
    with as_files(views) as (fds, bases, sizes):
        assert both_ways(splice.splice_files, parts, keys, fds, bases, sizes) == (want, want)
        # just written, so in the page cache: read without waiting, the same bytes
        if hasattr(os, "RWF_NOWAIT"):
            got = both_ways(splice.splice_files, parts, keys, fds, bases, sizes, True)
            assert got == (want, want)


@pytest.mark.parametrize(
    "piece",
    [(7, 0, 1), (3, 4, 1), (3, -1, 1), (3, 0, -1), (-1, 2, 1)],
    ids=["unknown key", "past the end", "negative offset", "negative count", "past the blob"],
)
def test_splice_files_refuses_a_piece_outside_its_chunk(loops, piece) -> None:
    parts = [(np.array([(3, 0, 2), piece], dtype=np.int64), b"ab")]
    with as_files([b"wxyz"]) as (fds, bases, sizes), pytest.raises(ValueError, match="splice"):
        splice.splice_files(parts, np.array([3], dtype=np.int64), fds, bases, sizes)


def test_splice_files_says_which_file_came_back_short(loops, tmp_path) -> None:
    """A file cut after it was opened: EOFError naming the chunk's key, never a message
    with bytes that are not there."""
    (tmp_path / "c").write_bytes(b"0123456789")
    fd = os.open(tmp_path / "c", os.O_RDONLY)
    try:
        os.truncate(tmp_path / "c", 4)
        parts = [(np.array([(5, 2, 6)], dtype=np.int64), b"")]
        args = (np.array([5]), np.array([fd]), np.array([0]), np.array([10]))
        with pytest.raises(EOFError, match="key 5"):
            splice.splice_files(parts, *(np.asarray(a, dtype=np.int64) for a in args))
    finally:
        os.close(fd)


def test_splice_files_without_waiting_stops_at_a_cut_file(loops, tmp_path) -> None:
    """`nowait`: a read that reaches the end of a cut file is None (the read that may
    wait then says which file), never a message with bytes that are not there."""
    (tmp_path / "c").write_bytes(b"0123456789")
    fd = os.open(tmp_path / "c", os.O_RDONLY)
    try:
        os.truncate(tmp_path / "c", 4)
        parts = [(np.array([(-1, 0, 2), (5, 2, 6)], dtype=np.int64), b"ab")]
        args = (np.array([5]), np.array([fd]), np.array([0]), np.array([10]))
        assert (
            splice.splice_files(parts, *(np.asarray(a, dtype=np.int64) for a in args), True) is None
        )
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT"), reason="Linux's RWF_NOWAIT")
def test_splice_files_without_waiting_is_none_where_the_disk_would_be_read(loops, tmp_path) -> None:
    """`nowait` on bytes the page cache dropped: None where the read would wait, the
    bytes where the kernel has them (a file system that keeps every file in memory, or
    a miss it served at once), never other bytes; a read that may wait gets them.
    Which of the two the kernel answers is its own timing (a RWF_NOWAIT miss starts a
    read that a fast device may finish within the call): a probe of another page does
    not predict it. None for certain: a cut file (the test above)."""
    data = os.urandom(1 << 20)
    (tmp_path / "c").write_bytes(data)
    fd = os.open(tmp_path / "c", os.O_RDONLY)
    try:
        os.fsync(fd)  # clean pages, which DONTNEED drops
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)  # a miss loads its own pages only
        parts = [(np.array([(5, 1 << 19, 4096)], dtype=np.int64), b"")]
        args = [np.asarray(a, dtype=np.int64) for a in ([5], [fd], [0], [len(data)])]
        got = splice.splice_files(parts, *args, True)
        assert got in (None, data[1 << 19 : (1 << 19) + 4096])
        assert splice.splice_files(parts, *args) == data[1 << 19 : (1 << 19) + 4096]
        assert splice.splice_files(parts, *args, True) == data[1 << 19 : (1 << 19) + 4096]
    finally:
        os.close(fd)


@st.composite
def rounds(draw: st.DrawFn):
    """A store of chunks (some empty) holding T = 0, 1, 2, ... and a round of batches
    whose rows lie anywhere in it, crossing chunks too."""
    sizes = draw(st.lists(st.integers(0, 40), min_size=1, max_size=8).filter(lambda s: sum(s)))
    total = sum(sizes)
    batches = []
    for _ in range(draw(st.integers(0, 4))):
        cols = draw(st.integers(1, total))
        starts = draw(st.lists(st.integers(0, total - cols), max_size=5))
        batches.append((cols, starts))
    frame_sizes = draw(st.lists(st.integers(0, 5), min_size=2 * len(batches)))
    return sizes, batches, frame_sizes[: 2 * len(batches)]


@given(rounds(), st.sampled_from([1, 2, 4]))
def test_the_program_splices_each_row_from_its_chunks(case, itemsize) -> None:
    """Spliced over the chunks, a round's program gives every batch's frames with its
    rows T[s : s + cols] between them, whatever chunks the rows cross; C and Python
    give the same program."""
    sizes, batches, frame_sizes = case
    dtype = {1: np.uint8, 2: np.uint16, 4: np.uint32}[itemsize]
    bounds = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    tokens = np.arange(bounds[-1]).astype(dtype)
    chunks = [tokens[a:b] for a, b in itertools.pairwise(bounds)]
    frames = bytes(range(sum(frame_sizes)))
    args = (
        np.array([s for _, starts in batches for s in starts], dtype=np.int64),
        bounds,
        np.array([len(starts) for _, starts in batches], dtype=np.int64),
        np.array([cols * itemsize for cols, _ in batches], dtype=np.int64),
        itemsize,
        np.array(frame_sizes, dtype=np.int64),
    )
    (program, piece_lo), (reference, reference_lo) = both_ways(splice.program, *args)
    assert program.dtype == reference.dtype == np.int64
    assert np.array_equal(program, reference)
    assert piece_lo == reference_lo
    assert program.shape == (piece_lo[-1], 3)
    assert piece_lo[0] == 0
    keys = np.arange(len(chunks), dtype=np.int64)
    views = [memoryview(c).cast("B") for c in chunks]
    at = np.concatenate(([0], np.cumsum(frame_sizes))).astype(int).tolist()
    for b, (cols, starts) in enumerate(batches):
        got = splice.splice([(program[piece_lo[b] : piece_lo[b + 1]], frames)], keys, views)
        rows = b"".join(tokens[s : s + cols].tobytes() for s in starts)
        want = frames[at[2 * b] : at[2 * b + 1]] + rows + frames[at[2 * b + 1] : at[2 * b + 2]]
        assert got == want
    assert (program[program[:, 0] >= 0, 2] > 0).all()  # no piece of an empty chunk


def test_a_row_outside_the_store_is_refused(loops) -> None:
    bounds = np.array([0, 10, 20], dtype=np.int64)
    one = np.array([1], dtype=np.int64)
    with pytest.raises(ValueError, match="outside the store"):
        splice.program(
            np.array([15], dtype=np.int64),
            bounds,
            one,
            np.array([12], dtype=np.int64),
            1,
            np.zeros(2, dtype=np.int64),
        )


def test_a_stream_is_byte_identical_without_the_extension(tmp_path) -> None:
    """The messages of a shuffled stream whose rows cross chunks, built with the C loops
    and with their Python and numpy references (what a TOKENFEED_PURE_PYTHON=1 install
    runs)."""
    from prometheus_client import CollectorRegistry

    from tokenfeed.core.request import SamplingSpec
    from tokenfeed.server.assembly import MessageBuilder
    from tokenfeed.server.cache import ChunkCache
    from tokenfeed.server.datasets import Catalog
    from tokenfeed.server.metrics import ServerMetrics
    from tokenfeed.server.service import sampler_for

    from support.stores import make_positional_store

    make_positional_store(tmp_path / "s", 30_000, 1_000, dtype="uint16")
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(dataset="s", seq_len=300, batch_size=3, stride=70, shuffle=True, seed=5)
    sampler = sampler_for(spec, ds)

    def messages() -> list[bytes]:
        cache = ChunkCache(1 << 22)
        metrics = ServerMetrics(CollectorRegistry())
        pipe = MessageBuilder(ds, sampler, sampler.rounds(1, 0), 4, cache, metrics)
        out = []
        while burst := pipe.next_burst():
            out += [data for data, _, _, _ in burst]
        cache.close()
        return out

    compiled, reference = both_ways(messages)
    assert len(compiled) > 10
    assert compiled == reference


def test_a_mixture_of_many_sources_reads_its_rows_in_place_the_same(tmp_path, monkeypatch) -> None:
    """A rank of a mixture of 16 sources (W x k >= inplace.IN_PLACE_WORLD_SIZE) reads its
    rows from the chunk files, not whole chunks through the cache, and its messages are
    the bytes the whole-chunk path builds."""
    from prometheus_client import CollectorRegistry

    from tokenfeed.core.request import SamplingSpec
    from tokenfeed.server import inplace
    from tokenfeed.server.assembly import MessageBuilder
    from tokenfeed.server.cache import ChunkCache
    from tokenfeed.server.datasets import Catalog
    from tokenfeed.server.metrics import ServerMetrics
    from tokenfeed.server.mixtures import MixtureSpace
    from tokenfeed.server.service import mixture_sampler_for

    from support.stores import make_positional_store

    names = [f"s{i:02d}" for i in range(16)]
    for n in names:
        make_positional_store(tmp_path / n, 6_000, 1_000, dtype="uint16")
    catalog = Catalog(tmp_path)
    sources = [catalog.get(n) for n in names]
    weights = tuple((n, float(1 + i % 3)) for i, n in enumerate(names))
    spec = SamplingSpec(dataset="", sources=weights, seq_len=90, batch_size=4, shuffle=True)

    def messages() -> tuple[list[bytes], bool, int]:
        ds = MixtureSpace.of(sources)
        sampler = mixture_sampler_for(spec, sources)
        cache = ChunkCache(1 << 22)
        metrics = ServerMetrics(CollectorRegistry())
        pipe = MessageBuilder(ds, sampler, sampler.rounds(0, 0), 4, cache, metrics)
        out = []
        while len(out) < 60 and (burst := pipe.next_burst()):
            out += [data for data, _, _, _ in burst]
        pipe.close()
        cache.close()
        return out[:60], pipe.files is not None, cache.stats.loads

    in_place, read_in_place, loads = messages()
    monkeypatch.setattr(inplace, "IN_PLACE_WORLD_SIZE", 1 << 40)
    whole, read_whole, whole_loads = messages()
    assert (read_in_place, read_whole) == (True, False)
    assert loads == 0 < whole_loads
    assert len(in_place) == 60
    assert in_place == whole
