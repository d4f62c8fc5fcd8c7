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

The feeder's streams share its open chunk files (`FilePool`): a shuffle group's chunks
serve a stream's next bursts and the other ranks of its job, a mixture's sources serve
every batch, and the streams that follow the last one for a while (KEEP_SECONDS). Each
file is advised random access, so a row missing from the page cache reads its own pages,
not the kernel's 128 KiB read-ahead.

Where a burst is read: a burst whose files are all open is tried on the event loop,
its reads taking only what the page cache holds (`kept`: RWF_NOWAIT, never waiting
for the disk); a row that is not there (WouldBlock), or a file to open, leaves the
burst to a worker thread, which then opens the next burst's files (`ahead`). A rank of
a large job crosses a shuffle group's chunks in a few bursts, so most of its bursts
are read on the loop, with no thread hop. While a stream is being set up its bursts
go to worker threads (service.py): a loop busy reading holds the GIL the set-up waits
for.

What is checked: the file's size against the store, when it is opened (a chunk missing
or cut short is DataLoss naming it, for the streams that need it; one cut while open,
in the pool, is found by the read that comes back short). A file is opened for its
store's generation (the pool's key is the chunk's cache key), as a chunk is cached.
Not the chunk's checksum, which covers the whole chunk: a whole-chunk load checks it
(streams of smaller jobs, `tokenfeed verify`). Stores whose reads convert the ids
(the seed layout, Megatron files of another dtype than uint16) and stores in object
storage are not read in place (`StoreReader.in_place`): their streams load whole
chunks as any other.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np

from tokenfeed.core.errors import DataLoss
from tokenfeed.server import descriptors, splice
from tokenfeed.server.datasets import Dataset
from tokenfeed.server.rounds import LocatedRound, Span

# A job this large reads in place. At 16 ranks a rank takes 1/16 of each chunk it
# reads; loading a chunk whole costs more CPU than reading all of its rows one by one
# (benchmarks/scale.py, "world size"), so a lone rank of such a job would pay 16 times
# over, while a smaller job is usually served by one feeder, whose cache shares each
# load among all its ranks (and checks the chunk's checksum).
IN_PLACE_WORLD_SIZE = 16
# The feeder's open chunk files (`FilePool`), shared by its streams that read in place:
# KEEP_FILES per such stream, a shuffle group's chunks (8 by default), which serve the
# stream's next bursts until it moves on; and at least POOL_FILES while any stream reads
# in place, so that one stream of a mixture of 1,000 sources (a chunk file each, or
# more) finds its sources' files open instead of opening 8 files per batch. Beyond
# that, the files bursts are reading (tens at most per burst, while a worker thread
# builds it) (docs/serving.md, "Limits").
KEEP_FILES = 8
POOL_FILES = 1024
FILES_PER_STREAM = 1 + KEEP_FILES  # its connection, and its share of the pool
# After the last stream reading in place ends, the feeder's pool keeps up to POOL_FILES
# files (what it may hold while one stream reads) this long: a job's ranks reconnect,
# resume, fail over and open a stream per epoch, and a mixture of 1,000 sources would
# open its 1,000 files again each time. A file kept through such a time is checked
# before it is read again (`_same`), so one replaced or cut meanwhile is opened anew.
KEEP_SECONDS = 30.0

Identity = tuple[int, int, int]  # a file's (device, inode, size): `_same`
Opened = tuple[int, int, int, str, Identity]  # an opened chunk file: fd, base, size, path, identity
# the files of some of a call's keys (their indices) opened in one go: each Opened, or the
# DataLoss that names its chunk (`ChunkFiles._open`)
OpenFiles = Callable[[list[int]], list[Opened | DataLoss]]


@dataclass(slots=True)
class _Kept:
    """A file in the pool: its (fd, base, size), the bursts holding it, and what says
    whether it may be read again without a look at its path (`trusted`)."""

    fd: int
    base: int
    size: int
    holds: int
    mark: int  # the idle time it was last known good before (`_idles`), -1: only while none
    path: str
    identity: Identity  # when opened: `_same`

    def trusted(self, idles: int) -> bool:
        """Held, or known good since the last stream ended (`idles` times so far)."""
        return bool(self.holds) or self.mark == idles


