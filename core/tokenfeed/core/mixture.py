"""Mixtures: the pure sampling math of several sources blended by weight.

design.md "Mixtures" is the contract (ARCHITECTURE.md "Mixtures" sums it up). Pure:
no I/O, no gRPC; errors are the core's (InvalidArgument / FailedPrecondition whose
`field` names the request field at fault, and whose message starts with it).

Definitions (p, x, q are global positions of the endless mixture stream, one window
each; k is the number of sources):

* weights: each weight is the shortest decimal that round-trips its float
  (``Fraction(repr(float(w)))``), normalized per segment with exact rationals. In
  segment j, source i has weight ``a[j][i] / D[j]`` (integers, sum of a = D).
* segments: position p belongs to the last segment whose ``from_tokens <= p*seq_len``,
  so segment j starts at position ``P_j = ceil(from_tokens_j / seq_len)``. A segment
  that owns no position (its start rounds to the next one's) is dropped.
* target: ``t_i(p)`` = source i's weight summed over positions 0..p-1 (exact).
* due points: item n >= 1 of source i falls due at the first x with ``t_i(x) >= n``;
  item 0 at the first position where the source's weight is positive. Position q
  takes the q-th item in order of (due point, source index). ``c_i(p)`` counts the
  items of source i among positions 0..p-1.

Why this closed form, and how it is computed without walking:

* ``N_i(x)``, the items of source i due at or before x, is
  ``floor(t_i(x)) + [source i started by x]``; ``S(x) = sum_i N_i(x)``. Since
  ``sum_i t_i(x) = x``, ``x < S(x) <= x + k`` (the item at position q is due in
  [q-k+1, q]), and at most one item per source falls due at one x.
* Precomputed once per segment j (exact Python ints): ``NB[j][i] = N_i(P_j - 1)``,
  ``Q_j = S(P_j - 1)`` (positions [Q_j, Q_{j+1}) hold exactly the items due in
  segment j), ``g[j][i] = floor(D * frac(t_i(P_j)))`` and ``h[j][i]`` (item due at
  P_j itself). Inside segment j, with ``d = x - P_j >= 0``,
  ``N_i(x) - NB[j][i] = M_i(d) = h_i + floor((g_i + a_i*d) / D)``: only the integer
  ``g_i`` of the fractional start is needed, so all arithmetic is on integers.
* ``c(p)``: find j with ``Q_j <= p < Q_{j+1}``, then the smallest d with
  ``sum_i M_i(d) >= p - Q_j``; it lies in a window of k values (binary search), and
  the items due at that d are taken in source order. O(k log k + log segments), no
  dependence on p, O(1) memory.
* The due point of a given item inverts M_i: ``d = ceil((D*u - g_i) / a_i)``.

int64 and exactness: with ``D <= 2**31`` the kernels are int64, reducing d modulo D
first when ``a*d`` could overflow (``a*d = a*D*(d//D) + a*(d%D)``, products < D**2).
Weights with many significant digits (float shares like n_i/total) give D up to
~10**20; there a call anchors at its smallest d with exact Python ints
(``g + a*d0 = q0*D + r0``) and evaluates ``q0 + floor(r0/D + (a/D)*(d - d0))`` in
float64 over a span of at most 2**32, recomputing exactly (Python ints) every element
whose float lies within the float's error bound of an integer; wider spans use numpy
object arrays of Python ints. Results are exact in every mode.

Steps and ranks: step s covers positions [o_s, o_s + B*W) and its windows from source
i are that source's items ``c_i(o_s) .. c_i(o_s + B*W) - 1``. Shuffle off: the step is
in due order and rank r takes positions [o_s + r*B, o_s + (r+1)*B), with no
permutation anywhere. Shuffle on: the step's windows are laid out *source-major*
(source 0's items c_0(o_s).., then source 1's, ...) and permuted by the keyed
bijection of [0, B*W) (keyed.py) with key ``step_key(seed, o_s)`` = key(seed, 16, o_s);
rank r takes slots [r*B, (r+1)*B) of the permuted order. This is design.md's "an
order keyed by (seed, o_s)" (a decision confirmed by the lead): source-major needs
only c at the step's two boundaries, not a due-order lookup per window, and the
result is as random and as portable. Both are pure functions of (mixture, seq_len,
B, W, seed, o_s); every language can compute them.

Per-source passes: item n of source i is position ``n % windows_i`` of pass
``n // windows_i``; the caller maps it with the single-dataset epoch order seeded by
``source_seed(seed, name)`` with epoch = pass.
"""

from __future__ import annotations

import json
import logging
import math
import os
from bisect import bisect_right
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from typing import Any

import numpy as np

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.keyed import (
    MASK64,
    NATIVE,
    domain_bits,
    encrypt,
    key,
    keys,
    native_step_rows,
    permute,
    round_keys_by_round,
)

log = logging.getLogger(__name__)

__all__ = [
    "Budget",
    "FailedPrecondition",
    "InvalidArgument",
    "Mixture",
    "MixtureRound",
    "SourceBudget",
    "normalize",
    "parse_weight",
    "source_seed",
    "split_passes",
    "step_key",
]

MAX_TOKENS = 1 << 62  # positions * seq_len never exceed this
MAX_PARAM = 1 << 40  # seq_len, batch_size, world_size
MAX_SOURCES = 1 << 12
_FAST_D = 1 << 31  # D <= this: every product of the kernels fits int64
_ANCHOR_SPAN = 1 << 32  # large D: floats near an exact anchor over at most this span
# Positions of a rank per round: more than a dataset's 4096 (sampling.py), because a
# mixture's round makes more numpy calls (counts, the step order, many sources' passes)
# and larger rounds amortise them (~25 % per batch at 16 sources; benchmarks/).
_POSITIONS_PER_ROUND = 16384
# rank_steps finds a slot's source by counting (k - 1 compares per slot) up to this many
# sources, by a binary search of every step's starts (~log2(steps * k) probes) above
_COUNT_SOURCES = 32
# Key-derivation domain tags (the single-dataset engine uses 1..3).
_TAG_STEP = 16
_TAG_SOURCE = 17


