"""What every integration does the same way: import its framework or say which extra
brings it, build each rank's FeederClient, and keep one position per checkpoint.

A FeederClient's position is global (docs/client.md, "Position and state dict"):
after the same number of steps every rank's `state_dict()` is the same, and any
number of ranks can continue it. The frameworks save one entry per rank; `agreed`
checks that a checkpoint's entries are one position before a rank loads it.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterable, Mapping
from types import ModuleType
from typing import Any

from tokenfeed.client import FeederClient
from tokenfeed.core.sampling import steps_per_epoch


def require(module: str, extra: str) -> ModuleType:
    """Import a framework, or ImportError naming the extra that installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"tokenfeed.integrations.{extra} needs {module}: pip install 'tokenfeed[{extra}]'"
        ) from e


def rank_loader(
    loader: FeederClient | Mapping[str, Any],
    rank: int,
    world_size: int,
    what: str,
    **defaults: Any,
) -> FeederClient:
    """`loader` itself, or a FeederClient built from its keyword arguments for this
    rank and world size (`defaults` fill what the arguments leave out)."""
    if isinstance(loader, FeederClient):
        if (loader.rank, loader.world_size) != (rank, world_size):
            raise ValueError(
                f"{what} streams rank {loader.rank} of {loader.world_size}, but this process "
                f"is rank {rank} of {world_size}: pass a FeederClient built for this process, "
                f"or its keyword arguments"
            )
        return loader
    if not isinstance(loader, Mapping):
        raise TypeError(
            f"{what} is a FeederClient or a dict of its keyword arguments, "
            f"got {type(loader).__name__}"
        )
    given = {"rank", "world_size"} & set(loader)
    if given:
        raise TypeError(f"{what}: {sorted(given)} come from the framework, leave them out")
    return FeederClient(**{**defaults, **loader, "rank": rank, "world_size": world_size})


def agreed(states: Iterable[Mapping[str, Any]], where: str) -> dict[str, Any]:
    """The one position of a checkpoint's per-rank states (ValueError if they differ:
    the ranks were saved at different steps)."""
    distinct = {json.dumps(dict(s), sort_keys=True) for s in states}
    if not distinct:
        raise ValueError(f"{where} holds no tokenfeed loader state")
    if len(distinct) > 1:
        raise ValueError(
            f"{where} holds {len(distinct)} different loader positions; every rank saves "
            f"the same one after the same step, so this checkpoint is not of one step"
        )
    return dict(json.loads(distinct.pop()))


class EpochMap:
    """A framework's epoch counter onto the loader's epochs.

    The offset between the two is fixed at the first epoch after a start or a
    resume: then the loader's epoch is its position's (or the next one, if that is
    used up). A framework counts epochs in its own steps or marks a stopped epoch
    done, which after a resume, another world size or gradient accumulation differs
    from the loader's epochs; the loader's position is the one that is exact.
    """

    def __init__(self, loader: FeederClient) -> None:
        self.loader = loader
        self._base: int | None = None

    def reset(self) -> None:
        """A new position was loaded: the offset is fixed again at the next epoch."""
        self._base = None

    def __call__(self, epoch: int) -> int:
        """The loader's epoch for the framework's `epoch`."""
        if self._base is None:
            loader = self.loader
            own = int(loader.state_dict()["epoch"])
            if not loader.is_mixture and loader.steps_left == 0:
                own += 1
            self._base = own - epoch
        return epoch + self._base


def common_steps(loader: FeederClient) -> int:
    """Steps of a full epoch that every rank has: validation gives the ranks of a
    short last step one step more than the others (docs/sampling.md, "Steps and
    ranks"), and a framework that gathers across ranks at every step needs equal
    counts."""
    info = loader.dataset_info
    return steps_per_epoch(
        info.windows, loader.batch_size, loader.world_size, loader.world_size - 1, loader.split
    )
