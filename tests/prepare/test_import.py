"""`tokenfeed import`: nanoGPT .bin and llm.c shards become stores without re-tokenizing."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenfeed.cli import main
from tokenfeed.core.store import TokenStore

from support.prepare import store_tokens


def run(*argv: object) -> int:
    return main([str(a) for a in argv])


def llmc_shard(
    path: Path, tokens: np.ndarray, magic: int = 20240520, count: int | None = None
) -> Path:
    header = np.zeros(256, dtype="<i4")
    header[0], header[1] = magic, 1
    header[2] = len(tokens) if count is None else count
    dtype = "<u2" if magic == 20240520 else "<u4"
    path.write_bytes(header.tobytes() + tokens.astype(dtype).tobytes())
    return path


def test_nanogpt_train_and_val(tmp_path, capsys):
    rng = np.random.default_rng(0)
    train = rng.integers(0, 50257, 5_000).astype("<u2")
    val = rng.integers(0, 50257, 700).astype("<u2")
    train.tofile(tmp_path / "train.bin")
    val.tofile(tmp_path / "val.bin")
    out = tmp_path / "store"
    argv = ["import", "--format", "nanogpt", tmp_path / "train.bin", tmp_path / "val.bin"]
    argv += ["--output", out, "--tokens-per-chunk", 1024, "--tokenizer", "gpt2"]
    argv += ["--eos-token-id", 50256, "--vocab-size", 50257]
    assert run(*argv) == 0
    assert "5000 uint16 tokens in 5 chunks" in capsys.readouterr().out
    np.testing.assert_array_equal(store_tokens(out / "train"), train)
    np.testing.assert_array_equal(store_tokens(out / "val"), val)
    meta = TokenStore.open(out / "train").meta
    assert (meta.dtype, meta.tokenizer, meta.eos_token_id, meta.vocab_size) == (
        "uint16",
        "gpt2",
        50256,
        50257,
    )
    assert TokenStore.open(out / "val").verify() == []
    # the same command again: complete, nothing to do
    assert run(*argv) == 0


@pytest.mark.parametrize(("magic", "dtype"), [(20240520, "uint16"), (20240801, "uint32")])
def test_llmc_shards_concatenate_in_name_order(tmp_path, magic, dtype):
    rng = np.random.default_rng(1)
    high = 50257 if dtype == "uint16" else 128_256
    parts = [rng.integers(0, high, n) for n in (3_000, 1, 2_500)]
    # written out of order: the store follows the file names
    for name, toks in zip(
        ["s_train_000002.bin", "s_train_000000.bin", "s_train_000001.bin"],
        [parts[2], parts[0], parts[1]],
        strict=True,
    ):
        llmc_shard(tmp_path / name, toks, magic)
    out = tmp_path / "llmc"
    assert (
        run(
            "import",
            "--format",
            "llmc",
            f"{tmp_path}/s_train_*.bin",
            "--output",
            out,
            "--tokens-per-chunk",
            2048,
        )
        == 0
    )
    store = TokenStore.open(out)
    assert store.meta.dtype == dtype
    assert store.total_tokens == 5_501
    np.testing.assert_array_equal(store_tokens(out), np.concatenate(parts))


def _fails(capsys, *argv: object) -> str:
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenfeed import: error: ")
    return err


def test_bad_llmc_files(tmp_path, capsys):
    good = llmc_shard(tmp_path / "a.bin", np.arange(100))
    out = tmp_path / "out"

    bad_magic = llmc_shard(tmp_path / "b.bin", np.arange(100), magic=12345)
    err = _fails(capsys, "import", "--format", "llmc", good, bad_magic, "--output", out)
    assert "b.bin" in err
    assert "magic 12345" in err
    assert "20240520" in err

    truncated = llmc_shard(tmp_path / "c.bin", np.arange(100), count=150)
    err = _fails(capsys, "import", "--format", "llmc", good, truncated, "--output", out)
    assert "c.bin" in err
    assert "header says 150" in err
    assert "truncated" in err

    wide = llmc_shard(tmp_path / "d.bin", np.arange(10), magic=20240801)
    err = _fails(capsys, "import", "--format", "llmc", good, wide, "--output", out)
    assert "mix token dtypes" in err

    tiny = tmp_path / "e.bin"
    tiny.write_bytes(b"\x00" * 100)
    assert "shorter than the llm.c header" in _fails(
        capsys, "import", "--format", "llmc", tiny, "--output", out
    )
    assert not out.exists()


def test_bad_nanogpt_files(tmp_path, capsys):
    out = tmp_path / "out"
    odd = tmp_path / "train.bin"
    odd.write_bytes(b"\x01\x02\x03")
    err = _fails(capsys, "import", "--format", "nanogpt", odd, "--output", out)
    assert "train.bin" in err
    assert "whole number of uint16" in err
    assert "no file matches" in _fails(
        capsys, "import", "--format", "nanogpt", tmp_path / "missing.bin", "--output", out
    )
    # ids beyond --vocab-size: refused, and the half-written store is removed
    np.array([1, 2, 60_000], dtype="<u2").tofile(odd)
    err = _fails(
        capsys, "import", "--format", "nanogpt", odd, "--output", out, "--vocab-size", 50257
    )
    assert "token id 60000" in err
    assert not (out / "train").exists()
