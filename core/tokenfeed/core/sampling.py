"""The sampling engine: which token windows each rank receives at each step.

Pure functions of the request (no I/O, no gRPC), so any replica computes the same
order and a stream resumes exactly at an offset. ARCHITECTURE.md "Sampling semantics"
is the contract; in short, for a store of N tokens T:

* split: train is T[0 : floor(N * split_rate)], validation the rest;
* window k of a split starts at k * stride, for every k with
  k * stride + seq_len + max_shift <= split length (windows cross chunks freely);
* a sample is T[start : start + seq_len + shift], input = [:seq_len], labels = [shift:];
* the epoch order P permutes window indices; global step s covers positions
  [o_s, o_s + B*W) of P and rank r takes [o_s + r*B, o_s + (r+1)*B).

Shuffling is a *block shuffle*. Windows are grouped in blocks of consecutive windows
(about `block_tokens`, one chunk, of tokens each); the block order is permuted per
epoch; runs of `shuffle_blocks` consecutive blocks of that order form a group whose
windows are permuted together. While a group is consumed the server reads only its
blocks, so the cache working set is about `shuffle_blocks` + 1 chunks, and
`shuffle_blocks` trades randomness (how far apart two neighbouring samples come from)
against cache memory. The default, 8, mixes 8 chunks' worth of windows (8 x 32 MiB
with default chunks) and keeps a few hundred MiB hot; `shuffle_blocks >= blocks`
is a full shuffle.

Every permutation is a keyed bijection (a Feistel network with cycle walking) keyed
by (seed, epoch, block/group): any position of P maps to its window in O(1) time and
memory, without generating what precedes it or storing a permutation. Nothing here
grows with N.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.keyed import (
    Permutation,
    domain_bits,
    key,
    keys,
    permute,
    round_keys,
    round_keys_by_round,
)
from tokenfeed.core.mixture import Budget, Mixture, source_seed
from tokenfeed.core.request import AUTO, MAX_PARAM, SamplingSpec, proper_divisors

DEFAULT_BLOCK_TOKENS = 1 << 24
MAX_TOKENS = 1 << 62  # with MAX_PARAM: every product of the math stays inside int64

_POSITIONS_PER_ROUND = 4096
# Domain tags for the key derivation: one RNG stream per purpose (mixture.py uses 16, 17).
_BLOCKS, _GROUP, _SHIFT = 1, 2, 3
_FAR = 1 << 62  # PassOrders: the short block of a group that has none (past every block)


# ------------------------------------------------------------------------ the math


def split_bounds(total_tokens: int, split: str, split_rate: Fraction) -> tuple[int, int]:
    """[begin, end) of a split in the token array: train is T[0 : floor(N * split_rate)],
    exact (split_rate is the decimal the user wrote, SamplingSpec.split_fraction)."""
    cut = math.floor(split_rate * total_tokens)
    return (0, cut) if split == "train" else (cut, total_tokens)


def window_count(split_tokens: int, seq_len: int, stride: int, max_shift: int) -> int:
    """Windows k with k*stride + seq_len + max_shift <= split_tokens."""
    if stride <= 0:
        raise InvalidArgument(f"stride must be positive, got {stride}")
    room = split_tokens - seq_len - max_shift
    return 0 if room < 0 else room // stride + 1


def steps_per_epoch(
    num_windows: int, batch_size: int, world_size: int, rank: int, split: str, offset: int = 0
) -> int:
    """Steps `rank` receives from `offset` to the end of the epoch.

    Train drops a final global batch of fewer than B*W windows; validation delivers
    every window, so a rank whose share of the short last step is empty has one step
    fewer.
    """
    global_batch = batch_size * world_size
    full, rest = divmod(max(num_windows - offset, 0), global_batch)
    if split == "train":
        return full
    return full + (1 if rest > rank * batch_size else 0)


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
        self.n = num_windows
        self.shuffle = shuffle
        if not shuffle:
            return
        self.seed, self.epoch = seed, epoch
        self.wpb = wpb = min(windows_per_block, num_windows)
        self.num_blocks = nb = -(-num_windows // wpb)
        # Only the last block may be short; `deficit` is how many windows it lacks.
        self.deficit = nb * wpb - num_windows
        self.blocks_per_group = min(shuffle_blocks, nb)
        self.group_windows = self.blocks_per_group * wpb
        self._blocks = Permutation(nb, key(seed, epoch, _BLOCKS))
        # Where the short block lands in the permuted block order.
        self._short_at = int(self._blocks.inverse(np.array([nb - 1]))[0])
        self._groups: dict[int, tuple[Permutation, np.ndarray]] = {}  # see _group

    def _group_start(self, g: np.ndarray) -> np.ndarray:
        short_group = self._short_at // self.blocks_per_group
        return g * self.group_windows - self.deficit * (g > short_group)

    def windows(self, positions: np.ndarray) -> np.ndarray:
        """Window indices at `positions` (int64 array, each in [0, num_windows))."""
        p = np.asarray(positions, dtype=np.int64)
        if not self.shuffle:
            return p.copy()
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
        for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
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
            if len(self._groups) >= 8:
                self._groups.clear()
            made = self._groups[group] = (
                Permutation(size, key(self.seed, self.epoch, _GROUP, group)),
                self._blocks(first_block + np.arange(n_blocks, dtype=np.int64)),
            )
        return made


@dataclass(frozen=True)
class BatchPlan:
    """One rank's batch of one global step: rows are T[s : s + seq_len + shift]."""

    epoch: int
    step: int
    offset: int
    shift: int
    starts: np.ndarray  # int64 absolute token offsets in the store
    sources: np.ndarray | None = None  # a mixture's: each row's source index


