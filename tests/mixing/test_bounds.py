"""Bounds and rounding of a policy's weights (mixing/bounds.py; docs/mixing.md,
"Bounds and rounding"): properties over random weights."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tokenfeed.mixing import bounded, rounded

EPS = 1e-9


@st.composite
def simplex(draw, k: int | None = None, zeros: bool = True) -> np.ndarray:
    k = draw(st.integers(1, 8)) if k is None else k
    lo = 0.0 if zeros else 1e-3
    w = np.array(draw(st.lists(st.floats(lo, 10.0), min_size=k, max_size=k)))
    assume(w.sum() > 1e-6)
    return w / w.sum()


@given(st.data(), st.floats(0, 1), st.one_of(st.none(), st.floats(1e-3, 1)))
def test_bounded_weights_sum_to_one_within_the_bounds(data, min_share, max_change):
    current = data.draw(simplex())
    k = len(current)
    target = data.draw(simplex(k))
    min_weight = min_share / k
    w = bounded(target, current, min_weight, max_change)
    assert abs(w.sum() - 1) < EPS
    if max_change is not None:
        # a source below min_weight now rises by max_change at most: both bounds hold
        # from the weights in force whenever those satisfy min_weight
        assert (np.abs(w - current) <= max_change + EPS).all()
    if (current >= min_weight).all() or max_change is None:
        assert (w >= min_weight - EPS).all()
    else:
        assert (w >= np.minimum(min_weight, current) - EPS).all()


@given(st.data())
def test_weights_within_the_bounds_are_kept(data):
    current = data.draw(simplex(zeros=False))
    target = data.draw(simplex(len(current), zeros=False))
    change = float(np.abs(target - current).max()) + 1e-6
    floor = float(target.min()) - 1e-6
    assume(floor * len(target) <= 1)
    np.testing.assert_allclose(bounded(target, current, max(floor, 0.0), change), target, atol=1e-9)


@given(st.data(), st.integers(1, 6))
def test_rounded_weights_are_decimals_that_sum_to_exactly_one(data, resolution):
    w = data.draw(simplex())
    units = rounded(w, resolution)
    scale = 10**resolution
    assert units.dtype == np.int64
    assert int(units.sum()) == scale
    assert (np.abs(units - w * scale) < 1 + EPS).all()  # each within one unit
    assert (units >= 0).all()
    assert np.array_equal(rounded(w, resolution), units)  # deterministic


def test_rounding_gives_the_units_left_to_the_largest_remainders_then_the_earlier_source():
    assert rounded(np.array([1 / 3, 1 / 3, 1 / 3]), 4).tolist() == [3334, 3333, 3333]
    assert rounded(np.array([0.12345, 0.5, 0.37655]), 4).tolist() == [1235, 5000, 3765]
    assert rounded(np.array([0.25, 0.75]), 1).tolist() == [3, 7]  # tie: the earlier one


def test_bad_weights_are_refused():
    with pytest.raises(ValueError, match="finite"):
        bounded(np.array([np.nan, 1.0]), np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="not all 0"):
        bounded(np.array([0.0, 0.0]), np.array([0.5, 0.5]))
    with pytest.raises(ValueError, match="no weights sum to 1"):
        bounded(np.array([0.5, 0.5]), np.array([0.5, 0.5]), min_weight=0.6)
