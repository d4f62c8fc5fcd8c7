"""Read token stores: one interface (StoreReader) that every served format implements.

    StoreReader                 metadata, chunk boundaries, verified chunk reads
    ├── TokenStore              the native store (meta.json + chunk_NNNNNN.bin), on a
    │                           local directory or an s3:// prefix (files.py)
    ├── SeedStore (seed.py)     the seed loader's chunk_NNNNNN/ save_to_disk folders
    └── MegatronStore (megatron.py)  Megatron-LM / NeMo PREFIX.bin + PREFIX.idx

What every reader gives the feeder and the CLI:

* `meta` (a StoreMeta: dtype, chunks, eos, vocab, tokenizer; made up for formats
  without a meta.json), `dtype`, `chunk_starts` (chunk i holds tokens
  [chunk_starts[i], chunk_starts[i+1]) of the store's one token array T),
  `total_tokens`, `num_chunks`, `chunk_nbytes(i)`, `chunk_of(token)`;
* `read_chunk(i)`: chunk i as a uint16/uint32 array in its own anonymous memory map
  (what the cache holds; narrowed from the format's dtype on the way in), verified:
  DataLoss naming the file when it is short, corrupt or unreadable;
* `verify()`: every problem found, as messages naming the file (empty = healthy);
* `document_ends()`: for formats that record documents (Megatron), the exclusive
  end offset in T of every document; None for the others (documents end at EOS);
  `end_search()` the same ends searched batch by batch (a Megatron index in place);
* `location`, `format`, `generation` (changes when the store is rewritten: part of
  the feeder's cache keys).

A directory with `meta.json` is a native store. A directory of bare `*.bin` files and
no `meta.json` is one too when the dtype is given (the files, in name order, are the
chunks). `open_store` (formats.py) tells the formats apart.
"""

from __future__ import annotations

import functools
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from tokenfeed.core.documents import ArrayEnds, EndSearch
from tokenfeed.core.dtypes import numpy_dtype
from tokenfeed.core.errors import DataLoss, FeederError, InvalidArgument, NotFound
from tokenfeed.core.store.files import LocalFiles, StoreFiles, open_files
from tokenfeed.core.store.meta import META_NAME, Chunk, StoreMeta, check_checksum


class StoreReader(ABC):
    """Read access to one store of any format (see the module docstring)."""

    format = "?"

    def __init__(self, location: str, meta: StoreMeta, generation: int = 0) -> None:
        self.location = location
        self.meta = meta
        self.generation = generation
        self.dtype = numpy_dtype(meta.dtype)
        sizes = np.array([c.tokens for c in meta.chunks], dtype=np.int64)
        self.chunk_starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)

    @property
    def total_tokens(self) -> int:
        return int(self.chunk_starts[-1])

    @property
    def num_chunks(self) -> int:
        return len(self.meta.chunks)

    @property
    def remote(self) -> bool:
        """Whether chunks come over the network (read ahead deeper)."""
        return False

    def chunk_nbytes(self, index: int) -> int:
        return self.meta.chunks[index].tokens * self.dtype.itemsize

    def chunk_of(self, token: int) -> int:
        """Index of the chunk holding token position `token` of T."""
        return int(np.searchsorted(self.chunk_starts, token, side="right")) - 1

    @abstractmethod
    def read_chunk(self, index: int, verify: bool = True) -> np.ndarray:
        """Chunk `index` as the store dtype, in its own memory; DataLoss if damaged."""

    @abstractmethod
    def verify(self) -> list[str]:
        """Every problem found (empty = healthy), each naming its file."""

    @property
    def in_place(self) -> bool:
        """Whether every chunk's bytes lie, as served, in a local file (`chunk_file`), so
        that their rows can be read in place; False when reading a chunk converts its
        ids, or the chunks are not local (object storage)."""
        return False

    def chunk_file(self, index: int) -> tuple[str, int]:
        """Where chunk `index`'s bytes lie in its local file: (path, byte offset)."""
        raise NotImplementedError(f"{self.format} stores are not read in place")

    def check_chunk_file(self, index: int, size: int | None) -> None:
        """DataLoss naming chunk `index` unless its file (`chunk_file`) has `size` bytes
        as the store says (None: the file is missing)."""
        raise NotImplementedError(f"{self.format} stores are not read in place")

    def document_ends(self) -> np.ndarray | None:
        """Exclusive end offsets (int64, non-decreasing) of the recorded documents, or
        None when the format records none (documents then end at EOS)."""
        return None

    def end_search(self) -> EndSearch | None:
        """The recorded document ends, searched batch by batch (what the feeder uses),
        or None when the format records none. From `document_ends()` unless the format
        searches its own index in place (Megatron)."""
        ends = self.document_ends()
        return None if ends is None else ArrayEnds(ends)

    def _problems(
        self, read: Callable[[int], np.ndarray], findings: type[FeederError]
    ) -> list[str]:
        """What `verify` finds: each chunk read with `read` (index -> its tokens), the
        `findings` it raises and the token ids outside the vocabulary, in chunk order."""
        problems: list[str] = []
        for i in range(self.num_chunks):
            try:
                data = read(i)
            except findings as e:
                problems.append(e.message)
                continue
            bad = self._check_ids(i, data)
            if bad:
                problems.append(bad)
        return problems

    def _check_ids(self, index: int, data: np.ndarray) -> str | None:
        vocab = self.meta.vocab_size
        if vocab and data.size and int(data.max()) >= vocab:
            return (
                f"{self.location}: chunk {self.meta.chunks[index].file} has token id "
                f"{int(data.max())} >= vocab_size {vocab}"
            )
        return None


