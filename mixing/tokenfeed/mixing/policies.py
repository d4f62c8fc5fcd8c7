"""Online mixing policies: from each source's loss over an update interval to new weights
(docs/mixing.md is the contract, with the papers each one follows).

A policy sees, at each update, the weights in force (normalized), each source's mean
loss per row over the interval (NaN where the interval had no row of it) and its rows
(summed over ranks), and returns new weights (>= 0, not all 0; the mixer bounds and
rounds them: bounds.py). Everything is float64 numpy in source order, deterministic:
every rank computes the same weights from the same sums.

* `ExcessLoss`: DoReMi's exponentiated-gradient step on the excess loss over a
  per-source reference, smoothed toward uniform (Xie et al., 2023).
* `Bandit`: EXP3 (Auer et al., 2002) as online data mixing applies it (Albalak et al.,
  2023): exponential weights over each source's cumulative importance-weighted reward,
  mixed with uniform exploration; the reward is the source's loss or its learning
  progress.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

REWARDS = ("loss", "progress")


class Policy(Protocol):
    """What an OnlineMixer asks of a policy."""

    def bind(self, names: Sequence[str]) -> None:
        """The mixture's sources, in order (once, before any update)."""

    def update(self, weights: np.ndarray, losses: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """New weights from the weights in force, the interval's mean losses and rows."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


def _number(name: str, value: Any, lo: float, hi: float = math.inf, lo_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {value!r}")
    value = float(value)
    below = value <= lo if lo_open else value < lo
    if not math.isfinite(value) or below or value > hi:
        raise ValueError(f"{name} must be in {'(' if lo_open else '['}{lo}, {hi}], got {value}")
    return value


def _floats(values: Sequence[float | None]) -> np.ndarray:
    """A state's list (None for NaN: JSON has none) as float64."""
    return np.array([math.nan if v is None else v for v in values], dtype=np.float64)


def _plain(values: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else v for v in values.tolist()]


class ExcessLoss:
    """DoReMi's domain weights, online: at each update, with excess loss
    ``e_i = max(loss_i - reference[i], 0)`` (0 for a source without rows),

        w_i <- w_i * exp(eta * e_i), normalized;  w <- (1 - smoothing) * w + smoothing / k

    `reference` maps every source to its reference loss (a reference model's loss on
    it, in the training loss's units); `eta` is the step size, `smoothing` the share of
    uniform mixed in (DoReMi's c). Stateless between updates: the weights in force
    carry the run's history.
    """

    def __init__(self, reference: Mapping[str, float], eta: float = 1.0, smoothing: float = 1e-3):
        if not isinstance(reference, Mapping) or not reference:
            raise TypeError(f"reference must map every source to its loss, got {reference!r}")
        self.reference = {
            str(n): _number(f"reference[{n!r}]", v, -math.inf) for n, v in reference.items()
        }
        self.eta = _number("eta", eta, 0.0, lo_open=True)
        self.smoothing = _number("smoothing", smoothing, 0.0, 1.0)
        self._ref: np.ndarray | None = None

    def bind(self, names: Sequence[str]) -> None:
        missing = [n for n in names if n not in self.reference]
        extra = [n for n in self.reference if n not in names]
        if missing or extra:
            raise ValueError(
                f"reference must name exactly the mixture's sources {list(names)}: "
                f"missing {missing}, not sources {extra}"
            )
        self._ref = np.array([self.reference[n] for n in names], dtype=np.float64)

    def update(self, weights: np.ndarray, losses: np.ndarray, rows: np.ndarray) -> np.ndarray:
        assert self._ref is not None, "bind() first"
        excess = np.where(rows > 0, np.maximum(losses - self._ref, 0.0), 0.0)
        excess = np.nan_to_num(excess, nan=0.0)
        logits = np.log(np.maximum(weights, 1e-300)) + self.eta * excess
        w = np.exp(logits - logits.max()) * (weights > 0)
        if w.sum() == 0:
            w = np.ones_like(weights)
        w /= w.sum()
        return (1.0 - self.smoothing) * w + self.smoothing / len(w)

    def state_dict(self) -> dict[str, Any]:
        return {
            "policy": "excess_loss",
            "reference": dict(self.reference),
            "eta": self.eta,
            "smoothing": self.smoothing,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("policy") != "excess_loss":
            raise ValueError(f"not an ExcessLoss state: {state.get('policy')!r}")
        # nothing accumulates between updates: the settings are kept for the record


class Bandit:
    """EXP3 over the sources, as online data mixing applies it. At each update:

        r_i = reward_i * rows_i / (rows * w_i)      (0 for a source without rows)
        G_i <- G_i + r_i
        w_i = (1 - gamma) * p_i * exp(eta * G_i) / sum_j p_j * exp(eta * G_j) + gamma / k

    where w is the weights in force, p the weights the bandit started from, and
    reward_i, with `reward="loss"`, the source's mean loss over the interval (ODM's
    reward: what is left to learn), or with `reward="progress"` its learning progress,
    the drop of its mean loss since its previous interval (0 the first time). The
    factor rows_i / (rows * w_i) is ODM's importance weight (1 when a source got its
    share of the rows). `gamma` is the share of uniform exploration, `eta` the step
    size (rewards are in the loss's units: losses add up fast, progress slowly).

    The rows are the bandit's draws: the feeder draws them by the weights, keyed by
    the loader's seed, so the policy itself draws nothing. `seed` is kept with its
    state, and a state saved with another seed is refused on load.
    """

    def __init__(
        self, reward: str = "progress", gamma: float = 0.1, eta: float = 1.0, seed: int = 0
    ) -> None:
        if reward not in REWARDS:
            raise ValueError(f"reward must be one of {REWARDS}, got {reward!r}")
        self.reward = reward
        self.gamma = _number("gamma", gamma, 0.0, 1.0)
        self.eta = _number("eta", eta, 0.0, lo_open=True)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an integer, got {seed!r}")
        self.seed = seed
        self._gains: np.ndarray | None = None  # G
        self._prior: np.ndarray | None = None  # p: the weights at the first update
        self._last: np.ndarray | None = None  # each source's previous mean loss

    def bind(self, names: Sequence[str]) -> None:
        k = len(names)
        self._gains = np.zeros(k)
        self._last = np.full(k, math.nan)

    def update(self, weights: np.ndarray, losses: np.ndarray, rows: np.ndarray) -> np.ndarray:
        assert self._gains is not None, "bind() first"
        assert self._last is not None
        if self._prior is None:
            self._prior = weights.copy()
        seen = (rows > 0) & np.isfinite(losses)
        if self.reward == "loss":
            reward = np.where(seen, losses, 0.0)
        else:
            before = np.isfinite(self._last)
            reward = np.where(seen & before, self._last - np.where(seen, losses, 0.0), 0.0)
            self._last = np.where(seen, losses, self._last)
        share = np.where(seen, rows / max(float(rows.sum()), 1.0), 0.0)
        importance = np.where(seen & (weights > 0), share / np.maximum(weights, 1e-300), 0.0)
        self._gains = self._gains + reward * importance
        logits = np.log(np.maximum(self._prior, 1e-300)) + self.eta * self._gains
        w = np.exp(logits - logits.max()) * (self._prior > 0)
        w /= w.sum()
        return (1.0 - self.gamma) * w + self.gamma / len(w)

    def state_dict(self) -> dict[str, Any]:
        empty: list[float | None] = []
        return {
            "policy": "bandit",
            "reward": self.reward,
            "gamma": self.gamma,
            "eta": self.eta,
            "seed": self.seed,
            "gains": empty if self._gains is None else _plain(self._gains),
            "prior": None if self._prior is None else _plain(self._prior),
            "last_loss": empty if self._last is None else _plain(self._last),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("policy") != "bandit":
            raise ValueError(f"not a Bandit state: {state.get('policy')!r}")
        mine = {"reward": self.reward, "seed": self.seed}
        saved = {k: state.get(k) for k in mine}
        if saved != mine:
            raise ValueError(f"the Bandit state was saved with {saved}, this one has {mine}")
        gains, last = _floats(state["gains"]), _floats(state["last_loss"])
        if self._gains is not None and len(gains) != len(self._gains):
            raise ValueError(
                f"the Bandit state has {len(gains)} sources, the mixture {len(self._gains)}"
            )
        self._gains, self._last = gains, last
        self._prior = None if state["prior"] is None else _floats(state["prior"])
