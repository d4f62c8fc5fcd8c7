"""The seed loader's original layout, served in place: chunk_NNNNNN/ save_to_disk folders.

    root/
      chunk_000000/  data-00000-of-00001.arrow  dataset_info.json  state.json
      chunk_000001/  ...
      meta.json      (optional: what `tokenfeed info ROOT` prints, edited)

Each chunk folder is a Hugging Face dataset with one row whose `input_ids` column is a
list of token ids. Its value type depends on the writer: `datasets` stores
`input_ids` as int32 by itself, older versions and explicit features give int64, and
`large_list` appears when asked for. The data files are Arrow IPC *stream* format;
`state.json` names them in order.

A chunk is read by memory-mapping its files (pyarrow), taking the row's values as a
zero-copy view and narrowing them to the store dtype into the chunk's own anonymous
memory map (what the cache holds): one copy, which also checks every id fits.

Without a meta.json the layout is served as uint32 with no EOS or vocabulary, and
opening it reads each chunk's Arrow metadata to count its tokens (the values stay
untouched). A meta.json beside the chunk folders (`tokenfeed info` prints one: chunk
folder names and token counts, dtype, eos_token_id, vocab_size) skips that and gives
the EOS, vocabulary and a narrower dtype (uint16) when the user knows them.

pyarrow comes with the `server` and `prepare` extras; without it, opening a seed
layout is an ImportError naming the pip install.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.core.errors import DataLoss, FeederError, NotFound
from tokenfeed.core.store.memory import anonymous
from tokenfeed.core.store.meta import META_NAME, Chunk, StoreMeta, check_checksum
from tokenfeed.core.store.reader import StoreReader

CHUNK_DIR = re.compile(r"^chunk_(\d+)$")
FIELD = "input_ids"
DEFAULT_DTYPE = "uint32"


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc  # pa.ipc is a submodule
    except ImportError:
        raise ImportError(
            "the seed loader's chunk folders are Arrow files: pip install 'tokenfeed[server]' "
            "(or pyarrow)"
        ) from None
    return pyarrow


def chunk_dirs(root: Path) -> list[Path]:
    """The chunk folders under `root`, in chunk-number order.

    Names first, a Path and a stat only for those that match: telling a native store
    from a seed layout lists its directory, 60,000 chunk files for a 10^12-token store."""
    try:
        names = [n for n in os.listdir(root) if n[:6] == "chunk_" and "." not in n]
        names = [n for n in names if CHUNK_DIR.match(n)]
    except OSError:
        return []
    found = [(int(n[6:]), root / n) for n in names]
    return [p for _, p in sorted(found) if p.is_dir()]


def is_seed_layout(root: Path) -> bool:
    dirs = chunk_dirs(root)
    return bool(dirs) and (dirs[0] / "state.json").is_file()


def data_files(chunk: Path) -> list[Path]:
    state = chunk / "state.json"
    try:
        doc = json.loads(state.read_text())
        names = [f["filename"] for f in doc["_data_files"]]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DataLoss(
            f"{state}: unreadable save_to_disk state ({type(e).__name__}: {e})"
        ) from None
    if not names:
        raise DataLoss(f"{state}: lists no data files")
    for n in names:
        if not isinstance(n, str) or Path(n).name != n:
            raise DataLoss(f"{state}: data file {n!r} is not a plain file name")
    return [chunk / n for n in names]


def _values(pa: Any, arr: Any, where: str) -> np.ndarray:
    """The ids of a list/large_list column, zero-copy for one row without nulls."""
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise DataLoss(f"{where}: {FIELD} is {arr.type}, not a list of token ids")
    vt = arr.type.value_type
    if not pa.types.is_integer(vt):
        raise DataLoss(f"{where}: {FIELD} holds {vt}, not integers")
    if arr.null_count:
        raise DataLoss(f"{where}: {FIELD} has {arr.null_count} null row(s)")
    flat = arr.flatten()  # honours offsets and slicing; a view of the values buffer
    if flat.null_count:
        raise DataLoss(f"{where}: {FIELD} has {flat.null_count} null token id(s)")
    return flat.to_numpy(zero_copy_only=True)


def chunk_values(chunk: Path) -> list[np.ndarray]:
    """The token ids of one chunk folder, as read-only views of its memory-mapped files."""
    pa = _pyarrow()
    parts: list[np.ndarray] = []
    for path in data_files(chunk):
        try:
            reader = pa.ipc.open_stream(pa.memory_map(str(path), "r"))
        except (OSError, pa.ArrowInvalid) as e:
            raise DataLoss(f"{path}: not an Arrow IPC stream ({e})") from None
        names = reader.schema.names
        if FIELD not in names:
            raise DataLoss(f"{path}: no {FIELD!r} column; the columns are: {', '.join(names)}")
        col = reader.schema.get_field_index(FIELD)
        try:
            for batch in reader:
                if batch.num_rows:
                    parts.append(_values(pa, batch.column(col), str(path)))
        except (OSError, pa.ArrowInvalid) as e:  # truncated or damaged stream
            raise DataLoss(f"{path}: damaged Arrow stream ({e})") from None
    return parts


class SeedStore(StoreReader):
    format = "seed"

    def __init__(self, root: Path, meta: StoreMeta, generation: int, has_meta: bool) -> None:
        super().__init__(str(root), meta, generation)
        self.root = root
        self.has_meta = has_meta

    @classmethod
    def open(cls, root: Path) -> SeedStore:
        dirs = chunk_dirs(root)
        if not dirs:
            raise NotFound(f"no seed-layout store at {root}: no chunk_NNNNNN/ folders")
        meta_path = root / META_NAME
        if meta_path.is_file():
            try:
                doc = json.loads(meta_path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataLoss(f"{meta_path}: unreadable meta.json ({e})") from None
            meta = StoreMeta.from_json(doc, str(root))
            names = [d.name for d in dirs]
            listed = [c.file for c in meta.chunks]
            if listed != names:
                raise DataLoss(
                    f"{meta_path}: lists chunk folders {_short(listed)} but {root} holds "
                    f"{_short(names)}; run `tokenfeed info {root}` for a matching meta.json"
                )
            generation = meta_path.stat().st_mtime_ns
            return cls(root, meta, generation >> 1, True)
        chunks = []
        stamp = hashlib.blake2b(digest_size=8)
        for d in dirs:
            tokens = sum(int(v.size) for v in chunk_values(d))
            chunks.append(Chunk(d.name, tokens))
            stamp.update(f"{d.name}:{(d / 'state.json').stat().st_mtime_ns}".encode())
        meta = StoreMeta(
            dtype=DEFAULT_DTYPE,
            chunks=tuple(chunks),
            source={"kind": "seed-layout", "format": "save_to_disk chunk folders"},
            format_version=None,
        )
        return cls(root, meta, int.from_bytes(stamp.digest(), "little") >> 1, False)

    def suggested_meta(self) -> dict[str, Any]:
        """The meta.json to put beside the chunk folders (edit eos/vocab/dtype)."""
        doc = self.meta.to_json()
        doc.pop("format_version", None)
        doc["source"] = {"kind": "seed-layout", "format": "save_to_disk chunk folders"}
        return doc

    def read_chunk(self, index: int, verify: bool = True) -> np.ndarray:
        c = self.meta.chunks[index]
        folder = self.root / c.file
        parts = chunk_values(folder)
        got = sum(int(p.size) for p in parts)
        if got != c.tokens:
            raise DataLoss(f"{folder}: {got} tokens, meta.json says {c.tokens}")
        buf = anonymous(got * self.dtype.itemsize)
        out = np.frombuffer(buf, dtype=self.dtype, count=got)
        limit = int(np.iinfo(self.dtype).max)
        at = 0
        for p in parts:
            # One pass checks both ends: as unsigned, a negative id is above any limit.
            if p.size and int(p.view(f"u{p.dtype.itemsize}").max()) > limit:
                raise DataLoss(
                    f"{folder}: token ids {int(p.min())}..{int(p.max())} do not fit "
                    f"{self.meta.dtype}"
                )
            np.copyto(out[at : at + p.size], p, casting="unsafe")
            at += p.size
        if verify:
            check_checksum(out, c, str(folder))
        return out

    def verify(self) -> list[str]:
        return self._problems(self.read_chunk, FeederError)


def _short(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)} in all)" if len(names) > 3 else "")


__all__ = ["SeedStore", "chunk_dirs", "is_seed_layout"]
