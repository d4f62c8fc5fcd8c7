"""`Mixture`: a mixture's math in one object, composed of the package's parts.

Sources with weights and a schedule of weight segments (spec.py) merged with the
segments added at run time (runtime.py), which source each position takes
(apportionment.py), and what a run draws (budget.py); steps.py lays a
Mixture's positions out in steps and ranks. Pure: no I/O, no gRPC; errors are the
core's (InvalidArgument / FailedPrecondition whose `field` names the request field at
fault and starts the message). docs/mixtures.md is the contract.
"""

from __future__ import annotations

from bisect import bisect_left
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
from tokenfeed.core.mixture.prefix import Prefix
from tokenfeed.core.mixture.runtime import RuntimeSegments, merge
from tokenfeed.core.mixture.spec import Segment


class Mixture:
    """Sources with weights, a schedule of weight segments and run-time segments; the
    stream's math.

    `sources` is the base mixture (segment 0, from token 0): a mapping name -> weight
    or a list of (name, weight) pairs; its order is the source order. `schedule` lists
    later segments, each ``(from_tokens, weights)`` or ``{"from_tokens": N, "weights":
    {...}}``, whose weights name every source. `runtime` holds the segments added while
    the run streams (runtime.py: RuntimeSegments or its bytes), merged with the declared
    ones by from_tokens. Raises InvalidArgument naming the field.
    """

    def __init__(
        self,
        sources: Any,
        schedule: Any = (),
        *,
        seq_len: int,
        runtime: RuntimeSegments | bytes = b"",
    ) -> None:
        if (
            isinstance(seq_len, bool)
            or not isinstance(seq_len, (int, np.integer))
            or not 1 <= seq_len <= MAX_PARAM
        ):
            raise InvalidArgument.at(
                "seq_len", f"must be an integer in [1, 2**40], got {seq_len!r}"
            )
        names, declared = spec.parse(sources, schedule)
        rt = _runtime(len(names), runtime)
        added = Prefix(rt.segments(names))
        in_force = Prefix(merge(declared, added))
        tokens = Prefix([s.from_tokens for s in in_force])
        apportionment = Apportionment(in_force, seq_len)
        self._assemble(int(seq_len), names, declared, rt, added, in_force, tokens, apportionment)

    def _assemble(
        self,
        seq_len: int,
        names: tuple[str, ...],
        declared: tuple[Segment, ...],
        runtime: RuntimeSegments,
        added: Prefix[Segment],
        in_force: Prefix[Segment],
        tokens: Prefix[int],
        apportionment: Apportionment,
    ) -> None:
        self.seq_len, self.names, self.k = seq_len, names, len(names)
        self.declared = declared  # the base mixture, then the schedule
        self.runtime, self._added = runtime, added
        self.in_force = in_force  # declared and run-time segments merged (runtime.merge)
        self._tokens = tokens  # each in_force segment's from_tokens
        self._declared_tokens = [s.from_tokens for s in declared]
        self.apportionment = apportionment
        self._weights: dict[int, tuple[tuple[str, float], ...]] = {}  # see weights()

    def with_runtime(self, runtime: RuntimeSegments | bytes) -> Mixture:
        """This mixture with the run-time segments `runtime` instead of its own. What the
        two have in common is reused (the segments, the closed form's integers), and
        appended to in place (prefix.py), so a segment added to thousands costs
        O(sources)."""
        rt = _runtime(self.k, runtime)
        c = self.runtime.common_prefix(rt)
        if c == len(self.runtime) == len(rt):
            return self
        new = rt.segments(self.names, start=c)
        added = self._added.grown(c, new)
        # every segment in force before the first run-time segment that differs stays
        first = min(s.from_tokens for s in (*self._added[c : c + 1], *new[:1]))
        cut = self._tokens.bisect_left(first)
        tail = merge(self.declared[bisect_left(self._declared_tokens, first) :], new)
        in_force = self.in_force.grown(cut, tail)
        tokens = self._tokens.grown(cut, [s.from_tokens for s in tail])
        apportionment = Apportionment(
            in_force, self.seq_len, extending=self.apportionment, common=cut
        )
        mix = Mixture.__new__(Mixture)
        mix._assemble(
            self.seq_len, self.names, self.declared, rt, added, in_force, tokens, apportionment
        )
        return mix

    @cached_property
    def segments(self) -> tuple[tuple[int, tuple[Fraction, ...]], ...]:
        """(from_tokens, exact normalized shares in source order) of each segment in force
        (made when first asked: 100,000 Fractions for 1,000 sources over 100 segments)."""
        return tuple((s.from_tokens, s.shares) for s in self.in_force)

    def weights(self, j: int) -> tuple[tuple[str, float], ...]:
        """Declared segment j's weights as given (not normalized; 0 is the base mixture),
        (name, float) in source order. Made once: every spec of this mixture (one per
        seed, world size, ...) holds these same tuples."""
        made = self._weights.get(j)
        if made is None:
            made = self._weights[j] = tuple(zip(self.names, self.declared[j].given, strict=True))
        return made

    def schedule(self) -> list[tuple[int, dict[str, str]]]:
        """Every segment in force from token 0, declared and run-time merged, as
        (from_tokens, {name: its weight as given, a decimal string})."""
        return [
            (s.from_tokens, {n: repr(w) for n, w in zip(self.names, s.given, strict=True)})
            for s in self.in_force
        ]

    def shares_at(self, p: int) -> tuple[Fraction, ...]:
        """The normalized weights in force at position p, in source order."""
        return self.in_force[self.segment_of(p)].shares

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


def _runtime(k: int, runtime: RuntimeSegments | bytes) -> RuntimeSegments:
    """`runtime` as the RuntimeSegments of a mixture of k sources."""
    if isinstance(runtime, RuntimeSegments):
        if runtime.k != k:
            raise InvalidArgument.at(
                "runtime_segments", f"has weights for {runtime.k} sources, the mixture {k}"
            )
        return runtime
    return RuntimeSegments(k, bytes(runtime))
