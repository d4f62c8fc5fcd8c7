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
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from dataclasses import asdict, dataclass, replace
from fractions import Fraction
from typing import Any

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.v1 import feeder_pb2 as pb

SPLITS = ("train", "validation")
DEFAULT_SHUFFLE_BLOCKS = 8
AUTO = "auto"
MAX_PARAM = 1 << 40  # keeps every product of the sampling math inside int64
MAX_SEED = (1 << 64) - 1


def decimal_fraction(value: float) -> Fraction:
    """The shortest decimal that round-trips to `value`, exactly: 0.7 -> 7/10."""
    return Fraction(repr(float(value)))


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
    split too short) is the Plan's.
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

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset:
            raise InvalidArgument("dataset must be a non-empty name (Info lists the datasets)")
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

    # ------------------------------------------------------------ derived values

    @property
    def split_fraction(self) -> Fraction:
        return decimal_fraction(self.split_rate)

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
        the order does not depend on them, so a resume may change them."""
        doc = asdict(self)
        del doc["world_size"], doc["batch_size"]
        blob = json.dumps(doc, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---------------------------------------------------------------------- wire

    def to_proto(self) -> pb.SamplingParams:
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
        return p

    @classmethod
    def from_proto(cls, p: pb.SamplingParams, **overrides: Any) -> SamplingSpec:
        """The spec a wire request means; unset fields take the defaults above.
        `overrides` replace fields (Info names the dataset outside the params)."""
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
        return cls(**(fields | overrides))

    # ----------------------------------------------------------- command line

    @staticmethod
    def add_arguments(
        parser: argparse.ArgumentParser,
        *,
        dataset: bool = True,
        seq_len_default: int | None = 1024,
        batch_size_default: int | None = 16,
    ) -> None:
        """The spec's flags (--seq-len, --stride, ...) with the defaults above."""
        a = parser.add_argument
        if dataset:
            a("--dataset", default="demo", help="dataset name on the feeder (default %(default)s)")
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
        fields = dict(
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
        return cls(**(fields | overrides))
