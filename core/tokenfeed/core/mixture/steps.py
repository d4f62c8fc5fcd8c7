"""A mixture's steps: which source and item each slot of a global batch takes, per rank.

docs/mixtures.md, "Steps and ranks" is the contract. Step s covers positions [o_s, o_s + B*W)
and its windows from source i are that source's items
``c_i(o_s) .. c_i(o_s + B*W) - 1`` (apportionment.py). Shuffle off: the step is in due
order and rank r takes positions [o_s + r*B, o_s + (r+1)*B), with no permutation
anywhere. Shuffle on: the step's windows are laid out *source-major* (source 0's items
c_0(o_s).., then source 1's, ...) and permuted by the keyed bijection of [0, B*W)
(keyed.py) with key ``step_key(seed, o_s)``; rank r takes slots [r*B, (r+1)*B) of the
permuted order. Source-major needs c only at the step's two boundaries, not a
due-order lookup per window, and the result is as random and as portable. Both are
pure functions of (mixture, seq_len, B, W, seed, o_s): no I/O, never O(p).

`step_rows` (the permuted slots' sources and items) runs in C (_keyed.c) when built;
`step_rows_py` is its reference (native.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial

import numpy as np

from tokenfeed.core import native
from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.keyed import (
    Tag,
    domain_bits,
    encrypt,
    key,
    keys,
    permute_py,
    stage_keys_by_stage,
)
from tokenfeed.core.limits import MAX_PARAM, MAX_SEED, MAX_TOKENS
from tokenfeed.core.mixture.mixture import Mixture

# Positions of a rank per round: more than a dataset's (sampling.DATASET_ROUND_POSITIONS,
# 4096), because a mixture's round makes more numpy calls (counts, the step order, many
# sources' passes) and larger rounds amortise them (~25 % per batch at 16 sources;
# benchmarks/sampling_cost.py).
MIXTURE_ROUND_POSITIONS = 16384
# Positions of a rank in a stream's first round. A round's cost is mostly fixed (~0.5 ms
# of numpy calls up to a few thousand positions), so a first round this large costs
# the first batch little, and a stream re-opened often (run-time weight changes: every
# change opens one) makes a few rounds instead of doubling up from one step.
FIRST_ROUND_POSITIONS = 1024
# A round of shuffled steps shorter than the mixture's sources (gb < k) is laid out by the
# sources each step takes (step_sources: O(positions)) instead of c at every step
# boundary for every source (O(steps x k)) while it spans at most this many positions.
_SPARSE_SPAN = 1 << 17
# step_rows_py finds a slot's source by counting (k - 1 compares per slot) up to this
# many sources, by a binary search of every step's starts (~log2(steps * k) probes) above
_COUNT_SOURCES = 32


def step_key(seed: int, offset: int) -> int:
    """The key of the step that starts at position `offset`: its windows are permuted by
    the keyed bijection (keyed.py) of [0, B*W) with this key."""
    return key(seed, Tag.STEP, offset)


def step_keys(seed: int, offsets: np.ndarray) -> np.ndarray:
    """`step_key` of many steps: uint64 [len(offsets)]."""
    return keys(seed, Tag.STEP, np.asarray(offsets, dtype=np.int64))


@dataclass(frozen=True)
class MixtureRound:
    """Consecutive batches of one rank: batch i is rows ``sources[i]``, ``items[i]``
    (source index in request order, item index in that source's endless sequence)."""

    step: int  # step of the first batch
    offsets: list[int]  # o_s of each batch's step
    sources: np.ndarray  # [batches, B] int64
    items: np.ndarray  # [batches, B] int64

    def __len__(self) -> int:
        return len(self.offsets)


def rank_steps(
    mix: Mixture,
    rank: int,
    offset: int,
    steps: int,
    *,
    batch_size: int,
    world_size: int,
    seed: int = 0,
    shuffle: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Rank `rank`'s rows of `steps` consecutive steps of `mix`, the first at position
    `offset`: (source index, item index), int64 arrays of shape [steps, B].
    InvalidArgument naming the field unless the layout fits the stream."""
    for field, value, lo, hi in (
        ("batch_size", batch_size, 1, MAX_PARAM),
        ("world_size", world_size, 1, MAX_PARAM),
        ("seed", seed, 0, MAX_SEED),
        ("steps", steps, 0, MAX_TOKENS),
    ):
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, np.integer))
            or not lo <= value <= hi
        ):
            raise InvalidArgument.at(field, f"must be an integer in [{lo}, {hi}], got {value!r}")
    if (
        isinstance(rank, bool)
        or not isinstance(rank, (int, np.integer))
        or not 0 <= rank < world_size
    ):
        raise InvalidArgument.at("rank", f"must be in [0, world_size={world_size}), got {rank!r}")
    app = mix.apportionment
    offset = app.check_position(offset, "offset")
    B, gb = int(batch_size), int(batch_size) * int(world_size)
    if offset + steps * gb > app.max_position:
        raise InvalidArgument.at("offset", f"the steps run past position {app.max_position}")
    if steps == 0:
        z = np.zeros((0, B), dtype=np.int64)
        return z, z.copy()
    offs = offset + gb * np.arange(steps, dtype=np.int64)
    if not shuffle:
        return app.runs(offs + rank * B, B)
    sk = stage_keys_by_stage(step_keys(seed, offs))
    if gb < app.k and gb * steps <= _SPARSE_SPAN:  # the sources each step takes
        ids, start, counts = step_sources(mix, offset, gb, steps)
        col, item = step_rows(sk, gb, rank * B, B, start, counts)
        return np.take_along_axis(ids, col, axis=1), item
    # counts at every step boundary: a step's windows from source i are items
    # c_i(o_s) .. c_i(o_{s+1}) - 1, laid out source-major, then permuted
    c = app.counts_every(offset, gb, steps)
    per = c[1:] - c[:-1]
    start = np.cumsum(per, axis=1) - per  # [steps, k] slot where source i begins
    return step_rows(sk, gb, rank * B, B, start, c[:-1])


def step_sources(
    mix: Mixture, offset: int, gb: int, steps: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The source-major layout of `steps` steps of gb positions from `offset`, by the
    sources each step takes (at most gb of the k), from its positions in due order:
    (ids, start, counts), int64 [steps, m], m the most sources a step takes. Step s's
    j-th source (ascending) is ids[s, j], its windows take slots start[s, j] ..
    start[s, j + 1] - 1 and are its items from counts[s, j] = c_i(o_s) on; a row of
    fewer sources ends in slots of gb (past every slot). `step_rows` reads it as the
    [steps, k] layout: a source a step does not take has no slot to be found at."""
    k, span = mix.k, gb * steps
    src, item = mix.items(offset, offset + span)
    cell = np.arange(span, dtype=np.int64) // gb * k + src  # (step, source), ascending
    cells, first, per = np.unique(cell, return_index=True, return_counts=True)
    step = cells // k
    taken = np.bincount(step, minlength=steps)
    col = np.arange(len(cells), dtype=np.int64) - np.repeat(np.cumsum(taken) - taken, taken)
    shape = (steps, int(taken.max()))
    ids, counts = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    start = np.full(shape, gb, dtype=np.int64)
    ids[step, col] = cells % k
    counts[step, col] = item[first]  # a source's first item in the step is c_i(o_s)
    start[step, col] = np.cumsum(per) - per - step * gb  # each step's positions add to gb
    return ids, start, counts


def step_rows(
    sk: np.ndarray, gb: int, first: int, rows: int, start: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """One rank's rows of shuffled mixture steps: (source, item), int64 [steps, rows].

    Step s's slots first .. first + rows - 1 of [0, gb) go through the step's keyed
    bijection of [0, gb) (stage keys sk[:, s], sk: uint64 [6, steps]) to v; v's source
    is the last i with start[s, i] <= v (start: int64 [steps, k], ascending along i,
    start[s, 0] = 0) and its item counts[s, i] + v - start[s, i].
    """
    if _step_rows_c is None or not native.enabled():
        return step_rows_py(sk, gb, first, rows, start, counts)
    src = np.empty((sk.shape[1], rows), dtype=np.int64)
    item = np.empty_like(src)
    _step_rows_c(
        np.ascontiguousarray(sk, dtype=np.uint64),
        gb,
        first,
        np.ascontiguousarray(start, dtype=np.int64),
        np.ascontiguousarray(counts, dtype=np.int64),
        src,
        item,
    )
    return src, item


def step_rows_py(
    sk: np.ndarray, gb: int, first: int, rows: int, start: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """`step_rows`' reference, in numpy (in one pass per slot in C: _keyed.c)."""
    steps, k = start.shape
    slots = first + np.arange(rows, dtype=np.int64)
    bits = domain_bits(gb)
    if gb == 1 << bits:  # no value walks: one key per step, broadcast over its slots
        v = encrypt(slots[None, :].astype(np.uint64), sk.T[:, None, :], bits).astype(np.int64)
    else:
        keys_ = np.repeat(sk, rows, axis=1).T
        v = permute_py(np.tile(slots, steps), gb, keys_, bits).reshape(steps, rows)
    # slot v of step s holds source i = the last i with start[s, i] <= v (starts do
    # not decrease along i): a count of the starts at or below v for a few sources,
    # a search in all steps' starts laid end to end for many
    if k <= _COUNT_SOURCES:
        src = np.zeros((steps, rows), dtype=np.int64)
        for i in range(1, k):
            src += v >= start[:, i : i + 1]
        at = (src + (k * np.arange(steps, dtype=np.int64))[:, None]).ravel()
        item = counts.ravel()[at] + (v.ravel() - start.ravel()[at])
        return src, item.reshape(steps, rows)
    row = (gb * np.arange(steps, dtype=np.int64))[:, None]
    gstart = (start + row).ravel()
    gv = (v + row).ravel()
    idx = np.searchsorted(gstart, gv, side="right") - 1
    item = counts.ravel()[idx] + (gv - gstart[idx])
    return (idx % k).reshape(steps, rows), item.reshape(steps, rows)


_step_rows_c: Callable[..., None] | None
try:
    from tokenfeed.core._keyed import step_rows as _step_rows_c
except ImportError:  # built without the extension (TOKENFEED_PURE_PYTHON=1 at install)
    _step_rows_c = None


def rounds(
    mix: Mixture,
    rank: int,
    offset: int = 0,
    step: int = 0,
    *,
    batch_size: int,
    world_size: int,
    seed: int = 0,
    shuffle: bool = False,
    max_steps: int | None = None,
) -> Iterator[MixtureRound]:
    """`rank`'s batches of `mix` from `offset` on, in rounds of consecutive steps (the
    first of FIRST_ROUND_POSITIONS positions of this rank, or one step, then doubling
    up to MIXTURE_ROUND_POSITIONS). Endless unless `max_steps` is given."""
    steps_at = partial(
        rank_steps,
        mix,
        rank,
        batch_size=batch_size,
        world_size=world_size,
        seed=seed,
        shuffle=shuffle,
    )
    steps_at(offset, 0)  # the layout's errors, before any round
    B, gb = int(batch_size), int(batch_size) * int(world_size)
    max_round = max(1, MIXTURE_ROUND_POSITIONS // B)
    n, o, done = max(1, FIRST_ROUND_POSITIONS // B), int(offset), 0
    while max_steps is None or done < max_steps:
        n = min(n, max_round)
        if max_steps is not None:
            n = min(n, max_steps - done)
        src, item = steps_at(o, n)
        yield MixtureRound(step, (o + gb * np.arange(n, dtype=np.int64)).tolist(), src, item)
        step += n
        done += n
        o += n * gb
        n *= 2
