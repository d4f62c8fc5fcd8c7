"""Shared fixtures: real stores on disk (no mocks of our own components)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenfeed.server.store import TokenStore, write_store


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


@pytest.fixture
def positional_store(tmp_path: Path) -> TokenStore:
    """10,000 tokens in chunks of 1,000 (uint32, token == position)."""
    return make_positional_store(tmp_path / "positions", 10_000, 1_000)
