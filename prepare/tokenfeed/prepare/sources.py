"""Where documents come from: a Hugging Face dataset, local files, or any iterable.

A source is an iterable of document texts in a fixed order plus `describe()`, a JSON
description that goes into the store's `meta.json` (`source`) and identifies "the
same command" when a run is resumed.

Decisions:

* A Hugging Face dataset is always opened with `streaming=True`: rows arrive as they
  are read, nothing is downloaded in full. A name that starts with `/`, `./`, `../` or
  `~` is a local path and must exist.
* Local files are given as globs (`**` allowed), expanded in the order given, each
  glob's matches sorted by path; a file matched twice is read once.
* A `.txt` file is ONE document (a book, an article, a page). Corpora with one
  document per line or paragraph should be converted to `.jsonl` first: a line format
  cannot say where a multi-line document ends, and a paragraph split would cut
  documents that have blank lines inside. Text is decoded as UTF-8 with invalid bytes
  replaced (one bad byte does not stop a long run).
* `.jsonl` has one JSON object per line; `.parquet` is read column-wise in batches.
  `.txt.gz` and `.jsonl.gz` are read through gzip.
* Arrow IPC (`.arrow` stream or file format, `.feather` v2) and `.csv` (with a header
  row; `.csv.gz` too) stream as well, one record batch or CSV block at a time
  (readers.py): a file is never loaded whole.
* The text field must exist in every row; a row without it stops the run with the
  fields the row does have. A `null` text is an empty document (dropped).
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO, Any

from tokenfeed.core.errors import InvalidArgument, NotFound

ARROW_SUFFIXES = (".arrow", ".feather", ".ipc", ".arrows")
CSV_SUFFIXES = (".csv", ".csv.gz", ".csv.bz2", ".csv.zst", ".csv.lz4")
SUFFIXES = (".txt", ".jsonl", ".parquet", ".txt.gz", ".jsonl.gz", *ARROW_SUFFIXES, *CSV_SUFFIXES)


def _text_of(row: Any, field: str, where: str) -> str:
    if not isinstance(row, dict):
        raise InvalidArgument(f"{where}: expected a JSON object, got {type(row).__name__}")
    if field not in row:
        fields = ", ".join(sorted(map(str, row))) or "(none)"
        raise InvalidArgument(
            f"{where}: no text field {field!r}; the fields are: {fields} "
            "(choose one with --text-field)"
        )
    value = row[field]
    if value is None:
        return ""
    if not isinstance(value, str):
        raise InvalidArgument(
            f"{where}: field {field!r} holds {type(value).__name__}, not text "
            "(choose another with --text-field)"
        )
    return value


class HFSource:
    """A Hugging Face dataset, streamed."""

    def __init__(self, dataset: str, name: str | None, split: str, text_field: str) -> None:
        self.dataset, self.name, self.split, self.text_field = dataset, name, split, text_field
        if dataset.startswith(("/", "./", "../", "~")) and not Path(dataset).expanduser().exists():
            raise NotFound(f"dataset {dataset}: no such local path")

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "huggingface",
            "dataset": self.dataset,
            "name": self.name,
            "split": self.split,
            "text_field": self.text_field,
        }

    def _open(self) -> Any:
        try:
            import datasets
        except ImportError:
            raise ImportError(
                "--dataset needs datasets: pip install 'tokenfeed[prepare]'"
            ) from None
        try:
            return datasets.load_dataset(self.dataset, self.name, split=self.split, streaming=True)
        except (FileNotFoundError, ConnectionError) as e:
            raise NotFound(
                f"dataset {self.dataset!r} not found locally or on the Hugging Face Hub "
                f"({type(e).__name__}: {str(e).splitlines()[0]})"
            ) from None
        except ValueError as e:  # unknown config or split
            raise InvalidArgument(f"dataset {self.dataset!r}: {str(e).splitlines()[0]}") from None

    def __iter__(self) -> Iterator[str]:
        where = f"dataset {self.dataset}"
        for i, row in enumerate(self._open()):
            yield _text_of(row, self.text_field, f"{where} row {i}")


def expand_globs(
    patterns: Iterable[str], suffixes: tuple[str, ...] | None = SUFFIXES
) -> list[Path]:
    """Every file the globs match, in the documented order (each glob's matches sorted,
    a file matched twice kept once); NotFound for a glob with none, InvalidArgument for
    a file whose name ends in none of `suffixes` (None: any file)."""
    files: list[Path] = []
    seen: set[Path] = set()
    for pattern in patterns:
        matches = sorted(
            Path(p)
            for p in glob.glob(os.path.expanduser(pattern), recursive=True)
            if os.path.isfile(p)
        )
        if not matches:
            raise NotFound(f"no file matches {pattern!r}")
        for p in matches:
            if suffixes is not None and not p.name.endswith(suffixes):
                raise InvalidArgument(
                    f"{p}: unsupported file type; --files reads {', '.join(SUFFIXES)}"
                )
            key = p.resolve()
            if key not in seen:
                seen.add(key)
                files.append(p)
    return files


def _open_text(path: Path) -> IO[str]:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8", errors="replace")
    return open(path, encoding="utf-8", errors="replace")


class FileSource:
    """Local .txt / .jsonl / .parquet / .arrow / .feather / .csv files."""

    def __init__(self, patterns: list[str], text_field: str) -> None:
        self.files = expand_globs(patterns)
        self.text_field = text_field

    def describe(self) -> dict[str, Any]:
        return {
            "kind": "files",
            "text_field": self.text_field,
            "files": [[str(p.resolve()), p.stat().st_size] for p in self.files],
        }

    def __iter__(self) -> Iterator[str]:
        for path in self.files:
            name = path.name
            if name.endswith((".txt", ".txt.gz")):
                with _open_text(path) as f:
                    yield f.read()
            elif name.endswith((".jsonl", ".jsonl.gz")):
                yield from self._jsonl(path)
            elif name.endswith(ARROW_SUFFIXES):
                from tokenfeed.prepare.readers import iter_arrow_texts

                yield from iter_arrow_texts(path, self.text_field)
            elif name.endswith(CSV_SUFFIXES):
                from tokenfeed.prepare.readers import iter_csv_texts

                yield from iter_csv_texts(path, self.text_field)
            else:
                yield from self._parquet(path)

    def _jsonl(self, path: Path) -> Iterator[str]:
        with _open_text(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise InvalidArgument(f"{path}:{lineno}: not JSON ({e})") from None
                yield _text_of(row, self.text_field, f"{path}:{lineno}")

    def _parquet(self, path: Path) -> Iterator[str]:
        import pyarrow.parquet as pq

        try:
            pf = pq.ParquetFile(path)
        except Exception as e:  # pyarrow raises several types for bad files
            raise InvalidArgument(f"{path}: not a parquet file ({e})") from None
        names = pf.schema_arrow.names
        if self.text_field not in names:
            raise InvalidArgument(
                f"{path}: no text field {self.text_field!r}; the fields are: "
                f"{', '.join(names)} (choose one with --text-field)"
            )
        row = 0
        for batch in pf.iter_batches(columns=[self.text_field], batch_size=1024):
            for value in batch.column(0).to_pylist():
                yield _text_of({self.text_field: value}, self.text_field, f"{path} row {row}")
                row += 1


class IterableSource:
    """Documents from Python: `make()` returns a fresh iterable of texts each call.

    `describe` must identify the corpus, since it decides whether a re-run resumes.
    """

    def __init__(self, make: Callable[[], Iterable[str]], description: dict[str, Any]) -> None:
        self.make = make
        self.description = {"kind": "python", **description}  # a caller may name its kind

    def describe(self) -> dict[str, Any]:
        return dict(self.description)

    def __iter__(self) -> Iterator[str]:
        return iter(self.make())
