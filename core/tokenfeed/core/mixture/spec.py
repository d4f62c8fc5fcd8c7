"""A mixture's sources and schedule as the user gives them -> exact, validated segments.

Pure: no I/O (files.py reads mixture files), no float arithmetic on weights.
docs/mixtures.md, "Weights and segments" is the contract:

* a weight is the shortest decimal that round-trips its float
  (``Fraction(repr(float(w)))``), so every language that prints floats the shortest
  way computes the same stream;
* segment 0 is the base mixture, from token 0; each schedule entry starts a segment at
  its `from_tokens` (strictly increasing) and names every source;
* a segment's weights are normalized with exact rationals: source i's share is
  ``a[i] / D`` (integers in lowest terms, sum of a = D).

A segment keeps its weights as the floats given (the shortest decimal of a float names
it exactly), so a thousand sources over a hundred segments are parsed, normalized and
given back without a Fraction per weight: the few distinct values of a segment are made
exact once each.

Errors are InvalidArgument whose `field` names the request field at fault
(``sources[0].name``, ``schedule[1].weights['web']``) and starts the message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from functools import cached_property, lru_cache
from operator import itemgetter
from typing import Any

import numpy as np

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_SOURCES, MAX_TOKENS


@dataclass(frozen=True)
class Segment:
    """A schedule segment: from token `from_tokens` of the mixture stream on, these
    weights (in source order)."""

    from_tokens: int
    given: tuple[float, ...]  # as given: weight i is the shortest decimal of given[i]
    a: tuple[int, ...]  # normalized: share i = a[i] / D
    D: int

    @classmethod
    def of(cls, from_tokens: int, given: Sequence[float]) -> Segment:
        """The segment of these weights (checked floats: finite, >= 0, not -0.0, not all
        0), normalized."""
        return cls(from_tokens, tuple(given), *normalize_given(given))

    @cached_property
    def weights(self) -> tuple[Fraction, ...]:
        """The weights as given, exact: the shortest decimal of each float."""
        return tuple(map(shortest_decimal, self.given))

    @cached_property
    def shares(self) -> tuple[Fraction, ...]:
        return tuple(Fraction(x, self.D) for x in self.a)


def parse_weight(value: Any, field: str) -> Fraction:
    """A weight as the shortest decimal that round-trips its float, exactly.

    0.7 is 7/10 (not the binary float 0.6999...), so every language that prints floats
    the shortest way computes the same stream.
    """
    return shortest_decimal(given_weight(value, field))


def given_weight(value: Any, field: str) -> float:
    """A weight as the float whose shortest decimal it is (-0.0 as 0.0); InvalidArgument
    naming `field` unless it is a finite number >= 0."""
    if type(value) is float:  # what the wire gives: no ABC checks (1,000 sources x 100)
        f = value
    elif isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, str, Decimal, Fraction, np.integer, np.floating)
    ):
        raise InvalidArgument.at(field, f"must be a number, got {type(value).__name__} {value!r}")
    else:
        try:
            f = float(value)
        except (ValueError, OverflowError):
            raise InvalidArgument.at(field, f"must be a finite number, got {value!r}") from None
    if math.isnan(f) or math.isinf(f):
        raise InvalidArgument.at(field, f"must be a finite number, got {value!r}")
    if f < 0:
        raise InvalidArgument.at(field, f"must be >= 0, got {value!r}")
    return f or 0.0  # -0.0 is 0


@lru_cache(maxsize=1 << 16)
def shortest_decimal(f: float) -> Fraction:
    """The shortest decimal that round-trips `f`, exactly: 0.7 -> 7/10. Cached: parsing
    it costs microseconds, and weights repeat (a policy's are a few decimals each; Info
    asks for each source's split_rate)."""
    return Fraction(*Decimal(repr(f)).as_integer_ratio())  # Fraction(repr(f)), 2x faster


def normalize(weights: Sequence[Fraction]) -> tuple[tuple[int, ...], int]:
    """Exact weights -> integers a_i and D with a_i / D = w_i / sum(w) in lowest common
    terms (D is the least common denominator of the shares; sum of a = D)."""
    return _normalized(weights, lambda w: w if type(w) is Fraction else Fraction(w))


def normalize_given(given: Sequence[float]) -> tuple[tuple[int, ...], int]:
    """normalize() of the weights the floats `given` name (their shortest decimals)."""
    return _normalized(given, shortest_decimal)


def _normalized(
    values: Sequence[Any], exact: Callable[[Any], Fraction]
) -> tuple[tuple[int, ...], int]:
    """normalize() of `exact(v)` for each of `values`, computed once per distinct value:
    a segment of 1,000 sources has a few."""
    by_value = {v: exact(v) for v in set(values)}
    common = math.lcm(*(w.denominator for w in by_value.values()))
    m = {v: w.numerator * (common // w.denominator) for v, w in by_value.items()}
    total = sum(map(m.__getitem__, values))
    if total == 0:
        raise ValueError("all weights are 0")
    g = math.gcd(total, *m.values())
    a = {v: x // g for v, x in m.items()}
    return tuple(map(a.__getitem__, values)), total // g


def parse(sources: Any, schedule: Any = ()) -> tuple[tuple[str, ...], tuple[Segment, ...]]:
    """(source names in order, segments) of a mixture.

    `sources` is the base mixture (segment 0, from token 0): a mapping name -> weight
    or a list of (name, weight) pairs; its order is the source order. `schedule` lists
    later segments, each ``(from_tokens, weights)`` or ``{"from_tokens": N, "weights":
    {...}}``, whose weights name every source.
    """
    base = _pairs(sources, "sources")
    if not base:
        raise InvalidArgument.at("sources", "a mixture needs at least one source")
    if len(base) > MAX_SOURCES:
        raise InvalidArgument.at("sources", f"at most {MAX_SOURCES} sources, got {len(base)}")
    names: dict[str, int] = {}  # in order; a dict: a segment looks each weight's name up
    for n, (name, _) in enumerate(base):
        if not isinstance(name, str) or not name:
            raise InvalidArgument.at(
                f"sources[{n}].name", f"must be a non-empty string, got {name!r}"
            )
        if name in names:
            raise InvalidArgument.at(f"sources[{n}].name", f"duplicate source {name!r}")
        names[name] = n
    order = list(names)
    raw = [(0, _weights(order, base, "sources"))]
    if schedule is None:
        schedule = ()
    if isinstance(schedule, (str, bytes, Mapping)) or not isinstance(schedule, Sequence):
        raise InvalidArgument.at(
            "schedule", f"must be a list of segments, got {type(schedule).__name__}"
        )
    for n, entry in enumerate(schedule):
        field = f"schedule[{n}]"
        tokens, weights = _schedule_entry(entry, field)
        tokens = _from_tokens(tokens, f"{field}.from_tokens")
        if tokens <= raw[-1][0]:
            before = "the base mixture's 0" if n == 0 else f"schedule[{n - 1}]'s {raw[-1][0]}"
            raise InvalidArgument.at(
                f"{field}.from_tokens",
                f"must be greater than {before}, got {tokens} (from_tokens must strictly increase)",
            )
        pairs = _pairs(weights, f"{field}.weights")
        raw.append((tokens, _weights(order, pairs, f"{field}.weights")))
    segments = tuple(Segment.of(tok, w) for tok, w in raw)
    return tuple(names), segments


def segment_weights(names: Sequence[str], weights: Any, field: str) -> list[float]:
    """A segment's weights (a mapping name -> weight or (name, weight) pairs, naming
    every source once) -> its weights in source order, each the float whose shortest
    decimal it is (given_weight); InvalidArgument naming `field` otherwise."""
    return _weights(list(names), _pairs(weights, field), field)


def _weights(names: list[str], pairs: list[tuple[Any, Any]], field: str) -> list[float]:
    """A segment's (name, weight) pairs -> its weights in source order (given_weight)."""
    if list(map(itemgetter(0), pairs)) == names:  # every source in order: checked at once
        values = list(map(itemgetter(1), pairs))
        distinct = set(values)
        if set(map(type, distinct)) == {float} and all(0 <= v < math.inf for v in distinct):
            if 0.0 in distinct:
                values = [v or 0.0 for v in values]  # -0.0 is 0
            if any(values):
                return values
    # anything else, and every error, one pair at a time
    known = set(names)
    by_name: dict[str, float] = {}
    for n, (name, value) in enumerate(pairs):
        if not isinstance(name, str):
            raise InvalidArgument.at(f"{field}[{n}]", f"source names are strings, got {name!r}")
        if name in by_name:
            raise InvalidArgument.at(f"{field}[{name!r}]", f"duplicate source {name!r}")
        if name not in known:
            raise InvalidArgument.at(
                f"{field}[{name!r}]", f"{name!r} is not a source of the mixture {list(names)}"
            )
        by_name[name] = given_weight(value, f"{field}[{name!r}]")
    missing = [x for x in names if x not in by_name]
    if missing:
        raise InvalidArgument.at(field, f"must name every source of the mixture; missing {missing}")
    weights = [by_name[x] for x in names]
    if not any(weights):
        raise InvalidArgument.at(field, "all weights are 0; at least one must be positive")
    return weights


def _pairs(value: Any, field: str) -> list[tuple[Any, Any]]:
    """A mapping or a sequence of (name, weight) pairs -> list of pairs."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise InvalidArgument.at(
            field,
            f"must be a mapping name -> weight or a list of (name, weight) pairs, "
            f"got {type(value).__name__}",
        )
    if set(map(type, value)) == {tuple} and set(map(len, value)) == {2}:
        return list(value)  # the wire's form, checked at once
    out = []
    for n, item in enumerate(value):
        if type(item) is tuple and len(item) == 2:
            out.append(item)
            continue
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise InvalidArgument.at(
                f"{field}[{n}]", f"must be a (name, weight) pair, got {item!r}"
            )
        out.append((item[0], item[1]))
    return out


def _from_tokens(value: Any, field: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgument.at(field, f"must be an integer token count, got {value!r}")
    if isinstance(value, str):  # "2e9" (YAML 1.1 reads it as a string) or "2_000_000"
        try:
            exact = Decimal(value.strip().replace("_", ""))
        except ArithmeticError:
            raise InvalidArgument.at(
                field, f"must be an integer token count, got {value!r}"
            ) from None
        if not exact.is_finite() or exact != exact.to_integral_value():
            raise InvalidArgument.at(field, f"must be an integer token count, got {value!r}")
        value = int(exact)
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != int(value):
            raise InvalidArgument.at(field, f"must be an integer token count, got {value!r}")
        value = int(value)
    if not isinstance(value, (int, np.integer)):
        raise InvalidArgument.at(field, f"must be an integer token count, got {value!r}")
    value = int(value)
    if not 0 < value <= MAX_TOKENS:
        raise InvalidArgument.at(field, f"must be in (0, 2**62], got {value}")
    return value


def _schedule_entry(entry: Any, field: str) -> tuple[Any, Any]:
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"from_tokens", "weights"}
        if unknown or "from_tokens" not in entry or "weights" not in entry:
            raise InvalidArgument.at(
                field, f"must have exactly the keys from_tokens and weights, got {sorted(entry)}"
            )
        return entry["from_tokens"], entry["weights"]
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2:
        raise InvalidArgument.at(field, f"must be a (from_tokens, weights) pair, got {entry!r}")
    return entry[0], entry[1]
