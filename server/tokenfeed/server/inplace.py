"""Rows read in place: a burst's rows read from the chunk files, not from chunks loaded whole.

A rank of a job of W ranks takes about 1/W of the windows of every chunk it reads
(docs/sampling.md, "Steps and ranks"). Loading whole chunks into the cache pays off
when the other ranks of the job read the same chunks from the same feeder; a feeder
that serves a few ranks of a large job (one of several replicas, or a rank on its
own) would read and checksum a whole 32 MiB chunk for each few rows it sends: every
rank paying for its whole global step. So a stream of a job of IN_PLACE_WORLD_SIZE
ranks or more whose burst needs chunks that are not all cached reads its rows out of
the chunk files, a positioned read each (from the OS page cache, or the disk:
splice.splice_files): the bytes it reads are the rows it sends, whatever W.

A mixture of k sources spreads a rank's windows over k shuffle groups at once: loading
whole chunks, one stream of a mixture of 1,000 sources needed 1,000 groups' chunks in
the cache (far more than it holds) and reloaded a chunk for nearly every window. So
the threshold is on W x k, the shares each chunk's windows go to.

A stream keeps up to KEEP_FILES files of its last burst open for the next
(`ChunkFiles`): a shuffle group's chunks serve several bursts. Each file is advised
random access, so a row missing from the page cache reads its own pages, not the
kernel's 128 KiB read-ahead.

What is checked: the file's size against the store, when it is opened (a chunk missing
or cut short is DataLoss naming it, for the streams that need it; one cut while open
is found by the read that comes back short). Not the chunk's checksum, which covers
the whole chunk: a whole-chunk load checks it (streams of smaller jobs, `tokenfeed
verify`). Stores whose reads convert the ids (the seed layout, Megatron files of
another dtype than uint16) and stores in object storage are not read in place
(`StoreReader.in_place`): their streams load whole chunks as any other.
"""

from __future__ import annotations

import os

import numpy as np

from tokenfeed.core.errors import DataLoss
from tokenfeed.core.store import StoreReader
from tokenfeed.server import splice
from tokenfeed.server.rounds import LocatedRound, Span

# A job this large reads in place. At 16 ranks a rank takes 1/16 of each chunk it
# reads; loading a chunk whole costs more CPU than reading all of its rows one by one
# (benchmarks/scale.py, "world size"), so a lone rank of such a job would pay 16 times
# over, while a smaller job is usually served by one feeder, whose cache shares each
# load among all its ranks (and checks the chunk's checksum).
IN_PLACE_WORLD_SIZE = 16
# Files a stream keeps open between bursts: a shuffle group's chunks (8 by default),
# which serve the stream's next bursts until it moves on. A burst opens what it needs
# (tens of files at most, for as long as a worker thread builds it); 1,024 streams
# hold at most 8,192 between bursts (docs/serving.md, "Limits").
KEEP_FILES = 8
FILES_PER_STREAM = 1 + KEEP_FILES  # its connection, and the chunk files it keeps open


