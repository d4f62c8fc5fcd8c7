"""One response message from pieces of buffers, copied once.

A message is its batches' frames (wire.py) with their rows of tokens between them, and
every row is a slice of a cached chunk. `program` describes a round of batches as
pieces, once per round; `splice` copies a message's pieces into its bytes:

    program(starts, chunk_starts, rows, row_bytes, itemsize, frame_sizes)
        -> (int64 array (n, 3), piece_lo: list)

- per batch b (rows[b] rows of row_bytes[b] bytes): its head (key -1, the next
  frame), then each row's piece (chunk, byte offset, byte count), a row crossing chunks
  being a piece per non-empty chunk, then its tail (key -1); frame_sizes are the heads'
  and tails' sizes in order, laid out one after another (wire.frames' blob); batch b is
  pieces [piece_lo[b], piece_lo[b + 1]).

    splice(parts, keys, views) -> bytes
    splice_files(parts, keys, fds, bases, sizes, nowait=False) -> bytes | None

- `parts`: (program, blob) pairs, in order; a program is an int64 array of shape
  (n, 3), one (key, byte offset, byte count) row per piece;
- key -1 reads the part's `blob` (a round's frames); any other key reads the view at
  that key's index in `keys` (ascending int64: pinned chunk ids), `views[i]` being
  chunk keys[i]'s bytes.
- `splice_files` reads chunk keys[i]'s bytes from a file instead (rows read in place,
  inplace.py): `sizes[i]` bytes from byte `bases[i]` of file descriptor `fds[i]`, a
  positioned read per piece; a read cut short (the file shrank) is EOFError naming
  the key. `nowait`: the reads take only what the page cache holds (Linux's
  RWF_NOWAIT), and the result is None as soon as one would wait for the disk (or
  reaches a file's end: a read that waits tells a cut file), so that the event loop
  can try a burst that a worker thread builds otherwise.

Both loop over rows in C (_native.c) when the extension is built, with no Python
object per row: the per-row slicing, the join and the per-round numpy are what the
server's CPU profile showed. `splice_py` and `program_py` are the loops' references:
they define them, run when the compiled loops are off (tokenfeed.core.native), and the
tests check the two agree.
"""

from __future__ import annotations

import errno
import os
from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from tokenfeed.core import native

Part = tuple[np.ndarray, Any]  # (program, blob): pieces, and the frames key -1 reads
Ints = np.ndarray  # keys, file descriptors, offsets, sizes: int64 arrays
_NOWAIT: int = getattr(os, "RWF_NOWAIT", 0)  # Linux's: a read only from the page cache


def splice_py(parts: Sequence[Part], keys: np.ndarray, views: Sequence[Any]) -> bytes:
    """`splice`'s reference, in Python."""
    if len(keys) != len(views):
        raise ValueError(f"splice: {len(keys)} keys but {len(views)} views")
    at = {int(k): memoryview(v).cast("B") for k, v in zip(keys.tolist(), views, strict=True)}
    out: list[Any] = []
    for program, blob in parts:
        data = memoryview(blob).cast("B")
        for key, offset, count in np.asarray(program, dtype=np.int64).reshape(-1, 3).tolist():
            src = data if key == -1 else at.get(key)
            if src is None or offset < 0 or count < 0 or offset + count > len(src):
                raise ValueError(
                    f"splice: piece (key {key}, offset {offset}, count {count}) is not inside "
                    "its source"
                )
            out.append(src[offset : offset + count])
    return b"".join(out)


def splice_files_py(
    parts: Sequence[Part], keys: Ints, fds: Ints, bases: Ints, sizes: Ints, nowait: bool = False
) -> bytes | None:
    """`splice_files`' reference, in Python."""
    flags = _NOWAIT if nowait else 0
    if not len(keys) == len(fds) == len(bases) == len(sizes):
        raise ValueError("splice_files: one fd, base and size per key")
    at = {int(k): j for j, k in enumerate(keys.tolist())}
    programs = [np.asarray(p, dtype=np.int64).reshape(-1, 3) for p, _ in parts]
    if any((p[:, 2] < 0).any() for p in programs):
        raise ValueError("splice: a piece has a negative byte count")
    out = bytearray(sum(int(p[:, 2].sum()) for p in programs))
    dst, pos = memoryview(out), 0
    for program, (_, blob) in zip(programs, parts, strict=True):
        data = memoryview(blob).cast("B")
        for key, offset, count in program.tolist():
            j = at.get(key, -1)
            size = len(data) if key == -1 else int(sizes[j]) if j >= 0 else -1
            if size < 0 or offset < 0 or count < 0 or offset + count > size:
                raise ValueError(
                    f"splice: piece (key {key}, offset {offset}, count {count}) is not inside "
                    "its source"
                )
            if key == -1:
                dst[pos : pos + count] = data[offset : offset + count]
            else:
                done = 0
                while done < count:  # a positioned read may return less than asked
                    if nowait and not flags:
                        return None  # no way to read without waiting here
                    try:
                        got = os.preadv(
                            int(fds[j]),
                            [dst[pos + done : pos + count]],
                            int(bases[j]) + offset + done,
                            flags,
                        )
                    except OSError as e:  # not cached, or a file system that cannot tell
                        if nowait and e.errno in (errno.EAGAIN, errno.EOPNOTSUPP):
                            return None
                        raise
                    if got == 0:
                        if nowait:
                            return None
                        raise EOFError(f"key {key}")
                    done += got
            pos += count
    return bytes(out)


