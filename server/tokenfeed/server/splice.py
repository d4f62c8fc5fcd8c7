"""One response message from pieces of buffers, copied once.

A message is its batches' frames (wire.py) with their rows of tokens between them, and
every row is a slice of a cached chunk. `splice` takes the message as a program of
pieces and returns the bytes:

    splice(segments, keys, views) -> bytes

- `segments`: (program, blob) pairs, in order; a program is an int64 array of shape
  (n, 3), one (key, byte offset, byte count) row per piece;
- key -1 reads the segment's `blob` (a round's frames); any other key reads the view
  at that key's index in `keys` (ascending int64: pinned chunk ids), `views[i]` being
  chunk keys[i]'s bytes.

The native version (_native.c, built with the package) copies every piece with one
memcpy and no Python object per row: it took the per-row slicing and the join out
of the server's CPU profile (issue 16). `splice_py` below is the reference: it
defines the function, serves where the extension is not built (TOKENFEED_PURE_PYTHON=1
at install), and the tests check the two agree.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

Segment = tuple[np.ndarray, Any]  # (program, blob)


def splice_py(segments: Sequence[Segment], keys: np.ndarray, views: Sequence[Any]) -> bytes:
    """The reference: what `splice` returns, in Python."""
    if len(keys) != len(views):
        raise ValueError(f"splice: {len(keys)} keys but {len(views)} views")
    at = {int(k): memoryview(v).cast("B") for k, v in zip(keys.tolist(), views, strict=True)}
    parts: list[Any] = []
    for program, blob in segments:
        data = memoryview(blob).cast("B")
        for key, offset, count in np.asarray(program, dtype=np.int64).reshape(-1, 3).tolist():
            src = data if key == -1 else at.get(key)
            if src is None or offset < 0 or count < 0 or offset + count > len(src):
                raise ValueError(
                    f"splice: piece (key {key}, offset {offset}, count {count}) is not inside "
                    "its source"
                )
            parts.append(src[offset : offset + count])
    return b"".join(parts)


try:
    from tokenfeed.server._native import splice as splice
except ImportError:  # built without the extension (TOKENFEED_PURE_PYTHON=1): the reference
    splice = splice_py

NATIVE = splice is not splice_py