@dataclass(frozen=True)
class Round:
    """Consecutive batches of one rank (steps `step`, `step` + 1, ...) as arrays: the
    unit the server assembles in bulk. Batch i is `starts[i, :rows[i]]`; only the last
    batch of a validation epoch can have fewer than batch_size rows."""

    epoch: int
    step: int  # step of the first batch
    offsets: list[int]
    shifts: list[int]
    rows: list[int]
    starts: np.ndarray  # (batches, batch_size) int64 absolute token offsets
    # A mixture's rows: each window's source (index in the request's order); `starts`
    # are then offsets in that source's store. None for a single dataset.
    sources: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.offsets)

    def batches(self) -> Iterator[BatchPlan]:
        for i, (offset, shift, rows) in enumerate(
            zip(self.offsets, self.shifts, self.rows, strict=True)
        ):
            yield BatchPlan(
                self.epoch,
                self.step + i,
                offset,
                shift,
                self.starts[i, :rows],
                None if self.sources is None else self.sources[i, :rows],
            )


def split_windows(
    spec: SamplingSpec, total_tokens: int, split: str | None = None
) -> tuple[int, int]:
    """(tokens, windows) of a split of a store of `total_tokens` under `spec`: the one
    computation behind Plan, Info and `tokenfeed info` (0 windows when too short)."""
    begin, end = split_bounds(total_tokens, split or spec.split, spec.split_fraction)
    return end - begin, window_count(end - begin, spec.seq_len, spec.stride, spec.max_shift)


class _SpecView:
    """The request's fields the math reads most, by name (Plan, MixturePlan)."""

    spec: SamplingSpec

    @property
    def split(self) -> str:
        return self.spec.split

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def stride(self) -> int:
        return self.spec.stride

    @property
    def batch_size(self) -> int:
        return self.spec.batch_size

    @property
    def world_size(self) -> int:
        return self.spec.world_size

    @property
    def shuffle(self) -> bool:
        return self.spec.shuffle

    @property
    def max_shift(self) -> int:
        return self.spec.max_shift


