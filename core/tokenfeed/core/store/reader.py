"""Read a token store: metadata, chunk boundaries, verified chunk reads.

A directory with `meta.json` is a store (format in meta.py). A directory of bare
`*.bin` files and no `meta.json` is also one when the dtype is given (the files, in
name order, are the chunks).
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from tokenfeed.core.dtypes import numpy_dtype
from tokenfeed.core.errors import ChecksumMismatch, DataLoss, FeederError, InvalidArgument, NotFound
from tokenfeed.core.store.meta import META_NAME, Chunk, StoreMeta, checksum


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
            raise ChecksumMismatch(
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


def is_complete(path: str | os.PathLike[str]) -> bool:
    return (Path(path) / META_NAME).is_file()
