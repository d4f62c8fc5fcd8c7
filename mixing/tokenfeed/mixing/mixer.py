"""`OnlineMixer`: a mixture's weights driven by the training loop's losses.

    mixer = OnlineMixer(loader, Bandit(reward="progress"), every=50)
    for batch in loader:
        loss_per_row = ...                      # [B]: each row's mean token loss
        mixer.observe(batch, loss_per_row)
        mixer.step()                            # every 50 steps: new weights from the next

docs/mixing.md is the contract. `observe` adds each row's loss to its source's sum
(`batch["sources"]`), on the loss's device for a tensor (no sync per step); every
`every` calls of `step`, the sums and row counts are summed over ranks with
torch.distributed when a process group is initialized (so every rank computes the same
weights), the policy turns the interval's mean losses into weights, `bounds` bounds and
rounds them, and the loader's `set_weights` applies them from the step after the last
observed batch, on every rank at the same step. torch is never imported here: a loss
tensor brings it, and a process group needs it.
"""

from __future__ import annotations

import logging
import math
import sys
from collections.abc import Mapping
from typing import Any

import numpy as np

from tokenfeed.client import FeederClient
from tokenfeed.mixing.bounds import bounded, rounded
from tokenfeed.mixing.policies import Policy

log = logging.getLogger("tokenfeed.mixing")

MAX_RESOLUTION = 9  # decimals: 10**9 units still sum exactly in float64 and int64


