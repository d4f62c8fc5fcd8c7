"""The token store on disk: the only module that knows its format.

A store is a directory::

    meta.json
    chunk_000000.bin   flat little-endian token ids (uint16 or uint32)
    chunk_000001.bin
    ...

Documents are concatenated with one EOS after each. `meta.json` is a superset of
what the Streaming-Dataloader prepare script writes (`dtype`, `eos_token_id`,
`tokenizer_name_or_path`, `tokens_per_chunk`, `chunks: [{file, tokens}]`,
`total_tokens`, `created_at_unix`), so its stores are served as they are; tokenfeed
adds `format_version`, `vocab_size`, a `checksum` per chunk and `source`.

A directory of bare `*.bin` files and no `meta.json` is also a store when the dtype is
given (the files, in name order, are the chunks).

Writes are crash-safe: every file is written under a temporary name and renamed, and
`meta.json` last, so a directory with a `meta.json` is always complete.
"""

from __future__ import annotations

import json
import mmap
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.server.errors import DataLoss, FeederError, InvalidArgument, NotFound

FORMAT_VERSION = 1
META_NAME = "meta.json"
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
DEFAULT_TOKENS_PER_CHUNK = 1 << 24  # 32 MiB of uint16: big sequential reads, few files
_TMP_SUFFIX = ".tmp"


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest store dtype that holds every id of a vocabulary."""
    if vocab_size <= 0:
        raise InvalidArgument(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise InvalidArgument(f"vocab_size {vocab_size} does not fit in uint32 token ids")


def numpy_dtype(name: str) -> np.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown token dtype {name!r}; expected one of {sorted(DTYPES)}"
        ) from None


def checksum(data: bytes | memoryview | np.ndarray) -> str:
    """Checksum of a chunk's bytes, as stored in meta.json (`crc32:%08x`)."""
    if isinstance(data, np.ndarray):
        data = memoryview(np.ascontiguousarray(data)).cast("B")
    return f"crc32:{zlib.crc32(data) & 0xFFFFFFFF:08x}"


def chunk_name(index: int) -> str:
    return f"chunk_{index:06d}.bin"


@dataclass(frozen=True)
class Chunk:
    file: str
    tokens: int
    checksum: str | None = None  # absent in Streaming-Dataloader and bare stores


