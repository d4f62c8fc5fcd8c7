"""The bounded FIFO between the reader thread and the training loop, cheap for the loop.

`queue.Queue.get()` wakes the producer blocked on a full queue every time: a futex
wake that costs several times everything else in `next()` right after a training
step's sleep (benchmarks/trainer_loop.py). That wake was most of the data-stall
fraction at short steps, although the ring was full.

So here the loop wakes the reader rarely: a reader that finds the ring full says so
and waits for room on an Event, and the loop sets that Event only once it has taken
the ring down to half (or found it empty), so the reader refills half a ring per
wake-up, well within the steps the other half lasts. A reader waiting for room uses
no CPU at all (a client whose trainer is busy elsewhere: 64 such clients in one
process cost nothing; polling every 2 ms cost them half a core). The reader does
wake a waiting loop at once (a token on a SimpleQueue), so an empty ring is
refilled with no delay.

Same subset of the `queue.Queue` interface the client uses: put(item, timeout),
get(timeout), get_nowait(), qsize(), empty(); `queue.Full` / `queue.Empty` as there.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from typing import Any


class Handoff:
    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._low = maxsize // 2  # the loop wakes a reader waiting for room at this many
        self._items: deque[Any] = deque()
        # The loop waiting for an item says so in `_waiting`, then blocks on `_wake`
        # (a C-level SimpleQueue: a token wakes it). A reader that appends while the
        # flag is up puts a token; with the flag down it does no system call and takes
        # no lock. Order makes it safe: the loop raises the flag, THEN looks at the
        # items once more before it blocks; the reader appends, THEN reads the flag.
        self._waiting = False
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        # The same the other way: a reader waiting for room clears `_room`, raises
        # `_full`, THEN looks at the items once more before it blocks on `_room`; the
        # loop takes an item, THEN reads the flag (and sets `_room` at the low mark).
        self._full = False
        self._room = threading.Event()

    def put(self, item: Any, timeout: float) -> None:
        """Append `item`, waiting up to `timeout` s for room (queue.Full after that)."""
        items = self._items
        if len(items) >= self.maxsize:
            deadline = time.monotonic() + timeout
            while len(items) >= self.maxsize:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise queue.Full
                self._room.clear()
                self._full = True
                try:
                    if len(items) >= self.maxsize:  # room made before the flag went up
                        self._room.wait(left)
                finally:
                    self._full = False
        items.append(item)
        if self._waiting:
            self._wake.put(None)

    def _taken(self) -> None:
        """An item was taken: wake a reader waiting for room once the ring is low."""
        if self._full and len(self._items) <= self._low:
            self._room.set()

    def get_nowait(self) -> Any:
        try:
            item = self._items.popleft()  # atomic in CPython: no lock on the fast path
        except IndexError:
            raise queue.Empty from None
        self._taken()
        return item

    def get(self, timeout: float) -> Any:
        """The next item, waiting up to `timeout` s for one (queue.Empty after that)."""
        items = self._items
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = items.popleft()
            except IndexError:
                pass
            else:
                self._taken()
                return item
            self._room.set()  # the ring ran dry: wake a reader waiting for room
            left = deadline - time.monotonic()
            if left <= 0:
                raise queue.Empty
            self._waiting = True
            try:
                if not items:  # an append before the flag went up would be missed
                    self._wake.get(timeout=left)
            except queue.Empty:
                pass
            finally:
                self._waiting = False
            # A token may be left over from a wake that found the item already taken:
            # it only makes a later wait return early and look again.

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items
