"""Where a chunk's bytes live in a process: an anonymous map of its own, huge pages
where the kernel gives them, reused for the next chunk when the cache lets one go.

The map is private. Python's `mmap(-1, n)` makes a shared one, and Linux backs shared
anonymous memory with transparent huge pages only when shmem THP is on, which it
rarely is. Private anonymous memory gets them when asked (MADV_HUGEPAGE, with THP
`enabled` set to `madvise` or `always`, the usual defaults).

This matters because a message is about a hundred rows of a few KiB each, taken from
random places in the chunks. With 4 KiB pages nearly every row misses the TLB; with
2 MiB pages the server's copy of a 230 KiB message took ~20 % less time
(benchmarks/serve_throughput.py --cpu). Dropping the map unmaps it either way.

Reuse: a new map's first touch faults in and zeroes every page, and in a virtual
machine that hands freed memory back to its host (free page reporting, ballooning) the
host must supply the pages again: a 32 MiB chunk read into a new map cost 27-58 ms of
CPU there, into a map it had used before ~6 ms. So the chunk cache hands the map of a
chunk it evicts to the load that takes its room (`spare_map`, `hand`): no page is
faulted, zeroed or given back on the way.
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import weakref
from typing import Any

HUGE_PAGE = 2 << 20  # smaller maps are not worth asking huge pages for
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)  # None off POSIX: the default map
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0)
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only

_made: weakref.WeakSet[mmap.mmap] = weakref.WeakSet()  # the maps `anonymous` made
_given = threading.local()  # .spare: the map `hand` gives this thread's next fill


def anonymous(nbytes: int, whole: bool = False) -> mmap.mmap:
    """A new zeroed, writable map of `nbytes` (at least 1), private to this process.

    `whole`: the caller writes every byte before anyone reads one, so a map handed in
    by `hand` will do (it still holds the bytes of the chunk it held before)."""
    spare, _given.spare = getattr(_given, "spare", None), None  # taken, or dropped now
    if whole and spare is not None and len(spare) == max(nbytes, 1):
        return spare
    del spare
    if _PRIVATE is None:
        return mmap.mmap(-1, max(nbytes, 1))
    buf = mmap.mmap(-1, max(nbytes, 1), flags=_PRIVATE | _ANONYMOUS)
    if _HUGEPAGE is not None and nbytes >= HUGE_PAGE:
        with contextlib.suppress(OSError):  # THP compiled out or disabled: 4 KiB pages
            buf.madvise(_HUGEPAGE)
    _made.add(buf)
    return buf


def spare_map(array: Any) -> mmap.mmap | None:
    """The map `anonymous` made that `array` (a chunk's ndarray, made by frombuffer over
    the map or a memoryview of it) lies in; None for any other memory (a file's map,
    numpy's own). The caller may reuse it only once `array` is gone (a weak reference
    to it is dead: every view of a chunk, numpy's or a memoryview, keeps it alive)."""
    base = getattr(array, "base", None)
    if isinstance(base, memoryview):
        base = base.obj
    return base if isinstance(base, mmap.mmap) and base in _made else None


def hand(spare: mmap.mmap | None) -> None:
    """This thread's next `anonymous` call takes `spare` when it fits (same size,
    `whole`), else drops it before mapping anew; None takes back a spare not yet used."""
    _given.spare = spare
