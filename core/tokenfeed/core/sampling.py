"""One dataset's sampling: which token windows each rank receives at each step.

Pure functions of the request (no I/O, no gRPC), so any replica computes the same
order and a stream resumes exactly at an offset. docs/sampling.md is the contract; in
short, for a store of N tokens T:

* split: train is T[0 : floor(N * split_rate)], validation the rest;
* window k of a split starts at k * stride, for every k with
  k * stride + seq_len + max_shift <= split length (windows cross chunks freely);
* a sample is T[start : start + seq_len + shift], input = [:seq_len], labels = [shift:];
  the shift is fixed, or `auto`: one proper divisor of seq_len per global step;
* the epoch order permutes window indices (shuffle.py: the block shuffle); global step
  s covers positions [o_s, o_s + B*W) of it and rank r takes [o_s + r*B, o_s + (r+1)*B).

Memory and time never grow with N. A mixture's sampling (mixture/sampler.py) builds on
this: each source's passes are epoch orders of its train split.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from functools import cached_property

import numpy as np

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.keyed import Tag, key
from tokenfeed.core.limits import MAX_PARAM, MAX_TOKENS
from tokenfeed.core.request import AUTO, SamplingSpec, proper_divisors
from tokenfeed.core.shuffle import EpochOrder

DEFAULT_BLOCK_TOKENS = 1 << 24
# Positions of a rank per round. numpy's per-call cost, not the arithmetic, dominates
# at small B, so a round maps many steps' positions per call; a mixture's rounds are
# larger (mixture/steps.py, MIXTURE_ROUND_POSITIONS): they make more calls.
DATASET_ROUND_POSITIONS = 4096
# A round's steps after the first (of one step): 1, 4, 16, ... A stream's start locates
# a few rounds (its first bursts, and the files it opens ahead), each costing ~0.2 ms of
# numpy calls whatever its size: growing by 4, not 2, takes 4 rounds to 85 steps, not 7.
ROUND_GROWTH = 4
# Epoch orders a sampler keeps: a rank's epoch and the next one, opened ahead.
ORDERS_KEPT = 2


# ------------------------------------------------------------------------ the math


def split_bounds(total_tokens: int, split: str, split_rate: Fraction) -> tuple[int, int]:
    """[begin, end) of a split in the token array: train is T[0 : floor(N * split_rate)],
    exact (split_rate is the decimal the user wrote, SamplingSpec.split_fraction)."""
    cut = total_tokens * split_rate.numerator // split_rate.denominator  # floor, exact
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


@dataclass(frozen=True)
class RankBatch:
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

    def batches(self) -> Iterator[RankBatch]:
        for i, (offset, shift, rows) in enumerate(
            zip(self.offsets, self.shifts, self.rows, strict=True)
        ):
            yield RankBatch(
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
    computation behind the samplers, Info and `tokenfeed info` (0 windows when too
    short)."""
    begin, end = split_bounds(total_tokens, split or spec.split, spec.split_fraction)
    return end - begin, window_count(end - begin, spec.seq_len, spec.stride, spec.max_shift)


class SpecView:
    """The request's fields the samplers read most, by name, and each step's shift
    (DatasetSampler, MixtureSampler)."""

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

    @cached_property
    def divisors(self) -> list[int]:
        return proper_divisors(self.seq_len)

    def shifts(self, epoch: int, offsets: list[int]) -> list[int]:
        """The shift of each global step starting at `offsets` of `epoch`: the spec's,
        or `auto`'s draw among seq_len's proper divisors keyed by (seed, epoch, offset),
        the same on every rank (docs/sampling.md, "Shift")."""
        shift = self.spec.shift
        if shift != AUTO:
            return [int(shift)] * len(offsets)
        seed, divisors = self.spec.seed, self.divisors
        return [divisors[key(seed, epoch, Tag.SHIFT, o) % len(divisors)] for o in offsets]


@dataclass(frozen=True)
class DatasetSampler(SpecView):
    """A request's epoch orders over one store: `spec` applied to `total_tokens` tokens.

    The spec's values are checked by SamplingSpec; the sampler checks what depends on the
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
    def num_windows(self) -> int:
        return split_windows(self.spec, self.total_tokens)[1]

    @property
    def windows_per_block(self) -> int:
        return max(1, self.block_tokens // self.stride)

    @cached_property
    def _orders(self) -> dict[int, EpochOrder]:
        return {}

    def order(self, epoch: int) -> EpochOrder:
        """The epoch's order, kept for the last ORDERS_KEPT epochs asked: the ranks of a
        job share one sampler (the feeder keeps it), and with it the shuffle groups'
        permutations each rank would otherwise key again."""
        orders = self._orders
        made = orders.get(epoch)
        if made is None:
            spec = self.spec
            made = EpochOrder(
                self.num_windows,
                self.windows_per_block,
                spec.shuffle_blocks,
                spec.seed,
                epoch,
                spec.shuffle,
            )
            if len(orders) >= ORDERS_KEPT:
                orders.clear()
            orders[epoch] = made
        return made

    def _check(self, epoch: int, rank: int, offset: int, step: int) -> None:
        if not 0 <= rank < self.world_size:
            raise InvalidArgument(f"rank must be in [0, world_size={self.world_size}), got {rank}")
        if not 0 <= offset <= self.num_windows:
            raise InvalidArgument(
                f"offset {offset} is outside the epoch of {self.num_windows} windows"
            )
        if not 0 <= epoch <= MAX_PARAM:
            raise InvalidArgument(f"epoch must be in [0, 2**40], got {epoch}")
        if not 0 <= step <= MAX_TOKENS:
            raise InvalidArgument(f"step must be in [0, 2**62], got {step}")

    def steps(self, rank: int, offset: int = 0) -> int:
        """Steps left for `rank` from `offset` (len() of a client's epoch)."""
        self._check(0, rank, offset, 0)
        return steps_per_epoch(
            self.num_windows, self.batch_size, self.world_size, rank, self.split, offset
        )

    def batches(self, epoch: int, rank: int, offset: int = 0, step: int = 0) -> Iterator[RankBatch]:
        """`rank`'s batches of `epoch`, from position `offset` of the epoch order.

        `step` is the number of the first step (it continues across resumes).
        """
        for r in self.rounds(epoch, rank, offset, step):
            yield from r.batches()

    def rounds(self, epoch: int, rank: int, offset: int = 0, step: int = 0) -> Iterator[Round]:
        """`batches()` grouped in Rounds of consecutive steps, mapped in one numpy call each.

        numpy's per-call overhead, not the arithmetic, dominates at small B, so mapping
        several steps' positions per call amortises it. Rounds start at one step and
        grow ROUND_GROWTH times (to DATASET_ROUND_POSITIONS positions), so the first batch
        of a (resumed) stream comes at once.
        """
        self._check(epoch, rank, offset, step)
        order = self.order(epoch)
        n, B = self.num_windows, self.batch_size
        global_batch = B * self.world_size
        # Train stops before a short final global batch; validation delivers every window.
        end = n if self.split != "train" else offset + (n - offset) // global_batch * global_batch
        max_round = max(1, DATASET_ROUND_POSITIONS // B)
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
                    self.shifts(epoch, offs),
                    rows[:kept],
                    self.split_begin + windows[:kept] * self.stride,
                )
            if kept < k:
                return
            step += k
            o += k * global_batch
            k *= ROUND_GROWTH
