"""SamplingSpec: the one spelling of a sampling request, validated in one place.

Every part speaks it: FeederClient builds one from its arguments, the server from the
wire (`from_proto`), `tokenfeed info` and `tokenfeed bench` from the command line
(`add_arguments` / `from_args`), the benchmarks directly. One set of defaults holds
everywhere, the wire included (a field left unset means the same default, and the
.proto says so):

    split "train", split_rate 1.0, stride = seq_len, shift 1, seed 0,
    shuffle off, shuffle_blocks 8, world_size 1

`split_rate` is the decimal the user wrote: the train split is T[0 : floor(N * d)]
where d is the shortest decimal that round-trips to the float (0.7 means 7/10
exactly), so 10^6 tokens at 0.7 give 700,000 train tokens in every language.

A mixture is the same type with `sources` (name, weight pairs, in order) instead of
`dataset`, and optionally a `schedule` of (from_tokens, weights) segments
(docs/mixtures.md; the math is the mixture package). It streams the sources' train
splits only. Mixture errors name the field: ``sources['web']``,
``schedule[1].from_tokens``. docs/request.md is the contract: fields, defaults on the
wire, validation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from fractions import Fraction
from typing import Any

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_PARAM, MAX_REQUEST_BYTES, MAX_SEED, REQUEST_FIELDS_BYTES
from tokenfeed.core.mixture import Mixture, RuntimeSegments
from tokenfeed.core.mixture.files import load_mixture
from tokenfeed.core.mixture.spec import shortest_decimal
from tokenfeed.v1 import feeder_pb2 as pb

SPLITS = ("train", "validation")
DEFAULT_SHUFFLE_BLOCKS = 8
AUTO = "auto"


def proper_divisors(n: int) -> list[int]:
    """Divisors d of n with 1 < d < n, ascending (the shifts `auto` draws from)."""
    small = [d for d in range(2, math.isqrt(n) + 1) if n % d == 0]
    large = [n // d for d in reversed(small) if n // d != d]
    return small + large


def parse_shift(value: int | str) -> int | str:
    """A shift as given (an int, "3", "auto") -> int or "auto"; InvalidArgument otherwise."""
    if value == AUTO:
        return AUTO
    if isinstance(value, bool):
        raise InvalidArgument(f"shift must be a positive integer or 'auto', got {value!r}")
    try:
        return int(value)
    except (TypeError, ValueError):
        raise InvalidArgument(
            f"shift must be a positive integer or 'auto', got {value!r}"
        ) from None


# Built mixtures by their exact request, the latest few of each (sources, schedule,
# seq_len) with their own run-time segments: a stream open builds one (~35 ms at 16
# sources x 100 segments), and one more run-time segment extends the one built for the
# request before (Mixture.with_runtime) instead of starting over.
_MIXTURES: dict[Any, list[Mixture]] = {}
_MIXTURES_LOCK = threading.Lock()
_KEYS, _PER_KEY = 64, 8


def _plain(weights: Any) -> bool:
    """Whether `weights` is a tuple of (str, float) pairs (a float, not 1 == 1.0 == True:
    a bool must still be refused); checked a column at a time (1,000 sources x 100)."""
    if not isinstance(weights, tuple) or not set(map(type, weights)) <= {tuple}:
        return False
    if not weights:
        return True
    if set(map(len, weights)) != {2}:
        return False
    names, values = zip(*weights, strict=True)
    return set(map(type, values)) == {float} and set(map(type, names)) == {str}


def _mixture(sources: Any, schedule: Any, runtime: bytes, seq_len: int) -> Mixture:
    """Mixture(sources, schedule, seq_len, runtime), remembered under the wire's plain
    form of its request (tuples of (name, float)), which is how a SamplingSpec holds it
    once checked: a request in another spelling is built, then remembered so."""
    plain = _plain(sources) and all(
        isinstance(seg, tuple) and len(seg) == 2 and type(seg[0]) is int and _plain(seg[1])
        for seg in (schedule if isinstance(schedule, tuple) else [None])
    )
    if not plain:
        mix = Mixture(sources, schedule, seq_len=seq_len, runtime=runtime)
        sources = mix.weights(0)
        schedule = tuple((s.from_tokens, mix.weights(j)) for j, s in enumerate(mix.declared) if j)
        _remember((sources, schedule, seq_len), mix)
        return mix
    cache_key = (sources, schedule, seq_len)
    with _MIXTURES_LOCK:
        built = list(_MIXTURES.get(cache_key, ()))
    for mix in reversed(built):
        if mix.runtime.data == runtime:
            return mix
    if built:  # extend the one that shares the most run-time segments with this request:
        # usually the longest whose segments all begin it (one more change since)
        rt = RuntimeSegments(len(sources), runtime)
        longest = sorted(built, key=lambda m: len(m.runtime.data), reverse=True)
        parent = next((m for m in longest if runtime.startswith(m.runtime.data)), None)
        if parent is None:
            parent = max(reversed(built), key=lambda m: m.runtime.common_prefix(rt))
        mix = parent.with_runtime(rt)
    else:
        mix = Mixture(sources, schedule, seq_len=seq_len, runtime=runtime)
    _remember(cache_key, mix)
    return mix


# Specs of large mixture requests (this many weights or more: sources x segments) by
# the digest of their params (from_proto).
_PARSED: dict[bytes, SamplingSpec] = {}
_PARSED_LOCK = threading.Lock()
_PARSED_KEYS, _PARSED_MIN_WEIGHTS = 8, 1 << 12


def _remember(cache_key: Any, mix: Mixture) -> None:
    with _MIXTURES_LOCK:
        if cache_key not in _MIXTURES and len(_MIXTURES) >= _KEYS:
            _MIXTURES.clear()
        kept = _MIXTURES.setdefault(cache_key, [])
        kept.append(mix)
        del kept[:-_PER_KEY]


Weights = tuple[tuple[str, float], ...]
Schedule = tuple[tuple[int, Weights], ...]


def _int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{name} must be an integer, got {value!r}")
    if not lo <= value <= hi:
        raise InvalidArgument(f"{name} must be in [{lo}, {hi}], got {value}")
    return value


@dataclass(frozen=True)
class SamplingSpec:
    """What defines a stream's order; identical on every rank of a job.

    `stride` and `shuffle_blocks` 0 (or None) take their defaults (seq_len, 8), as on
    the wire, and are stored resolved, so two specs that mean the same compare equal.
    Invalid values raise InvalidArgument naming the field; what depends on the data (a
    split too short) is the sampler's.
    """

    dataset: str
    seq_len: int
    batch_size: int
    split: str = "train"
    split_rate: float = 1.0
    stride: int = 0  # 0 (or None) = seq_len
    shift: int | str = 1
    seed: int = 0
    shuffle: bool = False
    shuffle_blocks: int = 0  # 0 (or None) = DEFAULT_SHUFFLE_BLOCKS
    world_size: int = 1
    # A mixture: (name, weight) pairs in order (a dict is accepted), dataset "" then.
    sources: Weights = ()
    # Later weights: (from_tokens, weights) or {"from_tokens": N, "weights": {...}}.
    schedule: Schedule = ()
    # Segments added while the run streams, merged with the schedule: RuntimeSegments'
    # bytes (docs/mixtures.md, "Run-time weights"; the wire's runtime_segments).
    runtime: bytes = field(default=b"", repr=False)
    _mixture: Mixture | None = field(default=None, init=False, compare=False, repr=False)
    _proto: bytes | None = field(default=None, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.sources or self.schedule or self.runtime:
            self._check_mixture()
        elif not isinstance(self.dataset, str) or not self.dataset:
            raise InvalidArgument(
                "dataset must be a non-empty name (Info lists the datasets), or give a "
                "mixture (sources)",
                field="dataset",
            )
        if self.split not in SPLITS:
            raise InvalidArgument(f"split must be one of {SPLITS}, got {self.split!r}")
        rate = self.split_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise InvalidArgument(f"split_rate must be a number in [0, 1], got {rate!r}")
        object.__setattr__(self, "split_rate", float(rate))
        _int("seq_len", self.seq_len, 1, MAX_PARAM)
        _int("batch_size", self.batch_size, 1, MAX_PARAM)
        _int("world_size", self.world_size, 1, MAX_PARAM)
        stride = self.stride or self.seq_len
        object.__setattr__(self, "stride", _int("stride", stride, 1, MAX_PARAM))
        blocks = self.shuffle_blocks or DEFAULT_SHUFFLE_BLOCKS
        object.__setattr__(self, "shuffle_blocks", _int("shuffle_blocks", blocks, 1, MAX_PARAM))
        _int("seed", self.seed, 0, MAX_SEED)
        if not isinstance(self.shuffle, bool):
            raise InvalidArgument(f"shuffle must be True or False, got {self.shuffle!r}")
        shift = parse_shift(self.shift)
        object.__setattr__(self, "shift", shift)
        if shift == AUTO:
            if not proper_divisors(self.seq_len):
                raise InvalidArgument(
                    f"shift='auto' draws from the proper divisors of seq_len, and "
                    f"seq_len={self.seq_len} has none; use a composite seq_len or a fixed shift"
                )
        elif not isinstance(shift, int) or not 1 <= shift <= self.seq_len or self.seq_len % shift:
            raise InvalidArgument(
                f"shift={shift} must divide seq_len={self.seq_len} (the grouped "
                f"[seq_len//shift, shift] layout needs it); try one of "
                f"{[1, *proper_divisors(self.seq_len)][:8]}"
            )

    def _check_mixture(self) -> None:
        """Normalize and validate the mixture fields (errors name the field)."""
        if not self.sources:
            what = "schedule" if self.schedule else "runtime_segments"
            raise InvalidArgument(f"{what}: a {what} needs a mixture (sources)", field=what)
        if self.dataset:
            raise InvalidArgument(
                f"dataset: dataset ({self.dataset!r}) and a mixture (sources) are mutually "
                "exclusive; name the dataset among the sources instead",
                field="dataset",
            )
        if self.split != "train":
            raise InvalidArgument(
                f"split: a mixture streams its sources' train splits, got split={self.split!r}; "
                "stream one dataset's validation split instead (validation is per source)",
                field="split",
            )
        seq_len = self.seq_len
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
            _int("seq_len", seq_len, 1, MAX_PARAM)
        if not isinstance(self.runtime, bytes):
            raise InvalidArgument(
                f"runtime_segments: must be bytes, got {type(self.runtime).__name__}",
                field="runtime_segments",
            )
        mix = _mixture(self.sources, self.schedule, self.runtime, min(seq_len, MAX_PARAM))
        object.__setattr__(self, "dataset", "")
        object.__setattr__(self, "sources", mix.weights(0))
        object.__setattr__(
            self,
            "schedule",
            tuple((s.from_tokens, mix.weights(j)) for j, s in enumerate(mix.declared) if j),
        )
        object.__setattr__(self, "_mixture", mix)

    # ------------------------------------------------------------ derived values

    @property
    def is_mixture(self) -> bool:
        return bool(self.sources)

    @property
    def mixture(self) -> Mixture:
        """The mixture's math (Mixture), built once; InvalidArgument when the
        spec names a dataset."""
        if self._mixture is None:
            raise InvalidArgument("not a mixture: the request names a dataset", field="sources")
        return self._mixture

    @property
    def source_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.sources)

    @property
    def split_fraction(self) -> Fraction:
        return shortest_decimal(float(self.split_rate))

    @property
    def divisors(self) -> list[int]:
        return proper_divisors(self.seq_len)

    @property
    def max_shift(self) -> int:
        """The largest shift any step can use; windows leave room for it."""
        return self.divisors[-1] if self.shift == AUTO else int(self.shift)

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world_size

    def with_(self, **changes: Any) -> SamplingSpec:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)

    def fingerprint(self) -> str:
        """Hash of what defines the order. World size and batch size are left out:
        the order does not depend on them, so a resume may change them. A mixture's
        schedule is left out too (a resume may extend it: `resume_problem` checks it);
        its sources and their base weights are in; run-time segments are not."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.init}
        del doc["world_size"], doc["batch_size"], doc["schedule"], doc["runtime"]
        if not self.sources:
            del doc["sources"]  # single-dataset fingerprints are what they were
        else:
            doc["sources"] = [[n, repr(w)] for n, w in self.sources]
        blob = json.dumps(doc, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def mixture_state(self) -> dict[str, Any]:
        """The mixture as plain JSON (saved in a client's state dict): the declared
        sources and schedule, and the run-time segments (RuntimeSegments.to_state)."""
        return {
            "sources": [[n, w] for n, w in self.sources],
            "schedule": [[tok, [[n, w] for n, w in ws]] for tok, ws in self.schedule],
            "runtime": self.mixture.runtime.to_state(),
        }

    def resume_problem(self, saved: Mapping[str, Any], offset: int) -> str | None:
        """Why a checkpoint of the mixture `saved` (mixture_state()) taken at position
        `offset` cannot continue under this spec, or None if it can.

        Allowed: the same sources in the same order with the same base weights, and
        every saved segment still there, unchanged; new segments must start at or after
        the checkpoint (from_tokens >= offset * seq_len), so nothing before it moves."""
        old = SamplingSpec(
            dataset="",
            seq_len=self.seq_len,
            batch_size=1,
            sources=tuple((str(n), float(w)) for n, w in saved.get("sources", ())),
            schedule=tuple(
                (int(t), tuple((str(n), float(w)) for n, w in ws))
                for t, ws in saved.get("schedule", ())
            ),
        )
        if old.source_names != self.source_names:
            return (
                f"sources differ: the checkpoint has {list(old.source_names)}, this loader "
                f"{list(self.source_names)} (names and order must match)"
            )
        if old.sources != self.sources:
            diff = {n: (a, b) for (n, a), (_, b) in zip(old.sources, self.sources, strict=True)}
            changed = {n: f"{a} -> {b}" for n, (a, b) in diff.items() if a != b}
            return f"sources' weights differ from the checkpoint's: {changed}"
        now = dict(self.schedule)
        for j, (tok, ws) in enumerate(old.schedule):
            if tok not in now:
                return (
                    f"schedule[{j}] (from_tokens {tok}) of the checkpoint is missing; a resume "
                    "may only add segments"
                )
            if now[tok] != ws:
                return (
                    f"schedule segment from_tokens {tok} changed its weights "
                    f"({dict(ws)} -> {dict(now[tok])}); a resume may only add segments"
                )
        position_tokens = offset * self.seq_len
        known = {tok for tok, _ in old.schedule}
        for j, (tok, _) in enumerate(self.schedule):
            if tok not in known and tok < position_tokens:
                return (
                    f"schedule[{j}].from_tokens {tok} starts before the checkpoint's position "
                    f"({offset} windows = {position_tokens} tokens); segments added on resume "
                    "must start at or after it"
                )
        return None

    # ---------------------------------------------------------------------- wire

    def to_proto(self) -> pb.SamplingParams:
        """The wire's SamplingParams, a new message each call. A mixture's is built once
        and kept as bytes: 100,000 weights cost ~0.1 s to add one by one, ~5 ms to parse
        back (the client sends it with every Info and stream)."""
        if not self.sources:
            return self._build_proto()
        if self._proto is None:
            object.__setattr__(self, "_proto", self._build_proto().SerializeToString())
        assert self._proto is not None
        return pb.SamplingParams.FromString(self._proto)

    def _build_proto(self) -> pb.SamplingParams:
        p = pb.SamplingParams(
            dataset=self.dataset,
            split=self.split,
            split_rate=self.split_rate,
            seq_len=self.seq_len,
            stride=self.stride,
            batch_size=self.batch_size,
            seed=self.seed,
            shuffle=self.shuffle,
            shuffle_blocks=self.shuffle_blocks,
            world_size=self.world_size,
        )
        if self.shift == AUTO:
            p.auto_shift = True
        else:
            p.shift = int(self.shift)
        for name, weight in self.sources:
            p.sources.add(name=name, weight=weight)
        for tok, weights in self.schedule:
            seg = p.schedule.add(from_tokens=tok)
            for name, weight in weights:
                seg.weights.add(name=name, weight=weight)
        if self.runtime:
            p.runtime_segments = self.runtime
        return p

    def check_size(self) -> None:
        """InvalidArgument unless a request carrying these params fits MAX_REQUEST_BYTES
        on the wire, the feeder's receive limit (what the client checks before it
        sends: a request over the limit would be refused, never served)."""
        size = self.to_proto().ByteSize() + REQUEST_FIELDS_BYTES
        if size > MAX_REQUEST_BYTES:
            raise InvalidArgument.at(
                "schedule" if self.schedule else "sources",
                f"the request would be {size:,} bytes on the wire ({len(self.sources)} "
                f"sources, {len(self.schedule)} schedule segments), over the "
                f"{MAX_REQUEST_BYTES:,} bytes a feeder accepts; use fewer segments or "
                'sources (docs/request.md, "Request size")',
            )

    @classmethod
    def from_proto(
        cls, p: pb.SamplingParams, *, wire: bytes | memoryview | None = None, **overrides: Any
    ) -> SamplingSpec:
        """The spec a wire request means; unset fields take the defaults above.
        `overrides` replace fields (Info names the dataset outside the params).

        A large mixture's spec is remembered under a digest of its params' bytes: every
        rank of a job opens its streams with the same params, and turning 1,000 sources
        x 100 segments into a checked spec costs ~0.2 s of CPU. `wire`: `p`'s bytes as
        they were received, which `p` parses from (the feeder's request deserializer
        keeps them): the digest is taken of them (~3 ms for 2 MB), else of a
        serialization of `p` (~10 ms more). Either way the key is a function of the
        bytes, and bytes parse to one spec only. "Large" is counted in weights, not in
        bytes. Run-time segments do not count towards "large": they are cheap to read,
        and a request with one more than the last is new at every weight change."""
        if overrides or len(p.sources) == 0:
            return cls._from_proto(p, **overrides)
        if len(p.sources) * (1 + len(p.schedule)) < _PARSED_MIN_WEIGHTS:
            return cls._from_proto(p)
        data = p.SerializeToString(deterministic=True) if wire is None else wire
        key = hashlib.blake2b(data, digest_size=32).digest()
        with _PARSED_LOCK:
            spec = _PARSED.get(key)
        if spec is None:
            spec = cls._from_proto(p)
            with _PARSED_LOCK:
                if len(_PARSED) >= _PARSED_KEYS:
                    _PARSED.clear()
                _PARSED[key] = spec
        return spec

    @classmethod
    def _from_proto(cls, p: pb.SamplingParams, **overrides: Any) -> SamplingSpec:
        mode = p.WhichOneof("shift_mode")
        shift: int | str = 1
        if mode == "shift":
            shift = int(p.shift)
        elif mode == "auto_shift" and p.auto_shift:
            shift = AUTO
        fields: dict[str, Any] = dict(
            dataset=p.dataset,
            seq_len=int(p.seq_len),
            batch_size=int(p.batch_size),
            split=p.split or "train",
            split_rate=p.split_rate if p.HasField("split_rate") else 1.0,
            stride=int(p.stride),
            shift=shift,
            seed=int(p.seed),
            shuffle=bool(p.shuffle),
            shuffle_blocks=int(p.shuffle_blocks),
            world_size=int(p.world_size) or 1,
        )
        runtime = p.runtime_segments  # read once: each read copies the bytes
        if len(p.sources) or len(p.schedule) or runtime:
            fields["sources"] = tuple((s.name, s.weight) for s in p.sources)
            fields["schedule"] = tuple(
                (int(seg.from_tokens), tuple((w.name, w.weight) for w in seg.weights))
                for seg in p.schedule
            )
            fields["runtime"] = runtime
        return cls(**(fields | overrides))

    # ----------------------------------------------------------- command line

    @staticmethod
    def add_arguments(
        parser: argparse.ArgumentParser,
        *,
        dataset: bool = True,
        mixture: bool = True,
        seq_len_default: int | None = 1024,
        batch_size_default: int | None = 16,
    ) -> None:
        """The spec's flags (--seq-len, --stride, ...) with the defaults above."""
        a = parser.add_argument
        if dataset:
            a("--dataset", default="demo", help="dataset name on the feeder (default %(default)s)")
        if mixture:
            a(
                "--mixture",
                default=None,
                metavar="NAME=W,...|FILE",
                help="a mixture instead of one dataset: web=0.7,code=0.3, or a YAML/JSON file "
                "{sources: {...}, schedule: [{from_tokens: N, weights: {...}}]}",
            )
            a(
                "--schedule",
                default=None,
                metavar="FILE",
                help="a YAML/JSON file of the mixture's schedule: a list of "
                "{from_tokens, weights} (or a file with a `schedule:` key)",
            )
        a("--split", default="train", choices=SPLITS)
        a(
            "--split-rate",
            type=float,
            default=1.0,
            help="fraction of tokens in the train split, read as a decimal (default 1.0)",
        )
        a(
            "--seq-len",
            type=int,
            default=seq_len_default,
            help="tokens per window" + (" (default %(default)s)" if seq_len_default else ""),
        )
        a("--stride", type=int, default=0, help="window stride (default: seq-len)")
        a(
            "--batch-size",
            type=int,
            default=batch_size_default,
            help="windows per rank per step"
            + (" (default %(default)s)" if batch_size_default else ""),
        )
        a("--shift", default="1", help="label shift: an integer or 'auto' (default 1)")
        a("--seed", type=int, default=0)
        a("--shuffle", action=argparse.BooleanOptionalAction, default=False)
        a(
            "--shuffle-blocks",
            type=int,
            default=0,
            help=f"blocks mixed per shuffle group (default {DEFAULT_SHUFFLE_BLOCKS})",
        )
        a("--world-size", type=int, default=1, help="ranks of the job (default 1)")

    @classmethod
    def from_args(cls, args: argparse.Namespace, **overrides: Any) -> SamplingSpec:
        fields: dict[str, Any] = dict(
            dataset=getattr(args, "dataset", None) or "-",
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            split=args.split,
            split_rate=args.split_rate,
            stride=args.stride,
            shift=args.shift,
            seed=args.seed,
            shuffle=args.shuffle,
            shuffle_blocks=args.shuffle_blocks,
            world_size=args.world_size,
        )
        if getattr(args, "mixture", None) or getattr(args, "schedule", None):
            sources, schedule = load_mixture(getattr(args, "mixture", None), args.schedule)
            fields.update(dataset="", sources=sources, schedule=schedule)
        return cls(**(fields | overrides))
