"""Crash-safe writes: readers never see a partial file under its final name."""

from __future__ import annotations

import os
from pathlib import Path

TMP_SUFFIX = ".tmp"


def write_atomic(path: Path, data: bytes | memoryview) -> None:
    """Write under a temporary name, fsync, rename.

    On failure (disk full, read-only) the temporary file is removed and the OSError
    propagates: nothing half-written is left under either name.
    """
    tmp = path.with_name(path.name + TMP_SUFFIX)
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)
        raise
