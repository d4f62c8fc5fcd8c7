"""Feeders for the framework integrations: vocabularies small enough for a tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest

from support.feeders import running_feeder
from support.stores import make_document_store, write_counting_store


@pytest.fixture
def lm_root(tmp_path: Path) -> Path:
    """A data root with the counting store (40,000 tokens) and `docs`
    (make_document_store: vocabulary 500, EOS 7)."""
    root = tmp_path / "lm-data"
    write_counting_store(root, 40_000)
    make_document_store(root / "docs")
    return root


@pytest.fixture
def lm_feeder(lm_root: Path):
    with running_feeder(lm_root) as f:
        yield f
