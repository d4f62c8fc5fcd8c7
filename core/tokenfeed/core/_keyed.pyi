# Types of the C extension (_keyed.c); keyed.py and mixture/steps.py document the functions.
import numpy as np

def permute(
    x: np.ndarray,
    n: int | np.ndarray,
    sk: np.ndarray,
    bits: int | np.ndarray,
    inverse: bool,
    out: np.ndarray,
    /,
) -> None: ...
def step_rows(
    sk: np.ndarray,
    gb: int,
    rank_slot: int,
    start: np.ndarray,
    counts: np.ndarray,
    src: np.ndarray,
    item: np.ndarray,
    /,
) -> None: ...
