"""More prepare inputs: Arrow IPC (`.arrow` stream or file format, `.feather`) and `.csv`.

Both stream: a file is never loaded whole.

* Arrow IPC: the file is memory-mapped and read one record batch at a time (file
  format: random access by batch; stream format: in order), and each batch is turned
  into Python strings `rows_per_slice` rows at a time. Uncompressed buffers are read in
  place (only touched pages come in); compressed ones (Feather v2 is LZ4 by default)
  are decompressed one batch at a time. The format is told by the first bytes, not
  the suffix: `ARROW1` is the file format (and Feather v2), 0xFFFFFFFF the stream
  format (what `datasets` writes), `FEA1` the old Feather v1, which has no batches and
  is refused with the conversion to run.
* CSV (`.csv`, `.csv.gz`, `.csv.bz2`, ...): pyarrow's streaming reader, `block_size`
  bytes at a time, only the text column converted, quoted values may span lines
  (documents have newlines). pyarrow reads ahead: measured peak ~40 x block_size of
  Arrow memory whatever the file size (256 KiB -> ~12 MB; 1 MiB -> ~42 MB). The text
  is read as bytes and decoded as UTF-8 with invalid bytes replaced, the policy of the
  txt/jsonl readers. One row must fit in a block: a document longer than the block
  size makes pyarrow stop ("straddles two block boundaries"), so the file is read again
  with blocks 4x larger (up to 1 GiB), from the row where it stopped.

The text field must exist: otherwise the error names the file and the fields it does
have. A null is an empty document (the caller drops it), a non-text column is an error.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.ipc  # pa.ipc is a submodule

from tokenfeed.core.errors import InvalidArgument

log = logging.getLogger(__name__)

_TEXT_TYPES = (
    pa.types.is_string,
    pa.types.is_large_string,
    pa.types.is_binary,
    pa.types.is_large_binary,
)


def _missing(path: Path, field: str, names: list[str]) -> InvalidArgument:
    return InvalidArgument(
        f"{path}: no text field {field!r}; the fields are: {', '.join(names) or '(none)'} "
        "(choose one with --text-field)"
    )


def _is_text(t: pa.DataType) -> bool:
    return any(f(t) for f in _TEXT_TYPES) or getattr(pa.types, "is_string_view", lambda _: False)(t)


def _texts(col: pa.Array, rows_per_slice: int) -> Iterator[str]:
    binary = pa.types.is_binary(col.type) or pa.types.is_large_binary(col.type)
    for start in range(0, len(col), rows_per_slice):
        for v in col.slice(start, rows_per_slice).to_pylist():
            if v is None:
                yield ""
            elif binary:
                yield v.decode("utf-8", errors="replace")
            else:
                yield v


def arrow_kind(path: Path) -> str:
    """ "file" (IPC file format, Feather v2), "feather1", or "stream" (anything else: the
    stream reader says whether it is one)."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head == b"ARROW1":
        return "file"
    if head.startswith(b"FEA1"):
        return "feather1"
    return "stream"


def iter_arrow_texts(path: str | Path, field: str, rows_per_slice: int = 1024) -> Iterator[str]:
    """Documents from an Arrow IPC file (file or stream format) or Feather v2 file."""
    path = Path(path)
    kind = arrow_kind(path)
    if kind == "feather1":
        raise InvalidArgument(
            f"{path}: Feather v1 file (no record batches to stream); rewrite it as v2: "
            "pyarrow.feather.write_feather(pyarrow.feather.read_table(path), new_path)"
        )
    try:
        source = pa.memory_map(str(path), "r")
        if kind == "file":
            reader = pa.ipc.open_file(source)
            schema = reader.schema
            batches: Iterator[pa.RecordBatch] = (
                reader.get_batch(i) for i in range(reader.num_record_batches)
            )
        else:
            sreader = pa.ipc.open_stream(source)
            schema = sreader.schema
            batches = iter(sreader)
    except (OSError, pa.ArrowInvalid) as e:
        raise InvalidArgument(f"{path}: not an Arrow IPC or Feather v2 file ({e})") from None
    if field not in schema.names:
        raise _missing(path, field, schema.names)
    t = schema.field(field).type
    if not _is_text(t):
        raise InvalidArgument(
            f"{path}: field {field!r} holds {t}, not text (choose another with --text-field)"
        )
    i = schema.get_field_index(field)
    try:
        for batch in batches:
            yield from _texts(batch.column(i), rows_per_slice)
    except (OSError, pa.ArrowInvalid) as e:
        raise InvalidArgument(f"{path}: damaged Arrow data ({e})") from None


MAX_CSV_BLOCK = 1 << 30  # the longest row a CSV file may have
_CSV = pacsv.ParseOptions(newlines_in_values=True)


def iter_csv_texts(
    path: str | Path, field: str, block_size: int = 1 << 18, rows_per_slice: int = 1024
) -> Iterator[str]:
    """Documents from a CSV file with a header row, streamed `block_size` bytes at a time
    (larger where a row needs it)."""
    path = Path(path)
    names = _csv_names(path)
    if field not in names:
        raise _missing(path, field, names)
    convert = pacsv.ConvertOptions(include_columns=[field], column_types={field: pa.binary()})
    done = 0  # rows yielded: a retry with larger blocks goes on after them
    while True:
        try:
            with pa.input_stream(str(path), compression="detect") as f:
                read = pacsv.ReadOptions(block_size=block_size)
                row = 0
                for batch in pacsv.open_csv(f, read, _CSV, convert):
                    skip, row = max(0, done - row), row + batch.num_rows
                    for text in _texts(batch.column(0).slice(skip), rows_per_slice):
                        yield text
                        done += 1
            return
        except pa.ArrowInvalid as e:
            if not _row_too_long(e, block_size):
                raise InvalidArgument(f"{path}: CSV error ({e})") from None
            block_size *= 4
            log.info("%s: a row is longer than a block; reading on with %d", path, block_size)
        except OSError as e:
            raise InvalidArgument(f"{path}: CSV error ({e})") from None


def _csv_names(path: Path) -> list[str]:
    block_size = 1 << 16
    while True:
        try:
            with pa.input_stream(str(path), compression="detect") as f:
                read = pacsv.ReadOptions(block_size=block_size)
                return list(pacsv.open_csv(f, read, _CSV).schema.names)
        except pa.ArrowInvalid as e:
            if not _row_too_long(e, block_size):
                raise InvalidArgument(f"{path}: not a readable CSV file ({e})") from None
            block_size *= 4
        except OSError as e:
            raise InvalidArgument(f"{path}: not a readable CSV file ({e})") from None


def _row_too_long(e: pa.ArrowInvalid, block_size: int) -> bool:
    """pyarrow needs a row within one block; a larger block may hold it."""
    return "straddles" in str(e) and block_size < MAX_CSV_BLOCK
