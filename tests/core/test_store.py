"""The token store format: round trips, compatibility, and every malformed store."""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core.dtypes import dtype_for_vocab
from tokenfeed.core.errors import DataLoss, InvalidArgument, NotFound
from tokenfeed.core.store import (
    META_NAME,
    StoreWriter,
    TokenStore,
    checksum,
    is_complete,
    iter_tokens,
    meta,
    write_store,
)


def test_dtype_follows_the_vocabulary() -> None:
    assert dtype_for_vocab(50257) == "uint16"
    assert dtype_for_vocab(65536) == "uint16"
    assert dtype_for_vocab(65537) == "uint32"
    assert dtype_for_vocab(128256) == "uint32"
    with pytest.raises(InvalidArgument):
        dtype_for_vocab(0)


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_round_trip_across_chunks(tmp_path: Path, dtype: str) -> None:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 50_000, size=2_503).astype(dtype)
    meta = write_store(
        tmp_path,
        tokens,
        dtype=dtype,
        tokens_per_chunk=1000,
        eos_token_id=1,
        vocab_size=50_000,
        tokenizer="t",
        source={"files": ["x"]},
    )
    assert [c.tokens for c in meta.chunks] == [1000, 1000, 503]
    store = TokenStore.open(tmp_path)
    assert store.total_tokens == 2503
    assert store.num_chunks == 3
    assert store.chunk_starts.tolist() == [0, 1000, 2000, 2503]
    assert np.array_equal(np.concatenate(list(iter_tokens(store))), tokens)
    raw = (tmp_path / "chunk_000001.bin").read_bytes()
    assert raw == tokens[1000:2000].astype(np.dtype(dtype).newbyteorder("<")).tobytes()
    assert store.chunk_of(999) == 0
    assert store.chunk_of(1000) == 1
    assert store.chunk_of(2502) == 2
    doc = json.loads((tmp_path / META_NAME).read_text())
    for key in (
        "dtype",
        "eos_token_id",
        "tokenizer_name_or_path",
        "tokens_per_chunk",
        "chunks",
        "total_tokens",
        "created_at_unix",
        "format_version",
        "vocab_size",
        "source",
    ):
        assert key in doc
    assert doc["chunks"][0]["checksum"] == checksum(tokens[:1000])
    assert store.verify() == []


def test_meta_json_is_written_last(tmp_path: Path) -> None:
    writer = StoreWriter(tmp_path, dtype="uint16", tokens_per_chunk=10)
    done = writer.add(np.arange(25))
    assert [c.file for c in done] == ["chunk_000000.bin", "chunk_000001.bin"]
    assert not is_complete(tmp_path)
    assert not list(tmp_path.glob("*.tmp"))
    writer.finish()
    assert is_complete(tmp_path)
    assert TokenStore.open(tmp_path).total_tokens == 25


def test_token_ids_that_overflow_are_refused(tmp_path: Path) -> None:
    writer = StoreWriter(tmp_path, dtype="uint16", tokens_per_chunk=10, vocab_size=100)
    with pytest.raises(InvalidArgument, match="token id 100 does not fit"):
        writer.add([1, 2, 100])
    writer = StoreWriter(tmp_path / "b", dtype="uint16", tokens_per_chunk=10)
    with pytest.raises(InvalidArgument, match="70000"):
        writer.add([70000])


def test_streaming_dataloader_store_is_read_as_is(tmp_path: Path) -> None:
    """meta.json as the Streaming-Dataloader prepare script writes it (no checksums)."""
    tokens = np.arange(300, dtype=np.uint16)
    tokens[:150].tofile(tmp_path / "chunk_00000.bin")
    tokens[150:].tofile(tmp_path / "chunk_00001.bin")
    (tmp_path / META_NAME).write_text(
        json.dumps(
            {
                "dtype": "uint16",
                "eos_token_id": 50256,
                "tokenizer_name_or_path": "gpt2",
                "tokens_per_chunk": 150,
                "total_tokens": 300,
                "created_at_unix": 1700000000,
                "chunks": [
                    {"file": "chunk_00000.bin", "tokens": 150},
                    {"file": "chunk_00001.bin", "tokens": 150},
                ],
            }
        )
    )
    store = TokenStore.open(tmp_path)
    assert store.meta.tokenizer == "gpt2"
    assert store.meta.eos_token_id == 50256
    assert np.array_equal(np.concatenate(list(iter_tokens(store))), tokens)
    assert store.verify() == []


def test_bare_bin_folder_needs_a_dtype(tmp_path: Path) -> None:
    np.arange(10, dtype=np.uint32).tofile(tmp_path / "b.bin")
    np.arange(10, 20, dtype=np.uint32).tofile(tmp_path / "a.bin")
    with pytest.raises(InvalidArgument, match="give the dtype"):
        TokenStore.open(tmp_path)
    store = TokenStore.open(tmp_path, dtype="uint32")
    assert [c.file for c in store.meta.chunks] == ["a.bin", "b.bin"]
    assert np.concatenate(list(iter_tokens(store))).tolist() == [*range(10, 20), *range(10)]
    (tmp_path / "c.bin").write_bytes(b"abc")
    with pytest.raises(DataLoss, match="not a whole number"):
        TokenStore.open(tmp_path, dtype="uint32")


