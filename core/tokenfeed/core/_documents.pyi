# Types of the C extension (_documents.c); documents.py documents the function.
import numpy as np

def indexed_ends(
    starts: np.ndarray,
    cols: int,
    pointers: np.ndarray,
    doc_indices: np.ndarray,
    itemsize: int,
    total: int,
    out: np.ndarray,
    /,
) -> int: ...
