"""Grain as a peer: a random-access data source of windows over np.memmap of the flat
file, MapDataset shuffled (a new order every epoch) and repeated, batched by 16, as an
IterDataset read in this process with no read threads (`w0`, like the DataLoader's
0 workers) or with its default read threads and mp_prefetch over 2 worker processes
(`w2`). A mixture is its own: MapDataset.mix with the weights. Its state
(the iterator's get_state) refuses another sharding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import numpy as np
from harness import BATCH, FlatWindows, Peer, main


class MemmapWindows(FlatWindows):
    """Grain's random-access data source: window i as a numpy array."""

    def __getitem__(self, i: int) -> np.ndarray:
        return np.asarray(self.window(i))


class Grain(Peer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sources = [MemmapWindows(p) for p in self.data]
        self.windows = len(sources[0])
        sets = [
            grain.MapDataset.source(s).shuffle(seed=self.seed + i).repeat(None)
            for i, s in enumerate(sources)
        ]
        ds = sets[0] if not self.weights else grain.MapDataset.mix(sets, self.weights)
        batches = ds.batch(BATCH, drop_remainder=True)
        if not self.workers:  # all in this process, as the DataLoader's w0
            it = batches.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        else:
            it = batches.to_iter_dataset()
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=self.workers))
        self.it = iter(it)

    def epoch(self) -> Any:
        return self.it  # endless: epochs follow each other in the repeated dataset

    def rows(self, batch: Any) -> np.ndarray:
        return batch

    def epoch_batches(self) -> int:
        return self.windows // BATCH

    def state_dict(self) -> Any:
        return self.it.get_state()

    def load_state_dict(self, state: Any) -> None:
        self.it.set_state(state)

    def close(self) -> None:
        close = getattr(self.it, "close", None)
        if close is not None:
            close()


def write(flats: list[Path], out: Path) -> None:
    """The flat file is this loader's format: nothing to write."""


if __name__ == "__main__":
    main(Grain, write)
