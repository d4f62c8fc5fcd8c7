"""`Mixture`: a mixture's math in one object, composed of the package's parts.

Sources with weights and a schedule of weight segments (spec.py), which source each
position takes (apportionment.py), and what a run draws (budget.py); steps.py lays a
Mixture's positions out in steps and ranks. Pure: no I/O, no gRPC; errors are the
core's (InvalidArgument / FailedPrecondition whose `field` names the request field at
fault and starts the message). docs/mixtures.md is the contract.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from fractions import Fraction
from functools import cached_property
from typing import Any

import numpy as np

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_PARAM
from tokenfeed.core.mixture import spec
from tokenfeed.core.mixture.apportionment import Apportionment
from tokenfeed.core.mixture.budget import Budget, budget_of


class Mixture:
    """Sources with weights and a schedule of weight segments; the stream's math.

    `sources` is the base mixture (segment 0, from token 0): a mapping name -> weight
    or a list of (name, weight) pairs; its order is the source order. `schedule` lists
    later segments, each ``(from_tokens, weights)`` or ``{"from_tokens": N, "weights":
    {...}}``, whose weights name every source. Raises InvalidArgument naming the field.
    """

    def __init__(self, sources: Any, schedule: Any = (), *, seq_len: int) -> None:
        if (
            isinstance(seq_len, bool)
            or not isinstance(seq_len, (int, np.integer))
            or not 1 <= seq_len <= MAX_PARAM
        ):
            raise InvalidArgument.at(
                "seq_len", f"must be an integer in [1, 2**40], got {seq_len!r}"
            )
        self.seq_len = int(seq_len)
        self.names, segments = spec.parse(sources, schedule)
        self.k = len(self.names)
        self._segments = segments
        self.from_tokens = tuple(s.from_tokens for s in segments)  # where each segment starts
        self._given = tuple(s.weights for s in segments)
        self.apportionment = Apportionment(segments, self.seq_len)

    @cached_property
    def segments(self) -> tuple[tuple[int, tuple[Fraction, ...]], ...]:
        """(from_tokens, exact normalized shares) of each segment, in source order (made
        when first asked: 100,000 Fractions for 1,000 sources over 100 segments)."""
        return tuple((s.from_tokens, s.shares) for s in self._segments)

    def weights(self, j: int) -> tuple[tuple[str, float], ...]:
        """Segment j's weights as given (not normalized), (name, float) in source order."""
        given = self._given[j]  # n / d: Fraction.__float__ costs 10x more
        return tuple(
            (name, w.numerator / w.denominator) for name, w in zip(self.names, given, strict=True)
        )

    # ............................................................... apportionment

    @property
    def max_position(self) -> int:
        return self.apportionment.max_position

    def segment_of(self, p: int) -> int:
        """Index in `segments` of the segment that position p belongs to."""
        return self.apportionment.segment_of(p)

    def target(self, p: int) -> tuple[Fraction, ...]:
        """t_i(p): each source's weight summed over positions 0..p-1, exactly."""
        return self.apportionment.target(p)

    def counts(self, p: int) -> tuple[int, ...]:
        """c_i(p): how many of positions 0..p-1 come from each source (exact ints)."""
        return self.apportionment.counts(p)

    def counts_at(self, positions: np.ndarray) -> np.ndarray:
        """c(p) for an array of positions: int64 [len(positions), k]."""
        return self.apportionment.counts_at(positions)

    def runs(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, start + length) for each start, in due order: (source index,
        item index) int64 arrays of shape [len(starts), length]."""
        return self.apportionment.runs(starts, length)

    def items(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, stop) in due order: (source index, item index) int64 arrays."""
        return self.apportionment.items(start, stop)

    # ...................................................................... budget

    def budget(self, tokens: int, windows: Mapping[str, int] | Sequence[int]) -> Budget:
        """What a run of `tokens` tokens (tokens // seq_len windows) draws from each
        source, given each source's train windows (a mapping name -> windows, or a list
        in source order)."""
        return budget_of(self, tokens, windows)
