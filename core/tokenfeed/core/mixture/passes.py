"""A mixture source's endless sequence of passes: item n -> its window.

docs/mixtures.md, "Passes: each source's own sequence" is the contract: item n of
source i is position ``n % windows_i`` of pass ``n // windows_i``, and pass e is the
single-dataset epoch order (shuffle.EpochOrder) of the source's train split with seed
``source_seed(seed, name)`` and epoch e, so a source's order depends on its name,
never on the other sources. Pure: no I/O; a call's cost depends on the passes and
shuffle groups it touches, never on the store's size.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.keyed import (
    Tag,
    domain_bits,
    key,
    keys,
    permute,
    stage_keys,
    stage_keys_by_stage,
)
from tokenfeed.core.limits import MAX_SEED
from tokenfeed.core.shuffle import EpochOrder

_FAR = 1 << 62  # the short block of a group that has none: past every block


def source_seed(seed: int, name: str) -> int:
    """The 64-bit seed of one source's passes: a key of (seed, the source's NAME).

    Pass e of source `name` is the single-dataset epoch order with seed
    ``source_seed(seed, name)`` and epoch e, so reordering or adding sources never
    changes a source's own order. Definition (portable): the key chain over
    (seed, Tag.SOURCE = 17, len(utf8), each 8-byte little-endian word of the zero-padded
    UTF-8).
    """
    if not isinstance(name, str):
        raise InvalidArgument.at("name", f"must be a string, got {type(name).__name__}")
    if not 0 <= seed <= MAX_SEED:
        raise InvalidArgument.at("seed", f"must be in [0, 2**64), got {seed}")
    raw = name.encode("utf-8")
    padded = raw + b"\0" * (-len(raw) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    return key(seed, Tag.SOURCE, len(raw), *words)


def split_passes(items: np.ndarray | int, windows: int) -> tuple[Any, Any]:
    """Item n of a source with `windows` windows -> (pass n // windows, n % windows)."""
    if isinstance(windows, bool) or not isinstance(windows, (int, np.integer)) or windows < 1:
        raise FailedPrecondition.at("windows", f"a source needs at least one window, got {windows}")
    if isinstance(items, (int, np.integer)):
        return divmod(int(items), int(windows))
    n = np.asarray(items, dtype=np.int64)
    return n // windows, n % windows


def _dense_ids(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct values ascending, each element's index among them) of non-negative
    int64 values; a table lookup when they span little (the usual case), else a sort."""
    lo, hi = int(values.min()), int(values.max())
    if hi - lo <= 8 * len(values) + 1024:
        present = np.zeros(hi - lo + 1, dtype=bool)
        present[values - lo] = True
        uniq = np.flatnonzero(present)
        index = np.cumsum(present) - 1
        return uniq + lo, index[values - lo]
    uniq, inverse = np.unique(values, return_inverse=True)
    return uniq, inverse.reshape(-1)


def divmod_items(n: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`split_passes` of many items, each by its source's windows: np.divmod of
    non-negative int64 n by positive int64 d, exact: below 2**53 by a float quotient
    fixed up by one step (off by at most one there; numpy's int64 division costs ~3x as
    much), else by np.divmod."""
    if not len(n) or int(n.max()) >= 1 << 53:
        return np.divmod(n, d)
    q = (n / d).astype(np.int64)
    r = n - q * d
    low, high = r < 0, r >= d
    if low.any() or high.any():
        q += high.astype(np.int64) - low
        r = n - q * d
    return q, r


class PassOrders:
    """Many epoch orders at once: (source, pass, position) -> window index.

    Element m is position `pos[m]` of pass `epoch[m]` of source `src[m]`, whose order is
    ``EpochOrder(windows[i], windows_per_block[i], shuffle_blocks, seeds[i], epoch,
    shuffle)`` (the same function: tested equal), evaluated for every element in a few
    numpy calls with per-element keys and sizes instead of one EpochOrder per source
    and pass. What is per pass (where its short block lands) and per shuffle group
    (its key, its blocks' places) is computed for the groups a call touches and kept
    for the next calls, like EpochOrder's group cache. A call that touches only a few
    passes (a round of a few sources, most of them) maps each pass's elements with
    that pass's own EpochOrder (kept between calls too): scalar keys and sizes cost
    less per element than the gathers of the vectorized path. Safe to share between
    threads: a call holds the lock of what it keeps.
    """

    _CACHE = 4096  # groups (and passes) remembered
    few_passes = 8  # up to this many passes in a call: one EpochOrder each
    _ORDERS = 64  # EpochOrders remembered

    def __init__(
        self,
        windows: Sequence[int],
        windows_per_block: Sequence[int],
        shuffle_blocks: int,
        seeds: Sequence[int],
        shuffle: bool,
    ) -> None:
        self.k = len(windows)
        self.shuffle = shuffle
        n = np.array(windows, dtype=np.int64)
        if (n < 1).any():
            raise InvalidArgument("every source needs at least one window")
        wpb = np.minimum(np.array(windows_per_block, dtype=np.int64), n)
        self.n, self.wpb = n, wpb
        self.nb = -(-n // wpb)
        self.deficit = self.nb * wpb - n
        self.bpg = np.minimum(shuffle_blocks, self.nb)
        self.gw = self.bpg * wpb
        self.seeds = [int(x) for x in seeds]
        self.shuffle_blocks = shuffle_blocks
        self._orders: dict[tuple[int, int], EpochOrder] = {}  # (source, pass) -> its order
        self._max_bpg = int(self.bpg.max())
        self._passes: dict[tuple[int, ...], int] = {}  # (source, pass) -> short block at
        # (source, pass, group) -> row of the group tables below
        self._groups: dict[tuple[int, ...], int] = {}
        self._g_sk = np.zeros((6, 0), dtype=np.uint64)  # stage-major: [6, groups]
        self._g_blocks = np.zeros((0, self._max_bpg), dtype=np.int64)
        self._g_size = np.zeros(0, dtype=np.int64)  # windows in the group
        self._g_bits = np.zeros(0, dtype=np.int64)  # domain_bits of that
        self._g_short = np.zeros(0, dtype=np.int64)  # short block's index in it, or _FAR
        self._lock = threading.Lock()  # the caches above, one call at a time

    def windows(self, src: np.ndarray, epoch: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Window indices (int64) of the elements (int64 arrays of one shape)."""
        pos = np.asarray(pos, dtype=np.int64)
        if not self.shuffle:
            return pos.copy()
        with self._lock:
            return self._windows(src, epoch, pos)

    def _windows(self, src: np.ndarray, epoch: np.ndarray, pos: np.ndarray) -> np.ndarray:
        shape = pos.shape
        src, epoch, pos = src.ravel(), np.asarray(epoch, dtype=np.int64).ravel(), pos.ravel()
        if not len(pos):
            return pos.copy().reshape(shape)
        pairs, pid = self._pass_ids(src, epoch)
        if len(pairs) <= self.few_passes:
            if len(pairs) == 1:
                return self._order(*pairs[0]).windows(pos).reshape(shape)
            out = np.empty_like(pos)
            for n, pair in enumerate(pairs):
                sel = np.flatnonzero(pid == n)
                out[sel] = self._order(*pair).windows(pos[sel])
            return out.reshape(shape)
        wpb, deficit, bpg, gw = self.wpb[src], self.deficit[src], self.bpg[src], self.gw[src]
        short_at = self._short_at(pairs, pid)
        short_group = short_at // bpg
        g = pos // gw
        g += pos >= (g + 1) * gw - deficit * (g + 1 > short_group)
        within = pos - (g * gw - deficit * (g > short_group))
        row = self._group_rows(src, epoch, g, pid, short_at)
        # what is per group (its size, where its short block is) from the group tables
        u = permute(within, self._g_size[row], self._g_sk[:, row].T, self._g_bits[row])
        # u indexes the concatenation of the group's blocks, in permuted order; `short`
        # is past every block of a group without the short one, so both terms vanish
        short = self._g_short[row]
        j = u // wpb
        j += u >= (j + 1) * wpb - deficit * (j + 1 > short)
        block_start = j * wpb - deficit * (j > short)
        out = self._g_blocks[row, j] * wpb + (u - block_start)
        return out.reshape(shape)

    def pass_windows(self, i: int, e: int, pos: np.ndarray) -> np.ndarray:
        """Window indices of positions `pos` of pass e of source i (`windows` for
        elements of one pass)."""
        if not self.shuffle:
            return np.asarray(pos, dtype=np.int64).copy()
        with self._lock:
            return self._order(i, e).windows(pos)

    def _order(self, i: int, e: int) -> EpochOrder:
        """Pass e of source i's epoch order, made once (a few are kept)."""
        order = self._orders.get((i, e))
        if order is None:
            if len(self._orders) >= self._ORDERS:
                self._orders.clear()
            order = self._orders[(i, e)] = EpochOrder(
                int(self.n[i]), int(self.wpb[i]), self.shuffle_blocks, self.seeds[i], e, True
            )
        return order

    def _pass_ids(
        self, src: np.ndarray, epoch: np.ndarray
    ) -> tuple[list[tuple[int, int]], np.ndarray]:
        """The (source, pass) pairs of a call's elements, and each element's index
        among them."""
        k = self.k
        if int(epoch.max()) < (1 << 62) // k:
            uniq, pid = _dense_ids(epoch * k + src)
            pairs = list(zip((uniq % k).tolist(), (uniq // k).tolist(), strict=True))
        else:  # astronomically many passes (a one-window source): no packing
            stacked, pid = np.unique(np.stack([src, epoch], axis=1), axis=0, return_inverse=True)
            pairs = [(int(a), int(b)) for a, b in stacked.tolist()]
            pid = pid.reshape(-1)
        return pairs, pid

    def _short_at(self, pairs: list[tuple[int, int]], pid: np.ndarray) -> np.ndarray:
        """Where each element's pass (`pairs[pid]`) puts its source's short (last) block."""
        missing = [p for p in pairs if p not in self._passes]
        if missing:
            if len(self._passes) + len(missing) > self._CACHE:
                self._passes.clear()  # all of this call's passes are made again below
                missing = pairs
            i = np.array([p[0] for p in missing], dtype=np.int64)
            e = np.array([p[1] for p in missing], dtype=np.int64)
            nb = self.nb[i]
            sk = stage_keys(keys(self._seed_array(i), e, Tag.BLOCKS))
            at = permute(nb - 1, nb, sk, inverse=True)
            self._passes.update(zip(missing, at.tolist(), strict=True))
        table = np.array([self._passes[p] for p in pairs], dtype=np.int64)
        return table[pid]

    def _seed_array(self, i: np.ndarray) -> np.ndarray:
        return np.array([self.seeds[x] for x in i.tolist()], dtype=np.uint64)

    def _group_rows(
        self,
        src: np.ndarray,
        epoch: np.ndarray,
        g: np.ndarray,
        pid: np.ndarray,
        short_at: np.ndarray,
    ) -> np.ndarray:
        """Each element's row in the group tables (stage keys, blocks' places, size,
        domain bits, short block), adding the groups not seen yet. `pid` numbers the
        elements' passes, `short_at` is where each element's pass puts the short block."""
        n_pass = int(pid.max()) + 1
        g_min = np.full(n_pass, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(g_min, pid, g)
        uniq, inverse = _dense_ids((g - g_min[pid]) * n_pass + pid)
        first = np.zeros(len(uniq), dtype=np.int64)
        first[inverse] = np.arange(len(g))  # an element of each group
        groups = list(
            zip(src[first].tolist(), epoch[first].tolist(), g[first].tolist(), strict=True)
        )
        missing = [x for x in groups if x not in self._groups]
        if missing:
            if len(self._groups) + len(missing) > self._CACHE:
                self._groups.clear()
                self._g_sk = self._g_sk[:, :0]
                self._g_blocks = self._g_blocks[:0]
                self._g_size = self._g_size[:0]
                self._g_bits = self._g_bits[:0]
                self._g_short = self._g_short[:0]
                missing = groups
                at = short_at[first]
            else:
                at = short_at[first][[n for n, x in enumerate(groups) if x not in self._groups]]
            i = np.array([x[0] for x in missing], dtype=np.int64)
            e = np.array([x[1] for x in missing], dtype=np.int64)
            grp = np.array([x[2] for x in missing], dtype=np.int64)
            seeds = self._seed_array(i)
            sk = stage_keys_by_stage(keys(seeds, e, Tag.GROUP, grp))
            # the blocks of each group, padded to the widest group (pads map block 0)
            nb, bpg = self.nb[i], self.bpg[i]
            blocks = grp[:, None] * bpg[:, None] + np.arange(self._max_bpg)
            real = blocks < np.minimum((grp + 1) * bpg, nb)[:, None]
            blocks = np.where(real, blocks, 0)
            bsk = stage_keys(keys(seeds, e, Tag.BLOCKS))
            flat = permute(
                blocks.ravel(),
                np.repeat(nb, self._max_bpg),
                np.repeat(bsk, self._max_bpg, axis=0),
            ).reshape(blocks.shape)
            base = self._g_sk.shape[1]
            self._groups.update((x, base + n) for n, x in enumerate(missing))
            self._g_sk = np.concatenate([self._g_sk, sk], axis=1)
            self._g_blocks = np.concatenate([self._g_blocks, np.where(real, flat, 0)])
            # the group's size, less the short block's deficit if it holds that block
            n_blocks = np.minimum(bpg, nb - grp * bpg)
            short = at - grp * bpg
            has_short = (short >= 0) & (short < n_blocks)
            size = n_blocks * self.wpb[i] - self.deficit[i] * has_short
            self._g_size = np.concatenate([self._g_size, size])
            self._g_bits = np.concatenate([self._g_bits, domain_bits(size)])
            self._g_short = np.concatenate([self._g_short, np.where(has_short, short, _FAR)])
        table = np.array([self._groups[x] for x in groups], dtype=np.int64)
        return table[inverse]
