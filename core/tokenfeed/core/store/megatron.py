"""Megatron-LM / NeMo indexed datasets (PREFIX.bin + PREFIX.idx), served in place.

Layout of PREFIX.idx (little-endian; megatron/core/datasets/indexed_dataset.py,
_IndexWriter / _IndexReader, unchanged from the legacy MMapIndexedDataset):

    offset     size        field
    0          9           magic b"MMIDIDX\\x00\\x00"
    9          8  u64      version, always 1
    17         1  u8       token dtype code (DTYPE_CODES)
    18         8  u64      S = sequence count
    26         8  u64      D = document count + 1 (length of document_indices)
    34         4*S int32   sequence_lengths, in tokens
    34+4S      8*S int64   sequence_pointers, byte offset of each sequence in PREFIX.bin
    34+12S     8*D int64   document_indices: the sequence where each document starts;
                           [0] == 0, [-1] == S, non-decreasing (an empty document repeats)
    34+12S+8D  S int8      sequence_modes, only in multimodal datasets (the header does
                           not say so: the file size does)

The writer makes sequence_pointers the running sum of lengths x itemsize, so PREFIX.bin
is one flat token array, served as it is: the store's token array T. Document d is
tokens [starts[di[d]], starts[di[d+1]]) with starts = [0, cumsum(lengths)]. Sequences
are sentences when the corpus was prepared with --split-sentences; documents are what
`document_ends()` reports, so document masks need no EOS. The feeder never makes that
list (8 bytes a document): `end_search()` finds each batch's ends in the mapped index.

The .bin is cut into chunks of 4 MiB (CHUNK_BYTES) for the cache. A chunk is read with one
positioned read (not through a memory map: a file truncated under a mapping kills the
process with SIGBUS), then narrowed to the store dtype: uint16 and the unsigned/
non-negative types that fit it (uint8, int8, int16) -> uint16; int32 and int64 ->
uint32 (int32 is the same bits once ids are >= 0). A negative id or one beyond uint32
is DataLoss naming the file. Opening checks what costs O(1) (magic, version, dtype,
both file sizes against the counts); `verify()` checks the rest.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import struct
from functools import cached_property
from pathlib import Path

import numpy as np

from tokenfeed.core import documents
from tokenfeed.core.documents import EndSearch
from tokenfeed.core.errors import DataLoss, NotFound
from tokenfeed.core.store.memory import anonymous
from tokenfeed.core.store.meta import Chunk, StoreMeta
from tokenfeed.core.store.reader import StoreReader

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = struct.Struct("<9sQBQQ")  # 34 bytes
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("u1"),
    2: np.dtype("i1"),
    3: np.dtype("<i2"),
    4: np.dtype("<i4"),
    5: np.dtype("<i8"),
    6: np.dtype("<f8"),
    7: np.dtype("<f4"),  # legacy writers put float64 here too; token ids are never floats
    8: np.dtype("<u2"),
}
# Store-dtype bytes per chunk. A chunk is the unit of caching and (about) of the block
# shuffle, whose working set is shuffle_blocks + 1 chunks: 32 MiB slices made a 72 MiB
# cache thrash in benchmarks/store_sources.py (0.003x a native store of 4 MiB chunks).
# A positioned read of 4 MiB costs next to nothing more per byte than 32 MiB.
CHUNK_BYTES = 4 << 20


def split_prefix(path: str | os.PathLike[str]) -> Path:
    """PREFIX for a prefix, PREFIX.bin or PREFIX.idx."""
    p = Path(path)
    return p.with_suffix("") if p.suffix in (".bin", ".idx") else p


def is_megatron(path: str | os.PathLike[str]) -> bool:
    """Whether `path` (a prefix or either file) names an existing PREFIX.bin + PREFIX.idx."""
    prefix = split_prefix(path)
    return all(prefix.with_name(prefix.name + s).is_file() for s in (".bin", ".idx"))


def _map(path: Path) -> tuple[np.ndarray, mmap.mmap | None]:
    """The file's bytes, memory-mapped, and the mapping (None for an empty file)."""
    size = path.stat().st_size
    if size == 0:
        return np.zeros(0, dtype=np.uint8), None
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    return np.frombuffer(m, dtype=np.uint8), m


