"""Prefix: versions of an append-only list that share it (core/mixture/prefix.py)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core.mixture.prefix import Prefix


@given(st.lists(st.tuples(st.integers(0, 1 << 30), st.lists(st.integers(-50, 50), max_size=5))))
def test_every_version_keeps_its_own_items_whatever_grows_after_it(steps) -> None:
    # each step grows one earlier version (chosen by its first number) by a few items:
    # the newest grows in place, an older one by a copy; every version always reads
    # exactly the list it was made as
    versions: list[tuple[Prefix[int], list[int]]] = [(Prefix([3, 1], ints=True), [3, 1])]
    for pick, new in steps:
        old, want = versions[pick % len(versions)]
        keep = pick % (len(want) + 1)
        versions.append((old.grown(keep, new), want[:keep] + new))
        for v, w in versions:
            assert list(v) == w
            assert len(v) == len(w)
            assert v == w
            assert v.array.tolist() == w
            assert v[1:] == w[1:]
            assert v[::-2] == w[::-2]
            if w:
                assert v[-1] == w[-1]
                assert v[0] == w[0]
            s = sorted(w)
            sv = Prefix(s).grown(len(s), [])
            for x in (-51, 0, 7, 51):
                assert sv.bisect_left(x) == sum(y < x for y in s)
                assert sv.bisect_right(x) == sum(y <= x for y in s)


def test_the_newest_version_grows_in_place_and_an_older_one_by_a_copy() -> None:
    a = Prefix(["x", "y"])
    b = a.grown(2, ["z"])
    assert b._shared is a._shared  # appended in place: nothing copied
    c = a.grown(2, ["w"])  # a's list has grown past it: a copy
    assert c._shared is not a._shared
    assert list(a) == ["x", "y"]
    assert list(b) == ["x", "y", "z"]
    assert list(c) == ["x", "y", "w"]
    with pytest.raises(IndexError):
        a[2]  # a version never reads past its own items


def test_threads_growing_one_version_each_get_their_own_items() -> None:
    base = Prefix(range(100), ints=True)
    out: dict[int, Prefix[int]] = {}

    def grow(t: int) -> None:
        out[t] = base.grown(100, range(1000 * t, 1000 * t + 500))

    threads = [threading.Thread(target=grow, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    for t, v in out.items():
        want = [*range(100), *range(1000 * t, 1000 * t + 500)]
        assert list(v) == want
        assert np.array_equal(v.array, np.array(want))
    assert list(base) == list(range(100))