def _store(tmp_path: Path) -> Path:
    write_store(
        tmp_path, np.arange(3000) % 50_000, dtype="uint16", tokens_per_chunk=1000, vocab_size=50_000
    )
    return tmp_path


def _lie_without_total(doc: dict) -> None:
    doc["chunks"][1]["tokens"] = 999
    doc.pop("total_tokens")


def _edit_meta(path: Path, edit) -> None:
    doc = json.loads((path / META_NAME).read_text())
    edit(doc)
    (path / META_NAME).write_text(json.dumps(doc))


def test_flipped_byte_is_data_loss_naming_the_chunk(tmp_path: Path) -> None:
    path = _store(tmp_path)
    chunk = path / "chunk_000001.bin"
    data = bytearray(chunk.read_bytes())
    data[77] ^= 0x01
    chunk.write_bytes(bytes(data))
    store = TokenStore.open(path)  # sizes are fine: opening is cheap and succeeds
    with pytest.raises(DataLoss, match=r"chunk_000001\.bin is corrupt"):
        store.read_chunk(1)
    assert len(store.verify()) == 1
    assert "chunk_000001.bin" in store.verify()[0]
    assert store.read_chunk(0).size == 1000  # the others still read


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: _edit_meta(p, lambda d: d.update(total_tokens=9999)), "total_tokens=9999"),
        (lambda p: _edit_meta(p, lambda d: d["chunks"][1].update(tokens=999)), "chunks hold 2999"),
        (lambda p: _edit_meta(p, lambda d: d.update(dtype="int8")), "unknown token dtype"),
        (lambda p: _edit_meta(p, lambda d: d["chunks"].append(d["chunks"][0])), "more than once"),
        (lambda p: _edit_meta(p, lambda d: d["chunks"][0].update(file="../x.bin")), "plain file"),
        (lambda p: _edit_meta(p, lambda d: d.pop("chunks")), "malformed meta.json"),
        (lambda p: (p / META_NAME).write_text("{not json"), "unreadable meta.json"),
    ],
)
def test_malformed_meta_fails_at_open(tmp_path: Path, damage, message) -> None:
    path = _store(tmp_path)
    damage(path)
    with pytest.raises((DataLoss, InvalidArgument), match=message):
        TokenStore.open(path)


@pytest.mark.parametrize(
    ("damage", "chunk", "message"),
    [
        (lambda p: (p / "chunk_000002.bin").write_bytes(b"\0" * 10), 2, "has 10 bytes, expected"),
        (lambda p: (p / "chunk_000000.bin").unlink(), 0, "chunk_000000.bin is missing"),
        (lambda p: _edit_meta(p, _lie_without_total), 1, "2000 bytes, expected 999 tokens"),
        (
            lambda p: _edit_meta(p, lambda d: d.update(dtype="uint32")),
            0,
            "expected 1000 tokens x 4",
        ),
    ],
)
def test_damaged_chunk_fails_at_its_first_read(tmp_path: Path, damage, chunk, message) -> None:
    """Opening reads meta.json only (docs/stores.md, "What is checked when"): a chunk that
    is missing or not the size meta.json gives is DataLoss naming it when it is read."""
    path = _store(tmp_path)
    damage(path)
    store = TokenStore.open(path)
    with pytest.raises(DataLoss, match=message):
        store.read_chunk(chunk)
    assert any(message in problem for problem in store.verify())


def test_missing_store_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(NotFound):
        TokenStore.open(tmp_path / "nope")
    with pytest.raises(NotFound, match=r"neither meta\.json"):
        TokenStore.open(tmp_path)


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that starts at `address` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            flags = next(x for x in lines[i + 1 :] if x.startswith("VmFlags:"))
            return set(flags.split()[1:])
    raise AssertionError(f"no mapping at {address:#x}")


@pytest.mark.skipif(not Path("/proc/self/smaps").exists(), reason="Linux: reads /proc/self/smaps")
def test_a_chunk_is_read_into_private_memory_that_asks_for_huge_pages(tmp_path: Path) -> None:
    """Chunks land in private anonymous maps (shared ones get no transparent huge pages
    unless shmem THP is on) advised MADV_HUGEPAGE: fewer TLB misses for the server's
    row copies (core/store/memory.py)."""
    import ctypes

    from tokenfeed.core.store.memory import HUGE_PAGE

    tokens = np.arange(3 * HUGE_PAGE // 2, dtype=np.uint16)  # one chunk of 3 MiB
    write_store(tmp_path / "s", tokens, dtype="uint16", tokens_per_chunk=tokens.size)
    chunk = TokenStore.open(tmp_path / "s").read_chunk(0)
    assert np.array_equal(chunk, tokens)
    address = ctypes.addressof(ctypes.c_char.from_buffer(chunk.base))
    flags = _vm_flags(address)
    assert "sh" not in flags  # private
    if Path("/sys/kernel/mm/transparent_hugepage").exists():  # THP built into this kernel
        assert "hg" in flags  # MADV_HUGEPAGE


@given(st.binary(max_size=1 << 14), st.integers(0, (1 << 32) - 1))
def test_the_chunk_checksum_is_zlibs_crc32(data: bytes, start: int) -> None:
    # meta.crc32 is ISA-L's when installed (the server extra): the same values as zlib's,
    # so stores written either way verify either way.
    assert meta.crc32(data, start) == zlib.crc32(data, start)
    assert checksum(data) == f"crc32:{zlib.crc32(data):08x}"