class MegatronStore(StoreReader):
    format = "megatron"

    def __init__(
        self,
        prefix: Path,
        source_dtype: np.dtype,
        lengths: np.ndarray,
        pointers: np.ndarray,
        doc_indices: np.ndarray,
        modes: np.ndarray | None,
        total_tokens: int,
        generation: int,
        chunk_tokens: int | None = None,
        index_map: mmap.mmap | None = None,
    ) -> None:
        self.prefix = prefix
        self.index_map = index_map  # the .idx's mapping: its size() is the file's now
        self.bin_path = prefix.with_name(prefix.name + ".bin")
        self.idx_path = prefix.with_name(prefix.name + ".idx")
        self.source_dtype = source_dtype
        self.sequence_lengths = lengths
        self.sequence_pointers = pointers
        self.document_indices = doc_indices
        self.sequence_modes = modes
        store_dtype = "uint16" if source_dtype.itemsize <= 2 else "uint32"
        per = chunk_tokens or CHUNK_BYTES // (2 if store_dtype == "uint16" else 4)
        name = self.bin_path.name
        chunks = tuple(Chunk(name, min(per, total_tokens - a)) for a in range(0, total_tokens, per))
        meta = StoreMeta(
            dtype=store_dtype,
            chunks=chunks,
            tokens_per_chunk=per,
            source={
                "kind": "megatron",
                "prefix": str(prefix),
                "dtype": source_dtype.name,
                "sequences": int(lengths.size),
                "documents": int(doc_indices.size - 1),
                "multimodal": modes is not None,
            },
            format_version=None,
        )
        super().__init__(str(prefix), meta, generation)

    @classmethod
    def open(cls, path: str | os.PathLike[str], chunk_tokens: int | None = None) -> MegatronStore:
        """Open PREFIX (or PREFIX.bin / PREFIX.idx); DataLoss naming the file if damaged."""
        prefix = split_prefix(path)
        idx_path = prefix.with_name(prefix.name + ".idx")
        bin_path = prefix.with_name(prefix.name + ".bin")
        for p in (idx_path, bin_path):
            if not p.is_file():
                raise NotFound(f"{p}: no such file (a Megatron dataset is PREFIX.bin + PREFIX.idx)")
        try:
            idx, index_map = _map(idx_path)
            bin_size = bin_path.stat().st_size
            gen_key = f"{idx_path.stat().st_mtime_ns}:{idx.size}:"
            gen_key += f"{bin_path.stat().st_mtime_ns}:{bin_size}"
        except OSError as e:
            raise DataLoss(f"{prefix}: unreadable ({e.strerror or e})") from None
        if idx.size < HEADER.size:
            raise DataLoss(f"{idx_path}: {idx.size} bytes, shorter than the 34-byte header")
        magic, version, code, s, d = HEADER.unpack_from(idx.data)
        if magic != MAGIC:
            raise DataLoss(
                f"{idx_path}: not a Megatron index (magic {magic!r}, expected {MAGIC!r})"
            )
        if version != VERSION:
            raise DataLoss(f"{idx_path}: index version {version}, only 1 is known")
        if code not in DTYPE_CODES or DTYPE_CODES[code].kind == "f":
            raise DataLoss(f"{idx_path}: dtype code {code} holds no token ids")
        dtype = DTYPE_CODES[code]
        base = HEADER.size + 12 * s + 8 * d
        if idx.size == base:
            modes = None
        elif idx.size == base + s:
            modes = idx[base : base + s].view(np.int8)
        else:
            raise DataLoss(
                f"{idx_path}: {idx.size} bytes, but {s} sequences and {d} document indices "
                f"need {base} (or {base + s} with multimodal modes): truncated or not an index"
            )
        o = HEADER.size
        lengths = idx[o : o + 4 * s].view("<i4")
        pointers = idx[o + 4 * s : o + 12 * s].view("<i8")
        docs = idx[o + 12 * s : base].view("<i8")
        if d < 1 or docs[0] != 0 or docs[-1] != s:
            raise DataLoss(
                f"{idx_path}: document indices must run from 0 to the sequence count {s}, "
                f"found {int(docs[0]) if d else None} .. {int(docs[-1]) if d else None}"
            )
        expect = int(pointers[-1]) + int(lengths[-1]) * dtype.itemsize if s else 0
        if bin_size != expect or (s and pointers[0] != 0):
            raise DataLoss(
                f"{bin_path}: {bin_size} bytes, but its index says the tokens end at byte {expect}"
            )
        generation = (
            int.from_bytes(hashlib.blake2b(gen_key.encode(), digest_size=8).digest(), "little") >> 1
        )
        return cls(
            prefix,
            dtype,
            lengths,
            pointers,
            docs,
            modes,
            bin_size // dtype.itemsize,
            generation,
            chunk_tokens,
            index_map,
        )

    @property
    def num_documents(self) -> int:
        return int(self.document_indices.size - 1)

    @cached_property
    def sequence_starts(self) -> np.ndarray:
        """Token offset of each sequence, plus the total at the end: int64 [S + 1]."""
        out = np.zeros(self.sequence_lengths.size + 1, dtype=np.int64)
        np.cumsum(self.sequence_lengths, out=out[1:])
        return out

    def document_ends(self) -> np.ndarray:
        """Exclusive end offset of every document in T, int64 [D], non-decreasing (an
        empty document repeats the previous end). Made whole, 8 bytes per document and
        as many per sequence: the feeder searches the index instead (`end_search`)."""
        return self.sequence_starts[self.document_indices[1:]]

    def end_search(self) -> EndSearch:
        """The documents' ends searched in the memory-mapped index, batch by batch:
        nothing per document, in memory or in time (documents.indexed_ends). One per
        store: a mixture asks each source at every request, and the index's mapping is
        advised once."""
        return self._index_ends

    @cached_property
    def _index_ends(self) -> _IndexEnds:
        return _IndexEnds(self)

    @property
    def in_place(self) -> bool:
        """When the .bin holds the served ids as they are (uint16); the other dtypes are
        converted (and checked) as a chunk is read."""
        return self.source_dtype == np.dtype("<u2")

    def chunk_file(self, index: int) -> tuple[str, int]:
        return str(self.bin_path), int(self.chunk_starts[index]) * 2

    def check_chunk_file(self, index: int, size: int | None) -> None:
        expect = self.total_tokens * self.source_dtype.itemsize
        if size != expect:
            raise DataLoss(
                f"{self.bin_path}: {'missing' if size is None else f'{size} bytes'}, but its "
                f"index says the tokens end at byte {expect}: the file changed since it was "
                "opened"
            )

    def _read_source(self, a: int, b: int, out: memoryview) -> None:
        item = self.source_dtype.itemsize
        try:
            with open(self.bin_path, "rb") as f:
                f.seek(a * item)
                got = f.readinto(out)
        except OSError as e:
            raise DataLoss(f"{self.bin_path}: unreadable ({e.strerror or e})") from None
        if got != (b - a) * item:
            raise DataLoss(
                f"{self.bin_path}: tokens [{a}, {b}) cut short (read {got} of "
                f"{(b - a) * item} bytes): the file changed since it was opened"
            )

    def read_chunk(self, index: int, verify: bool = True) -> np.ndarray:
        a, b = int(self.chunk_starts[index]), int(self.chunk_starts[index + 1])
        n = b - a
        buf = anonymous(n * self.dtype.itemsize, whole=True)  # filled below
        out = np.frombuffer(buf, dtype=self.dtype, count=n)
        src = self.source_dtype
        if src.itemsize == self.dtype.itemsize:  # uint16, int16, int32: read in place
            self._read_source(a, b, memoryview(buf)[: n * src.itemsize])
            if src.kind == "i" and n and int(out.view(src).min()) < 0:
                self._bad_ids(a, b, out.view(src))
            return out
        tmp = np.empty(n, dtype=src)
        self._read_source(a, b, tmp.data.cast("B"))
        if n and (int(tmp.min()) < 0 or int(tmp.max()) > int(np.iinfo(self.dtype).max)):
            self._bad_ids(a, b, tmp)
        np.copyto(out, tmp, casting="unsafe")
        return out

    def _bad_ids(self, a: int, b: int, values: np.ndarray) -> None:
        raise DataLoss(
            f"{self.bin_path}: tokens [{a}, {b}) hold ids {int(values.min())}..{int(values.max())}"
            f", which do not fit {self.meta.dtype} ({self.source_dtype.name} file)"
        )

    def verify(self) -> list[str]:
        """The structure the O(1) checks at open did not look at, then every token."""
        problems = []
        idx = str(self.idx_path)
        item = self.source_dtype.itemsize
        if self.sequence_lengths.size and int(self.sequence_lengths.min()) < 0:
            problems.append(f"{idx}: negative sequence length")
        elif not np.array_equal(self.sequence_pointers, self.sequence_starts[:-1] * item):
            bad = int(np.flatnonzero(self.sequence_pointers != self.sequence_starts[:-1] * item)[0])
            problems.append(
                f"{idx}: sequence {bad} starts at byte {int(self.sequence_pointers[bad])}, not "
                f"right after the one before ({int(self.sequence_starts[bad]) * item}): the "
                ".bin is not one flat token array"
            )
        if np.any(np.diff(self.document_indices) < 0):
            problems.append(f"{idx}: document indices go backwards")
        for i in range(self.num_chunks):
            try:
                self.read_chunk(i)
            except DataLoss as e:
                problems.append(e.message)
        return problems


