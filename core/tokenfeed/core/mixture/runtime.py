"""Run-time segments: weight changes made while a mixture streams, kept apart from the
segments declared up front (the base mixture and the schedule).

docs/mixtures.md, "Run-time weights" is the contract:

* a run-time segment is a schedule segment (from_tokens, weights naming every source)
  added during the run; their from_tokens strictly increase, as a schedule's do;
* the segments in force are the declared ones and the run-time ones merged by
  from_tokens, a run-time segment replacing a declared one at an equal from_tokens
  (`merge`), so a change may fall before a later declared segment, which still
  applies from its own from_tokens;
* a change asked for global step s starts at that step's position o
  (`step_position`): the next offset plus the steps in between times B * W, which
  after an elastic resume is not s * B * W.

`RuntimeSegments` is their compact spelling, the same in a SamplingSpec and on the wire
(`SamplingParams.runtime_segments`): per segment a little-endian int64 from_tokens, then
k float64 weights in source order. 10,000 changes of 3 sources take 320 kB, decoded
without a Python object per weight, and the request after one more change begins with
the same bytes as the one before, so whoever built the mixture for the shorter one
extends it (`Mixture.with_runtime`) instead of starting over. Pure: no I/O.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.core.mixture.spec import Segment, given_weight

FIELD = "runtime_segments"  # the wire's name, which errors start with


@dataclass(frozen=True)
class RuntimeSegments:
    """The run-time segments of a mixture of `k` sources, as `data` (module docstring).

    Building one checks only that `data` holds whole segments; `segments()` validates
    what it decodes (InvalidArgument naming ``runtime_segments[j]...``).
    """

    k: int
    data: bytes = b""

    def __post_init__(self) -> None:
        if len(self.data) % self.record_bytes:
            raise InvalidArgument.at(
                FIELD,
                f"holds {len(self.data)} bytes, not a whole number of {self.record_bytes}-byte "
                f"segments (an int64 from_tokens and {self.k} float64 weights each)",
            )

    def __repr__(self) -> str:
        return f"RuntimeSegments(k={self.k}, {len(self)} segments)"

    @property
    def record_bytes(self) -> int:
        return 8 * (self.k + 1)

    def __len__(self) -> int:
        return len(self.data) // self.record_bytes

    def columns(self) -> tuple[np.ndarray, np.ndarray]:
        """(from_tokens int64 [n], weights float64 [n, k]): views of `data`."""
        n, width = len(self), self.k + 1
        tokens = np.frombuffer(self.data, dtype="<i8").reshape(n, width)[:, 0]
        weights = np.frombuffer(self.data, dtype="<f8").reshape(n, width)[:, 1:]
        return tokens, weights

    def from_tokens(self, j: int) -> int:
        """Segment j's from_tokens."""
        return int(struct.unpack_from("<q", self.data, j * self.record_bytes)[0])

    @property
    def last_from_tokens(self) -> int | None:
        return self.from_tokens(len(self) - 1) if len(self) else None

    def segments(self, names: Sequence[str], start: int = 0) -> list[Segment]:
        """Segments `start`, `start + 1`, ... as exact Segments (spec.py), each checked as
        a schedule segment is: from_tokens in (0, 2**62] and greater than the previous
        one's, weights finite and >= 0, not all 0."""
        tokens, weights = self.columns()
        prev = int(tokens[start - 1]) if start else 0
        out = []
        for j in range(start, len(self)):
            at = f"{FIELD}[{j}]"
            tok = int(tokens[j])
            if not 0 < tok <= MAX_TOKENS:
                raise InvalidArgument.at(f"{at}.from_tokens", f"must be in (0, 2**62], got {tok}")
            if tok <= prev:
                raise InvalidArgument.at(
                    f"{at}.from_tokens",
                    f"must be greater than {FIELD}[{j - 1}]'s {prev}, got {tok} (from_tokens "
                    "must strictly increase)",
                )
            row = weights[j]
            if np.isfinite(row).all() and (row >= 0).all():  # checked at once, -0.0 made 0
                ws = (row + 0.0).tolist()
            else:  # the error names the first weight at fault
                ws = [
                    given_weight(w, f"{at}.weights[{name!r}]")
                    for name, w in zip(names, row.tolist(), strict=True)
                ]
            if not any(ws):
                raise InvalidArgument.at(
                    f"{at}.weights", "all weights are 0; at least one must be positive"
                )
            out.append(Segment.of(tok, ws))
            prev = tok
        return out

    def with_segment(self, from_tokens: int, weights: Sequence[float]) -> RuntimeSegments:
        """These segments and one more from `from_tokens` on (weights in source order),
        which replaces the last one if it starts at the same from_tokens. The caller
        checked the weights (spec.segment_weights) and that from_tokens is not before
        the last segment's."""
        if len(weights) != self.k:
            raise InvalidArgument.at("weights", f"expected {self.k} weights, got {len(weights)}")
        record = struct.pack(f"<q{self.k}d", from_tokens, *weights)
        last = self.last_from_tokens
        if last is not None and from_tokens < last:
            raise InvalidArgument.at(
                "from_tokens", f"must be at least the last run-time segment's {last}"
            )
        kept = self.data[: -self.record_bytes] if from_tokens == last else self.data
        return replace(self, data=kept + record)

    def common_prefix(self, other: RuntimeSegments) -> int:
        """How many leading segments `other` has in common with these, byte for byte."""
        if other.k != self.k:
            return 0
        n = min(len(self), len(other))
        size = n * self.record_bytes
        short, long = sorted((self.data, other.data), key=len)
        if long.startswith(short):  # the usual case: one more segment (no copy made)
            return n
        a = np.frombuffer(self.data, dtype="<u8", count=size // 8).reshape(n, self.k + 1)
        b = np.frombuffer(other.data, dtype="<u8", count=size // 8).reshape(n, self.k + 1)
        return int(np.flatnonzero((a != b).any(axis=1))[0])

    # ---------------------------------------------------------------- state dicts

    def to_state(self) -> list[list[Any]]:
        """``[[from_tokens, [weight, ...]], ...]``, weights in source order: plain JSON,
        exact (a float prints as its shortest decimal)."""
        tokens, weights = self.columns()
        return [[t, w] for t, w in zip(tokens.tolist(), weights.tolist(), strict=True)]

    @classmethod
    def from_state(cls, k: int, rows: Any, field: str = "runtime") -> RuntimeSegments:
        """The inverse of `to_state` (InvalidArgument naming `field` if malformed)."""
        if not isinstance(rows, (list, tuple)):
            raise InvalidArgument.at(
                field, f"must be a list of segments, got {type(rows).__name__}"
            )
        out = bytearray()
        for j, row in enumerate(rows):
            ok = (
                isinstance(row, (list, tuple))
                and len(row) == 2
                and isinstance(row[0], int)
                and not isinstance(row[0], bool)
                and isinstance(row[1], (list, tuple))
                and len(row[1]) == k
            )
            if not ok:
                raise InvalidArgument.at(
                    f"{field}[{j}]", f"must be [from_tokens, [{k} weights]], got {row!r}"
                )
            try:
                out += struct.pack(f"<q{k}d", row[0], *row[1])
            except (struct.error, TypeError):
                raise InvalidArgument.at(
                    f"{field}[{j}]", f"must be [from_tokens, [{k} weights]], got {row!r}"
                ) from None
        return cls(k, bytes(out))


def merge(declared: Sequence[Segment], runtime: Sequence[Segment]) -> list[Segment]:
    """The segments in force: `declared` (the base mixture, then the schedule) and
    `runtime`, each in from_tokens order, merged by from_tokens; at an equal from_tokens
    the run-time segment replaces the declared one."""
    out: list[Segment] = []
    i, n = 0, len(declared)
    for seg in runtime:
        while i < n and declared[i].from_tokens < seg.from_tokens:
            out.append(declared[i])
            i += 1
        if i < n and declared[i].from_tokens == seg.from_tokens:
            i += 1  # replaced
        out.append(seg)
    out.extend(declared[i:])
    return out


def step_position(at_step: Any, next_offset: int, next_step: int, global_batch: int) -> int:
    """The global position of step `at_step` of a stream whose next step (the first the
    loop has not received) is `next_step`, at position `next_offset`, with `global_batch`
    (B * W) positions per step. InvalidArgument naming `at_step` for a step before the
    next one, or for position 0 (that is the base mixture: construct with the weights)."""
    if isinstance(at_step, bool) or not isinstance(at_step, (int, np.integer)):
        raise InvalidArgument.at("at_step", f"must be an integer step, got {at_step!r}")
    at_step = int(at_step)
    if at_step < next_step:
        raise InvalidArgument.at(
            "at_step",
            f"step {at_step} is in the past: the next step the loop has not received is "
            f"{next_step}, so a change applies from it or a later one",
        )
    position = next_offset + (at_step - next_step) * global_batch
    if position == 0:
        raise InvalidArgument.at(
            "at_step",
            "a change from the first batch (position 0) is the base mixture: construct the "
            "loader with these weights instead",
        )
    return position
