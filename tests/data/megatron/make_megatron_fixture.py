"""Regenerate tests/data/megatron/* with megatron-core's own IndexedDatasetBuilder.

    python tests/data/megatron/make_megatron_fixture.py   # in a venv with megatron-core

Needs megatron-core (0.16.1 is the newest for Python 3.11) and torch. Writes, for each
case, PREFIX.bin + PREFIX.idx and PREFIX.json (the documents as lists of sentences of
token ids, which the tests compare the reader against). Deterministic: same bytes on
every run.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import numpy as np

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder  # noqa: E402

OUT = Path(__file__).resolve().parent


def corpus(seed: int, high: int) -> list[list[list[int]]]:
    """Documents made of sentences; one empty document, one empty sentence."""
    rng = np.random.default_rng(seed)
    docs = []
    for _d in range(12):
        n_sent = int(rng.integers(1, 4))
        docs.append(
            [rng.integers(0, high, int(rng.integers(1, 9))).tolist() for _ in range(n_sent)]
        )
    docs[3] = []  # a document with no sentences
    docs[5][0] = []  # an empty sentence
    docs[0][0][0] = high - 1  # the largest id appears
    return docs


def write(
    name: str, dtype: type, docs: list[list[list[int]]], *, per_item: bool, multimodal: bool = False
) -> None:
    prefix = OUT / name
    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=dtype, multimodal=multimodal)
    for doc in docs:
        if per_item:  # preprocess_data.py with --split-sentences: add_item per sentence
            for i, sent in enumerate(doc):
                b.add_item(torch.tensor(sent, dtype=torch.int64), mode=i % 2)
            b.end_document()
        else:  # one add_document call with the sentence lengths
            flat = [t for s in doc for t in s]
            modes = [i % 2 for i in range(len(doc))] if multimodal else None
            b.add_document(torch.tensor(flat, dtype=torch.int64), [len(s) for s in doc], modes)
    b.finalize(str(prefix) + ".idx")
    (OUT / f"{name}.json").write_text(json.dumps({"dtype": np.dtype(dtype).name, "docs": docs}))


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    write("u16_items", np.uint16, corpus(1, 65535), per_item=True)
    write("i32_docs", np.int32, corpus(2, 200_000), per_item=False)
    write("u8_docs", np.uint8, corpus(3, 255), per_item=False)
    write("i64_items", np.int64, corpus(4, 1 << 40), per_item=True)
    write("u16_multimodal", np.uint16, corpus(5, 50_000), per_item=True, multimodal=True)
    for p in sorted(OUT.iterdir()):
        print(p.name, p.stat().st_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