class _IndexEnds(EndSearch):
    """A Megatron store's document ends, read from its index's sentence pointers and
    document indices in place (equal to `document_ends()` wherever `verify` finds the
    index sound: the pointers are then the running sum of the lengths)."""

    def __init__(self, store: MegatronStore) -> None:
        self.idx_path = store.idx_path
        self.mapped = store.index_map
        self.size = len(store.index_map) if store.index_map is not None else 0
        if self.mapped is not None and hasattr(mmap, "MADV_RANDOM"):
            # a search's probes land on random pages of an index of gigabytes: a page
            # not in the page cache reads itself, not the kernel's read-around (up to
            # the device's read_ahead_kb: 8 MiB on this project's VM)
            with contextlib.suppress(OSError):
                self.mapped.madvise(mmap.MADV_RANDOM)
        self.index = documents.Sentences(
            store.sequence_pointers,
            store.document_indices,
            store.source_dtype.itemsize,
            store.total_tokens,
        )

    def ends(self, starts: np.ndarray, cols: int) -> np.ndarray:
        # A page of a mapping past its file's end kills the process (SIGBUS): a file
        # truncated in place is refused first (one fstat; a file replaced by a rename
        # leaves this mapping whole).
        if self.mapped is not None and self.mapped.size() < self.size:
            raise DataLoss(
                f"{self.idx_path}: {self.mapped.size()} bytes, {self.size} when opened: the "
                "file changed since it was opened"
            )
        try:
            return documents.indexed_ends(starts, cols, self.index)
        except ValueError as e:
            raise DataLoss(f"{self.idx_path}: {e} (`tokenfeed verify` says where)") from None
