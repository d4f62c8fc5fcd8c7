"""A mixture's fast paths against the general code they stand in for.

* rank_steps (shuffle on) lays a step's windows out source-major, permutes the slots
  by the step's keyed bijection and reads each slot's source and item back; with the
  C extension built it does all of that in one C pass (`_keyed.step_rows`). The numpy
  code (NATIVE off) is the reference: the two must agree for any weights, layout and
  position, including many sources (numpy searches there), sources with no window in
  a step (equal starts) and B*W that is no power of two (values walk).
* MixturePlan.starts maps a few sources' items source by source, a source whose
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

import tokenfeed.core.mixture as mixture_module
from tokenfeed.core import keyed, sampling
from tokenfeed.core.mixture import Mixture
from tokenfeed.core.request import SamplingSpec

native = pytest.mark.skipif(keyed.native_step_rows is None, reason="built without C")


@native
@given(
    st.lists(st.sampled_from([0, 1, 2, 3, 0.5, 0.001]), min_size=1, max_size=40),
    st.integers(1, 12),
    st.integers(1, 9),
    st.integers(1, 8),
    st.integers(0, 2**64 - 1),
    st.integers(0, 10**7),
)
def test_step_rows_in_c_equal_the_numpy_code(weights, B, W, steps, seed, offset):
    if not any(weights):
        weights[0] = 1
    mix = Mixture([(f"s{i}", w) for i, w in enumerate(weights)], seq_len=5)
    offset = offset // (B * W) * (B * W)
    kw = dict(batch_size=B, world_size=W, seed=seed, shuffle=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mixture_module, "NATIVE", False)
        reference = [mix.rank_steps(r, offset, steps, **kw) for r in range(W)]
    for r, (src, item) in enumerate(reference):
        got = mix.rank_steps(r, offset, steps, **kw)
        assert got[0].dtype == got[1].dtype == np.int64
        assert np.array_equal(got[0], src) and np.array_equal(got[1], item)


@native
def test_step_rows_refuses_bad_arrays():
    rk = keyed.round_keys_by_round(np.arange(3, dtype=np.uint64))  # [6, 3]
    start = np.zeros((3, 2), dtype=np.int64)
    counts = np.zeros((3, 2), dtype=np.int64)
    out = np.empty((3, 4), dtype=np.int64)
    step_rows = keyed.native_step_rows
    assert step_rows is not None
    step_rows(rk, 8, 4, start, counts, out, out.copy())  # slots 4..7 of [0, 8): fine
    with pytest.raises(ValueError, match="slots"):
        step_rows(rk, 8, 5, start, counts, out, out.copy())  # slot 8 is outside
    with pytest.raises(ValueError, match="steps"):
        step_rows(np.ascontiguousarray(rk[:, :2]), 8, 0, start, counts, out, out.copy())
    with pytest.raises(TypeError, match="rk"):
        step_rows(rk.astype(np.int64), 8, 0, start, counts, out, out.copy())
    with pytest.raises(ValueError, match="contiguous"):
        step_rows(rk, 8, 0, np.zeros((2, 3), dtype=np.int64).T, counts, out, out.copy())


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
    plan = sampling.MixturePlan(spec, totals, tuple(max(16, t // 5) for t in totals))
    offset = offset // (B * W) * (B * W)
    for rank in range(W):
        rounds = plan.mixture.rounds(
            rank, offset, 0, batch_size=B, world_size=W, seed=seed, shuffle=True
        )
        for r in itertools.islice(rounds, 6):  # up to 63 steps: small sources wrap passes
            fast = plan.starts(r.sources, r.items)
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(sampling, "_SOURCES_ONE_BY_ONE", 0)
                general = plan.starts(r.sources, r.items)
            assert fast.shape == general.shape and np.array_equal(fast, general)
