"""The message splice (server/splice.py): the C version against its Python reference."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import keyed
from tokenfeed.server import splice, wire

SPLICES = [splice.splice_py] + ([splice.splice] if splice.NATIVE else [])


def test_the_c_extension_is_built() -> None:
    """The package builds its C extensions (hatch_build.py) unless told not to."""
    if os.environ.get("TOKENFEED_PURE_PYTHON") == "1":
        assert not splice.NATIVE and not keyed.NATIVE
    else:
        assert splice.NATIVE and wire._encode is not wire._frames_py and keyed.NATIVE


@st.composite
def programs(draw: st.DrawFn) -> tuple[list[tuple[np.ndarray, bytes]], np.ndarray, list, bytes]:
    """Sources (views under ascending keys, per-segment blobs) and pieces inside them,
    with the bytes they splice to, computed by hand."""
    keys = sorted(draw(st.sets(st.integers(0, 1 << 40), max_size=5)))
    views = [draw(st.binary(max_size=64)) for _ in keys]
    segments, want = [], b""
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
        segments.append((program, blob))
    # chunk views are memoryviews of cached arrays in the server
    mem = [memoryview(np.frombuffer(v, dtype=np.uint8)) for v in views]
    return segments, np.array(keys, dtype=np.int64), mem, want


@given(programs())
def test_splice_copies_every_piece_in_order(case) -> None:
    segments, keys, views, want = case
    for fn in SPLICES:
        assert fn(segments, keys, views) == want


@pytest.mark.parametrize("fn", SPLICES)
@pytest.mark.parametrize(
    "piece",
    [(7, 0, 1), (3, 4, 1), (3, -1, 1), (3, 0, -1), (-1, 2, 1)],
    ids=["unknown key", "past the end", "negative offset", "negative count", "past the blob"],
)
def test_a_piece_outside_its_source_is_refused(fn, piece) -> None:
    segments = [(np.array([(3, 0, 2), piece], dtype=np.int64), b"ab")]
    with pytest.raises(ValueError, match="splice"):
        fn(segments, np.array([3], dtype=np.int64), [b"wxyz"])


@pytest.mark.skipif(not splice.NATIVE, reason="the C extension's argument checks")
def test_the_c_splice_checks_its_arrays() -> None:
    keys = np.array([3], dtype=np.int64)
    with pytest.raises(TypeError, match="shape"):
        splice.splice([(np.zeros((2, 2), dtype=np.int64), b"")], keys, [b"x"])
    with pytest.raises(TypeError, match="int64"):
        splice.splice([(np.zeros((2, 3), dtype=np.int32), b"")], keys, [b"x"])
    with pytest.raises(ValueError, match="1 keys but 2 views"):
        splice.splice([], keys, [b"x", b"y"])


PROGRAMS = [splice.program_py] + ([splice._program] if splice.NATIVE else [])


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
    chunks = [tokens[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
    frames = bytes(range(sum(frame_sizes)))
    args = (
        np.array([s for _, starts in batches for s in starts], dtype=np.int64),
        bounds,
        np.array([len(starts) for _, starts in batches], dtype=np.int64),
        np.array([cols * itemsize for cols, _ in batches], dtype=np.int64),
        itemsize,
        np.array(frame_sizes, dtype=np.int64),
    )
    made = [fn(*args) for fn in PROGRAMS]
    assert all(m == made[0] for m in made)
    program = np.frombuffer(made[0][0], dtype=np.int64).reshape(-1, 3)
    piece_lo = np.frombuffer(made[0][1], dtype=np.int64).tolist()
    keys = np.arange(len(chunks), dtype=np.int64)
    views = [memoryview(c).cast("B") for c in chunks]
    at = np.concatenate(([0], np.cumsum(frame_sizes))).astype(int).tolist()
    for b, (cols, starts) in enumerate(batches):
        got = splice.splice([(program[piece_lo[b] : piece_lo[b + 1]], frames)], keys, views)
        rows = b"".join(tokens[s : s + cols].tobytes() for s in starts)
        want = frames[at[2 * b] : at[2 * b + 1]] + rows + frames[at[2 * b + 1] : at[2 * b + 2]]
        assert got == want
    assert (program[program[:, 0] >= 0, 2] > 0).all()  # no piece of an empty chunk


@pytest.mark.parametrize("fn", PROGRAMS)
def test_a_row_outside_the_store_is_refused(fn) -> None:
    bounds = np.array([0, 10, 20], dtype=np.int64)
    one = np.array([1], dtype=np.int64)
    with pytest.raises(ValueError, match="outside the store"):
        fn(
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
    from tokenfeed.server.service import plan_for

    from support.stores import make_positional_store

    make_positional_store(tmp_path / "s", 30_000, 1_000, dtype="uint16")
    ds = Catalog(tmp_path).get("s")
    spec = SamplingSpec(dataset="s", seq_len=300, batch_size=3, stride=70, shuffle=True, seed=5)
    plan = plan_for(spec, ds)

    def messages() -> list[bytes]:
        cache = ChunkCache(1 << 22)
        metrics = ServerMetrics(CollectorRegistry())
        pipe = MessageBuilder(ds, plan, plan.rounds(1, 0), 4, cache, metrics)
        out = []
        while burst := pipe.next_burst():
            out += [data for data, _, _, _ in burst]
        cache.close()
        return out

    native = messages()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(splice, "splice", splice.splice_py)
        mp.setattr(splice, "_program", splice.program_py)
        mp.setattr(wire, "_encode", wire._frames_py)
        mp.setattr(keyed, "_permute_c", None)
        reference = messages()
    assert len(native) > 10 and native == reference