class ChunkFiles:
    """One stream's open chunk files: those of its last burst (`burst`), closed by
    `close()` or when the next burst no longer needs them."""

    def __init__(self, store: StoreReader) -> None:
        self.store = store
        self._files: dict[int, tuple[int, int, int]] = {}  # chunk -> (fd, base, size)

    def keep(self, chunks: set[int]) -> None:
        """After a burst: close the files beyond KEEP_FILES, `chunks` (the chunks of its
        last message, the likeliest to serve the next) first kept."""
        if len(self._files) <= KEEP_FILES:
            return
        order = sorted(self._files, key=lambda c: c not in chunks)
        for c in order[KEEP_FILES:]:
            os.close(self._files.pop(c)[0])

    def ahead(self, chunks: list[int]) -> None:
        """Off the event loop, after a burst: open the files of the next one's `chunks`
        and keep them first, so that the next burst can be read on the event loop. A file
        that fails to open is left to the burst that needs it (its error names it)."""
        for c in chunks:
            if c not in self._files:
                path, base = self.store.chunk_file(c)
                try:
                    self._files[c] = (self._open(c, path), base, self.store.chunk_nbytes(c))
                except (DataLoss, OSError):
                    break
        self.keep(set(chunks))

    def kept(self, chunks: list[int]) -> InPlace | None:
        """The files of `chunks` (ascending) if all are open already, to be read without
        waiting (`InPlace` with `nowait`: on the event loop); else None."""
        files = self._files
        if not all(c in files for c in chunks):
            return None
        table = np.array([files[c] for c in chunks], dtype=np.int64).reshape(-1, 3)
        return InPlace(self.store, np.asarray(chunks, dtype=np.int64), table, nowait=True)

    def burst(self, chunks: list[int]) -> InPlace:
        """The files of `chunks` (ascending), open; DataLoss naming the first that is
        missing, cut short or unreadable."""
        kept = {c: self._files.pop(c) for c in chunks if c in self._files}
        self.close()
        self._files = kept
        for c in chunks:
            if c not in kept:
                path, base = self.store.chunk_file(c)
                kept[c] = (self._open(c, path), base, self.store.chunk_nbytes(c))
        files = np.array([kept[c] for c in chunks], dtype=np.int64).reshape(-1, 3)
        return InPlace(self.store, np.asarray(chunks, dtype=np.int64), files)

    def _open(self, chunk: int, path: str) -> int:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            self.store.check_chunk_file(chunk, None)
            raise
        except OSError as e:
            raise DataLoss(f"{path}: unreadable ({e.strerror or e})") from None
        try:
            self.store.check_chunk_file(chunk, os.fstat(fd).st_size)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def close(self) -> None:
        files, self._files = self._files, {}
        for fd, _, _ in files.values():
            os.close(fd)


class WouldBlock(Exception):
    """A row read without waiting is not in the page cache: the burst is left to a
    worker thread."""


class InPlace:
    """A burst's chunks as open files: what `rows` and `message` read (one positioned
    read per row piece). Like assembly.Pinned; `release()` has nothing to let go.
    `nowait`: the reads take only what the page cache holds, WouldBlock otherwise."""

    def __init__(
        self, store: StoreReader, keys: np.ndarray, files: np.ndarray, nowait: bool = False
    ) -> None:
        self.store = store
        self.keys = keys  # ascending chunk ids
        self.fds, self.bases, self.sizes = (np.ascontiguousarray(files[:, i]) for i in range(3))
        self.nowait = nowait

    def release(self) -> None:
        pass  # the stream's ChunkFiles keeps the files for its next burst

    def rows(self, lr: LocatedRound, i: int) -> bytes:
        """Batch i's rows of tokens."""
        return self._splice([(lr.row_pieces(i), b"")])

    def message(self, spans: list[Span]) -> bytes:
        """Batches [i, j) of each span's round, framed: a message."""
        return self._splice(
            [(lr.program[lr.piece_lo[i] : lr.piece_lo[j]], lr.frames) for lr, i, j in spans]
        )

    def _splice(self, parts: list[splice.Part]) -> bytes:
        try:
            data = splice.splice_files(
                parts, self.keys, self.fds, self.bases, self.sizes, self.nowait
            )
        except EOFError as e:  # the file was cut since it was opened: say which and how
            chunk = int(str(e).split()[-1])
            fd = int(self.fds[int(np.searchsorted(self.keys, chunk))])
            self.store.check_chunk_file(chunk, os.fstat(fd).st_size)
            raise DataLoss(f"{self.store.location}: chunk {chunk} was cut short") from None
        except OSError as e:
            raise DataLoss(f"{self.store.location}: a chunk file is unreadable ({e})") from None
        if data is None:
            raise WouldBlock
        return data
