"""A dataset epoch's order of its windows: their index order, or the block shuffle.

docs/sampling.md, "Block shuffle" is the contract. Windows are grouped in blocks of
consecutive windows (about one chunk of tokens each); the block order is permuted per
epoch; runs of `shuffle_blocks` consecutive blocks of that order form a group whose
windows are permuted together. While a group is consumed the server reads only its
blocks, so the cache working set is about `shuffle_blocks` + 1 chunks, and
`shuffle_blocks` trades randomness (how far apart two neighbouring samples come from)
against cache memory. The default, 8, mixes 8 chunks' worth of windows (8 x 32 MiB
with default chunks) and keeps a few hundred MiB hot; `shuffle_blocks >= blocks`
is a full shuffle.

Every permutation is a keyed bijection (keyed.py) keyed by (seed, epoch, block/group):
any position maps to its window in O(1) time and memory, without generating what
precedes it or storing a permutation. Pure: no I/O, nothing grows with the store.
"""

from __future__ import annotations

import itertools

import numpy as np

from tokenfeed.core.keyed import Permutation, Tag, key

# Shuffle groups whose permutations an order keeps. The ranks of a job share one order
# (their sampler is kept by the feeder) and look a few hundred steps ahead at most: at
# W = 1,024 a group lasts ~8 steps, so 8 groups kept were made again by every rank.
GROUPS_KEPT = 64


class EpochOrder:
    """Position in the epoch order -> window index, for one (seed, epoch)."""

    def __init__(
        self,
        num_windows: int,
        windows_per_block: int,
        shuffle_blocks: int,
        seed: int,
        epoch: int,
        shuffle: bool,
    ) -> None:
        self.n, self.shuffle = num_windows, shuffle
        if not shuffle:
            return
        self.seed, self.epoch = seed, epoch
        self.wpb = wpb = min(windows_per_block, num_windows)
        self.num_blocks = nb = -(-num_windows // wpb)
        # Only the last block may be short; `deficit` is how many windows it lacks.
        self.deficit = nb * wpb - num_windows
        self.blocks_per_group = min(shuffle_blocks, nb)
        self.group_windows = self.blocks_per_group * wpb
        self._blocks = Permutation(nb, key(seed, epoch, Tag.BLOCKS))
        # Where the short block lands in the permuted block order.
        self._short_at = int(self._blocks.inverse(np.array([nb - 1]))[0])
        self._groups: dict[int, tuple[Permutation, np.ndarray]] = {}  # see _group

    def _group_start(self, g: np.ndarray) -> np.ndarray:
        short_group = self._short_at // self.blocks_per_group
        return g * self.group_windows - self.deficit * (g > short_group)

    def _group_of(self, position: int) -> int:
        """The group of one position (`windows`' first two lines, on an int)."""
        g = position // self.group_windows
        return g + (position >= int(self._group_start(np.int64(g + 1))))

    def _one_group(self, p: np.ndarray) -> int | None:
        """The group of positions `p` if they ascend within one (a round of a few steps:
        its first and last tell), else None."""
        if p.ndim != 1 or not len(p):
            return None
        g = self._group_of(int(p[0]))
        if g != self._group_of(int(p[-1])) or (len(p) > 2 and not bool((p[1:] >= p[:-1]).all())):
            return None
        return g

    def windows(self, positions: np.ndarray) -> np.ndarray:
        """Window indices at `positions` (int64 array, each in [0, num_windows))."""
        p = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return p.copy()
        one = self._one_group(p)
        if one is not None:  # without the search for runs of groups below: fewer numpy calls
            return self._group_windows(one, p - int(self._group_start(np.int64(one))))
        g = p // self.group_windows
        g = g + (p >= self._group_start(g + 1))
        within = p - self._group_start(g)
        # Positions of one group are permuted together. A stream asks for ascending
        # positions, so its groups are runs (slices); any other order is sorted first.
        ordered = len(g) < 2 or bool((g[1:] >= g[:-1]).all())
        sort = None if ordered else np.argsort(g, kind="stable")
        if sort is not None:
            g, within = g[sort], within[sort]
        cuts = [0, *(np.flatnonzero(g[1:] != g[:-1]) + 1).tolist(), len(g)]
        out = np.empty_like(p)
        for lo, hi in itertools.pairwise(cuts):
            out[lo:hi] = self._group_windows(int(g[lo]), within[lo:hi])
        if sort is not None:
            out[sort] = out.copy()
        return out

    def _group_windows(self, group: int, within: np.ndarray) -> np.ndarray:
        """Window indices of positions `within` group `group` (offsets from its start)."""
        S, wpb = self.blocks_per_group, self.wpb
        first_block = group * S
        n_blocks = min(S, self.num_blocks - first_block)
        short = self._short_at - first_block  # its index in the group, if in it
        has_short = 0 <= short < n_blocks
        size = n_blocks * wpb - (self.deficit if has_short else 0)
        perm, blocks = self._group(group, size, first_block, n_blocks)
        u = perm(within)
        # u indexes the concatenation of the group's blocks, in permuted order.
        j = u // wpb
        if has_short:
            j = j + (u >= (j + 1) * wpb - self.deficit * (j + 1 > short))
        block_start = j * wpb - (self.deficit * (j > short) if has_short else 0)
        return blocks[j] * wpb + (u - block_start)

    def _group(
        self, group: int, size: int, first_block: int, n_blocks: int
    ) -> tuple[Permutation, np.ndarray]:
        """A group's permutation of its windows and its blocks' places, made once: a
        stream maps many rounds in one group, and permuting its few blocks costs about
        what permuting thousands of positions does (numpy's cost is per call)."""
        made = self._groups.get(group)
        if made is None:
            if len(self._groups) >= GROUPS_KEPT:
                self._groups.clear()
            made = self._groups[group] = (
                Permutation(size, key(self.seed, self.epoch, Tag.GROUP, group)),
                self._blocks(first_block + np.arange(n_blocks, dtype=np.int64)),
            )
        return made