# ------------------------------------------------------------------------- errors


def _invalid(field: str, message: str) -> InvalidArgument:
    """InvalidArgument naming the field: its message starts with it."""
    return InvalidArgument(f"{field}: {message}", field=field)


def _unsatisfiable(field: str, message: str) -> FailedPrecondition:
    return FailedPrecondition(f"{field}: {message}", field=field)


# ----------------------------------------------------------------- weights, schedule


def parse_weight(value: Any, field: str) -> Fraction:
    """A weight as the shortest decimal that round-trips its float, exactly.

    0.7 is 7/10 (not the binary float 0.6999...), so every language that prints floats
    the shortest way computes the same stream.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(
        value, (int, float, str, Decimal, Fraction, np.integer, np.floating)
    ):
        raise _invalid(field, f"must be a number, got {type(value).__name__} {value!r}")
    try:
        f = float(value)
    except (ValueError, OverflowError):
        raise _invalid(field, f"must be a finite number, got {value!r}") from None
    if math.isnan(f) or math.isinf(f):
        raise _invalid(field, f"must be a finite number, got {value!r}")
    if f < 0:
        raise _invalid(field, f"must be >= 0, got {value!r}")
    return Fraction(repr(f))


def normalize(weights: Sequence[Fraction]) -> tuple[tuple[int, ...], int]:
    """Exact weights -> integers a_i and D with a_i / D = w_i / sum(w) in lowest common
    terms (D is the least common denominator of the shares; sum of a = D)."""
    common = math.lcm(*(Fraction(w).denominator for w in weights))
    m = [int(w * common) for w in weights]
    total = sum(m)
    if total == 0:
        raise ValueError("all weights are 0")
    g = math.gcd(total, *m)
    return tuple(x // g for x in m), total // g


def _pairs(value: Any, field: str) -> list[tuple[Any, Any]]:
    """A mapping or a sequence of (name, weight) pairs -> list of pairs."""
    if isinstance(value, Mapping):
        return list(value.items())
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise _invalid(
            field,
            f"must be a mapping name -> weight or a list of (name, weight) pairs, "
            f"got {type(value).__name__}",
        )
    out = []
    for n, item in enumerate(value):
        if isinstance(item, (str, bytes)) or not isinstance(item, Sequence) or len(item) != 2:
            raise _invalid(f"{field}[{n}]", f"must be a (name, weight) pair, got {item!r}")
        out.append((item[0], item[1]))
    return out


def _from_tokens(value: Any, field: str) -> int:
    if isinstance(value, (bool, np.bool_)):
        raise _invalid(field, f"must be an integer token count, got {value!r}")
    if isinstance(value, str):  # "2e9" (YAML 1.1 reads it as a string) or "2_000_000"
        try:
            exact = Decimal(value.strip().replace("_", ""))
        except ArithmeticError:
            raise _invalid(field, f"must be an integer token count, got {value!r}") from None
        if not exact.is_finite() or exact != exact.to_integral_value():
            raise _invalid(field, f"must be an integer token count, got {value!r}")
        value = int(exact)
    if isinstance(value, (float, np.floating)):
        if not math.isfinite(value) or value != int(value):
            raise _invalid(field, f"must be an integer token count, got {value!r}")
        value = int(value)
    if not isinstance(value, (int, np.integer)):
        raise _invalid(field, f"must be an integer token count, got {value!r}")
    value = int(value)
    if not 0 < value <= MAX_TOKENS:
        raise _invalid(field, f"must be in (0, 2**62], got {value}")
    return value


def _schedule_entry(entry: Any, field: str) -> tuple[Any, Any]:
    if isinstance(entry, Mapping):
        unknown = set(entry) - {"from_tokens", "weights"}
        if unknown or "from_tokens" not in entry or "weights" not in entry:
            raise _invalid(
                field, f"must have exactly the keys from_tokens and weights, got {sorted(entry)}"
            )
        return entry["from_tokens"], entry["weights"]
    if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence) or len(entry) != 2:
        raise _invalid(field, f"must be a (from_tokens, weights) pair, got {entry!r}")
    return entry[0], entry[1]


@dataclass(frozen=True)
class _Segment:
    """One kept segment, with everything the closed form needs (exact ints)."""

    index: int  # index in Mixture.segments (0 = base mixture)
    P: int  # first position
    D: int
    a: tuple[int, ...]
    g: tuple[int, ...]  # floor(D * frac(t_i(P)))
    h: tuple[int, ...]  # 1 if an item of source i falls due at P itself
    NB: tuple[int, ...]  # N_i(P - 1) = c_i(Q)
    Q: int  # S(P - 1): first position whose item is due in this segment
    Tn: tuple[int, ...]  # t_i(P) = Tn[i] / den
    den: int

    @property
    def G(self) -> int:
        return sum(self.g)

    @property
    def H(self) -> int:
        return sum(self.h)


# ------------------------------------------------------------------ mixture files


def load_mixture(mixture: Any, schedule: Any = None) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(sources, schedule) from what a user writes; Mixture validates the values.

    `mixture`: a mapping name -> weight, a list of (name, weight) pairs, the command
    line's ``web=0.7,code=0.3``, or the path of a YAML/JSON file
    ``{sources: {web: 0.7, ...}, schedule: [{from_tokens: N, weights: {...}}, ...]}``.
    `schedule`: a list of segments, or the path of a file holding that list (or a
    mapping with a `schedule` key). The same file works for the client and the CLI.
    """
    file_schedule: Any = None
    if isinstance(mixture, (str, os.PathLike)):
        text = os.fspath(mixture)
        if _looks_like_file(text):
            doc = _read_doc(text, "mixture")
            if not isinstance(doc, Mapping):
                raise _invalid("mixture", f"{text}: expected a mapping with a `sources` key")
            if "sources" in doc:
                unknown = sorted(set(doc) - {"sources", "schedule"})
                if unknown:
                    raise _invalid("mixture", f"{text}: unknown keys {unknown}")
                mixture, file_schedule = doc["sources"], doc.get("schedule")
            else:
                mixture = doc
        else:
            pairs = []
            for n, part in enumerate(p for p in text.split(",") if p.strip()):
                name, eq, weight = part.partition("=")
                if not eq:
                    raise _invalid(
                        f"mixture[{n}]",
                        f"{part!r} is not NAME=WEIGHT (and {text!r} is not a file)",
                    )
                pairs.append((name.strip(), weight.strip()))
            mixture = pairs
    if isinstance(schedule, (str, os.PathLike)):
        doc = _read_doc(os.fspath(schedule), "schedule")
        if isinstance(doc, Mapping):
            if "schedule" not in doc:
                raise _invalid("schedule", f"{os.fspath(schedule)}: no `schedule` key")
            doc = doc["schedule"]
        schedule = doc
    if schedule is not None and file_schedule is not None:
        raise _invalid("schedule", "given twice: in the mixture file and as schedule; keep one")
    if schedule is None:
        schedule = file_schedule or ()
    if mixture is None:
        raise _invalid("sources", "a schedule needs a mixture (sources)")
    if isinstance(mixture, Mapping):
        sources = tuple(mixture.items())
    elif isinstance(mixture, Sequence) and not isinstance(mixture, (str, bytes)):
        sources = tuple(tuple(x) if isinstance(x, list) else x for x in mixture)
    else:
        raise _invalid(
            "sources",
            f"must be a mapping name -> weight, a list of pairs or a file, got "
            f"{type(mixture).__name__}",
        )
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence):
        raise _invalid("schedule", f"must be a list of segments, got {type(schedule).__name__}")
    return sources, tuple(schedule)


