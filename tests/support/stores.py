"""Stores the tests read: positional (token i == i, so every window is checkable),
documents ending in EOS, Megatron indexed datasets; and a DatasetSampler over a store."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import DEFAULT_BLOCK_TOKENS, DatasetSampler
from tokenfeed.core.store import TokenStore, write_store


def make_sampler(
    total_tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, **spec
) -> DatasetSampler:
    """A DatasetSampler from SamplingSpec fields (dataset defaults to "t")."""
    return DatasetSampler(SamplingSpec(**{"dataset": "t", **spec}), total_tokens, block_tokens)


def make_positional_store(
    path: Path, total_tokens: int, tokens_per_chunk: int, dtype: str = "uint32"
) -> TokenStore:
    """A store whose token at position i is i (mod the dtype), so every window is checkable."""
    tokens = np.arange(total_tokens, dtype=np.int64) % (np.iinfo(np.dtype(dtype)).max + 1)
    vocab = int(np.iinfo(np.dtype(dtype)).max) + 1
    write_store(
        path,
        tokens.astype(dtype),
        dtype=dtype,
        tokens_per_chunk=tokens_per_chunk,
        eos_token_id=0,
        vocab_size=vocab,
        tokenizer="positions",
        source={"kind": "test", "generator": "positions"},
    )
    return TokenStore.open(path)


MIXTURE_SOURCES = {"a": (6_000, 1_000), "b": (2_000, 500), "c": (900, 300)}  # tokens, chunk


def make_mixture_root(root: Path) -> Path:
    """A data root of three positional sources of different sizes (MIXTURE_SOURCES),
    for mixtures whose weights change while they stream."""
    for name, (tokens, chunk) in MIXTURE_SOURCES.items():
        make_positional_store(root / name, tokens, chunk)
    return root


def positional_rows(starts: Any, cols: int, modulo: int | None = None) -> np.ndarray:
    """The rows a positional store (token i == i, mod the dtype) holds at `starts`."""
    rows = np.asarray(starts, dtype=np.int64)[:, None] + np.arange(cols)
    return rows if modulo is None else rows % modulo


def assert_positional_batch(batch: dict[str, Any], seq_len: int) -> None:
    """A client batch from a positional store: input_ids and labels are the windows
    at `starts`, labels shifted by the batch's shift."""
    want = positional_rows(batch["starts"], seq_len + batch["shift"])
    np.testing.assert_array_equal(np.asarray(batch["input_ids"]), want[:, :seq_len])
    np.testing.assert_array_equal(np.asarray(batch["labels"]), want[:, batch["shift"] :])


DOCUMENT_EOS = 7  # the EOS of make_document_store's stores


def make_document_store(
    path: Path,
    total: int = 12_000,
    mean: float = 40.0,
    seed: int = 0,
    dtype: str = "uint16",
    eos: int | None = DOCUMENT_EOS,
    tokens_per_chunk: int = 1_000,
) -> np.ndarray:
    """A store of documents ending in EOS (lengths from 1 up, geometric); returns T.
    With eos=None the meta.json has no eos_token_id (the tokens are the same)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(DOCUMENT_EOS + 1, 500, size=total)
    lengths = rng.geometric(1 / mean, size=total)
    ends = np.cumsum(lengths) - 1
    tokens[ends[ends < total]] = DOCUMENT_EOS
    write_store(
        path,
        tokens.astype(dtype),
        dtype=dtype,
        tokens_per_chunk=tokens_per_chunk,
        eos_token_id=eos,
        vocab_size=500,
        tokenizer="synthetic",
        source={"kind": "test", "generator": "documents"},
    )
    return tokens


def write_megatron(prefix: Path, docs: list[list[np.ndarray]]) -> Path:
    """A Megatron-LM indexed dataset (uint16) of documents made of sequences (sentences),
    written from the documented layout (test_stores_formats pins it to megatron-core's)."""
    import struct

    prefix.parent.mkdir(parents=True, exist_ok=True)
    seqs = [s for d in docs for s in d]
    lengths = np.array([len(s) for s in seqs], dtype="<i4")
    pointers = (np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2).astype("<i8")
    doc_index = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, len(seqs), len(doc_index))
    prefix.with_name(prefix.name + ".idx").write_bytes(
        header + lengths.tobytes() + pointers.tobytes() + doc_index.tobytes()
    )
    np.concatenate(seqs).astype("<u2").tofile(prefix.with_name(prefix.name + ".bin"))
    return prefix


def megatron_corpus(root: Path, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Documents of 1-3 sentences, tokens 0-9 (so "EOS-like" ids occur anywhere): the
    store's token array and its document ends."""
    rng = np.random.default_rng(seed)
    docs = [
        [rng.integers(0, 10, size=int(rng.integers(1, 40))) for _ in range(int(rng.integers(1, 4)))]
        for _ in range(300)
    ]
    write_megatron(root / "mg" / "corpus", docs)
    tokens = np.concatenate([s for d in docs for s in d])
    ends = np.cumsum([sum(len(s) for s in d) for d in docs])
    return tokens, ends


COUNTING = "mod512"  # write_counting_store's dataset name


def write_counting_store(root: Path, tokens: int) -> Path:
    """Dataset COUNTING under `root`: token i is i mod 512 (uint16, vocabulary 512), so
    the next token always follows and a tiny model learns it in a few dozen steps."""
    write_store(
        root / COUNTING,
        (np.arange(tokens) % 512).astype(np.uint16),
        dtype="uint16",
        tokens_per_chunk=4_000,
        vocab_size=512,
        eos_token_id=511,
        tokenizer="mod512",
    )
    return root / COUNTING
