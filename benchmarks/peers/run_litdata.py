"""LitData as a peer: `optimize` with TokensLoader (the flat tokens in chunks of 2,048
windows), read by StreamingDataset(item_loader=TokensLoader(block_size=1025)) through
StreamingDataLoader. TokensLoader cuts blocks end to end (stride 1,025, not 1,024): the
same tokens, 0.1 % fewer windows. Variants `w0`, `w2` workers. A mixture is its own:
CombinedStreamingDataset with `weights`. Its state refuses another world size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from harness import BATCH, WINDOW, LoaderPeer, main
from litdata import (
    CombinedStreamingDataset,
    StreamingDataLoader,
    StreamingDataset,
    TokensLoader,
    optimize,
)

PIECE = 1 << 22  # tokens per input of optimize: bounded memory


class LitData(LoaderPeer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        sets = [
            StreamingDataset(
                input_dir=str(d),
                item_loader=TokensLoader(block_size=WINDOW),
                shuffle=True,
                drop_last=True,
                seed=self.seed,
            )
            for d in self.data
        ]
        dataset: Any = sets[0]
        if self.weights:
            dataset = CombinedStreamingDataset(
                sets, seed=self.seed, weights=self.weights, iterate_over_all=False
            )
        self.loader = StreamingDataLoader(
            dataset, batch_size=BATCH, num_workers=self.workers, drop_last=True
        )

    def rows(self, batch: Any) -> np.ndarray:
        return batch.numpy()


def pieces(flat: str) -> Iterator[torch.Tensor]:
    tokens = np.memmap(flat, dtype=np.uint16, mode="r")
    for start in range(0, len(tokens), PIECE):
        yield torch.from_numpy(np.array(tokens[start : start + PIECE]))


def write(flats: list[Path], out: Path) -> None:
    for flat in flats:
        optimize(
            fn=pieces,
            inputs=[str(flat)],
            output_dir=str(out / flat.stem),
            chunk_size=WINDOW * 2048,
            item_loader=TokensLoader(),
            num_workers=1,
            mode="overwrite",
            verbose=False,
        )


if __name__ == "__main__":
    main(LitData, write)
