# Types of the C extension (_native.c); splice.py and wire.py document the functions.
from collections.abc import Sequence
from typing import Any

import numpy as np

def splice(
    parts: Sequence[tuple[np.ndarray, Any]], keys: np.ndarray, views: Sequence[Any]
) -> bytes: ...
def splice_files(
    parts: Sequence[tuple[np.ndarray, Any]],
    keys: np.ndarray,
    fds: np.ndarray,
    bases: np.ndarray,
    sizes: np.ndarray,
    nowait: bool = False,
) -> bytes | None: ...
def frames(
    batch_tag: bytes,
    epoch_field: bytes,
    step_tag: bytes,
    step: int,
    offset_tag: bytes,
    offsets: np.ndarray,
    middles: Sequence[bytes],
    payloads: np.ndarray,
    starts_tag: bytes,
    starts: np.ndarray,
    cut: np.ndarray,
    sources_tag: bytes,
    sources: np.ndarray | None,
) -> tuple[bytes, bytes]: ...
def program(
    starts: np.ndarray,
    chunk_starts: np.ndarray,
    rows: np.ndarray,
    row_bytes: np.ndarray,
    itemsize: int,
    frame_sizes: np.ndarray,
) -> tuple[bytes, bytes]: ...
def open_files(paths: Sequence[str], advise_random: bool) -> list[tuple[int, int, int, int]]: ...
def close_files(fds: Sequence[int]) -> None: ...
