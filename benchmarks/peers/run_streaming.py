"""MosaicML Streaming as a peer: MDS shards written by MDSWriter (one sample per window,
an `ndarray:uint16` column, no compression), read by StreamingDataset (its default
shuffle, py1e) through StreamingDataLoader. Variants `w0`, `w2` workers. A mixture is
its own: one Stream per source with `proportion` set to the weight. Its state
(`StreamingDataLoader.state_dict`) is the samples seen this epoch; resuming at another
world size needs every rank of the node running at once (shared memory), which these
adapters, one process each, do not do.
"""

from __future__ import annotations

import gc
import importlib.machinery
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
from harness import BATCH, SEQ_LEN, WINDOW, LoaderPeer, main


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    return module


def _without_torchvision() -> None:
    """`import streaming` imports its image datasets, which import torchvision, whose
    PyPI wheel is linked against torch's CUDA libraries and fails to load beside the CPU
    build. Tokens need none of it: stand-ins for the two names that module takes."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        for name in [n for n in sys.modules if n.startswith("torchvision")]:
            del sys.modules[name]
        tv, datasets, transforms, functional = (
            _module(n)
            for n in (
                "torchvision",
                "torchvision.datasets",
                "torchvision.transforms",
                "torchvision.transforms.functional",
            )
        )
        datasets.VisionDataset = object  # type: ignore[attr-defined]
        functional.to_tensor = None  # type: ignore[attr-defined]
        tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional  # type: ignore[attr-defined]
        sys.modules.update(
            {
                "torchvision": tv,
                "torchvision.datasets": datasets,
                "torchvision.transforms": transforms,
                "torchvision.transforms.functional": functional,
            }
        )


_without_torchvision()
from streaming import MDSWriter, Stream, StreamingDataLoader, StreamingDataset  # noqa: E402
from streaming.base.util import clean_stale_shared_memory  # noqa: E402


class MosaicStreaming(LoaderPeer):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        clean_stale_shared_memory()
        common: dict[str, Any] = {"shuffle": True, "shuffle_seed": self.seed, "batch_size": BATCH}
        if self.weights:
            streams = [
                Stream(local=str(d), proportion=w)
                for d, w in zip(self.data, self.weights, strict=True)
            ]
            self.dataset = StreamingDataset(streams=streams, **common)
        else:
            self.dataset = StreamingDataset(local=str(self.data[0]), **common)
        self.loader = StreamingDataLoader(
            self.dataset,
            batch_size=BATCH,
            num_workers=self.workers,
            persistent_workers=self.workers > 0,
            drop_last=True,
        )

    def rows(self, batch: Any) -> np.ndarray:
        return batch["tokens"].numpy()

    def close(self) -> None:
        super().close()
        del self.loader, self.dataset  # its shared memory goes with it
        gc.collect()
        clean_stale_shared_memory()


def write(flats: list[Path], out: Path) -> None:
    for flat in flats:
        tokens = np.memmap(flat, dtype=np.uint16, mode="r")
        n = (len(tokens) - WINDOW) // SEQ_LEN + 1
        with MDSWriter(
            out=str(out / flat.stem), columns={"tokens": "ndarray:uint16"}, compression=None
        ) as w:
            for i in range(n):
                w.write({"tokens": np.asarray(tokens[i * SEQ_LEN : i * SEQ_LEN + WINDOW])})


if __name__ == "__main__":
    main(MosaicStreaming, write)
