"""The argument checks every settings value uses: TypeError for a wrong type, ValueError
for a value out of range, each naming the argument."""

from __future__ import annotations

import math
from typing import Any, TypeVar

T = TypeVar("T")


def check_type(name: str, value: Any, types: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, types):
        raise TypeError(f"{name} must be {what}, got {value!r}")


def check_int(name: str, value: Any, lo: int, hi: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = "an integer or None" if none_ok else "an integer"
        raise TypeError(f"{name} must be {allowed}, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {value}")


def check_seconds(name: str, value: Any) -> None:
    """A positive, finite number of seconds (not a bool)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


def instance_or_default(name: str, value: T | None, cls: type[T]) -> T:
    """`value`, or `cls()` for None; TypeError naming `name` for anything else."""
    if value is None:
        return cls()
    check_type(name, value, cls, f"a {cls.__name__}")
    return value
