"""Token dtypes: the one table of what a store, a message and a buffer may hold.

Tokens are little-endian unsigned integers, `uint16` when the vocabulary fits in
65,536 ids, else `uint32` (nanoGPT's rule). Other formats' dtypes are narrowed to
one of these when their chunks are read.
"""

from __future__ import annotations

import numpy as np

from tokenfeed.core.errors import InvalidArgument

DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a token dtype name; InvalidArgument for any other name."""
    try:
        return DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            f"unknown token dtype {name!r}; expected one of {sorted(DTYPES)}"
        ) from None


def itemsize(name: str) -> int:
    """Bytes per token of a dtype name."""
    return numpy_dtype(name).itemsize


def dtype_for_vocab(vocab_size: int) -> str:
    """The narrowest token dtype that holds every id of a vocabulary."""
    if vocab_size <= 0:
        raise InvalidArgument(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 16:
        return "uint16"
    if vocab_size <= 1 << 32:
        return "uint32"
    raise InvalidArgument(f"vocab_size {vocab_size} does not fit in uint32 token ids")