class TokenStore(StoreReader):
    """The native store: meta.json + chunk files, in a local directory or under s3://."""

    format = "tokenfeed"

    def __init__(self, files: StoreFiles | Path, meta: StoreMeta, generation: int = 0) -> None:
        if isinstance(files, Path):
            files = LocalFiles(files)
        super().__init__(files.location, meta, generation)
        self.files = files

    @classmethod
    def open(cls, path: str | os.PathLike[str], dtype: str | None = None) -> TokenStore:
        """Open a store (a directory or `s3://bucket/prefix`): read and check its
        meta.json. The chunk files are not touched: each is checked (exists, its size,
        its checksum) when it is first read, so opening costs the same for 10 chunks
        as for 60,000 (docs/stores.md, "What is checked when")."""
        return cls.open_files(open_files(path), dtype)

    @classmethod
    def open_files(cls, files: StoreFiles, dtype: str | None = None) -> TokenStore:
        root = files.location
        if isinstance(files, LocalFiles) and not files.path.is_dir():
            raise NotFound(f"no token store at {root}: not a directory")
        raw = files.read_small(META_NAME)
        generation = files.version(META_NAME) or 0
        if raw is not None:
            try:
                doc = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise DataLoss(f"{files.where(META_NAME)}: unreadable meta.json ({e})") from None
            meta = StoreMeta.from_json(doc, root)
            if dtype is not None and dtype != meta.dtype:
                raise InvalidArgument(
                    f"{root}: dtype {dtype} was given but meta.json says {meta.dtype}"
                )
        else:
            meta = _bare_meta(files, dtype)
        return cls(files, meta, generation)

    @property
    def path(self) -> Path:
        """The local directory (InvalidArgument for a store in object storage)."""
        if not isinstance(self.files, LocalFiles):
            raise InvalidArgument(f"{self.location} is in object storage, not a local directory")
        return self.files.path

    @property
    def remote(self) -> bool:
        return self.files.remote

    def chunk_path(self, index: int) -> Path:
        return self.path / self.meta.chunks[index].file

    @property
    def in_place(self) -> bool:
        return not self.files.remote

    @functools.cached_property
    def _local_prefix(self) -> str:
        return os.path.join(self.files.location, "")

    def chunk_file(self, index: int) -> tuple[str, int]:
        # a lone rank of a large job opens a chunk file per batch: one concatenation
        return self._local_prefix + self.meta.chunks[index].file, 0

    def check_chunk_file(self, index: int, size: int | None) -> None:
        self._check_size(self.meta.chunks[index], size)

    def _check_size(self, c: Chunk, size: int | None) -> None:
        """DataLoss naming chunk `c` unless its file has `size` bytes as meta.json says
        (None: the file is missing)."""
        if size is None:
            raise DataLoss(f"{self.location}: chunk {c.file} is missing")
        if size != c.tokens * self.dtype.itemsize:
            raise DataLoss(
                f"{self.location}: chunk {c.file} has {size} bytes, expected "
                f"{c.tokens} tokens x {self.dtype.itemsize} = {c.tokens * self.dtype.itemsize}"
            )

    def read_chunk(self, index: int, verify: bool = True) -> np.ndarray:
        """The tokens of chunk `index`, read whole; DataLoss naming it if it is missing,
        not the size meta.json gives, or corrupt.

        The array lives in its own anonymous memory map, so dropping it (a cache
        eviction) hands the memory straight back to the OS: with malloc, freed chunks
        stay in the heap and a server's RSS drifts far above its cache bound.
        """
        c = self.meta.chunks[index]
        nbytes = c.tokens * self.dtype.itemsize
        try:
            buf = self.files.read(c.file, nbytes)
        except (DataLoss, NotFound) as e:
            # missing, or not the size meta.json gives: say which
            self._check_size(c, self.files.size(c.file))
            raise DataLoss(e.message) from None
        data = np.frombuffer(buf, dtype=self.dtype, count=c.tokens)
        if verify:
            check_checksum(data, c, self.location)
        return data

    def verify(self) -> list[str]:
        """Every problem found in sizes, checksums and token ids (empty = healthy)."""
        sizes = self.files.names() if self.files.remote else None

        def read(i: int) -> np.ndarray:
            c = self.meta.chunks[i]
            self._check_size(c, sizes.get(c.file) if sizes is not None else self.files.size(c.file))
            return self.read_chunk(i)

        return self._problems(read, DataLoss)  # unreachable storage is not a finding


def _bare_meta(files: StoreFiles, dtype: str | None) -> StoreMeta:
    root = files.location
    names = sorted((n, s) for n, s in files.names().items() if "/" not in n and n.endswith(".bin"))
    if not names:
        if isinstance(files, LocalFiles) or files.names():
            raise NotFound(f"no token store at {root}: neither meta.json nor *.bin files")
        raise NotFound(f"no token store at {root}: nothing there")
    if dtype is None:
        raise InvalidArgument(
            f"{root} has *.bin files but no meta.json: give the dtype (uint16 or uint32)"
        )
    itemsize = numpy_dtype(dtype).itemsize
    chunks = []
    for name, size in names:
        if size % itemsize:
            raise DataLoss(f"{root}: {name} has {size} bytes, not a whole number of {dtype}")
        chunks.append(Chunk(name, size // itemsize))
    return StoreMeta(dtype=dtype, chunks=tuple(chunks), format_version=None)


def iter_tokens(store: StoreReader, verify: bool = True) -> Iterator[np.ndarray]:
    """The store's tokens, chunk by chunk, in order."""
    for i in range(store.num_chunks):
        yield store.read_chunk(i, verify=verify)


def is_complete(path: str | os.PathLike[str]) -> bool:
    return open_files(path).exists(META_NAME)
