"""`Prefix`: the first n items of an append-only list, shared by the versions of a
structure that grows at its end (a mixture's segments as run-time changes arrive).

Extending the newest version appends to the shared list in place, costing what is
appended, not what is kept: a run that adds its 10,000th weight change does not copy the
9,999 before it. Every older version still sees its own first n items, which never
change. Extending an older version (whose list has since grown past it) copies its
items first. Pure; safe to share between threads (appends hold a lock, and readers only
read items that no append touches).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, Generic, TypeVar, overload

import numpy as np

T = TypeVar("T")


class _Shared:
    """The list behind every Prefix of one line of versions, and for a Prefix of ints
    the same values as an int64 array (capacity doubling, for numpy searches)."""

    __slots__ = ("array", "items", "lock")

    def __init__(self, items: list[Any], ints: bool) -> None:
        self.items = items
        self.array = np.array(items, dtype=np.int64) if ints else None
        self.lock = threading.Lock()

    def append(self, new: list[Any]) -> None:
        start = len(self.items)
        self.items.extend(new)
        if self.array is None or not new:
            return
        end = start + len(new)
        if end > len(self.array):  # a new array: older views keep the old one
            grown = np.empty(max(end, 2 * len(self.array)), dtype=np.int64)
            grown[:start] = self.array[:start]
            self.array = grown
        self.array[start:end] = new


class Prefix(Sequence[T], Generic[T]):
    """A read-only sequence: the first `len(self)` items of a shared append-only list.

    `ints=True` keeps an int64 array of the items as well (`array`).
    """

    __slots__ = ("_n", "_shared")

    def __init__(self, items: Iterable[T] = (), *, ints: bool = False) -> None:
        self._shared = _Shared(list(items), ints)
        self._n = len(self._shared.items)

    @classmethod
    def _view(cls, shared: _Shared, n: int) -> Prefix[T]:
        view = cls.__new__(cls)
        view._shared, view._n = shared, n
        return view

    def grown(self, keep: int, new: Iterable[T]) -> Prefix[T]:
        """Items [0, keep) of this prefix followed by `new`: in place when nothing
        follows them in the shared list yet, else a copy."""
        if not 0 <= keep <= self._n:
            raise IndexError(f"keep={keep} is not in [0, {self._n}]")
        new = list(new)
        shared = self._shared
        with shared.lock:
            if len(shared.items) == keep:
                shared.append(new)
                return Prefix._view(shared, keep + len(new))
        return Prefix(shared.items[:keep] + new, ints=shared.array is not None)

    @property
    def array(self) -> np.ndarray:
        """The items as int64 (a Prefix made with ints=True)."""
        if self._shared.array is None:
            raise TypeError("a Prefix made without ints=True has no array")
        return self._shared.array[: self._n]

    def bisect_left(self, x: Any) -> int:
        return bisect.bisect_left(self._shared.items, x, 0, self._n)

    def bisect_right(self, x: Any) -> int:
        return bisect.bisect_right(self._shared.items, x, 0, self._n)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> T: ...
    @overload
    def __getitem__(self, i: slice) -> list[T]: ...
    def __getitem__(self, i: int | slice) -> T | list[T]:
        items = self._shared.items
        if isinstance(i, slice):
            r = range(self._n)[i]
            if r.step == 1:
                return items[r.start : r.stop]
            return [items[j] for j in r]
        n = self._n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("Prefix index out of range")
        return items[i]

    def __iter__(self) -> Iterator[T]:
        return islice(self._shared.items, self._n)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (Prefix, list, tuple)):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to a list, so not hashable

    def __repr__(self) -> str:
        return f"Prefix({list(self)!r})"
