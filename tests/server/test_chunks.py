"""chunks.MappedStore: chunks mapped from their files, checked once per node."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from tokenfeed.core.errors import ChecksumMismatch, DataLoss
from tokenfeed.core.store import TokenStore
from tokenfeed.server.chunks import MappedStore, VerifiedChunks

from support.stores import make_positional_store


def open_mapped(path: Path, verified: VerifiedChunks | None) -> MappedStore:
    store = MappedStore.opener(verified)(path)
    assert isinstance(store, MappedStore)
    return store


def flip_byte(path: Path, at: int = 5) -> None:
    """Corrupt a chunk file in place (same inode, same size)."""
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0xFF]))


def test_mapped_chunks_equal_the_private_reads(tmp_path: Path) -> None:
    private = make_positional_store(tmp_path / "s", 10_000, 1_000)
    mapped = open_mapped(tmp_path / "s", VerifiedChunks(tmp_path / "v"))
    for i in range(private.num_chunks):
        a, b = private.read_chunk(i), mapped.read_chunk(i)
        assert np.array_equal(a, b)
        assert a.dtype == b.dtype
        assert not b.flags.writeable  # a shared map is read-only


def test_checksum_checked_once_per_node_and_again_for_a_new_file(tmp_path: Path) -> None:
    make_positional_store(tmp_path / "s", 10_000, 1_000)
    verified = VerifiedChunks(tmp_path / "v")
    worker_a = open_mapped(tmp_path / "s", verified)
    worker_b = open_mapped(tmp_path / "s", verified)
    worker_a.read_chunk(0)  # checked, marked
    assert len(os.listdir(verified.directory)) == 1
    worker_b.read_chunk(0)  # trusts the marker: no second pass
    assert len(os.listdir(verified.directory)) == 1
    # A corrupt chunk that no one has checked yet is refused, with the file named ...
    flip_byte(worker_a.chunk_path(1))
    with pytest.raises(ChecksumMismatch, match="chunk_000001"):
        worker_b.read_chunk(1)
    # ... and a rewritten chunk file (new inode, as prepare writes them) is checked again.
    path = worker_a.chunk_path(0)
    data = bytearray(path.read_bytes())
    data[0] ^= 0xFF
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(bytes(data))
    os.replace(tmp, path)
    with pytest.raises(ChecksumMismatch, match="chunk_000000"):
        worker_a.read_chunk(0)


def test_without_a_shared_record_every_map_is_checked(tmp_path: Path) -> None:
    make_positional_store(tmp_path / "s", 10_000, 1_000)
    store = open_mapped(tmp_path / "s", None)
    store.read_chunk(2)
    flip_byte(store.chunk_path(2))
    with pytest.raises(ChecksumMismatch):
        store.read_chunk(2)


def test_a_short_chunk_is_data_loss(tmp_path: Path) -> None:
    make_positional_store(tmp_path / "s", 10_000, 1_000)
    store = open_mapped(tmp_path / "s", VerifiedChunks(tmp_path / "v"))
    with open(store.chunk_path(3), "r+b") as f:
        f.truncate(100)
    with pytest.raises(DataLoss, match=r"chunk_000003\.bin holds 25 tokens, meta\.json says 1000"):
        store.read_chunk(3)
    assert isinstance(store, TokenStore)