def program_py(
    starts: np.ndarray,
    chunk_starts: np.ndarray,
    rows: np.ndarray,
    row_bytes: np.ndarray,
    itemsize: int,
    frame_sizes: np.ndarray,
) -> tuple[bytes, bytes]:
    """`program`'s loop in Python, the reference of _native.program: the program's and
    piece_lo's int64 bytes."""
    bounds, sizes = chunk_starts.tolist(), frame_sizes.tolist()
    pieces: list[tuple[int, int, int]] = []
    piece_lo, at, r = [], 0, 0  # at: the next frame's offset in the frames' blob
    for b, (n, nbytes) in enumerate(zip(rows.tolist(), row_bytes.tolist(), strict=True)):
        piece_lo.append(len(pieces))
        pieces.append((-1, at, sizes[2 * b]))  # the head
        at += sizes[2 * b]
        cols = nbytes // itemsize
        for s in starts[r : r + n].tolist():
            if s < 0 or s + cols > bounds[-1]:
                raise ValueError(f"program: row {r} is outside the store's {bounds[-1]} tokens")
            c = bisect_right(bounds, s) - 1
            while c + 1 < len(bounds) and bounds[c] < s + cols:
                a, e = max(s, bounds[c]), min(s + cols, bounds[c + 1])
                if a < e:
                    pieces.append((c, (a - bounds[c]) * itemsize, (e - a) * itemsize))
                c += 1
            r += 1
        pieces.append((-1, at, sizes[2 * b + 1]))  # the tail
        at += sizes[2 * b + 1]
    piece_lo.append(len(pieces))
    return np.array(pieces, dtype=np.int64).tobytes(), np.array(piece_lo, dtype=np.int64).tobytes()


_splice_c: Callable[..., bytes] | None
_splice_files_c: Callable[..., bytes | None] | None
_program_c: Callable[..., tuple[bytes, bytes]] | None
try:
    from tokenfeed.server._native import program as _program_c
    from tokenfeed.server._native import splice as _splice_c
    from tokenfeed.server._native import splice_files as _splice_files_c
except ImportError:  # built without the extension (TOKENFEED_PURE_PYTHON=1 at install)
    _splice_c = _splice_files_c = _program_c = None


def splice(parts: Sequence[Part], keys: np.ndarray, views: Sequence[Any]) -> bytes:
    """The parts' pieces, in order, copied into one bytes object (module docstring)."""
    if _splice_c is None or not native.enabled():
        return splice_py(parts, keys, views)
    return _splice_c(parts, keys, views)


def splice_files(
    parts: Sequence[Part], keys: Ints, fds: Ints, bases: Ints, sizes: Ints, nowait: bool = False
) -> bytes | None:
    """The parts' pieces, in order, the chunks' read from their files; `nowait`: None
    if a read would wait for the disk (module docstring)."""
    if _splice_files_c is None or not native.enabled():
        return splice_files_py(parts, keys, fds, bases, sizes, nowait)
    return _splice_files_c(parts, keys, fds, bases, sizes, nowait)


def program(
    starts: np.ndarray,
    chunk_starts: np.ndarray,
    rows: Sequence[int] | np.ndarray,
    row_bytes: Sequence[int] | np.ndarray,
    itemsize: int,
    frame_sizes: np.ndarray,
) -> tuple[np.ndarray, list[int]]:
    """A round's splice program (see the module docstring) and where each batch's
    pieces begin."""
    loop = program_py if _program_c is None or not native.enabled() else _program_c
    prog, lo = loop(
        np.ascontiguousarray(starts, dtype=np.int64),
        np.ascontiguousarray(chunk_starts, dtype=np.int64),
        np.asarray(rows, dtype=np.int64),
        np.asarray(row_bytes, dtype=np.int64),
        itemsize,
        np.ascontiguousarray(frame_sizes, dtype=np.int64),
    )
    return np.frombuffer(prog, dtype=np.int64).reshape(-1, 3), np.frombuffer(lo, np.int64).tolist()
