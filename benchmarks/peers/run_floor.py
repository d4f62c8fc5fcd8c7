"""The harness's floor, not a loader: one batch built once and handed out again and
again, with no reading, no copy and no thread. Its stall at --step-ms steps is what a
Python iterator costs the loop on this machine at that moment (the interpreter resuming
after the step's sleep), so the loaders' stalls are read against it. Runs in the
project's venv; the one-dataset run only (peers.py never compares a loader with it).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from harness import BATCH, FlatWindows, Peer, main


class Ready(Peer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        windows = FlatWindows(self.data[0])
        self.n = len(windows) // (BATCH * self.world_size)
        self.batch = np.stack([windows.window(i) for i in range(BATCH)])

    def epoch(self) -> Iterator[np.ndarray]:
        for _ in range(self.n):
            yield self.batch

    def rows(self, batch: Any) -> np.ndarray:
        return batch  # type: ignore[no-any-return]

    def epoch_batches(self) -> int:
        return self.n


def write(flats: list[Path], out: Path) -> None:
    """The flat file is all it reads: nothing to write."""


if __name__ == "__main__":
    main(Ready, write)
