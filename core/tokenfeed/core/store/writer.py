"""Write a token store, crash-safe: chunks as they fill, `meta.json` last.

Locally every file is written under a temporary name and renamed
(tokenfeed.core.atomic); under s3:// every file is one PUT, which replaces an object
atomically. `meta.json` goes last either way, so a store with a `meta.json` is always
complete.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.core.dtypes import numpy_dtype
from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.store.files import LocalFiles, StoreFiles, open_files
from tokenfeed.core.store.meta import (
    DEFAULT_TOKENS_PER_CHUNK,
    META_NAME,
    Chunk,
    StoreMeta,
    checksum,
    chunk_name,
)
from tokenfeed.core.store.objects import WRITER_POLICY


def write_meta(path: Path | StoreFiles, meta: StoreMeta) -> None:
    """Write meta.json atomically: the moment a store becomes complete."""
    files = LocalFiles(path) if isinstance(path, Path) else path
    files.write(META_NAME, json.dumps(meta.to_json(), indent=2).encode() + b"\n")


class StoreWriter:
    """Append tokens; full chunks go to disk as they fill; `finish()` writes meta.json.

    `chunks` may name chunks already on disk (a resumed run): they are kept and new
    chunks are numbered after them.
    """

    def __init__(
        self,
        path: str | os.PathLike[str] | StoreFiles,
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
        self.files = path if isinstance(path, StoreFiles) else open_files(path, WRITER_POLICY)
        if isinstance(self.files, LocalFiles):
            self.files.path.mkdir(parents=True, exist_ok=True)
        self.dtype = numpy_dtype(dtype)
        self.dtype_name = dtype
        self.tokens_per_chunk = tokens_per_chunk
        self.eos_token_id = eos_token_id
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.source = dict(source or {})
        self.stats: dict[str, Any] = {}  # what was written (StoreMeta.stats); the caller's
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
        self.files.write(name, data.data.cast("B"))
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
            stats=dict(self.stats),
        )

    def finish(self) -> StoreMeta:
        """Flush the last partial chunk and write meta.json; the store is then complete."""
        if self._fill:
            self._flush()
        meta = self.meta()
        write_meta(self.files, meta)
        return meta


def write_store(
    path: str | os.PathLike[str] | StoreFiles, tokens: np.ndarray, **kwargs: Any
) -> StoreMeta:
    """Write a whole token array as a store (small stores, tests, imports)."""
    writer = StoreWriter(path, **kwargs)
    writer.add(tokens)
    return writer.finish()