class FilePool:
    """A feeder's open chunk files, by chunk cache key (a store's generation is in the
    key: a rewritten store's files are opened anew), shared by its streams.

    A file is held (`take`) while a burst reads it and closed only when no burst holds
    it: least recently taken first, once the pool holds more than its capacity
    (KEEP_FILES per attached stream, at least POOL_FILES; POOL_FILES for `keep_seconds`
    after the last stream ends, then none). Files are opened outside the lock (a cold
    disk would hold every stream up), those a call needs in one go, and closed in one
    go (descriptors.py: the GIL let go once, not per system call).

    A file that stayed in the pool while no stream was attached is not read again
    before its path is found to be the same file of the same size (`_same`): a file
    replaced or cut meanwhile is closed and opened anew, its DataLoss raised as at any
    open. Files kept while streams read are used as they are (a file cut under them is
    found by the read that comes back short).
    """

    def __init__(self, keep_seconds: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.keep_seconds = keep_seconds
        self._clock = clock
        self._lock = threading.Lock()
        self._files: OrderedDict[Any, _Kept] = OrderedDict()  # least recently taken first
        self._streams = 0
        self._idles = 0  # times the last stream ended
        self._idle_since: float | None = None  # while the pool keeps files for none

    def __len__(self) -> int:
        return len(self._files)

    @property
    def capacity(self) -> int:
        if self._streams:
            return max(KEEP_FILES * self._streams, POOL_FILES)
        return POOL_FILES if self._idle_since is not None else 0

    def attach(self) -> None:
        """A stream reads in place: the pool may keep KEEP_FILES more files."""
        with self._lock:
            self._streams += 1
            self._idle_since = None

    def detach(self) -> None:
        """A stream ended: the files beyond the pool's capacity now are closed (with
        `keep_seconds`, the last stream's end keeps POOL_FILES until `expire`)."""
        with self._lock:
            self._streams -= 1
            if not self._streams:
                self._idles += 1
                self._idle_since = self._clock() if self.keep_seconds > 0 else None
            self._trim()

    def expire(self) -> float | None:
        """Close the files kept for no stream once `keep_seconds` have passed since the
        last one ended; the seconds left if not yet, None if nothing is waiting."""
        with self._lock:
            if self._idle_since is None:
                return None
            left = self._idle_since + self.keep_seconds - self._clock()
            if left > 0:
                return left
            self._idle_since = None
            self._trim()
        return None

    def close(self) -> None:
        """The feeder stops: close every file no burst holds (those when given back)."""
        with self._lock:
            self._idle_since = None
            self._trim()

    def take(self, keys: list[Any], open_files: OpenFiles | None) -> np.ndarray | None:
        """(fd, base, size) of each key's file, held until `give_back(keys)`; the files
        not open are opened by `open_files` (their indices in `keys`; the first one's
        DataLoss raised, nothing held), or without `open_files`, None (nothing held). A
        file kept while no stream was attached is checked first (`_same`), so only
        where `open_files` is given."""
        with self._lock:  # a burst's files are usually all open: held in one go
            rows = self._hold(keys)
        if len(rows) < len(keys) and open_files is None:
            self.give_back(keys[: len(rows)])
            return None
        got: list[_Kept | None] = list(rows)
        try:
            for key in keys[len(rows) :]:
                with self._lock:
                    held = self._hold([key])
                    kept = None if held else self._files.get(key)
                got.append(held[0] if held else kept and self._checked(key, kept))
            missing = [i for i, row in enumerate(got) if row is None]
            if missing:
                assert open_files is not None
                opened = list(zip(missing, open_files(missing), strict=True))
                good = [(i, o) for i, o in opened if not isinstance(o, DataLoss)]
                added = self._add([(keys[i], o) for i, o in good], 1)
                for (i, _), row in zip(good, added, strict=True):
                    got[i] = row
                failed = [o for _, o in opened if isinstance(o, DataLoss)]
                if failed:
                    raise failed[0]
        except BaseException:
            self.give_back([key for key, row in zip(keys, got, strict=False) if row is not None])
            raise
        rows = [row for row in got if row is not None]
        return np.array([(r.fd, r.base, r.size) for r in rows], dtype=np.int64).reshape(-1, 3)

    def _hold(self, keys: list[Any]) -> list[_Kept]:
        """The files of `keys` held, up to the first not open or not trusted. (Called
        holding the lock.)"""
        rows = []
        files, idles = self._files, self._idles
        for key in keys:
            row = files.get(key)
            if row is None or not row.trusted(idles):
                break
            row.holds += 1
            files.move_to_end(key)
            rows.append(row)
        return rows

    def open(self, keys: list[Any], open_files: OpenFiles) -> None:
        """Open the files of `keys` not open yet, in one go, held by no burst
        (read-ahead of opens); one that fails is left out (the burst that needs it
        says why)."""
        with self._lock:  # what to open, in one look
            idles, files = self._idles, self._files
            wanted = [(i, files.get(key)) for i, key in enumerate(keys)]
            wanted = [(i, row) for i, row in wanted if row is None or not row.trusted(idles)]
        todo = [
            i for i, row in wanted if row is None or self._checked(keys[i], row, hold=0) is None
        ]
        if todo:
            opened = zip(todo, open_files(todo), strict=True)
            self._add([(keys[i], o) for i, o in opened if not isinstance(o, DataLoss)], 0)
        with self._lock:
            self._trim()

    def _mark(self) -> int:
        return self._idles if self._streams else -1

    def _add(self, opened: list[tuple[Any, Opened]], holds: int) -> list[_Kept]:
        """The files just opened, by key, in the pool, each held `holds` times: a key
        another stream opened meanwhile keeps that file (this one is closed)."""
        rows, twins = [], []
        with self._lock:
            mark = self._mark()
            for key, (fd, base, size, path, identity) in opened:
                row = self._files.get(key)
                if row is None:
                    row = self._files[key] = _Kept(fd, base, size, holds, mark, path, identity)
                else:
                    row.holds += holds
                    self._files.move_to_end(key)
                    twins.append(fd)
                rows.append(row)
        if twins:
            descriptors.close_files(twins)
        return rows

    def _checked(self, key: Any, row: _Kept, hold: int = 1) -> _Kept | None:
        """`row`, kept while no stream was attached, held `hold` more times if its path
        is still the same file of the same size; else None, and closed unless held (the
        caller opens the path anew, as if it had never been kept)."""
        same = _same(row.path, row.identity)
        with self._lock:
            if self._files.get(key) is not row:
                return None  # closed or replaced meanwhile: open it anew
            if same:
                row.holds += hold
                if row.mark != self._idles:
                    row.mark = self._mark()
                self._files.move_to_end(key)
                return row
            if not row.holds:
                del self._files[key]
                os.close(row.fd)
        return None

    def give_back(self, keys: list[Any]) -> None:
        with self._lock:
            for key in keys:
                self._files[key].holds -= 1
            self._trim()

    def _trim(self) -> None:
        """Close files held by no burst, least recently taken first, down to capacity.
        (Called holding the lock.)"""
        over = len(self._files) - self.capacity
        if over <= 0:
            return
        idle = list(islice((k for k, row in self._files.items() if not row.holds), over))
        descriptors.close_files([self._files.pop(key).fd for key in idle])


def _same(path: str, identity: Identity) -> bool:
    """Whether `path` is still the file kept open, (device, inode, size)."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino, st.st_size) == identity


class ChunkFiles:
    """One stream's chunk files, from the feeder's pool (`FilePool`, attached while the
    stream reads in place: `close()` detaches it)."""

    def __init__(self, ds: Dataset, pool: FilePool, attach: bool = True) -> None:
        self.store = ds.store
        self.keys = ds.chunk_keys
        self.pool = pool
        # attached at the first burst: a stream that ends before its first (its client
        # gone while it was prepared) holds nothing
        self._attach = attach
        self._attached = False

    def _use(self) -> None:
        if self._attach and not self._attached:
            self._attached = True
            self.pool.attach()

    def ahead(self, chunks: list[int]) -> None:
        """Off the event loop, after a burst: open the files of the next one's `chunks`,
        so that it can be read on the event loop. A file that fails to open is left to
        the burst that needs it (its error names it)."""
        self._use()
        self.pool.open([self.keys[c] for c in chunks], lambda at: self._open(chunks, at))

    def kept(self, chunks: list[int]) -> InPlace | None:
        """The files of `chunks` (ascending) if all are open already, to be read without
        waiting (`InPlace` with `nowait`: on the event loop); else None."""
        keys = [self.keys[c] for c in chunks]
        table = self.pool.take(keys, None)
        if table is None:
            return None
        return InPlace(self, keys, np.asarray(chunks, dtype=np.int64), table, nowait=True)

    def burst(self, chunks: list[int]) -> InPlace:
        """The files of `chunks` (ascending), open; DataLoss naming the first that is
        missing, cut short or unreadable."""
        self._use()
        keys = [self.keys[c] for c in chunks]
        table = self.pool.take(keys, lambda at: self._open(chunks, at))
        assert table is not None
        return InPlace(self, keys, np.asarray(chunks, dtype=np.int64), table)

    def _open(self, chunks: list[int], at: list[int]) -> list[Opened | DataLoss]:
        """The files of chunks[i] for i in `at`, opened and checked in one go."""
        wanted = [chunks[i] for i in at]
        where = [self.store.chunk_file(c) for c in wanted]
        got = descriptors.open_files([path for path, _ in where], advise_random=True)
        return [
            _opened(self.store, c, path, base, o)
            for c, (path, base), o in zip(wanted, where, got, strict=True)
        ]

    def close(self) -> None:
        """The stream ended (once; the files stay in the pool, within its capacity)."""
        self._attach = False
        if self._attached:
            self._attached = False
            self.pool.detach()


def read_head(store: Any, chunk: int, nbytes: int) -> bytes:
    """The first `nbytes` of chunk `chunk`, read from its file (a stream loading whole
    chunks takes only a head from a chunk its rows cross into: rounds.spans_heads);
    DataLoss naming the chunk if its file is missing, short or unreadable. The file is
    advised random access: a head is a token or a row, and the kernel's read-ahead
    would read up to the device's `read_ahead_kb` around it (8 MiB on this project's
    VM: ~5 ms of CPU for a 2-byte head of a Megatron .bin, where the page cache held
    none of it)."""
    path, base = store.chunk_file(chunk)
    got = descriptors.open_files([path], advise_random=True)[0]
    opened = _opened(store, chunk, path, base, got)
    if isinstance(opened, DataLoss):
        raise opened
    fd = opened[0]
    try:
        data = os.pread(fd, nbytes, base)
    except OSError as e:
        raise DataLoss(f"{path}: unreadable ({e.strerror or e})") from None
    finally:
        os.close(fd)
    if len(data) != nbytes:  # cut between the check and the read
        raise DataLoss(f"{store.location}: chunk {chunk} was cut short")
    return data


def _opened(
    store: Any, chunk: int, path: str, base: int, got: descriptors.Opened
) -> Opened | DataLoss:
    """Chunk `chunk`'s file as `descriptors.open_files` opened it, its size checked
    against the store's: (fd, base, size, path, identity), or the DataLoss naming the
    chunk (the file missing, of another size or unreadable; nothing left open)."""
    fd, dev, ino, size = got
    try:
        if fd < 0:
            if -fd == errno.ENOENT:
                store.check_chunk_file(chunk, None)  # says which chunk is missing
            raise DataLoss(f"{path}: unreadable ({os.strerror(-fd)})")
        store.check_chunk_file(chunk, size)
    except DataLoss as e:
        if fd >= 0:
            os.close(fd)
        return e
    return fd, base, store.chunk_nbytes(chunk), str(path), (dev, ino, size)


class WouldBlock(Exception):
    """A row read without waiting is not in the page cache: the burst is left to a
    worker thread."""


class InPlace:
    """A burst's chunks as open files: what `rows` and `message` read (one positioned
    read per row piece). Like assembly.Pinned: `release()` gives the files back to the
    pool. `nowait`: the reads take only what the page cache holds, WouldBlock
    otherwise."""

    def __init__(
        self,
        files: ChunkFiles,
        held: list[Any],
        keys: np.ndarray,
        table: np.ndarray,
        nowait: bool = False,
    ) -> None:
        self.store = files.store
        self._files, self._held = files, held
        self.keys = keys  # ascending chunk ids
        self.fds, self.bases, self.sizes = table.T.copy()  # each a contiguous row
        self.nowait = nowait

    def release(self) -> None:
        held, self._held = self._held, []
        self._files.pool.give_back(held)

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
