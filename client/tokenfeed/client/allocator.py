"""glibc's malloc, set once per process for a stream of ~1 MiB messages.

A stream's messages (~1 MiB each, joined by gRPC from its slices) are allocated and
freed by the reader's and gRPC's threads many times a second. With glibc's defaults the
memory freed at the top of a thread's heap goes back to the kernel (its trim
threshold is twice an adaptive mmap threshold, a few MiB at most here) and the next
message faults it back in, zeroed: ~5 page faults per batch, about half of the
client's system CPU. A mmap threshold above a message keeps its buffers in the heap,
and a trim threshold of a few messages keeps that much freed memory for the next ones
(benchmarks/README.md has the figures; the trainer's RSS grows by ~10-20 MB).

`tune` sets both when a process makes its first FeederClient, with glibc only, and
never when the process chose for itself: any of glibc's MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, MALLOC_TOP_PAD_ variables, or a `glibc.malloc.` tunable in
GLIBC_TUNABLES, leaves malloc as it is.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from collections.abc import Mapping

log = logging.getLogger("tokenfeed.client")

MMAP_THRESHOLD = 4 << 20  # above the default ~1 MiB message
TRIM_THRESHOLD = 16 << 20
# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
USERS_OWN = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")

_lock = threading.Lock()
_tuned: bool | None = None  # None: not decided yet in this process


def settings(environ: Mapping[str, str], libc_version: str | None) -> dict[int, int]:
    """{mallopt parameter: value} for a process with `environ` on the C library
    `libc_version` reports (os.confstr's "glibc 2.36"; None elsewhere): empty when
    malloc is not glibc's or the process set its own."""
    if not libc_version or not libc_version.startswith("glibc"):
        return {}
    if any(name in environ for name in USERS_OWN):
        return {}
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return {}
    return {M_MMAP_THRESHOLD: MMAP_THRESHOLD, M_TRIM_THRESHOLD: TRIM_THRESHOLD}


def tune() -> bool:
    """Apply `settings` to this process, once; whether they are in effect."""
    global _tuned
    with _lock:
        if _tuned is None:
            _tuned = _apply(settings(os.environ, _libc_version()))
        return _tuned


def _libc_version() -> str | None:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError, AttributeError):  # not a GNU system
        return None


def _apply(wanted: dict[int, int]) -> bool:
    if not wanted:
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    done = all(mallopt(param, value) == 1 for param, value in wanted.items())
    log.debug("malloc thresholds %s: %s", "set" if done else "not set", wanted)
    return done
