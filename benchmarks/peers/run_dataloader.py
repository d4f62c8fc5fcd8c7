"""torch's DataLoader as a peer: a map-style Dataset of windows over np.memmap of the
flat token file, the way a training script writes one (nanoGPT's get_batch, made a
Dataset). Runs in the project's venv (it has torch). Variants: `w0`, `w2` workers.

The epoch order is a seeded permutation; the state is (epoch, windows consumed by all
ranks), so a resume slices the same permutation, also at another world size (what a
training script does by hand: the DataLoader keeps no state). A mixture is the
DataLoader's own: WeightedRandomSampler over a ConcatDataset, each window weighted by
its source's weight over the source's size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import BATCH, FlatWindows, LoaderPeer, main
from torch.utils.data import ConcatDataset, DataLoader, Dataset, Sampler, WeightedRandomSampler

MIXTURE_SAMPLES = 1 << 20  # rows per "epoch" of the weighted sampler


class MemmapWindows(FlatWindows, Dataset[torch.Tensor]):
    """The DataLoader's map-style Dataset: window i as an int64 tensor."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(self.window(i).astype(np.int64))


class EpochSampler(Sampler[int]):
    """This rank's windows of a seeded permutation per epoch, from `consumed` windows
    (of all ranks) on, in whole steps of BATCH x world_size."""

    def __init__(self, n: int, seed: int, world_size: int, rank: int) -> None:
        self.n, self.seed, self.world_size, self.rank = n, seed, world_size, rank
        self.epoch, self.consumed = 0, 0

    def steps(self) -> int:
        return (self.n - self.consumed) // (BATCH * self.world_size)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        rest = torch.randperm(self.n, generator=g)[self.consumed :]
        steps = self.steps()
        mine = rest[: steps * BATCH * self.world_size].view(steps, self.world_size, BATCH)
        return iter(mine[:, self.rank].reshape(-1).tolist())

    def __len__(self) -> int:
        return self.steps() * BATCH


class TorchDataLoader(LoaderPeer):
    elastic = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        torch.set_num_threads(1)
        sets = [MemmapWindows(p) for p in self.data]
        if self.weights:
            per_row = [
                w / len(s) for s, w in zip(sets, self.weights, strict=True) for _ in range(len(s))
            ]
            g = torch.Generator().manual_seed(self.seed)
            sampler: Sampler[int] = WeightedRandomSampler(per_row, MIXTURE_SAMPLES, generator=g)
            dataset: Dataset[torch.Tensor] = ConcatDataset(sets)
        else:
            self.sampler = sampler = EpochSampler(
                len(sets[0]), self.seed, self.world_size, self.rank
            )
            dataset = sets[0]
        self.loader = DataLoader(
            dataset,
            batch_size=BATCH,
            sampler=sampler,
            drop_last=True,
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
        )
        self.epoch_no = 0
        self.resumed = False

    def epoch(self) -> Iterator[torch.Tensor]:
        if self.weights:
            yield from self.loader
            return
        s = self.sampler
        if not self.resumed:
            s.epoch, s.consumed = self.epoch_no, 0
        self.resumed = False
        self.epoch_no = s.epoch + 1
        step = BATCH * self.world_size
        for batch in self.loader:
            s.consumed += step  # the loop received it: the position moves past it
            yield batch

    def rows(self, batch: Any) -> np.ndarray:
        return batch.numpy()

    def epoch_batches(self) -> int:
        return self.sampler.n // (BATCH * self.world_size)  # a whole epoch's, from its start

    def state_dict(self) -> Any:
        return {"epoch": self.sampler.epoch, "consumed": self.sampler.consumed}

    def load_state_dict(self, state: Any) -> None:
        self.sampler.epoch, self.sampler.consumed = state["epoch"], state["consumed"]
        self.resumed = True


def write(flats: list[Path], out: Path) -> None:
    """The flat file is this loader's format: nothing to write."""


if __name__ == "__main__":
    main(TorchDataLoader, write)