def _looks_like_file(text: str) -> bool:
    return os.path.exists(text) or text.lower().endswith((".yaml", ".yml", ".json"))


def _read_doc(path: str, field: str) -> Any:
    """A YAML or JSON file's content (JSON by suffix or when PyYAML is missing)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise _invalid(field, f"cannot read {path}: {e.strerror or e}") from None
    if path.lower().endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise _invalid(field, f"{path}: not valid JSON ({e})") from None
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise _invalid(
                field, f"{path}: YAML needs PyYAML (pip install pyyaml), or write it as JSON"
            ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise _invalid(field, f"{path}: not valid YAML ({e})") from None


# ------------------------------------------------------------------- key derivation


def source_seed(seed: int, name: str) -> int:
    """The 64-bit seed of one source's passes: a key of (seed, the source's NAME).

    Pass e of source `name` is the single-dataset epoch order with seed
    ``source_seed(seed, name)`` and epoch e, so reordering or adding sources never
    changes a source's own order. Definition (portable): the key chain over
    (seed, 17, len(utf8), each 8-byte little-endian word of the zero-padded UTF-8).
    """
    if not isinstance(name, str):
        raise _invalid("name", f"must be a string, got {type(name).__name__}")
    if not 0 <= seed <= MASK64:
        raise _invalid("seed", f"must be in [0, 2**64), got {seed}")
    raw = name.encode("utf-8")
    padded = raw + b"\0" * (-len(raw) % 8)
    words = [int.from_bytes(padded[i : i + 8], "little") for i in range(0, len(padded), 8)]
    return key(seed, _TAG_SOURCE, len(raw), *words)


def step_key(seed: int, offset: int) -> int:
    """The key of the step that starts at position `offset`: its windows are permuted by
    the keyed bijection (keyed.py) of [0, B*W) with this key."""
    return key(seed, _TAG_STEP, offset)


def step_keys(seed: int, offsets: np.ndarray) -> np.ndarray:
    """`step_key` of many steps: uint64 [len(offsets)]."""
    return keys(seed, _TAG_STEP, np.asarray(offsets, dtype=np.int64))


def split_passes(items: np.ndarray | int, windows: int) -> tuple[Any, Any]:
    """Item n of a source with `windows` windows -> (pass n // windows, n % windows)."""
    if isinstance(windows, bool) or not isinstance(windows, (int, np.integer)) or windows < 1:
        raise _unsatisfiable("windows", f"a source needs at least one window, got {windows}")
    if isinstance(items, (int, np.integer)):
        return divmod(int(items), int(windows))
    n = np.asarray(items, dtype=np.int64)
    return n // windows, n % windows


# --------------------------------------------------------------------- the mixture


@dataclass(frozen=True)
class MixtureRound:
    """Consecutive batches of one rank: batch i is rows ``sources[i]``, ``items[i]``
    (source index in request order, item index in that source's endless sequence)."""

    step: int  # step of the first batch
    offsets: list[int]  # o_s of each batch's step
    sources: np.ndarray  # [batches, B] int64
    items: np.ndarray  # [batches, B] int64

    def __len__(self) -> int:
        return len(self.offsets)


@dataclass(frozen=True)
class SourceBudget:
    name: str
    windows: int  # the source's train windows (one pass)
    windows_drawn: int
    tokens_drawn: int  # windows_drawn * seq_len
    passes: Fraction  # windows_drawn / windows
    shares: tuple[Fraction, ...]  # normalized weight in each segment of Mixture.segments


@dataclass(frozen=True)
class Budget:
    """What a run of `tokens` tokens draws: ``positions = tokens // seq_len`` windows."""

    tokens: int
    positions: int
    seq_len: int
    segments: tuple[tuple[int, int | None], ...]  # (from_tokens, to_tokens or None=open)
    sources: tuple[SourceBudget, ...]

    def format(self) -> str:
        """A plain-text table for `tokenfeed info`."""
        title = (
            f"budget {self.tokens:,} tokens = {self.positions:,} windows of {self.seq_len} tokens"
        )
        lines = [title]
        seg_heads = [f"seg{j}@{lo:.3g}" for j, (lo, _) in enumerate(self.segments)]
        head = f"{'source':<20}{'windows':>14}{'drawn':>16}{'tokens':>18}{'passes':>10}"
        lines.append(head + "".join(f"{h:>12}" for h in seg_heads))
        for s in self.sources:
            lines.append(
                f"{s.name:<20}{s.windows:>14,}{s.windows_drawn:>16,}{s.tokens_drawn:>18,}"
                f"{float(s.passes):>10.3f}" + "".join(f"{float(x):>12.2%}" for x in s.shares)
            )
        return "\n".join(lines)


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
            raise _invalid("seq_len", f"must be an integer in [1, 2**40], got {seq_len!r}")
        self.seq_len = int(seq_len)
        base = _pairs(sources, "sources")
        if not base:
            raise _invalid("sources", "a mixture needs at least one source")
        if len(base) > MAX_SOURCES:
            raise _invalid("sources", f"at most {MAX_SOURCES} sources, got {len(base)}")
        names: list[str] = []
        for n, (name, _) in enumerate(base):
            if not isinstance(name, str) or not name:
                raise _invalid(f"sources[{n}].name", f"must be a non-empty string, got {name!r}")
            if name in names:
                raise _invalid(f"sources[{n}].name", f"duplicate source {name!r}")
            names.append(name)
        self.names: tuple[str, ...] = tuple(names)
        self.k = len(names)
        raw = [(0, self._weights(base, "sources"))]
        if schedule is None:
            schedule = ()
        if isinstance(schedule, (str, bytes, Mapping)) or not isinstance(schedule, Sequence):
            raise _invalid("schedule", f"must be a list of segments, got {type(schedule).__name__}")
        for n, entry in enumerate(schedule):
            field = f"schedule[{n}]"
            tokens, weights = _schedule_entry(entry, field)
            tokens = _from_tokens(tokens, f"{field}.from_tokens")
            if tokens <= raw[-1][0]:
                before = "the base mixture's 0" if n == 0 else f"schedule[{n - 1}]'s {raw[-1][0]}"
                raise _invalid(
                    f"{field}.from_tokens",
                    f"must be greater than {before}, got {tokens} "
                    "(from_tokens must strictly increase)",
                )
            raw.append(
                (tokens, self._weights(_pairs(weights, f"{field}.weights"), f"{field}.weights"))
            )
        # segments: (from_tokens, exact normalized shares) in Mixture order
        segments, self._normalized = [], []
        for tok, w in raw:
            a, D = normalize(w)
            self._normalized.append((a, D))
            segments.append((tok, tuple(Fraction(x, D) for x in a)))
        self.segments: tuple[tuple[int, tuple[Fraction, ...]], ...] = tuple(segments)
        self._raw_weights = tuple(tuple(w) for _, w in raw)
        self._build()

    # ...................................................................... validation

    def _weights(self, pairs: list[tuple[Any, Any]], field: str) -> list[Fraction]:
        by_name: dict[str, Fraction] = {}
        for n, (name, value) in enumerate(pairs):
            if not isinstance(name, str):
                raise _invalid(f"{field}[{n}]", f"source names are strings, got {name!r}")
            if name in by_name:
                raise _invalid(f"{field}[{name!r}]", f"duplicate source {name!r}")
            if name not in self.names:
                raise _invalid(
                    f"{field}[{name!r}]",
                    f"{name!r} is not a source of the mixture {list(self.names)}",
                )
            by_name[name] = parse_weight(value, f"{field}[{name!r}]")
        missing = [x for x in self.names if x not in by_name]
        if missing:
            raise _invalid(field, f"must name every source of the mixture; missing {missing}")
        weights = [by_name[x] for x in self.names]
        if not any(weights):
            raise _invalid(field, "all weights are 0; at least one must be positive")
        return weights

    # .................................................................. precomputation

    def _build(self) -> None:
        """Per kept segment, the exact integers of the closed form (module docstring).

        t_i(P) is kept as an integer numerator over a running common denominator
        (Fractions cost ~20x more here, and a stream open builds this)."""
        k, L = self.k, self.seq_len
        starts = [-(-tok // L) for tok, _ in self.segments]  # first position of each
        kept = [j for j in range(len(starts)) if j + 1 == len(starts) or starts[j + 1] > starts[j]]
        segs: list[_Segment] = []
        Tn, den = [0] * k, 1  # t_i(P) = Tn[i] / den
        first: list[int | None] = [None] * k  # first position with positive weight
        prev: tuple[tuple[int, ...], int] | None = None
        prev_P = 0
        for j in kept:
            P = starts[j]
            if prev is not None:
                pa, pD = prev
                new_den = math.lcm(den, pD)
                up, add = new_den // den, (new_den // pD) * (P - prev_P)
                Tn, den = [t * up + x * add for t, x in zip(Tn, pa, strict=True)], new_den
            a, D = self._normalized[j]
            for i in range(k):
                if first[i] is None and a[i] > 0:
                    first[i] = P
            F = [t // den for t in Tn]
            g = [(t - f * den) * D // den for t, f in zip(Tn, F, strict=True)]
            started_at = [f is not None and f <= P for f in first]
            started_before = [f is not None and f <= P - 1 for f in first]
            if prev is None:
                NB = [0] * k
            else:
                pa, pD = prev  # t_i(P - 1) = Tn/den - pa/pD
                NB = [
                    (t * pD - x * den) // (den * pD) + int(b)
                    for t, x, b in zip(Tn, pa, started_before, strict=True)
                ]
            N_at = [f + int(s) for f, s in zip(F, started_at, strict=True)]
            h = [x - y for x, y in zip(N_at, NB, strict=True)]
            segs.append(
                _Segment(j, P, D, tuple(a), tuple(g), tuple(h), tuple(NB), sum(NB), tuple(Tn), den)
            )
            prev, prev_P = (a, D), P
        self._segs = segs
        self._P = [s.P for s in segs]
        self._Q = [s.Q for s in segs]
        m = len(segs)
        self._Q_np = np.array(self._Q, dtype=np.int64)
        self._P_np = np.array(self._P, dtype=np.int64)
        self._fast = np.array([s.D <= _FAST_D for s in segs])
        # Tables for the vectorized kernels; int64 where a segment is fast, and the same
        # values as Python ints (object) for every segment.
        self._tables: dict[str, dict[str, np.ndarray]] = {}
        obj = {
            "a": np.array([list(s.a) for s in segs], dtype=object).reshape(m, k),
            "g": np.array([list(s.g) for s in segs], dtype=object).reshape(m, k),
            "h": np.array([list(s.h) for s in segs], dtype=np.int64).reshape(m, k),
            "NB": np.array([list(s.NB) for s in segs], dtype=np.int64).reshape(m, k),
            "D": np.array([s.D for s in segs], dtype=object),
            "H": np.array([s.H for s in segs], dtype=np.int64),
        }
        fast = {}
        for field_name, arr in obj.items():
            if arr.dtype == object:
                masked = arr.copy()
                masked[~self._fast] = 1 if field_name == "D" else 0
                fast[field_name] = masked.astype(np.int64)
            else:
                fast[field_name] = arr
        self._tables = {"fast": fast, "object": obj}
        self._GD = np.array([s.G // s.D for s in segs], dtype=np.int64)  # < k
        log.debug(
            "mixture of %d sources, %d segments (%d kept), D max %d",
            k,
            len(self.segments),
            m,
            max(s.D for s in segs),
        )

    # ................................................................. exact, scalar

    @property
    def max_position(self) -> int:
        return MAX_TOKENS // self.seq_len

    def _check_position(self, p: int, field: str = "position") -> int:
        if isinstance(p, bool) or not isinstance(p, (int, np.integer)):
            raise _invalid(field, f"must be an integer, got {p!r}")
        p = int(p)
        if not 0 <= p <= self.max_position:
            raise _invalid(
                field, f"must be in [0, {self.max_position}] (2**62 tokens / seq_len), got {p}"
            )
        return p

    def weights(self, j: int) -> tuple[tuple[str, float], ...]:
        """Segment j's weights as given (not normalized), (name, float) in source order."""
        return tuple(
            (name, float(w)) for name, w in zip(self.names, self._raw_weights[j], strict=True)
        )

    def segment_of(self, p: int) -> int:
        """Index in `segments` of the segment that position p belongs to."""
        p = self._check_position(p)
        return self._segs[bisect_right(self._P, p) - 1].index

    def target(self, p: int) -> tuple[Fraction, ...]:
        """t_i(p): each source's weight summed over positions 0..p-1, exactly."""
        p = self._check_position(p)
        s = self._segs[bisect_right(self._P, p) - 1]
        share = self.segments[s.index][1]
        return tuple(Fraction(t, s.den) + w * (p - s.P) for t, w in zip(s.Tn, share, strict=True))

    def counts(self, p: int) -> tuple[int, ...]:
        """c_i(p): how many of positions 0..p-1 come from each source (exact ints).

        O(k log k + log segments) time, O(k) memory, whatever p is.
        """
        p = self._check_position(p)
        s = self._segs[bisect_right(self._Q, p) - 1]
        r = p - s.Q
        a, g, h, D, k = s.a, s.g, s.h, s.D, self.k

        def M(d: int) -> list[int]:
            if d < 0:
                return [0] * k
            return [h[i] + (g[i] + a[i] * d) // D for i in range(k)]

        lo_u = r - s.H - s.G // D
        lo, hi = max(0, lo_u), max(0, lo_u + k - 1)
        while lo < hi:
            mid = (lo + hi) // 2
            if sum(M(mid)) >= r:
                hi = mid
            else:
                lo = mid + 1
        prev, cur = M(lo - 1), M(lo)
        extra = r - sum(prev)
        out = []
        for i in range(k):
            take = 1 if cur[i] > prev[i] and extra > 0 else 0
            extra -= take
            out.append(s.NB[i] + prev[i] + take)
        return tuple(out)

    # ........................................................... vectorized kernels

    def _params(self, j: int) -> tuple[dict[str, Any], str]:
        """Segment j's parameters as [1, k] arrays and scalars, and the kernel mode:
        "fast" (int64, D <= 2**31) or "anchored" (a large D: floats near an exact
        anchor, fixed up exactly wherever the float is ambiguous)."""
        fast = bool(self._fast[j])
        t = self._tables["fast" if fast else "object"]
        return {
            "a": t["a"][j][None, :],
            "g": t["g"][j][None, :],
            "h": t["h"][j][None, :],
            "NB": t["NB"][j][None, :],
            "D": t["D"][j],
            "GD": int(self._GD[j]),
            "H": int(t["H"][j]),
            "P": int(self._P_np[j]),
            "Q": int(self._Q_np[j]),
            "seg": j,
        }, "fast" if fast else "anchored"

    def _floors(
        self, prm: dict[str, Any], mode: str, d_min: int, d_max: int
    ) -> Callable[[np.ndarray], np.ndarray]:
        """A function d [m] -> floor((g_i + a_i*d) / D) [m, k] int64, exact, for d in
        [d_min, d_max] (0 <= d, relative to the segment start)."""
        a, g, D = prm["a"], prm["g"], prm["D"]
        if mode == "fast":
            # computed as [k, m] (a source's floors contiguous) and returned as its [m, k]
            # view: numpy loops along the last axis, and k is a few sources against m
            # positions (a [m, k] broadcast of [1, k] runs m loops of k: ~3x the time)
            aT, gT = a.T, g.T
            if int(a.max()) * d_max < 1 << 62:  # a*d fits int64 as it is

                def direct_floors(d: np.ndarray) -> np.ndarray:
                    return ((gT + aT * d) // D).T

                return direct_floors

            def reduced_floors(d: np.ndarray) -> np.ndarray:
                q, rho = d // D, d % D  # a*rho < D**2 <= 2**62
                return (aT * q + (gT + aT * rho) // D).T

            return reduced_floors
        s = self._segs[prm["seg"]]
        if d_max - d_min <= _ANCHOR_SPAN:
            # floor((g + a*d) / D) = q0 + floor(r0/D + (a/D)*(d - d_min)), q0 and r0 exact
            Dp = s.D
            q0, r0 = zip(
                *(divmod(gi + ai * d_min, Dp) for ai, gi in zip(s.a, s.g, strict=True)), strict=True
            )
            q0_np = np.array(q0, dtype=np.int64)
            # a = 0: y = 0.5, floor 0, never ambiguous (r0 < D, so the exact floor is 0)
            r0f = np.array([x / Dp if ai else 0.5 for x, ai in zip(r0, s.a, strict=True)])
            wf = np.array([x / Dp for x in s.a])
            tol = (8 + 4 * (d_max - d_min)) * 2.0**-52  # > the float's error bound

            def anchored_floors(d: np.ndarray) -> np.ndarray:
                delta = d - d_min
                y = r0f + wf * delta[:, None]
                out = q0_np + np.floor(y).astype(np.int64)
                amb = np.abs(y - np.rint(y)) <= tol
                if amb.any():  # y within tol of an integer: decide exactly
                    rows, cols = np.nonzero(amb)
                    for rr, cc in zip(rows.tolist(), cols.tolist(), strict=True):
                        out[rr, cc] = q0[cc] + (r0[cc] + s.a[cc] * int(delta[rr])) // Dp
                return out

            return anchored_floors

        def object_floors(d: np.ndarray) -> np.ndarray:
            dd = d.astype(object)
            return ((g + a * dd[:, None]) // D).astype(np.int64)

        return object_floors

    def _check_positions(self, p: np.ndarray, field: str) -> np.ndarray:
        p = np.asarray(p)
        if p.dtype.kind not in "iu":
            raise _invalid(field, f"must be integers, got dtype {p.dtype}")
        p = p.astype(np.int64, copy=False)
        if p.size and (int(p.min()) < 0 or int(p.max()) > self.max_position):
            raise _invalid(field, f"positions must be in [0, {self.max_position}]")
        return p

    def counts_at(self, positions: np.ndarray) -> np.ndarray:
        """c(p) for an array of positions: int64 [len(positions), k]. A few numpy calls
        on [len, k] arrays per segment touched (no dependence on the positions' size)."""
        p = self._check_positions(positions, "positions").reshape(-1)
        if p.size == 0:
            return np.zeros((0, self.k), dtype=np.int64)
        seg = np.searchsorted(self._Q_np, p, side="right") - 1
        return self._counts_by_segment(p, seg)

    def _counts_by_segment(self, p: np.ndarray, seg: np.ndarray) -> np.ndarray:
        """c(p), p[n] computed in segment seg[n] (Q_seg <= p <= Q_{seg+1})."""
        first = int(seg[0])
        if (seg == first).all():
            return self._counts_kernel(p, first)
        out = np.empty((len(p), self.k), dtype=np.int64)
        for j in np.unique(seg).tolist():
            sel = seg == j
            out[sel] = self._counts_kernel(p[sel], j)
        return out

    def _counts_kernel(self, p: np.ndarray, j: int) -> np.ndarray:
        prm, mode = self._params(j)
        k, h, H = self.k, prm["h"], prm["H"]
        r = p - prm["Q"]
        # the smallest d with sum_i M_i(d) >= r lies in [lo_u, lo_u + k - 1]
        lo_u = r - H - prm["GD"]
        lo = np.maximum(lo_u, 0)
        hi = np.maximum(lo_u + (k - 1), lo)
        floors = self._floors(prm, mode, max(0, int(lo.min()) - 1), int(hi.max()))
        for _ in range(max(0, (k - 1).bit_length())):
            mid = (lo + hi) // 2
            ok = H + floors(mid).sum(axis=1) >= r
            hi = np.where(ok, mid, hi)
            lo = np.where(ok, lo, mid + 1)
        d = lo
        cur = h + floors(d)
        prev = np.where((d >= 1)[:, None], h + floors(np.maximum(d - 1, 0)), 0)
        due = cur - prev
        extra = r - prev.sum(axis=1)
        take = (due > 0) & (np.cumsum(due, axis=1) <= extra[:, None])
        return prm["NB"] + prev + take

    def _due(self, prm: dict[str, Any], mode: str, src: np.ndarray, u: np.ndarray) -> np.ndarray:
        """Due point (relative to the segment start) of the item that needs u items from
        the floor term: the least d with floor((g + a*d) / D) >= u; 0 where u <= 0."""
        pos = u > 0
        if not pos.any():
            return np.zeros(len(u), dtype=np.int64)
        a, g, D = prm["a"][0][src], prm["g"][0][src], prm["D"]
        if mode == "fast":
            safe_a = np.where(a > 0, a, 1)
            qa, v = u // safe_a, u % safe_a  # D*v < D**2 <= 2**62
            d = D * qa + (D * v - g + safe_a - 1) // safe_a
            return np.where(pos, d, 0)
        s, k, big = self._segs[prm["seg"]], self.k, np.iinfo(np.int64).max
        # anchor: per source, its smallest u; (D*u0 - g) / a = e0 + f0/a exactly, and
        # d(u) = e0 + ceil(f0/a + (u - u0) * D/a)
        u0 = np.full(k, big, dtype=np.int64)
        np.minimum.at(u0, src[pos], u[pos])
        e0 = np.zeros(k, dtype=np.int64)
        frac0, step = np.zeros(k), np.zeros(k)
        for i in np.flatnonzero(u0 != big).tolist():
            e, f = divmod(s.D * int(u0[i]) - s.g[i], s.a[i])  # a > 0: u > 0 needs it
            e0[i], frac0[i], step[i] = e, f / s.a[i], s.D / s.a[i]
        z = np.where(pos, frac0[src] + (u - np.where(pos, u0[src], 0)) * step[src], 0.0)
        zmax = float(np.abs(z).max())
        if zmax <= _ANCHOR_SPAN:
            d = e0[src] + np.ceil(z).astype(np.int64)
            amb = pos & (np.abs(z - np.rint(z)) <= (8 + 4 * zmax) * 2.0**-52)
            for n in np.flatnonzero(amb).tolist():
                i = int(src[n])
                d[n] = -((s.g[i] - s.D * int(u[n])) // s.a[i])
            return np.where(pos, d, 0)
        uo = u.astype(object)
        safe_a = np.where(a > 0, a, 1)
        return np.where(pos, -((g - D * uo) // safe_a), 0).astype(np.int64)

    def _split_runs(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, ...]:
        """Cut runs [start, stop) at segment boundaries (positions Q_j): each piece's
        items are due in one segment. Returns (starts, stops, segment) of the pieces,
        in run order."""
        seg_a = np.searchsorted(self._Q_np, starts, side="right") - 1
        seg_b = np.searchsorted(self._Q_np, stops - 1, side="right") - 1
        if np.array_equal(seg_a, seg_b):
            return starts, stops, seg_a
        s_out, e_out, g_out = [], [], []
        for a, b, ja, jb in zip(
            starts.tolist(), stops.tolist(), seg_a.tolist(), seg_b.tolist(), strict=True
        ):
            for j in range(ja, jb + 1):
                lo = a if j == ja else self._Q[j]
                hi = b if j == jb else self._Q[j + 1]
                if hi > lo:
                    s_out.append(lo)
                    e_out.append(hi)
                    g_out.append(j)
        return (
            np.array(s_out, dtype=np.int64),
            np.array(e_out, dtype=np.int64),
            np.array(g_out, dtype=np.int64),
        )

    def runs(self, starts: np.ndarray, length: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, start + length) for each start, in due order: (source index,
        item index) int64 arrays of shape [len(starts), length]."""
        starts = self._check_positions(np.asarray(starts).reshape(-1), "starts")
        if isinstance(length, bool) or not isinstance(length, (int, np.integer)) or length < 0:
            raise _invalid("length", f"must be a non-negative integer, got {length!r}")
        R = len(starts)
        if R == 0 or length == 0:
            z = np.zeros((R, int(length)), dtype=np.int64)
            return z, z.copy()
        stops = starts + int(length)
        self._check_positions(stops, "stops")
        src, item = self._pieces(starts, stops)
        return src.reshape(R, int(length)), item.reshape(R, int(length))

    def items(self, start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions [start, stop) in due order: (source index, item index) int64 arrays."""
        start = self._check_position(start, "start")
        stop = self._check_position(stop, "stop")
        if stop < start:
            raise _invalid("stop", f"must be >= start={start}, got {stop}")
        if stop == start:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        return self._pieces(np.array([start], dtype=np.int64), np.array([stop], dtype=np.int64))

    def _pieces(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Concatenated positions of the runs [starts, stops), in due order."""
        starts, stops, seg = self._split_runs(starts, stops)
        first = int(seg[0])
        if (seg == first).all():
            return self._segment_pieces(starts, stops, first)
        lengths = stops - starts
        at = np.cumsum(lengths) - lengths
        src = np.empty(int(lengths.sum()), dtype=np.int64)
        item = np.empty_like(src)
        for j in np.unique(seg).tolist():
            sel = np.flatnonzero(seg == j)
            s, i = self._segment_pieces(starts[sel], stops[sel], j)
            where = np.repeat(at[sel] - (np.cumsum(lengths[sel]) - lengths[sel]), lengths[sel])
            where += np.arange(len(s))
            src[where], item[where] = s, i
        return src, item

    def _segment_pieces(
        self, starts: np.ndarray, stops: np.ndarray, j: int
    ) -> tuple[np.ndarray, np.ndarray]:
        """Runs whose items all fall due in segment j, concatenated, in due order."""
        k, n_pieces = self.k, len(starts)
        c = self._counts_kernel(np.concatenate([starts, stops]), j)
        c_a, c_b = c[:n_pieces], c[n_pieces:]
        cnt = (c_b - c_a).ravel()
        total = int(cnt.sum())
        lengths = stops - starts
        flat_src = np.repeat(np.tile(np.arange(k, dtype=np.int64), n_pieces), cnt)
        first = np.cumsum(cnt) - cnt
        within = np.arange(total, dtype=np.int64) - np.repeat(first, cnt)
        item = np.repeat(c_a.ravel(), cnt) + within
        prm, mode = self._params(j)
        # u: items the floor term must supply (h covers an item due at d = 0)
        u = item - (prm["NB"][0] + prm["h"][0] - 1)[flat_src]
        d = self._due(prm, mode, flat_src, u)
        # order: piece, then due point, then source. Due points of a piece [s, e) lie in
        # [s - k + 1, e - 1], so (x - s + k - 1) is in [0, length + k - 1).
        rel = (prm["P"] + d) - (np.repeat(starts, lengths) - (k - 1))
        span = lengths + (k - 1)
        base = (np.cumsum(span) - span) * k
        key = np.repeat(base, lengths) + rel * k + flat_src
        order = np.argsort(key, kind="stable")
        return flat_src[order], item[order]

    # ........................................................... steps and ranks

    def _check_layout(
        self, rank: int, offset: int, steps: int, batch_size: int, world_size: int, seed: int
    ) -> None:
        for field, value, lo, hi in (
            ("batch_size", batch_size, 1, MAX_PARAM),
            ("world_size", world_size, 1, MAX_PARAM),
            ("seed", seed, 0, MASK64),
            ("steps", steps, 0, MAX_TOKENS),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, np.integer))
                or not lo <= value <= hi
            ):
                raise _invalid(field, f"must be an integer in [{lo}, {hi}], got {value!r}")
        if (
            isinstance(rank, bool)
            or not isinstance(rank, (int, np.integer))
            or not 0 <= rank < world_size
        ):
            raise _invalid("rank", f"must be in [0, world_size={world_size}), got {rank!r}")
        offset = self._check_position(offset, "offset")
        end = offset + steps * batch_size * world_size
        if end > self.max_position:
            raise _invalid("offset", f"the steps run past position {self.max_position}")

    def rank_steps(
        self,
        rank: int,
        offset: int,
        steps: int,
        *,
        batch_size: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = False,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Rank `rank`'s rows of `steps` consecutive steps, the first at position
        `offset`: (source index, item index), int64 arrays of shape [steps, B]."""
        self._check_layout(rank, offset, steps, batch_size, world_size, seed)
        B, gb = int(batch_size), int(batch_size) * int(world_size)
        if steps == 0:
            z = np.zeros((0, B), dtype=np.int64)
            return z, z.copy()
        offs = int(offset) + gb * np.arange(steps, dtype=np.int64)
        if not shuffle:
            return self.runs(offs + rank * B, B)
        # counts at every step boundary: a step's windows from source i are items
        # c_i(o_s) .. c_i(o_{s+1}) - 1, laid out source-major, then permuted
        c = self.counts_at(int(offset) + gb * np.arange(steps + 1, dtype=np.int64))
        per = c[1:] - c[:-1]
        start = np.cumsum(per, axis=1) - per  # [steps, k] slot where source i begins
        rk = round_keys_by_round(step_keys(seed, offs))  # [6, steps]
        if gb > 1 and NATIVE and native_step_rows is not None:  # all of the below, in C
            src = np.empty((steps, B), dtype=np.int64)
            item = np.empty_like(src)
            start, c0 = np.ascontiguousarray(start), np.ascontiguousarray(c[:-1])
            native_step_rows(rk, gb, rank * B, start, c0, src, item)
            return src, item
        slots = np.tile(rank * B + np.arange(B, dtype=np.int64), steps)
        bits = domain_bits(gb)
        if gb == 1:
            v = np.zeros((steps, B), np.int64)
        elif gb == 1 << bits and not NATIVE:  # numpy: one key per step, broadcast over slots
            v = encrypt(slots.reshape(steps, B).astype(np.uint64), rk.T[:, None, :], bits)
            v = v.astype(np.int64)
        else:  # (in C, a power-of-two domain too: no value walks, the same bijection)
            v = permute(slots, gb, np.repeat(rk, B, axis=1).T, bits).reshape(steps, B)
        # slot v of step s holds source i = the last i with start[s, i] <= v (starts do
        # not decrease along i): a count of the starts at or below v for a few sources,
        # a search in all steps' starts laid end to end for many
        k = self.k
        if k <= _COUNT_SOURCES:
            src = np.zeros((steps, B), dtype=np.int64)
            for i in range(1, k):
                src += v >= start[:, i : i + 1]
            at = (src + (k * np.arange(steps, dtype=np.int64))[:, None]).ravel()
            item = c[:-1].ravel()[at] + (v.ravel() - start.ravel()[at])
            return src, item.reshape(steps, B)
        row = (gb * np.arange(steps, dtype=np.int64))[:, None]
        gstart = (start + row).ravel()
        gv = (v + row).ravel()
        idx = np.searchsorted(gstart, gv, side="right") - 1
        src = idx % k
        item = c[:-1].ravel()[idx] + (gv - gstart[idx])
        return src.reshape(steps, B), item.reshape(steps, B)

    def rounds(
        self,
        rank: int,
        offset: int = 0,
        step: int = 0,
        *,
        batch_size: int,
        world_size: int,
        seed: int = 0,
        shuffle: bool = False,
        max_steps: int | None = None,
    ) -> Iterator[MixtureRound]:
        """`rank`'s batches from `offset` on, in rounds of consecutive steps (like the
        single-dataset Plan.rounds: a round starts at one step and doubles up to 4096
        positions of this rank). Endless unless `max_steps` is given."""
        B, gb = int(batch_size), int(batch_size) * int(world_size)
        self._check_layout(rank, offset, 0, batch_size, world_size, seed)
        max_round = max(1, _POSITIONS_PER_ROUND // B)
        n, o, done = 1, int(offset), 0
        while max_steps is None or done < max_steps:
            n = min(n, max_round)
            if max_steps is not None:
                n = min(n, max_steps - done)
            src, item = self.rank_steps(
                rank, o, n, batch_size=B, world_size=world_size, seed=seed, shuffle=shuffle
            )
            yield MixtureRound(step, (o + gb * np.arange(n, dtype=np.int64)).tolist(), src, item)
            step += n
            done += n
            o += n * gb
            n *= 2

    # ..................................................................... the plan

    def budget(self, tokens: int, windows: Mapping[str, int] | Sequence[int]) -> Budget:
        """The plan of a run of `tokens` tokens (tokens // seq_len windows), given each
        source's train windows (a mapping name -> windows, or a list in source order)."""
        if (
            isinstance(tokens, (float, np.floating))
            and math.isfinite(tokens)
            and tokens == int(tokens)
        ):
            tokens = int(tokens)
        if (
            isinstance(tokens, bool)
            or not isinstance(tokens, (int, np.integer))
            or not 0 <= tokens <= MAX_TOKENS
        ):
            raise _invalid("tokens", f"must be an integer in [0, 2**62], got {tokens!r}")
        if isinstance(windows, Mapping):
            unknown = [x for x in windows if x not in self.names]
            if unknown:
                raise _invalid("windows", f"not sources of the mixture: {unknown}")
            missing = [x for x in self.names if x not in windows]
            if missing:
                raise _invalid("windows", f"missing sources {missing}")
            counts = [windows[x] for x in self.names]
        else:
            counts = list(windows)
            if len(counts) != self.k:
                raise _invalid("windows", f"expected {self.k} counts, got {len(counts)}")
        for name, w in zip(self.names, counts, strict=True):
            if isinstance(w, bool) or not isinstance(w, (int, np.integer)) or w < 1:
                raise _unsatisfiable(
                    f"sources[{name!r}]", f"source {name!r} has no train window ({w!r})"
                )
        positions = int(tokens) // self.seq_len
        drawn = self.counts(positions)
        spans = tuple(
            (tok, self.segments[j + 1][0] if j + 1 < len(self.segments) else None)
            for j, (tok, _) in enumerate(self.segments)
        )
        out = tuple(
            SourceBudget(
                name,
                int(w),
                c,
                c * self.seq_len,
                Fraction(c, int(w)),
                tuple(seg[1][i] for seg in self.segments),
            )
            for i, (name, w, c) in enumerate(zip(self.names, counts, drawn, strict=True))
        )
        return Budget(int(tokens), positions, self.seq_len, spans, out)
