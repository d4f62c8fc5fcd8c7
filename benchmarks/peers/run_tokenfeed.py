"""tokenfeed as a peer: FeederClient from the feeder benchmarks/peers.py started.

Runs in the project's venv. `--data` names datasets under the feeder's data root (the
address is in TOKENFEED_ADDRESS); variants `numpy` (device=None: uint16 views) and
`torch` (device="cpu": int64 tensors). The format is tokenfeed's store, written from
the flat file by `tokenfeed import --format nanogpt` (a flat uint16 file is nanoGPT's
.bin).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from harness import BATCH, SEQ_LEN, LoaderPeer, main

from tokenfeed.client import FeederClient  # imported before the clock, as every peer is

if "torch" in sys.argv:  # a trainer has torch imported already, as the other adapters do
    import torch  # noqa: F401


class Tokenfeed(LoaderPeer):
    elastic = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        common: dict[str, Any] = {
            "seq_len": SEQ_LEN,
            "batch_size": BATCH,
            "shuffle": True,
            "seed": self.seed,
            "rank": self.rank,
            "world_size": self.world_size,
            "device": "cpu" if self.variant == "torch" else None,
        }
        address = os.environ["TOKENFEED_ADDRESS"]
        if self.weights:
            mixture = {d.name: w for d, w in zip(self.data, self.weights, strict=True)}
            self.loader = FeederClient(address, mixture=mixture, **common)
        else:
            self.loader = FeederClient(address, dataset=self.data[0].name, **common)
        self.next_epoch = 0

    def epoch(self) -> Any:
        if not self.weights:  # a mixture is one endless stream
            self.loader.set_epoch(self.next_epoch)
            self.next_epoch += 1
        return self.loader

    def rows(self, batch: Any) -> np.ndarray:
        return np.asarray(batch["input_ids"])

    def load_state_dict(self, state: Any) -> None:
        super().load_state_dict(state)
        self.next_epoch = state["epoch"]  # set_epoch of the saved epoch keeps its position

    def close(self) -> None:
        self.loader.close()


def write(flats: list[Path], out: Path) -> None:
    from tokenfeed.cli import main as tokenfeed

    code = tokenfeed(["import", "--format", "nanogpt", *map(str, flats), "--output", str(out)])
    if code:
        raise SystemExit(code)


if __name__ == "__main__":
    main(Tokenfeed, write)
