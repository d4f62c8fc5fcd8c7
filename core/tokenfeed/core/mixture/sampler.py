"""`MixtureSampler`: a mixture request over its sources' stores -> each rank's rounds.

The mixture's math (Mixture) says which item of which source each row is; this maps
items to window starts in each source's store, for many sources in one go
(passes.PassOrders), and gives each step its shift as a dataset's step at epoch 0.
docs/mixtures.md is the contract. Pure: no I/O; the stores enter as their sizes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.core.mixture import steps
from tokenfeed.core.mixture.budget import Budget
from tokenfeed.core.mixture.mixture import Mixture
from tokenfeed.core.mixture.passes import PassOrders, divmod_items, source_seed
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import RankBatch, Round, SpecView, split_bounds, split_windows

# `starts` maps up to this many sources' items one source at a time
_SOURCES_ONE_BY_ONE = 8


@dataclass(frozen=True)
class MixtureSampler(SpecView):
    """A mixture request over its sources' stores: `spec` (a mixture) applied to each
    source's `totals[i]` tokens, `block_tokens[i]` (about one chunk) sizing its blocks.

    Each source's train split is its own endless sequence of passes: pass e is the
    single-dataset epoch order of that split with seed ``source_seed(seed, name)`` and
    epoch e (so a source's order does not depend on the other sources or their order).
    The mixture's math (Mixture) says which item of which source each row is; this
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
            raise InvalidArgument("a MixtureSampler needs a mixture (sources)", field="sources")
        if len(self.totals) != len(names) or len(self.block_tokens) != len(names):
            raise InvalidArgument("one total and one block size per source", field="sources")
        for name, total in zip(names, self.totals, strict=True):
            if not 0 <= total <= MAX_TOKENS:
                raise InvalidArgument(f"total_tokens out of range: {total}")
            _, windows = split_windows(spec, total, "train")
            if windows == 0:
                raise FailedPrecondition.at(
                    f"sources[{name!r}]",
                    f"source {name!r} has no train window: its train split "
                    f"({split_bounds(total, 'train', spec.split_fraction)[1]} tokens at "
                    f"split_rate {spec.split_rate}) is too short for seq_len {spec.seq_len} + "
                    f"shift {spec.max_shift}",
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
                    passes, positions = divmod_items(mine, self._windows_np[np.full(len(sel), i)])
                    out[sel] = self.orders.windows(np.full(len(sel), i), passes, positions)
            return (out * stride).reshape(items.shape)
        passes, positions = divmod_items(items, self._windows_np[sources])
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
            raise InvalidArgument(f"step must be in [0, 2**62], got {step}", field="step")
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
        B = spec.batch_size
        for r in steps.rounds(
            self.mixture,
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
                self.shifts(0, r.offsets),
                [B] * n,
                self.starts(r.sources, r.items),
                r.sources,
            )

    def batches(self, rank: int, offset: int = 0, step: int = 0) -> Iterator[RankBatch]:
        for r in self.rounds(rank, offset, step):
            yield from r.batches()

    def budget(self, tokens: int) -> Budget:
        """What a run of `tokens` tokens draws from each source (tokenfeed info, Info)."""
        return self.mixture.budget(tokens, list(self.windows))
