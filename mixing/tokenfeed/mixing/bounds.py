"""What every policy's weights go through before a mixer uses them: the bounds, then the
rounding (docs/mixing.md, "Bounds and rounding"). Pure numpy, deterministic: the same
floats give the same weights on every rank and every machine.

* `bounded`: the Euclidean projection of the policy's weights (normalized) onto the
  weight vectors that sum to 1, give every source at least `min_weight` and move none
  by more than `max_change` from the current weights. A source below `min_weight`
  now (a constructor's weight, say) rises by at most `max_change` per update.
* `rounded`: to `resolution` decimals that still sum to exactly 1 (largest remainder,
  ties to the earlier source), so a run-time segment is a few short decimals.
"""

from __future__ import annotations

import numpy as np

_BISECTIONS = 200  # halvings of the threshold's interval: far below a float's spacing


def bounded(
    target: np.ndarray,
    current: np.ndarray,
    min_weight: float = 0.0,
    max_change: float | None = None,
) -> np.ndarray:
    """`target` (>= 0, not all 0) normalized, then the nearest weights (sum 1) within the
    bounds: each >= `min_weight`, and each within `max_change` of `current` (sum 1)."""
    target = np.asarray(target, dtype=np.float64)
    current = np.asarray(current, dtype=np.float64)
    if not (np.isfinite(target).all() and (target >= 0).all() and target.sum() > 0):
        raise ValueError(f"weights must be finite, >= 0 and not all 0, got {target.tolist()}")
    target = target / target.sum()
    lo = np.full_like(target, min_weight)
    hi = np.ones_like(target)
    if max_change is not None:
        lo = np.maximum(lo, current - max_change)
        hi = np.minimum(hi, current + max_change)
        lo = np.minimum(lo, hi)  # below min_weight now: up by max_change at most
        if lo.sum() > 1:  # not every low source can rise that far at once
            lo = np.minimum(lo, current)
    if lo.sum() > 1 or hi.sum() < 1:
        raise ValueError(
            f"no weights sum to 1 within the bounds (min_weight {min_weight}, max_change "
            f"{max_change}) from {current.tolist()}"
        )
    # w(tau) = clip(target - tau, lo, hi) sums to 1 at one tau: it decreases with tau
    a, b = float((target - hi).min()), float((target - lo).max())
    for _ in range(_BISECTIONS):
        mid = (a + b) / 2
        if mid in (a, b):
            break
        if np.clip(target - mid, lo, hi).sum() > 1:
            a = mid
        else:
            b = mid
    w = np.clip(target - (a + b) / 2, lo, hi)
    return w / w.sum()


def rounded(weights: np.ndarray, resolution: int) -> np.ndarray:
    """`weights` (sum 1) as integers in units of 10**-resolution that sum to
    10**resolution: each floored, then the units left over to the largest remainders
    (ties to the earlier source)."""
    scale = 10**resolution
    exact = np.asarray(weights, dtype=np.float64) * scale
    units = np.floor(exact).astype(np.int64)
    left = scale - int(units.sum())
    if left < 0 or left > len(units):
        raise ValueError(f"weights must sum to 1, got {float(np.sum(weights))}")
    order = np.lexsort((np.arange(len(units)), -(exact - units)))
    units[order[:left]] += 1
    return units
