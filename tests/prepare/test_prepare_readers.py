"""prepare inputs: Arrow IPC (stream, file, Feather v2) and CSV, streamed; through prepare too."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.feather as feather
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.prepare.readers import iter_arrow_texts, iter_csv_texts

from support import fewer_examples

DOCS = ["first doc", "", 'multi\nline, with "quotes"', "ünïcödé ✓", "last"]


def table(docs: list[str | None]) -> pa.Table:
    return pa.table({"id": list(range(len(docs))), "text": pa.array(docs, pa.string())})


def write_stream(path: Path, t: pa.Table, max_chunksize: int = 2) -> None:
    with pa.ipc.new_stream(path, t.schema) as w:
        w.write_table(t, max_chunksize=max_chunksize)


def write_file(path: Path, t: pa.Table, max_chunksize: int = 2) -> None:
    with pa.ipc.new_file(path, t.schema) as w:
        w.write_table(t, max_chunksize=max_chunksize)


@pytest.mark.parametrize("fmt", ["stream", "file", "feather", "feather-uncompressed"])
def test_arrow_formats(tmp_path: Path, fmt: str) -> None:
    p = tmp_path / ("x.feather" if fmt.startswith("feather") else "x.arrow")
    t = table(DOCS)
    if fmt == "stream":
        write_stream(p, t)
    elif fmt == "file":
        write_file(p, t)
    else:
        feather.write_feather(
            t, p, chunksize=2, compression=None if fmt.endswith("uncompressed") else "lz4"
        )
    assert list(iter_arrow_texts(p, "text", rows_per_slice=2)) == DOCS


def test_arrow_nulls_and_large_string(tmp_path: Path) -> None:
    p = tmp_path / "x.arrow"
    t = pa.table({"text": pa.array(["a", None, "b"], pa.large_string())})
    write_file(p, t)
    assert list(iter_arrow_texts(p, "text")) == ["a", "", "b"]


def test_arrow_errors_name_file_and_fields(tmp_path: Path) -> None:
    p = tmp_path / "x.arrow"
    write_stream(p, table(DOCS))
    with pytest.raises(
        InvalidArgument, match=r"x\.arrow: no text field 'content'; the fields are: id, text"
    ):
        next(iter_arrow_texts(p, "content"))
    with pytest.raises(InvalidArgument, match="field 'id' holds int64, not text"):
        next(iter_arrow_texts(p, "id"))
    bad = tmp_path / "bad.arrow"
    bad.write_bytes(b"this is not arrow at all")
    with pytest.raises(InvalidArgument, match=r"bad\.arrow: not an Arrow IPC"):
        next(iter_arrow_texts(bad, "text"))
    v1 = tmp_path / "old.feather"
    with pytest.warns(DeprecationWarning, match="(?i)feather"):  # pyarrow writes v1, grudgingly
        feather.write_feather(table(DOCS), v1, version=1)
    with pytest.raises(InvalidArgument, match="Feather v1"):
        next(iter_arrow_texts(v1, "text"))
    cut = tmp_path / "cut.arrow"
    write_stream(cut, table(DOCS * 100), max_chunksize=50)
    cut.write_bytes(cut.read_bytes()[:-500])
    with pytest.raises(InvalidArgument, match=r"cut\.arrow: damaged"):
        list(iter_arrow_texts(cut, "text"))


def write_csv(path: Path, docs: list[str], extra: bool = True) -> None:
    cols = {"text": docs} | ({"n": list(range(len(docs)))} if extra else {})
    pacsv.write_csv(pa.table(cols), path)


def test_csv(tmp_path: Path) -> None:
    p = tmp_path / "x.csv"
    write_csv(p, DOCS)
    assert list(iter_csv_texts(p, "text", block_size=64)) == DOCS
    with pytest.raises(
        InvalidArgument, match=r"x\.csv: no text field 'body'; the fields are: text, n"
    ):
        next(iter_csv_texts(p, "body"))


def test_csv_gzip_bom_and_bad_utf8(tmp_path: Path) -> None:
    p = tmp_path / "x.csv.gz"
    with gzip.open(p, "wb") as f:
        f.write(b'\xef\xbb\xbftext,n\n"ok",1\n"bad \xff byte",2\n')
    assert list(iter_csv_texts(p, "text")) == ["ok", "bad \ufffd byte"]


@fewer_examples(4)  # a file written and read each
@given(
    st.lists(
        st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r")),
        min_size=1,
        max_size=30,
    )
)
def test_csv_roundtrip(tmp_path_factory: pytest.TempPathFactory, docs: list[str]) -> None:
    p = tmp_path_factory.mktemp("csv") / "x.csv"
    write_csv(p, docs)
    assert list(iter_csv_texts(p, "text", block_size=128)) == docs


def test_csv_rows_longer_than_a_block(tmp_path: Path) -> None:
    """pyarrow needs a row within one block: the reader reads on with larger blocks,
    after the rows it has already given, none twice (a long first row too)."""
    docs = ["short", "a\nlong one " * 300, "after", "x" * 5000 + "\n", "end"]
    for first in (docs, docs[1:]):
        p = tmp_path / "long.csv"
        write_csv(p, first)
        assert list(iter_csv_texts(p, "text", block_size=128)) == first


def _peak_arrow_bytes(it) -> int:  # type: ignore[no-untyped-def]
    peak = 0
    for _ in it:
        peak = max(peak, pa.total_allocated_bytes())
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["csv", "stream", "feather"])
def test_big_files_stream(tmp_path: Path, fmt: str) -> None:
    """~40 MB of text; Arrow's allocations stay a small fraction of it (one batch or a
    few CSV blocks), for a compressed Feather file too."""
    docs = [f"document {i} " + "x" * 4000 for i in range(10_000)]
    p = tmp_path / f"big.{fmt}"
    if fmt == "csv":
        write_csv(p, docs, extra=False)
        it = iter_csv_texts(p, "text", block_size=1 << 16)
    elif fmt == "stream":
        write_stream(p, pa.table({"text": docs}), max_chunksize=1000)
        it = iter_arrow_texts(p, "text")
    else:
        feather.write_feather(pa.table({"text": docs}), p, chunksize=1000)
        it = iter_arrow_texts(p, "text")
    text_bytes = sum(map(len, docs))
    del docs
    base = pa.total_allocated_bytes()
    peak = _peak_arrow_bytes(it) - base
    assert text_bytes > 30e6, text_bytes
    assert peak < text_bytes / 4, (text_bytes, peak)


def test_prepare_reads_arrow_feather_and_csv_like_jsonl(tmp_path: Path, tok_dir: Path) -> None:
    """The same documents as .jsonl, .arrow, .feather and .csv make the same tokens."""
    from tokenfeed.cli import main

    from support.prepare import (
        expected_tokens,
        make_documents,
        prepare_argv,
        store_tokens,
        write_jsonl,
    )

    docs = make_documents(120, seed=5)
    t = pa.table({"id": list(range(len(docs))), "body": docs})
    write_jsonl(tmp_path / "d.jsonl", docs, field="body")
    write_stream(tmp_path / "d.arrow", t, max_chunksize=16)
    feather.write_feather(t, tmp_path / "d.feather", chunksize=16)
    pacsv.write_csv(t, tmp_path / "d.csv")
    want = expected_tokens(tok_dir, docs)
    for name in ("d.jsonl", "d.arrow", "d.feather", "d.csv"):
        out = tmp_path / f"store-{name}"
        argv = prepare_argv(tmp_path / name, tok_dir, out, "--text-field", "body", "--no-progress")
        assert main(argv) == 0
        np.testing.assert_array_equal(store_tokens(out), want)
    assert main([*argv[:-3], "--text-field", "nope", "--output", str(tmp_path / "x")]) == 2
