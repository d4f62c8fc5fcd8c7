"""The native token store format: the one module that knows meta.json and chunk names.

A store is a directory::

    meta.json
    chunk_000000.bin   flat little-endian token ids (uint16 or uint32)
    chunk_000001.bin
    ...

Documents are concatenated with one EOS after each. `meta.json` is a superset of
what the Streaming-Dataloader prepare script writes (`dtype`, `eos_token_id`,
`tokenizer_name_or_path`, `tokens_per_chunk`, `chunks: [{file, tokens}]`,
`total_tokens`, `created_at_unix`), so its stores are served as they are; tokenfeed
adds `format_version`, `vocab_size`, a `checksum` per chunk, `source` (what made the
store: the command, which decides whether a re-run resumes) and `stats` (what was
written: `documents` and their UTF-8 `text_bytes`, counted over the documents the
store holds, not the whole corpus).

The reader (reader.py) and the writer (writer.py) both import this module; neither
owns the format.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from tokenfeed.core.dtypes import numpy_dtype
from tokenfeed.core.errors import ChecksumMismatch, DataLoss, InvalidArgument

FORMAT_VERSION = 1
META_NAME = "meta.json"
DEFAULT_TOKENS_PER_CHUNK = 1 << 24  # 32 MiB of uint16: big sequential reads, few files


def _crc32() -> Callable[[Any], int]:
    """The fastest CRC-32 at hand: ISA-L's (the `server` extra installs it) computes the
    same value as zlib's ~10x faster, which is most of a chunk load from the page cache
    (a stream's first batch waits for its chunks)."""
    try:
        from isal.isal_zlib import crc32
    except ImportError:
        return zlib.crc32
    return crc32


crc32 = _crc32()


def checksum(data: bytes | memoryview | np.ndarray) -> str:
    """Checksum of a chunk's bytes, as stored in meta.json (`crc32:%08x`)."""
    if isinstance(data, np.ndarray):
        data = np.ascontiguousarray(data).data.cast("B")
    return f"crc32:{crc32(data) & 0xFFFFFFFF:08x}"


def check_checksum(data: np.ndarray, chunk: Chunk, where: str) -> None:
    """ChecksumMismatch naming the chunk when `data` is not what meta.json recorded
    (a chunk without a recorded checksum passes)."""
    if chunk.checksum and (got := checksum(data)) != chunk.checksum:
        raise ChecksumMismatch(
            f"{where}: chunk {chunk.file} is corrupt (checksum {got}, meta.json says "
            f"{chunk.checksum}); run `tokenfeed verify {where}`"
        )


def chunk_name(index: int) -> str:
    return f"chunk_{index:06d}.bin"


class Chunk(NamedTuple):  # a tuple: a store of 10^12 tokens lists 60,000 of them
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
    stats: dict[str, Any] = field(default_factory=dict)

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
            "stats": self.stats,
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
                Chunk(str(c["file"]), int(c["tokens"]), c.get("checksum")) for c in doc["chunks"]
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
                stats=dict(doc.get("stats") or {}),
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
            if "/" in c.file or c.file in ("", ".", ".."):
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
