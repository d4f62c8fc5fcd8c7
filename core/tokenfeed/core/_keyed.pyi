# Types of the C extension (_keyed.c); keyed.py documents the function.
import numpy as np

def permute(
    x: np.ndarray,
    n: int | np.ndarray,
    rk: np.ndarray,
    bits: int | np.ndarray,
    inverse: bool,
    out: np.ndarray,
    /,
) -> None: ...
def step_rows(
    rk: np.ndarray,
    gb: int,
    rank_slot: int,
    start: np.ndarray,
    counts: np.ndarray,
    src: np.ndarray,
    item: np.ndarray,
    /,
) -> None: ...
