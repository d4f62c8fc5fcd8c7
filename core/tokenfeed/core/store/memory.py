"""Where a chunk's bytes live in a process: an anonymous map of its own, huge pages
where the kernel gives them.

The map is private. Python's `mmap(-1, n)` makes a shared one, and Linux backs shared
anonymous memory with transparent huge pages only when shmem THP is on, which it
rarely is. Private anonymous memory gets them when asked (MADV_HUGEPAGE, with THP
`enabled` set to `madvise` or `always`, the usual defaults).

This matters because a message is about a hundred rows of a few KiB each, taken from
random places in the chunks. With 4 KiB pages nearly every row misses the TLB; with
2 MiB pages the server's copy of a 230 KiB message took ~20 % less time
(benchmarks/serve_throughput.py --cpu). Dropping the map unmaps it either way.
"""

from __future__ import annotations

import contextlib
import mmap

HUGE_PAGE = 2 << 20  # smaller maps are not worth asking huge pages for
_PRIVATE = getattr(mmap, "MAP_PRIVATE", None)  # None off POSIX: the default map
_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0)
_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only


def anonymous(nbytes: int) -> mmap.mmap:
    """A new zeroed, writable map of `nbytes` (at least 1), private to this process."""
    if _PRIVATE is None:
        return mmap.mmap(-1, max(nbytes, 1))
    buf = mmap.mmap(-1, max(nbytes, 1), flags=_PRIVATE | _ANONYMOUS)
    if _HUGEPAGE is not None and nbytes >= HUGE_PAGE:
        with contextlib.suppress(OSError):  # THP compiled out or disabled: 4 KiB pages
            buf.madvise(_HUGEPAGE)
    return buf
