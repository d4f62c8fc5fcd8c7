"""The message splice (server/splice.py): the C version against its Python reference."""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfeed.server import splice, wire

SPLICES = [splice.splice_py] + ([splice.splice] if splice.NATIVE else [])


def test_the_c_extension_is_built() -> None:
    """The package builds _native (hatch_build.py) unless told not to."""
    if os.environ.get("TOKENFEED_PURE_PYTHON") == "1":
        assert not splice.NATIVE
    else:
        assert splice.NATIVE and wire._encode is not wire._frames_py


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


@settings(max_examples=300, deadline=None)
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