@dataclass(frozen=True)
class Plan(_SpecView):
    """A request's epoch orders over one store: `spec` applied to `total_tokens` tokens.

    The spec's values are checked by SamplingSpec; the Plan checks what depends on the
    data (FailedPrecondition when the split has no window, or a train split fewer than
    one global batch). `block_tokens` (about one chunk) sizes the shuffle's blocks.
    """

    spec: SamplingSpec
    total_tokens: int
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self) -> None:
        if not 0 <= self.total_tokens <= MAX_TOKENS:
            raise InvalidArgument(f"total_tokens out of range: {self.total_tokens}")
        if not 1 <= self.block_tokens <= MAX_PARAM:
            raise InvalidArgument(f"block_tokens must be in [1, 2**40], got {self.block_tokens}")
        spec = self.spec
        if self.num_windows == 0:
            raise FailedPrecondition(
                f"the {spec.split} split has {self.split_end - self.split_begin} tokens, too "
                f"short for one window of seq_len {spec.seq_len} + shift {spec.max_shift}"
            )
        if spec.split == "train" and self.num_windows < spec.global_batch:
            raise FailedPrecondition(
                f"the train split has {self.num_windows} windows, fewer than one global batch "
                f"of batch_size {spec.batch_size} x world_size {spec.world_size} = "
                f"{spec.global_batch}"
            )

    @cached_property
    def _bounds(self) -> tuple[int, int]:
        return split_bounds(self.total_tokens, self.spec.split, self.spec.split_fraction)

    @property
    def split_begin(self) -> int:
        return self._bounds[0]

    @property
    def split_end(self) -> int:
        return self._bounds[1]

    @cached_property
    def divisors(self) -> list[int]:
        return proper_divisors(self.seq_len)

    @cached_property
    def num_windows(self) -> int:
        return split_windows(self.spec, self.total_tokens)[1]

    @property
    def windows_per_block(self) -> int:
        return max(1, self.block_tokens // self.stride)

    def order(self, epoch: int) -> EpochOrder:
        spec = self.spec
        return EpochOrder(
            self.num_windows,
            self.windows_per_block,
            spec.shuffle_blocks,
            spec.seed,
            epoch,
            spec.shuffle,
        )

    def shift_at(self, epoch: int, offset: int) -> int:
        """The shift of the global step starting at `offset`: the same on every rank."""
        shift = self.spec.shift
        if shift != AUTO:
            return int(shift)
        divisors = self.divisors
        return divisors[key(self.spec.seed, epoch, _SHIFT, offset) % len(divisors)]

    def _check(self, epoch: int, rank: int, offset: int, step: int) -> None:
        if not 0 <= rank < self.world_size:
            raise InvalidArgument(f"rank must be in [0, world_size={self.world_size}), got {rank}")
        if not 0 <= offset <= self.num_windows:
            raise InvalidArgument(
                f"offset {offset} is outside the epoch of {self.num_windows} windows"
            )
        if not 0 <= epoch <= MAX_PARAM or not 0 <= step <= MAX_TOKENS:
            raise InvalidArgument(f"epoch and step must be non-negative, got {epoch}, {step}")

    def steps(self, rank: int, offset: int = 0) -> int:
        """Steps left for `rank` from `offset` (len() of a client's epoch)."""
        self._check(0, rank, offset, 0)
        return steps_per_epoch(
            self.num_windows, self.batch_size, self.world_size, rank, self.split, offset
        )

    def batches(self, epoch: int, rank: int, offset: int = 0, step: int = 0) -> Iterator[BatchPlan]:
        """`rank`'s batches of `epoch`, from position `offset` of the epoch order.

        `step` is the number of the first step (it continues across resumes).
        """
        for r in self.rounds(epoch, rank, offset, step):
            yield from r.batches()

    def rounds(self, epoch: int, rank: int, offset: int = 0, step: int = 0) -> Iterator[Round]:
        """`batches()` grouped in Rounds of consecutive steps, mapped in one numpy call each.

        numpy's per-call overhead, not the arithmetic, dominates at small B, so mapping
        several steps' positions per call amortises it. Rounds start at one step and
        double (to `_POSITIONS_PER_ROUND` positions), so the first batch of a (resumed)
        stream comes at once.
        """
        self._check(epoch, rank, offset, step)
        order = self.order(epoch)
        n, B = self.num_windows, self.batch_size
        global_batch = B * self.world_size
        # Train stops before a short final global batch; validation delivers every window.
        end = n if self.split != "train" else offset + (n - offset) // global_batch * global_batch
        max_round = max(1, _POSITIONS_PER_ROUND // B)
        fixed = 0 if self.spec.shift == AUTO else int(self.spec.shift)
        k = 1
        o = offset
        while o < end:
            k = min(k, max_round, -(-(end - o) // global_batch))
            offsets = o + global_batch * np.arange(k, dtype=np.int64)
            first = offsets + rank * B
            positions = first[:, None] + np.arange(B, dtype=np.int64)
            windows = order.windows(np.minimum(positions, end - 1).ravel()).reshape(k, B)
            rows = np.clip(end - first, 0, B).tolist()
            # validation: a rank whose share of the short last step is empty ends here
            kept = k if rows[-1] > 0 else rows.index(0)
            if kept:
                offs = offsets[:kept].tolist()
                yield Round(
                    epoch,
                    step,
                    offs,
                    [fixed] * kept if fixed else [self.shift_at(epoch, x) for x in offs],
                    rows[:kept],
                    self.split_begin + windows[:kept] * self.stride,
                )
            if kept < k:
                return
            step += k
            o += k * global_batch
            k *= 2


# ---------------------------------------------------------------------- mixtures


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


def _divmod(n: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.divmod of non-negative int64 n by positive int64 d, exact: below 2**53 by a
    float quotient fixed up by one step (off by at most one there; numpy's int64
    division costs ~3x as much), else by np.divmod."""
    if not len(n) or int(n.max()) >= 1 << 53:
        return np.divmod(n, d)
    q = (n / d).astype(np.int64)
    r = n - q * d
    low, high = r < 0, r >= d
    if low.any() or high.any():
        q += high.astype(np.int64) - low
        r = n - q * d
    return q, r


# MixturePlan.starts maps up to this many sources' items one source at a time
_SOURCES_ONE_BY_ONE = 8


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
    less per element than the gathers of the vectorized path.
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
        self._g_rk = np.zeros((6, 0), dtype=np.uint64)  # round-major: [6, groups]
        self._g_blocks = np.zeros((0, self._max_bpg), dtype=np.int64)
        self._g_size = np.zeros(0, dtype=np.int64)  # windows in the group
        self._g_bits = np.zeros(0, dtype=np.int64)  # domain_bits of that
        self._g_short = np.zeros(0, dtype=np.int64)  # short block's index in it, or _FAR

    def windows(self, src: np.ndarray, epoch: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Window indices (int64) of the elements (int64 arrays of one shape)."""
        pos = np.asarray(pos, dtype=np.int64)
        if not self.shuffle:
            return pos.copy()
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
        u = permute(within, self._g_size[row], self._g_rk[:, row].T, self._g_bits[row])
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
            if len(self._passes) > self._CACHE:
                self._passes.clear()
            i = np.array([p[0] for p in missing], dtype=np.int64)
            e = np.array([p[1] for p in missing], dtype=np.int64)
            nb = self.nb[i]
            rk = round_keys(keys(self._seed_array(i), e, _BLOCKS))
            at = permute(nb - 1, nb, rk, inverse=True)
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
        """Each element's row in the group tables (round keys, blocks' places, size,
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
                self._g_rk = self._g_rk[:, :0]
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
            rk = round_keys_by_round(keys(seeds, e, _GROUP, grp))
            # the blocks of each group, padded to the widest group (pads map block 0)
            nb, bpg = self.nb[i], self.bpg[i]
            blocks = grp[:, None] * bpg[:, None] + np.arange(self._max_bpg)
            real = blocks < np.minimum((grp + 1) * bpg, nb)[:, None]
            blocks = np.where(real, blocks, 0)
            brk = round_keys(keys(seeds, e, _BLOCKS))
            flat = permute(
                blocks.ravel(),
                np.repeat(nb, self._max_bpg),
                np.repeat(brk, self._max_bpg, axis=0),
            ).reshape(blocks.shape)
            base = self._g_rk.shape[1]
            self._groups.update((x, base + n) for n, x in enumerate(missing))
            self._g_rk = np.concatenate([self._g_rk, rk], axis=1)
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


@dataclass(frozen=True)
class MixturePlan(_SpecView):
    """A mixture request over its sources' stores: `spec` (a mixture) applied to each
    source's `totals[i]` tokens, `block_tokens[i]` (about one chunk) sizing its blocks.

    Each source's train split is its own endless sequence of passes: pass e is the
    single-dataset epoch order of that split with seed ``source_seed(seed, name)`` and
    epoch e (so a source's order does not depend on the other sources or their order).
    The mixture math (mixture.py) says which item of which source each row is; this
    maps items to window starts, for many sources in one go (PassOrders). A source
    without a train window is FailedPrecondition naming it; one with fewer windows
    than a global batch is fine (it repeats).
    """

    spec: SamplingSpec
    totals: tuple[int, ...]
    block_tokens: tuple[int, ...]

    def __post_init__(self) -> None:
        spec = self.spec
        names = spec.source_names
        if not names:
            raise InvalidArgument("a MixturePlan needs a mixture (sources)", field="sources")
        if len(self.totals) != len(names) or len(self.block_tokens) != len(names):
            raise InvalidArgument("one total and one block size per source", field="sources")
        for name, total in zip(names, self.totals, strict=True):
            if not 0 <= total <= MAX_TOKENS:
                raise InvalidArgument(f"total_tokens out of range: {total}")
            _, windows = split_windows(spec, total, "train")
            if windows == 0:
                raise FailedPrecondition(
                    f"sources[{name!r}]: source {name!r} has no train window: its train "
                    f"split ({split_bounds(total, 'train', spec.split_fraction)[1]} tokens at "
                    f"split_rate {spec.split_rate}) is too short for seq_len {spec.seq_len} + "
                    f"shift {spec.max_shift}",
                    field=f"sources[{name!r}]",
                )

    @property
    def mixture(self) -> Mixture:
        return self.spec.mixture

    @cached_property
    def windows(self) -> tuple[int, ...]:
        """Each source's train windows (one pass)."""
        return tuple(split_windows(self.spec, t, "train")[1] for t in self.totals)

    @cached_property
    def train_tokens(self) -> tuple[int, ...]:
        return tuple(split_windows(self.spec, t, "train")[0] for t in self.totals)

    @cached_property
    def orders(self) -> PassOrders:
        spec = self.spec
        return PassOrders(
            self.windows,
            [max(1, b // spec.stride) for b in self.block_tokens],
            spec.shuffle_blocks,
            [source_seed(spec.seed, name) for name in spec.source_names],
            spec.shuffle,
        )

    @cached_property
    def _windows_np(self) -> np.ndarray:
        return np.array(self.windows, dtype=np.int64)

    def shift_at(self, offset: int) -> int:
        """The shift of the global step at `offset` (as a dataset's, with epoch 0)."""
        shift = self.spec.shift
        if shift != AUTO:
            return int(shift)
        divisors = self.spec.divisors
        return divisors[key(self.spec.seed, 0, _SHIFT, offset) % len(divisors)]

    def starts(self, sources: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Item `items[m]` of source `sources[m]` -> its window's start in that source's
        store (pass items // windows, position items % windows of that pass)."""
        stride = self.spec.stride  # the train split begins at token 0
        if self.spec.shuffle and len(self.windows) <= _SOURCES_ONE_BY_ONE:
            # source by source: a round's items of one source are a few thousand
            # consecutive ones, most often all in one pass, mapped by its order at once
            flat, out = items.ravel(), np.empty(items.size, dtype=np.int64)
            src = sources.ravel()
            for i, n in enumerate(self.windows):
                sel = np.flatnonzero(src == i)
                if not len(sel):
                    continue
                mine = flat[sel]
                e = int(mine.min()) // n
                if int(mine.max()) // n == e:
                    out[sel] = self.orders.pass_windows(i, e, mine - e * n)
                else:
                    passes, positions = _divmod(mine, self._windows_np[np.full(len(sel), i)])
                    out[sel] = self.orders.windows(np.full(len(sel), i), passes, positions)
            return (out * stride).reshape(items.shape)
        passes, positions = _divmod(items, self._windows_np[sources])
        window = self.orders.windows(sources, passes, positions)
        return window * stride

    def check(self, rank: int, offset: int, step: int) -> None:
        """InvalidArgument (naming the field) unless `rank` can stream from (offset, step)."""
        spec = self.spec
        if not 0 <= rank < spec.world_size:
            raise InvalidArgument(
                f"rank must be in [0, world_size={spec.world_size}), got {rank}", field="rank"
            )
        if not 0 <= step <= MAX_TOKENS:
            raise InvalidArgument(f"step must be non-negative, got {step}", field="step")
        last = self.mixture.max_position - spec.global_batch
        if not 0 <= offset <= last:
            raise InvalidArgument(
                f"offset {offset} is outside the mixture stream's positions [0, {last}] "
                f"(2**62 tokens / seq_len, less one global batch)",
                field="offset",
            )

    def rounds(self, rank: int, offset: int = 0, step: int = 0) -> Iterator[Round]:
        """`rank`'s batches from position `offset` on, endless, in Rounds (epoch 0).
        `starts` are offsets in each row's source store, `sources` the indices."""
        spec = self.spec
        self.check(rank, offset, step)
        fixed = 0 if spec.shift == AUTO else int(spec.shift)
        B = spec.batch_size
        for r in self.mixture.rounds(
            rank,
            offset,
            step,
            batch_size=B,
            world_size=spec.world_size,
            seed=spec.seed,
            shuffle=spec.shuffle,
        ):
            n = len(r)
            yield Round(
                0,
                r.step,
                r.offsets,
                [fixed] * n if fixed else [self.shift_at(x) for x in r.offsets],
                [B] * n,
                self.starts(r.sources, r.items),
                r.sources,
            )

    def batches(self, rank: int, offset: int = 0, step: int = 0) -> Iterator[BatchPlan]:
        for r in self.rounds(rank, offset, step):
            yield from r.batches()

    def budget(self, tokens: int) -> Budget:
        """What a run of `tokens` tokens draws from each source (tokenfeed info, Info)."""
        return self.mixture.budget(tokens, list(self.windows))