class OnlineMixer:
    """Drives `loader`'s mixture weights with `policy` every `every` steps.

    `min_weight` and `max_change` bound the normalized weights (each at least
    `min_weight`; none moving more than `max_change` per update); both apply before
    the weights are rounded to `resolution` decimals, which still sum to exactly 1.
    `weights` is the mixer's current weights; `state_dict()` holds the policy's state
    and this rank's sums since the last update (resume on the same world size).
    """

    def __init__(
        self,
        loader: FeederClient,
        policy: Policy,
        *,
        every: int,
        min_weight: float = 0.0,
        max_change: float | None = None,
        resolution: int = 4,
    ) -> None:
        if not getattr(loader, "is_mixture", False):
            raise TypeError(f"OnlineMixer drives a mixture's weights; got {loader!r}")
        for name in ("bind", "update", "state_dict", "load_state_dict"):
            if not callable(getattr(policy, name, None)):
                raise TypeError(
                    f"policy must be a mixing policy (ExcessLoss, Bandit), got {policy!r}"
                )
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive integer (steps), got {every!r}")
        names = tuple(loader.sources)
        k = len(names)
        if isinstance(resolution, bool) or not isinstance(resolution, int):
            raise TypeError(f"resolution must be an integer (decimals), got {resolution!r}")
        if not 1 <= resolution <= MAX_RESOLUTION:
            raise ValueError(
                f"resolution must be in [1, {MAX_RESOLUTION}] decimals, got {resolution}"
            )
        if not (isinstance(min_weight, (int, float)) and 0 <= min_weight <= 1 / k):
            raise ValueError(
                f"min_weight must be in [0, 1/{k}] for {k} sources, got {min_weight!r}"
            )
        if max_change is not None and not (
            isinstance(max_change, (int, float)) and 0 < max_change <= 1
        ):
            raise ValueError(f"max_change must be None or in (0, 1], got {max_change!r}")
        self.loader, self.policy, self.names = loader, policy, names
        self.every, self.resolution = every, resolution
        self.min_weight = float(min_weight)
        self.max_change = None if max_change is None else float(max_change)
        policy.bind(names)
        self._weights = np.array([loader.weights[n] for n in names], dtype=np.float64)
        self.steps = 0  # step() calls so far
        self.updates = 0
        self._last_step: int | None = None  # the last observed batch's step
        self._sums: Any = np.zeros(k)  # per source: loss sum, then rows (numpy or torch)
        self._rows: Any = np.zeros(k)

    @property
    def weights(self) -> dict[str, float]:
        """The weights in force since the last update (normalized)."""
        return {n: float(w) for n, w in zip(self.names, self._weights, strict=True)}

    # ---------------------------------------------------------------- each step
    def observe(self, batch: Mapping[str, Any], loss_per_row: Any) -> None:
        """Add a batch's per-row losses (a tensor or array of B values, in the batch's
        row order) to their sources' sums."""
        sources = np.asarray(batch["sources"], dtype=np.int64)
        if hasattr(loss_per_row, "detach"):  # a torch tensor: summed where it is
            losses = loss_per_row.detach().reshape(-1)
            if losses.shape[0] != len(sources):
                raise ValueError(
                    f"loss_per_row has {losses.shape[0]} values, the batch {len(sources)} rows"
                )
            self._add_tensor(sources, losses)
        else:
            values = np.asarray(loss_per_row, dtype=np.float64).reshape(-1)
            if len(values) != len(sources):
                raise ValueError(
                    f"loss_per_row has {len(values)} values, the batch {len(sources)} rows"
                )
            k = len(self.names)
            self._sums = self._sums + np.bincount(sources, weights=values, minlength=k)
            self._rows = self._rows + np.bincount(sources, minlength=k)
        self._last_step = int(batch["step"])

    def _add_tensor(self, sources: np.ndarray, losses: Any) -> None:
        torch = sys.modules["torch"]
        device = losses.device
        if not isinstance(self._sums, torch.Tensor) or self._sums.device != device:
            self._sums = torch.as_tensor(_host(self._sums), dtype=torch.float64, device=device)
            self._rows = torch.as_tensor(_host(self._rows), dtype=torch.float64, device=device)
        index = torch.as_tensor(sources, device=device)
        self._sums.index_add_(0, index, losses.to(torch.float64))
        self._rows.index_add_(0, index, torch.ones_like(losses, dtype=torch.float64))

    def step(self) -> None:
        """Once per training step, after `observe`: every `every` steps, new weights from
        the next step on."""
        self.steps += 1
        if self.steps % self.every == 0:
            self._update()

    def _update(self) -> None:
        sums, rows = _all_reduce(self._sums, self._rows)
        k = len(self.names)
        self._sums, self._rows = np.zeros(k), np.zeros(k)
        ok = np.isfinite(sums)
        if not ok.all():
            log.warning(
                "mixer: non-finite losses for %s over the last %d steps; left out",
                [n for n, good in zip(self.names, ok, strict=True) if not good],
                self.every,
            )
        rows = np.where(ok, rows, 0.0)
        losses = np.divide(sums, rows, out=np.full(k, math.nan), where=rows > 0)
        self.loader.metrics.mixer_loss(dict(zip(self.names, losses.tolist(), strict=True)))
        target = self.policy.update(self._weights.copy(), losses, rows)
        units = rounded(
            bounded(target, self._weights, self.min_weight, self.max_change), self.resolution
        )
        weights = units / 10**self.resolution
        self.updates += 1
        if np.array_equal(weights, self._weights):
            return
        at_step = None if self._last_step is None else self._last_step + 1
        step = self.loader.set_weights(
            dict(zip(self.names, weights.tolist(), strict=True)), at_step=at_step
        )
        self._weights = weights
        log.info(
            "mixer: weights from step %d: %s (mean loss %s)",
            step,
            " ".join(
                f"{n}={w:.{self.resolution}f}" for n, w in zip(self.names, weights, strict=True)
            ),
            " ".join(f"{n}={x:.4g}" for n, x in zip(self.names, losses, strict=True)),
        )

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The policy's state, the current weights and this rank's sums since the last
        update: plain JSON."""
        return {
            "sources": list(self.names),
            "steps": self.steps,
            "updates": self.updates,
            "last_step": self._last_step,
            "weights": self._weights.tolist(),
            "sums": _host(self._sums).tolist(),
            "rows": _host(self._rows).tolist(),
            "policy": self.policy.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue from a `state_dict()` (ValueError, changing nothing, if it was saved
        for other sources)."""
        if list(state.get("sources", ())) != list(self.names):
            raise ValueError(
                f"the mixer state is for sources {state.get('sources')}, this mixture has "
                f"{list(self.names)}"
            )
        k = len(self.names)
        arrays = [np.array(state[key], dtype=np.float64) for key in ("weights", "sums", "rows")]
        if any(a.shape != (k,) for a in arrays):
            raise ValueError(f"the mixer state's weights, sums and rows need {k} values each")
        self.policy.load_state_dict(state["policy"])
        self._weights, self._sums, self._rows = arrays
        self.steps, self.updates = int(state["steps"]), int(state["updates"])
        last = state["last_step"]
        self._last_step = None if last is None else int(last)


def _host(values: Any) -> np.ndarray:
    """Sums on the host as float64 (a tensor is copied off its device)."""
    if hasattr(values, "detach"):
        return values.detach().to("cpu").double().numpy()
    return np.asarray(values, dtype=np.float64)


def _all_reduce(sums: Any, rows: Any) -> tuple[np.ndarray, np.ndarray]:
    """(sums, rows) summed over the ranks of torch.distributed's default group when one
    is initialized (every rank gets the same), else this rank's, on the host."""
    torch = sys.modules.get("torch")  # not imported here: no torch, no process group
    dist = getattr(torch, "distributed", None)
    if torch is None or dist is None or not dist.is_available() or not dist.is_initialized():
        return _host(sums), _host(rows)
    nccl = dist.get_backend() == "nccl"  # its collectives take CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def tensor(x: Any) -> Any:
        t = x if isinstance(x, torch.Tensor) else torch.from_numpy(_host(x))
        return t.to(device=device, dtype=torch.float64)

    both = torch.cat([tensor(sums), tensor(rows)])
    dist.all_reduce(both)  # a sum
    out = _host(both)
    k = len(out) // 2
    return out[:k], out[k:]
