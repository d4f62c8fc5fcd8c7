"""A mixture's fast paths against the general code they stand in for.

* rank_steps (shuffle on) lays a step's windows out source-major, permutes the slots
  by the step's keyed bijection and reads each slot's source and item back
  (steps.step_rows); with the C extension built it does all of that in one C pass.
  step_rows_py (the compiled loops off: native.disabled()) is the reference: the two
  must agree for any weights, layout and position, including many sources (numpy
  searches there), sources with no window in a step (equal starts), B*W = 1 and B*W
  that is no power of two (values walk).
* rank_steps lays out a round of steps with fewer slots than sources (B*W < k) by the
  sources each step takes (steps.step_sources); the layout from the counts at every
  step boundary for every source is the reference.
* MixtureSampler.starts maps a few sources' items source by source, a source whose
  items lie in one pass by that pass's order directly; the general path (every item
  split into (pass, position), PassOrders.windows) is the reference, passes wrapping
  within a round included.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import keyed, native
from tokenfeed.core.mixture import Mixture, sampler, steps
from tokenfeed.core.mixture.steps import rank_steps, rounds
from tokenfeed.core.request import SamplingSpec

compiled = pytest.mark.skipif(
    not (native.enabled() and native.built("tokenfeed.core._keyed")),
    reason="the compiled loops are off or not built (TOKENFEED_PURE_PYTHON=1)",
)


WEIGHTS = st.lists(st.sampled_from([0, 1, 2, 3, 0.5, 0.001]), min_size=1, max_size=40)
SEED_OFFSET = (st.integers(0, 2**64 - 1), st.integers(0, 10**7))


def shuffled_steps(weights: list, B: int, W: int, seed: int, offset: int):
    """A mixture of `weights` (one made positive if none is), a step's first position
    at or below `offset`, and rank_steps' keywords for shuffled steps of B x W."""
    if not any(weights):
        weights[0] = 1
    mix = Mixture([(f"s{i}", w) for i, w in enumerate(weights)], seq_len=5)
    kw = dict(batch_size=B, world_size=W, seed=seed, shuffle=True)
    return mix, offset // (B * W) * (B * W), kw


@given(WEIGHTS, st.integers(1, 6), st.integers(1, 5), st.integers(1, 40), *SEED_OFFSET)
def test_steps_laid_out_by_the_sources_they_take_equal_the_counts_layout(
    weights, B, W, n, seed, offset
):
    mix, offset, kw = shuffled_steps(weights, B, W, seed, offset)
    sparse = [rank_steps(mix, r, offset, n, **kw) for r in range(W)]
    span, steps._SPARSE_SPAN = steps._SPARSE_SPAN, 0  # the counts at every boundary
    try:
        dense = [rank_steps(mix, r, offset, n, **kw) for r in range(W)]
    finally:
        steps._SPARSE_SPAN = span
    for (src, item), (want_src, want_item) in zip(sparse, dense, strict=True):
        assert np.array_equal(src, want_src)
        assert np.array_equal(item, want_item)


@compiled
@given(
    WEIGHTS,
    st.integers(1, 12),
    st.integers(1, 9),
    st.integers(1, 8),
    st.integers(0, 2**64 - 1),
    st.integers(0, 10**7),
)
def test_step_rows_in_c_equal_the_numpy_code(weights, B, W, steps, seed, offset):
    mix, offset, kw = shuffled_steps(weights, B, W, seed, offset)
    with native.disabled():
        reference = [rank_steps(mix, r, offset, steps, **kw) for r in range(W)]
    for r, (src, item) in enumerate(reference):
        got = rank_steps(mix, r, offset, steps, **kw)
        assert got[0].dtype == got[1].dtype == np.int64
        assert np.array_equal(got[0], src)
        assert np.array_equal(got[1], item)


@compiled
@pytest.mark.parametrize(("B", "W"), [(1, 1), (1, 2), (3, 1)])
def test_step_rows_of_tiny_steps_in_c_equal_the_numpy_code(B, W):
    """One or two slots per step: B*W = 1 walks its 1-bit domain to 0 in C."""
    mix = Mixture({"a": 0.5, "b": 0.3, "c": 0.2}, seq_len=4)
    kw = dict(batch_size=B, world_size=W, seed=9, shuffle=True)
    with native.disabled():
        reference = [rank_steps(mix, r, 0, 50, **kw) for r in range(W)]
    for r, (src, item) in enumerate(reference):
        got = rank_steps(mix, r, 0, 50, **kw)
        assert np.array_equal(got[0], src)
        assert np.array_equal(got[1], item)
    assert len(set(reference[0][0].ravel().tolist())) == 3  # every source appears


def test_the_c_step_rows_refuses_bad_arrays():
    step_rows = pytest.importorskip("tokenfeed.core._keyed").step_rows
    sk = keyed.stage_keys_by_stage(np.arange(3, dtype=np.uint64))  # [6, 3]
    start = np.zeros((3, 2), dtype=np.int64)
    counts = np.zeros((3, 2), dtype=np.int64)
    out = np.empty((3, 4), dtype=np.int64)
    step_rows(sk, 8, 4, start, counts, out, out.copy())  # slots 4..7 of [0, 8): fine
    with pytest.raises(ValueError, match="slots"):
        step_rows(sk, 8, 5, start, counts, out, out.copy())  # slot 8 is outside
    with pytest.raises(ValueError, match="steps"):
        step_rows(np.ascontiguousarray(sk[:, :2]), 8, 0, start, counts, out, out.copy())
    with pytest.raises(TypeError, match="sk"):
        step_rows(sk.astype(np.int64), 8, 0, start, counts, out, out.copy())
    with pytest.raises(ValueError, match="contiguous"):
        step_rows(sk, 8, 0, np.zeros((2, 3), dtype=np.int64).T, counts, out, out.copy())


@given(
    st.lists(st.tuples(st.integers(1, 5), st.integers(20, 3000)), min_size=1, max_size=10),
    st.integers(1, 8),
    st.integers(1, 3),
    st.sampled_from([1, 2, 4]),
    st.integers(1, 4),
    st.integers(0, 2**64 - 1),
    st.integers(0, 5000),
)
def test_mixture_starts_source_by_source_equal_the_general_path(
    sources, stride, B, W, shuffle_blocks, seed, offset
):
    spec = SamplingSpec(
        dataset="",
        sources=tuple((f"s{i}", w) for i, (w, _) in enumerate(sources)),
        seq_len=8,
        stride=stride,
        batch_size=B,
        world_size=W,
        seed=seed,
        shuffle=True,
        shuffle_blocks=shuffle_blocks,
    )
    totals = tuple(t for _, t in sources)
    ms = sampler.MixtureSampler(spec, totals, tuple(max(16, t // 5) for t in totals))
    offset = offset // (B * W) * (B * W)
    for rank in range(W):
        batches = rounds(
            ms.mixture, rank, offset, 0, batch_size=B, world_size=W, seed=seed, shuffle=True
        )
        for r in itertools.islice(batches, 6):  # up to 63 steps: small sources wrap passes
            fast = ms.starts(r.sources, r.items)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sampler, "_SOURCES_ONE_BY_ONE", 0)
                general = ms.starts(r.sources, r.items)
            assert fast.shape == general.shape
            assert np.array_equal(fast, general)
