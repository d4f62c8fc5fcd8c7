"""The mixing policies on their own (mixing/policies.py; docs/mixing.md): each step's
rule, determinism, and a resume from a state dict continuing exactly."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.mixing import Bandit, ExcessLoss

NAMES = ("web", "code", "noise")


def drive(policy, intervals: list[tuple[list[float], list[int] | None]], start=(0.5, 0.3, 0.2)):
    """Feed (losses, rows) intervals to a bound policy, weights in force = its last output;
    rows None: 100 rows drawn by the weights in force, as the feeder draws them."""
    w = np.array(start, dtype=np.float64)
    out = []
    for losses, rows in intervals:
        n = np.round(w * 100) if rows is None else np.array(rows, dtype=np.float64)
        w = policy.update(w, np.array(losses, dtype=np.float64), n)
        out.append(w.copy())
    return out


intervals = st.lists(
    st.tuples(
        st.lists(st.one_of(st.floats(0, 12), st.just(math.nan)), min_size=3, max_size=3),
        st.lists(st.integers(0, 40), min_size=3, max_size=3),
    ),
    min_size=1,
    max_size=12,
)


def valid(w: np.ndarray) -> bool:
    return bool(np.isfinite(w).all() and (w >= 0).all() and abs(w.sum() - 1) < 1e-9)


@given(intervals, st.sampled_from(["loss", "progress"]), st.floats(0, 1), st.floats(0.01, 5))
def test_the_bandit_is_deterministic_explores_and_resumes_exactly(seq, reward, gamma, eta):
    def fresh():
        b = Bandit(reward=reward, gamma=gamma, eta=eta, seed=7)
        b.bind(NAMES)
        return b

    # (a NaN mean loss is what the mixer passes for a source without rows)
    seq = [([x if r else math.nan for x, r in zip(ls, rs, strict=True)], rs) for ls, rs in seq]
    one, two = drive(fresh(), seq), drive(fresh(), seq)
    assert all(np.array_equal(a, b) for a, b in zip(one, two, strict=True))
    for w in one:
        assert valid(w)
        assert (w >= gamma / 3 - 1e-12).all()
    # a state dict in the middle (through JSON) continues exactly
    half = len(seq) // 2
    first = fresh()
    drive(first, seq[:half])
    state = json.loads(json.dumps(first.state_dict()))
    resumed = fresh()
    resumed.load_state_dict(state)
    start = tuple(one[half - 1]) if half else (0.5, 0.3, 0.2)
    rest = drive(resumed, seq[half:], start)
    assert all(np.array_equal(a, b) for a, b in zip(rest, one[half:], strict=True))


def test_learning_progress_moves_weight_away_from_a_source_that_does_not_learn():
    b = Bandit(reward="progress", gamma=0.1, eta=1.0)
    b.bind(NAMES)
    seq = [([4.0 - 0.3 * t, 3.0 - 0.2 * t, 5.5], None) for t in range(10)]
    w = drive(b, seq, start=(1 / 3, 1 / 3, 1 / 3))
    assert w[-1][2] < 0.1 < w[-1][1] < w[-1][0]  # noise: no progress; web learns fastest
    assert all(later[2] <= earlier[2] for earlier, later in itertools.pairwise(w))


def test_loss_reward_moves_weight_toward_the_highest_loss():
    b = Bandit(reward="loss", gamma=0.0, eta=0.5)
    b.bind(NAMES)
    w = drive(b, [([2.0, 3.0, 5.5], None)] * 4, start=(1 / 3, 1 / 3, 1 / 3))
    assert w[-1].argmax() == 2
    assert w[-1][2] > w[0][2] > 1 / 3


def test_importance_weights_credit_a_source_for_the_rows_it_got():
    """ODM's r * rows_i / (rows * w_i): a source that got twice its share counts twice."""
    b = Bandit(reward="loss", gamma=0.0, eta=1.0)
    b.bind(("a", "b"))
    w = b.update(np.array([0.5, 0.5]), np.array([1.0, 1.0]), np.array([60.0, 30.0]))
    # gains (1 * (60/90)/0.5, 1 * (30/90)/0.5) = (4/3, 2/3) over prior (1/2, 1/2)
    want = np.exp([4 / 3, 2 / 3]) / np.exp([4 / 3, 2 / 3]).sum()
    np.testing.assert_allclose(w, want, rtol=1e-12)


def test_excess_loss_is_doremis_step():
    p = ExcessLoss({"web": 2.0, "code": 1.5, "noise": 5.0}, eta=1.0, smoothing=0.1)
    p.bind(NAMES)
    w0 = np.array([0.5, 0.3, 0.2])
    w = p.update(w0, np.array([2.5, 1.0, 6.0]), np.array([10, 10, 0]))
    excess = np.array([0.5, 0.0, 0.0])  # code below its reference, noise unseen
    step = w0 * np.exp(excess)
    np.testing.assert_allclose(w, 0.9 * step / step.sum() + 0.1 / 3, rtol=1e-12)
    assert valid(w)
    # deterministic and stateless: the same input, the same output
    assert np.array_equal(p.update(w0, np.array([2.5, 1.0, 6.0]), np.array([10, 10, 0])), w)
    again = ExcessLoss({"web": 2.0, "code": 1.5, "noise": 5.0}, eta=1.0, smoothing=0.1)
    again.bind(NAMES)
    again.load_state_dict(json.loads(json.dumps(p.state_dict())))


def test_bad_policy_arguments_are_refused():
    with pytest.raises(ValueError, match="reward must be one of"):
        Bandit(reward="accuracy")
    with pytest.raises(ValueError, match="gamma"):
        Bandit(gamma=1.5)
    with pytest.raises(ValueError, match="eta"):
        Bandit(eta=0)
    with pytest.raises(TypeError, match="seed"):
        Bandit(seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="smoothing"):
        ExcessLoss({"a": 1.0}, smoothing=2)
    p = ExcessLoss({"web": 1.0, "other": 2.0})
    with pytest.raises(ValueError, match=r"missing \['code', 'noise'\], not sources \['other'\]"):
        p.bind(NAMES)
    b = Bandit(seed=1)
    b.bind(NAMES)
    other = Bandit(seed=2)
    other.bind(NAMES)
    with pytest.raises(ValueError, match="seed"):
        other.load_state_dict(b.state_dict())
    with pytest.raises(ValueError, match="not a Bandit state"):
        b.load_state_dict(p.state_dict())