@dataclass(frozen=True)
class StoreMeta:
    dtype: str
    chunks: tuple[Chunk, ...]
    eos_token_id: int | None = None
    vocab_size: int | None = None
    tokenizer: str | None = None
    tokens_per_chunk: int | None = None
    source: dict[str, Any] = field(default_factory=dict)
    created_at_unix: float | None = None
    format_version: int | None = FORMAT_VERSION

    @property
    def total_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks)

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version or FORMAT_VERSION,
            "dtype": self.dtype,
            "eos_token_id": self.eos_token_id,
            "vocab_size": self.vocab_size,
            "tokenizer_name_or_path": self.tokenizer,
            "tokens_per_chunk": self.tokens_per_chunk,
            "total_tokens": self.total_tokens,
            "created_at_unix": self.created_at_unix,
            "source": self.source,
            "chunks": [
                {"file": c.file, "tokens": c.tokens}
                | ({"checksum": c.checksum} if c.checksum else {})
                for c in self.chunks
            ],
        }

    @classmethod
    def from_json(cls, doc: Any, where: str) -> StoreMeta:
        """Parse meta.json (ours or the Streaming-Dataloader's); DataLoss if it lies."""
        try:
            chunks = tuple(
                Chunk(str(c["file"]), int(c["tokens"]), c.get("checksum"))
                for c in doc["chunks"]
            )
            meta = cls(
                dtype=str(doc["dtype"]),
                chunks=chunks,
                eos_token_id=_opt_int(doc.get("eos_token_id")),
                vocab_size=_opt_int(doc.get("vocab_size")),
                tokenizer=doc.get("tokenizer_name_or_path") or doc.get("tokenizer"),
                tokens_per_chunk=_opt_int(doc.get("tokens_per_chunk")),
                source=doc.get("source") or {},
                created_at_unix=doc.get("created_at_unix"),
                format_version=_opt_int(doc.get("format_version")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise DataLoss(f"{where}: malformed meta.json ({type(e).__name__}: {e})") from None
        try:
            numpy_dtype(meta.dtype)
        except InvalidArgument as e:  # the store is broken, not the caller's request
            raise DataLoss(f"{where}: meta.json: {e.message}") from None
        names = [c.file for c in meta.chunks]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise DataLoss(f"{where}: meta.json lists chunk(s) {dup} more than once")
        for c in meta.chunks:
            if c.tokens < 0:
                raise DataLoss(f"{where}: chunk {c.file} has negative token count {c.tokens}")
            if Path(c.file).name != c.file or c.file in ("", ".", ".."):
                raise DataLoss(f"{where}: chunk file {c.file!r} is not a plain file name")
        declared = doc.get("total_tokens")
        if declared is not None and int(declared) != meta.total_tokens:
            raise DataLoss(
                f"{where}: meta.json says total_tokens={declared} but its chunks hold "
                f"{meta.total_tokens}"
            )
        return meta


def _opt_int(v: Any) -> int | None:
    return None if v is None else int(v)


class TokenStore:
    """Read access to one store: metadata, chunk boundaries, verified chunk reads."""

    def __init__(self, path: Path, meta: StoreMeta) -> None:
        self.path = path
        self.meta = meta
        self.dtype = numpy_dtype(meta.dtype)
        sizes = np.array([c.tokens for c in meta.chunks], dtype=np.int64)
        # chunk i holds tokens [chunk_starts[i], chunk_starts[i+1]) of the token array T
        self.chunk_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @classmethod
    def open(
        cls, path: str | os.PathLike[str], dtype: str | None = None, check_sizes: bool = True
    ) -> TokenStore:
        """Open a store; check that every chunk exists with the size meta.json claims.

        `check_sizes=False` opens a damaged store anyway, so `verify` can list every
        problem instead of stopping at the first.
        """
        root = Path(path)
        if not root.is_dir():
            raise NotFound(f"no token store at {root}: not a directory")
        meta_path = root / META_NAME
        if meta_path.is_file():
            try:
                doc = json.loads(meta_path.read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataLoss(f"{meta_path}: unreadable meta.json ({e})") from None
            meta = StoreMeta.from_json(doc, str(root))
            if dtype is not None and dtype != meta.dtype:
                raise InvalidArgument(
                    f"{root}: dtype {dtype} was given but meta.json says {meta.dtype}"
                )
        else:
            meta = _bare_meta(root, dtype)
        store = cls(root, meta)
        if check_sizes:
            for c in meta.chunks:
                store._check_size(c)
        return store

    @property
    def total_tokens(self) -> int:
        return int(self.chunk_starts[-1])

    @property
    def num_chunks(self) -> int:
        return len(self.meta.chunks)

    def chunk_path(self, index: int) -> Path:
        return self.path / self.meta.chunks[index].file

    def chunk_nbytes(self, index: int) -> int:
        return self.meta.chunks[index].tokens * self.dtype.itemsize

    def chunk_of(self, token: int) -> int:
        """Index of the chunk holding token position `token` of T."""
        return int(np.searchsorted(self.chunk_starts, token, side="right")) - 1

    def _check_size(self, c: Chunk) -> None:
        p = self.path / c.file
        try:
            size = p.stat().st_size
        except OSError:
            raise DataLoss(f"{self.path}: chunk {c.file} is missing") from None
        if size != c.tokens * self.dtype.itemsize:
            raise DataLoss(
                f"{self.path}: chunk {c.file} has {size} bytes, expected "
                f"{c.tokens} tokens x {self.dtype.itemsize} = {c.tokens * self.dtype.itemsize}"
            )

    def read_chunk(self, index: int, verify: bool = True) -> np.ndarray:
        """The tokens of chunk `index`, read whole; DataLoss if short or corrupt.

        The array lives in its own anonymous memory map, so dropping it (a cache
        eviction) hands the memory straight back to the OS: with malloc, freed chunks
        stay in the heap and a server's RSS drifts far above its cache bound.
        """
        c = self.meta.chunks[index]
        nbytes = c.tokens * self.dtype.itemsize
        buf = mmap.mmap(-1, max(nbytes, 1))
        try:
            with open(self.path / c.file, "rb") as f:
                got = f.readinto(buf)
                extra = len(f.read(1))
        except OSError as e:
            raise DataLoss(f"{self.path}: chunk {c.file} unreadable ({e})") from None
        if got != nbytes or extra:
            size = (self.path / c.file).stat().st_size
            raise DataLoss(
                f"{self.path}: chunk {c.file} holds {size // self.dtype.itemsize} tokens, "
                f"meta.json says {c.tokens}"
            )
        data = np.frombuffer(buf, dtype=self.dtype, count=c.tokens)
        if verify and c.checksum and checksum(data) != c.checksum:
            raise DataLoss(
                f"{self.path}: chunk {c.file} is corrupt (checksum {checksum(data)}, "
                f"meta.json says {c.checksum}); run `tokenfeed verify {self.path}`"
            )
        return data

    def verify(self) -> list[str]:
        """Every problem found in sizes, checksums and token ids (empty = healthy)."""
        problems: list[str] = []
        for i, c in enumerate(self.meta.chunks):
            try:
                self._check_size(c)
                data = self.read_chunk(i)
            except FeederError as e:
                problems.append(e.message)
                continue
            vocab = self.meta.vocab_size
            if vocab and data.size and int(data.max()) >= vocab:
                problems.append(
                    f"{self.path}: chunk {c.file} has token id {int(data.max())} "
                    f">= vocab_size {vocab}"
                )
        return problems


def _bare_meta(root: Path, dtype: str | None) -> StoreMeta:
    files = sorted(p for p in root.glob("*.bin") if p.is_file())
    if not files:
        raise NotFound(f"no token store at {root}: neither meta.json nor *.bin files")
    if dtype is None:
        raise InvalidArgument(
            f"{root} has *.bin files but no meta.json: give the dtype (uint16 or uint32)"
        )
    itemsize = numpy_dtype(dtype).itemsize
    chunks = []
    for p in files:
        size = p.stat().st_size
        if size % itemsize:
            raise DataLoss(f"{root}: {p.name} has {size} bytes, not a whole number of {dtype}")
        chunks.append(Chunk(p.name, size // itemsize))
    return StoreMeta(dtype=dtype, chunks=tuple(chunks), format_version=None)


def iter_tokens(store: TokenStore, verify: bool = True) -> Iterator[np.ndarray]:
    """The store's tokens, chunk by chunk, in order."""
    for i in range(store.num_chunks):
        yield store.read_chunk(i, verify=verify)


def write_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write under a temporary name, fsync, rename: readers never see a partial file.

    On failure (disk full, read-only) the temporary file is removed and the OSError
    propagates: nothing half-written is left under either name.
    """
    tmp = path.with_name(path.name + _TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, doc: Any) -> None:
    """Write a JSON file atomically (temp name, fsync, rename): meta.json, progress files."""
    write_atomic(path, json.dumps(doc, indent=2).encode() + b"\n")


def write_meta(path: Path, meta: StoreMeta) -> None:
    """Write meta.json atomically: the moment a store becomes complete."""
    write_json(path / META_NAME, meta.to_json())


class StoreWriter:
    """Append tokens; full chunks go to disk as they fill; `finish()` writes meta.json.

    `chunks` may name chunks already on disk (a resumed run): they are kept and new
    chunks are numbered after them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        dtype: str,
        tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK,
        eos_token_id: int | None = None,
        vocab_size: int | None = None,
        tokenizer: str | None = None,
        source: dict[str, Any] | None = None,
        chunks: tuple[Chunk, ...] = (),
    ) -> None:
        if tokens_per_chunk <= 0:
            raise InvalidArgument(f"tokens_per_chunk must be positive, got {tokens_per_chunk}")
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self.dtype = numpy_dtype(dtype)
        self.dtype_name = dtype
        self.tokens_per_chunk = tokens_per_chunk
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.source = dict(source or {})
        self.chunks: list[Chunk] = list(chunks)
        self._limit = int(np.iinfo(self.dtype).max) if vocab_size is None else vocab_size - 1
        self._buf = np.empty(tokens_per_chunk, dtype=self.dtype)
        self._fill = 0

    def add(self, tokens: np.ndarray | list[int]) -> list[Chunk]:
        """Append token ids; return the chunks this call completed on disk."""
        arr = np.asarray(tokens)
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > self._limit):
            bad = int(arr.max()) if int(arr.max()) > self._limit else int(arr.min())
            raise InvalidArgument(
                f"token id {bad} does not fit the store (dtype {self.dtype_name}, "
                f"vocab_size {self.vocab_size})"
            )
        done = []
        pos = 0
        while pos < arr.size:
            take = min(arr.size - pos, self.tokens_per_chunk - self._fill)
            self._buf[self._fill : self._fill + take] = arr[pos : pos + take]
            self._fill += take
            pos += take
            if self._fill == self.tokens_per_chunk:
                done.append(self._flush())
        return done

    def _flush(self) -> Chunk:
        data = self._buf[: self._fill]
        name = chunk_name(len(self.chunks))
        write_atomic(self.path / name, memoryview(data).cast("B"))
        chunk = Chunk(name, int(self._fill), checksum(data))
        self.chunks.append(chunk)
        self._fill = 0
        return chunk

    @property
    def total_tokens(self) -> int:
        return sum(c.tokens for c in self.chunks) + self._fill

    def meta(self) -> StoreMeta:
        return StoreMeta(
            dtype=self.dtype_name,
            chunks=tuple(self.chunks),
            eos_token_id=self.eos_token_id,
            vocab_size=self.vocab_size,
            tokenizer=self.tokenizer,
            tokens_per_chunk=self.tokens_per_chunk,
            source=self.source,
            created_at_unix=time.time(),
        )

    def finish(self) -> StoreMeta:
        """Flush the last partial chunk and write meta.json; the store is then complete."""
        if self._fill:
            self._flush()
        meta = self.meta()
        write_meta(self.path, meta)
        return meta


def write_store(
    path: str | os.PathLike[str], tokens: np.ndarray, **kwargs: Any
) -> StoreMeta:
    """Write a whole token array as a store (small stores, tests, imports)."""
    writer = StoreWriter(path, **kwargs)
    writer.add(tokens)
    return writer.finish()


def is_complete(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / META_NAME).is_file()
