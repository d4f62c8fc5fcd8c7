"""Chunk files opened and closed many at a time, the GIL released once for all of them.

A lone rank of a large job opens about one chunk file per batch and closes one
(inplace.py). In Python each `open`, `fstat`, `posix_fadvise` and `close` lets go of
the GIL and takes it back, and while the event loop thread wants it each of those is a
hand-over between threads: measured in process beside a busy thread, a file through
the pool cost 25-29 us of that thread's CPU this way, 13-16 us with these calls (~9 us
with no other thread). So the pool opens the files a burst needs in one call, and
closes the files it trims in one:

    open_files(paths, advise_random) -> [(fd, dev, ino, size) or (-errno, 0, 0, 0)]
    close_files(fds) -> None

- `open_files` opens each path read-only (close-on-exec) and stats it; `advise_random`
  advises random access (its failure is no error: it is advice). A path that fails to
  open or stat is (-errno, 0, 0, 0), nothing of it left open, and the others are opened
  all the same: the caller says which chunk failed, and why (DataLoss naming it).
- `close_files` closes every one; OSError for the first that failed.

Both run in C (_native.c) when the extension is built; `open_files_py` and
`close_files_py` are their references (tokenfeed.core.native).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence

from tokenfeed.core import native

Opened = tuple[int, int, int, int]  # (fd, device, inode, size), or (-errno, 0, 0, 0)
_RANDOM = getattr(os, "POSIX_FADV_RANDOM", None)  # Linux's


def open_files_py(paths: Sequence[str], advise_random: bool) -> list[Opened]:
    """`open_files`' reference, in Python."""
    out: list[Opened] = []
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            out.append((-(e.errno or 0), 0, 0, 0))
            continue
        try:
            st = os.fstat(fd)
        except OSError as e:
            os.close(fd)
            out.append((-(e.errno or 0), 0, 0, 0))
            continue
        if advise_random and _RANDOM is not None:
            with contextlib.suppress(OSError):  # advice
                os.posix_fadvise(fd, 0, 0, _RANDOM)
        out.append((fd, st.st_dev, st.st_ino, st.st_size))
    return out


def close_files_py(fds: Sequence[int]) -> None:
    """`close_files`' reference, in Python."""
    first: OSError | None = None
    for fd in fds:
        try:
            os.close(fd)
        except OSError as e:
            first = first or e
    if first is not None:
        raise first


_open_files_c: Callable[[Sequence[str], bool], list[Opened]] | None
_close_files_c: Callable[[Sequence[int]], None] | None
try:
    from tokenfeed.server._native import close_files as _close_files_c
    from tokenfeed.server._native import open_files as _open_files_c
except ImportError:  # built without the extension (TOKENFEED_PURE_PYTHON=1 at install)
    _open_files_c = _close_files_c = None


def open_files(paths: Sequence[str], advise_random: bool = False) -> list[Opened]:
    """Each path opened read-only and stat'ed: (fd, dev, ino, size), or (-errno, 0, 0, 0)."""
    if _open_files_c is None or not native.enabled():
        return open_files_py(paths, advise_random)
    return _open_files_c(paths, advise_random)


def close_files(fds: Sequence[int]) -> None:
    """Every fd closed; OSError for the first that failed."""
    if _close_files_c is None or not native.enabled():
        close_files_py(fds)
    else:
        _close_files_c(fds)
