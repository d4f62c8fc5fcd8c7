"""Chunks that every worker process of a node shares: read-only maps of the chunk files.

One server process (the default) reads each chunk into private anonymous memory
(`TokenStore.read_chunk`) and checks its crc32 on every load. Under `--workers N` that
would be N private copies of the hot chunks and N checksum passes over each, so each
worker opens its stores as `MappedStore`s instead:

* a chunk is a read-only `MAP_SHARED` map of its file, so its bytes live once, in the
  OS page cache, however many workers map it (and a worker's own memory stays small:
  an eviction from its LRU is an `munmap`, the page cache keeps the bytes for the
  others);
* its checksum is checked once per node: the first worker to map a chunk file checks
  it and leaves a marker (`VerifiedChunks`, a directory the supervisor owns) named by
  the file's identity (device, inode, size, mtime) and the checksum meta.json expects;
  later maps of the same file, by any worker, skip the pass. A store is immutable once
  prepared (a re-prepared chunk is a new file: new inode, new marker), so the marker
  stays true; `tokenfeed verify` re-reads everything from disk when in doubt.

Where a chunk's bytes come from is this module's concern only: the cache and the
assembly code see an ndarray. A store that is not on local disk (S3, say) fits the
same seam: its loader writes the chunk once per node to a file in shared memory
(`/dev/shm`, atomically, named by its cache key) and maps it as here.
"""

from __future__ import annotations

import logging
import mmap
import os
import resource
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tokenfeed.core.errors import ChecksumMismatch, DataLoss
from tokenfeed.core.store import TokenStore
from tokenfeed.core.store.meta import checksum

log = logging.getLogger(__name__)

_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: fault the pages in at map time


class VerifiedChunks:
    """Chunk files whose checksum a process of this node has checked: one empty marker
    file each in `directory` (shared by the workers; a worker killed mid-check leaves
    no marker, so the next one checks again)."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def mark(st: os.stat_result, expected: str) -> str:
        return f"{st.st_dev}-{st.st_ino}-{st.st_size}-{st.st_mtime_ns}-{expected}"

    def __contains__(self, mark: str) -> bool:
        return (self.directory / mark).exists()

    def add(self, mark: str) -> None:
        try:
            (self.directory / mark).touch()
        except OSError as e:  # only costs another check later
            log.warning("could not record a verified chunk: %s", e)


class MappedStore(TokenStore):
    """A TokenStore whose chunks are read-only maps of the chunk files (see above)."""

    verified: VerifiedChunks | None = None  # None: check on every map, like TokenStore

    @classmethod
    def opener(cls, verified: VerifiedChunks | None) -> Callable[[Path], TokenStore]:
        """`Catalog(open_store=...)`: open stores as MappedStores sharing `verified`."""

        def open_store(path: Path) -> TokenStore:
            store = cls.open(path)
            assert isinstance(store, MappedStore)
            store.verified = verified
            return store

        return open_store

    def read_chunk(self, index: int, verify: bool = True) -> np.ndarray:
        """Chunk `index` as a read-only array over a shared map of its file."""
        c = self.meta.chunks[index]
        itemsize = self.dtype.itemsize
        nbytes = c.tokens * itemsize
        try:
            with open(self.path / c.file, "rb") as f:
                st = os.fstat(f.fileno())
                if st.st_size != nbytes:
                    raise DataLoss(
                        f"{self.path}: chunk {c.file} holds {st.st_size // itemsize} tokens, "
                        f"meta.json says {c.tokens}"
                    )
                if nbytes == 0:
                    return np.empty(0, dtype=self.dtype)
                buf = mmap.mmap(
                    f.fileno(), nbytes, flags=mmap.MAP_SHARED | _POPULATE, prot=mmap.PROT_READ
                )
        except OSError as e:
            raise DataLoss(f"{self.path}: chunk {c.file} unreadable ({e})") from None
        data = np.frombuffer(buf, dtype=self.dtype, count=c.tokens)
        if verify and c.checksum:
            mark = VerifiedChunks.mark(st, c.checksum)
            if self.verified is None or mark not in self.verified:
                got = checksum(data)
                if got != c.checksum:
                    raise ChecksumMismatch(
                        f"{self.path}: chunk {c.file} is corrupt (checksum {got}, meta.json "
                        f"says {c.checksum}); run `tokenfeed verify {self.path}`"
                    )
                if self.verified is not None:
                    self.verified.add(mark)
        return data


def raise_open_files_limit() -> int:
    """Raise this process's soft limit of open files to the hard limit (a mapped chunk
    holds its file open while mapped); returns the limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d: %s", soft, e)
    return soft
