"""`tokenfeed info` / `tokenfeed verify`: what they print and their exit codes.

On stores tokenfeed did not write (the Streaming-Dataloader meta.json, a folder of
bare *.bin files with --dtype) and damaged ones (flipped byte, truncated or missing
file). How the reader itself treats those stores is test_store.py's.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenfeed.cli import main
from tokenfeed.core.store import TokenStore

from support.stores import make_positional_store, make_sampler


def run(capsys, *argv: object) -> tuple[int, str, str]:
    capsys.readouterr()
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def streaming_dataloader_store(path: Path) -> None:
    """A store exactly as the Streaming-Dataloader prepare script lays it out."""
    path.mkdir()
    rng = np.random.default_rng(7)
    sizes = [1000, 1000, 437]
    chunks = []
    for i, n in enumerate(sizes):
        toks = rng.integers(0, 50257, n).astype(np.uint16)
        toks[-1] = 50256
        toks.tofile(path / f"chunk_{i:06d}.bin")
        chunks.append({"file": f"chunk_{i:06d}.bin", "tokens": n})
    meta = {
        "dtype": "uint16",
        "eos_token_id": 50256,
        "tokenizer_name_or_path": "gpt2",
        "tokens_per_chunk": 1000,
        "chunks": chunks,
        "total_tokens": sum(sizes),
        "created_at_unix": 1700000000,
    }
    (path / "meta.json").write_text(json.dumps(meta))


def test_streaming_dataloader_store_is_read_as_is(tmp_path, capsys):
    path = tmp_path / "sdl"
    streaming_dataloader_store(path)
    code, out, _ = run(capsys, "info", path, "--json")
    doc = json.loads(out)
    assert code == 0
    assert doc["format"] == "Streaming-Dataloader meta.json"
    assert (doc["total_tokens"], doc["chunks"], doc["eos_token_id"]) == (2437, 3, 50256)
    assert doc["tokenizer"] == "gpt2"
    assert doc["checksums"] == 0
    code, out, _ = run(capsys, "verify", path)
    assert code == 0
    assert "no checksums" in out


def test_bare_bin_folder_needs_dtype(tmp_path, capsys):
    path = tmp_path / "bare"
    path.mkdir()
    np.arange(300, dtype="<u4").tofile(path / "a.bin")
    np.arange(300, 500, dtype="<u4").tofile(path / "b.bin")
    code, _, err = run(capsys, "info", path)
    assert code == 2
    assert "no meta.json: pass --dtype uint16 or --dtype uint32" in err
    code, out, _ = run(capsys, "info", path, "--dtype", "uint32", "--json")
    doc = json.loads(out)
    assert code == 0
    assert (doc["total_tokens"], doc["chunks"]) == (500, 2)
    assert doc["format"] == "bare *.bin files"
    assert run(capsys, "verify", path, "--dtype", "uint32")[0] == 0


def test_info_text_and_windows_match_the_sampling_engine(positional_store, capsys):
    path = positional_store.path
    code, out, _ = run(
        capsys,
        "info",
        path,
        "--seq-len",
        64,
        "--stride",
        32,
        "--split-rate",
        0.9,
        "--shift",
        "auto",
        "--batch-size",
        4,
        "--world-size",
        2,
    )
    assert code == 0
    assert "total_tokens" in out
    assert "10000" in out
    assert "uint32" in out
    for split in ("train", "validation"):
        sampler = make_sampler(
            total_tokens=10_000,
            split=split,
            split_rate=0.9,
            seq_len=64,
            stride=32,
            batch_size=4,
            world_size=2,
            shift="auto",
        )
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(split))
        assert f"{sampler.num_windows} windows" in line
        assert f"{sampler.steps(0)} steps/epoch" in line
    code, out, _ = run(capsys, "info", path, "--seq-len", 8000, "--json")
    splits = json.loads(out)["sampling"]["splits"]
    assert [s["windows"] for s in splits] == [1, 0]  # validation too short: 0, not an error
    code, _, err = run(capsys, "info", path, "--seq-len", 64, "--shift", "3")
    assert code == 2
    assert "must divide seq_len" in err


@pytest.fixture
def damaged(tmp_path: Path) -> TokenStore:
    return make_positional_store(tmp_path / "damaged", 5_000, 1_000)


def test_verify_names_a_chunk_with_a_flipped_byte(damaged, capsys):
    assert run(capsys, "verify", damaged.path)[0] == 0
    chunk = damaged.path / "chunk_000003.bin"
    data = bytearray(chunk.read_bytes())
    data[1234] ^= 0x01
    chunk.write_bytes(bytes(data))
    code, out, err = run(capsys, "verify", damaged.path)
    assert code == 1
    assert "chunk_000003.bin is corrupt" in err
    assert "chunk_000002" not in err
    assert "1 problem(s)" in out


def test_truncated_chunk(damaged, capsys):
    chunk = damaged.path / "chunk_000001.bin"
    chunk.write_bytes(chunk.read_bytes()[:-10])
    (damaged.path / "chunk_000004.bin").unlink()
    code, out, _ = run(capsys, "info", damaged.path)  # info reads meta.json only
    assert code == 0
    assert "chunk_000001" not in out
    code, _, err = run(capsys, "verify", damaged.path)  # verify lists every bad chunk
    assert code == 1
    assert "chunk_000001.bin has 3990 bytes" in err
    assert "chunk_000004.bin is missing" in err


def test_verify_unreadable_input(tmp_path, capsys):
    code, _, err = run(capsys, "verify", tmp_path / "nowhere")
    assert code == 2
    assert "no token store" in err
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "meta.json").write_text("{not json")
    code, _, err = run(capsys, "verify", bad)
    assert code == 2
    assert "unreadable meta.json" in err
