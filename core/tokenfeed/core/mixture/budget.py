"""What a run of N tokens draws from each source of a mixture (Info, `tokenfeed info`).

Plain values, exact (Fractions); presenting them is the caller's (the CLI prints a
table, the server fills InfoResponse). Pure: no I/O, O(sources x segments).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fractions import Fraction
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.core.mixture.spec import Segment

if TYPE_CHECKING:
    from tokenfeed.core.mixture.mixture import Mixture


@dataclass(frozen=True)
class SourceBudget:
    name: str
    windows: int  # the source's train windows (one pass)
    windows_drawn: int
    tokens_drawn: int  # windows_drawn * seq_len
    passes: Fraction  # windows_drawn / windows
    index: int  # in the source order
    segments: Sequence[Segment] = field(repr=False, compare=False)  # Mixture.in_force

    @cached_property
    def shares(self) -> tuple[Fraction, ...]:
        """Its normalized weight in each segment of Mixture.segments, exact (made when
        asked: a Fraction per segment)."""
        return tuple(s.shares[self.index] for s in self.segments)

    @property
    def share_floats(self) -> list[float]:
        """`shares` as floats (each the float nearest the exact share), without making
        the Fractions."""
        i = self.index
        return [s.a[i] / s.D for s in self.segments]


@dataclass(frozen=True)
class Budget:
    """What a run of `tokens` tokens draws: ``positions = tokens // seq_len`` windows."""

    tokens: int
    positions: int
    seq_len: int
    segments: tuple[tuple[int, int | None], ...]  # (from_tokens, to_tokens or None=open)
    sources: tuple[SourceBudget, ...]


def budget_of(mix: Mixture, tokens: int, windows: Mapping[str, int] | Sequence[int]) -> Budget:
    """The draws of a run of `tokens` tokens (tokens // seq_len windows), given each
    source's train windows (a mapping name -> windows, or a list in source order)."""
    if isinstance(tokens, (float, np.floating)) and math.isfinite(tokens) and tokens == int(tokens):
        tokens = int(tokens)
    if (
        isinstance(tokens, bool)
        or not isinstance(tokens, (int, np.integer))
        or not 0 <= tokens <= MAX_TOKENS
    ):
        raise InvalidArgument.at("tokens", f"must be an integer in [0, 2**62], got {tokens!r}")
    if isinstance(windows, Mapping):
        unknown = [x for x in windows if x not in mix.names]
        if unknown:
            raise InvalidArgument.at("windows", f"not sources of the mixture: {unknown}")
        missing = [x for x in mix.names if x not in windows]
        if missing:
            raise InvalidArgument.at("windows", f"missing sources {missing}")
        counts = [windows[x] for x in mix.names]
    else:
        counts = list(windows)
        if len(counts) != mix.k:
            raise InvalidArgument.at("windows", f"expected {mix.k} counts, got {len(counts)}")
    for name, w in zip(mix.names, counts, strict=True):
        if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
            raise FailedPrecondition.at(
                f"sources[{name!r}]", f"source {name!r} has no train window ({w!r})"
            )
    positions = int(tokens) // mix.seq_len
    drawn = mix.counts(positions)
    starts = [s.from_tokens for s in mix.in_force]
    spans = tuple(zip(starts, [*starts[1:], None], strict=True))
    out = tuple(
        SourceBudget(
            name,
            int(w),
            c,
            c * mix.seq_len,
            Fraction(c, int(w)),
            i,
            mix.in_force,
        )
        for i, (name, w, c) in enumerate(zip(mix.names, counts, drawn, strict=True))
    )
    return Budget(int(tokens), positions, mix.seq_len, spans, out)
