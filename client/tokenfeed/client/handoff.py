"""The bounded FIFO between the reader thread and the training loop, cheap for the loop.

`queue.Queue.get()` wakes the producer blocked on a full queue every time: a futex
wake that costs several times everything else in `next()` right after a training
step's sleep (benchmarks/trainer_loop.py). That wake was most of the data-stall
fraction at short steps, although the ring was full.

So here the loop never wakes the reader on its fast path. A reader that finds the ring
full waits for room on an Event with a timeout that starts at 0.2 ms and doubles while
no room comes: while the loop trains, a refill within about twice the time the slot
was free (the ring stays full). These polls cost the reader ~0.25 ms of CPU per 5 ms
step, and they are worth it: a reader that waited for half the ring to drain (a few
wake-ups per refill) used a sixth of that, but the loop's `next()` then resumed on a
colder core, ~6 us slower, and the stall at 5 ms steps grew (benchmarks/README.md,
peers.py). While the reader polls, the loop sets that Event only when it finds the
ring empty, and the reader wakes a waiting loop at once (a token on a SimpleQueue), so
an empty ring is refilled with no delay.

Once the next poll would be longer than POLL_MAX (the ring has stayed full ~1.6 s: the
trainer is away, in an evaluation or a checkpoint, or its steps are that long), the
reader stops polling and sleeps (`asleep`), so an idle client costs next to nothing
(benchmarks/scale.py measures 64 of them). Back from its absence, the loop wakes it
once half the ring is free (`took`): one wake-up per absence, and the reader refills
the ring while the loop works through the other half. (Polling once a second instead
cost 0.015-0.04 of a core per 64 idle clients here, and a loop that drained the ring
within that second waited 5-39 ms for a refill at its end; waking the reader at a
low mark on every refill put a futex wake and a burst of refills into `next()`.)

A reader hands over a message's batches together (`put_all`): an idle loop wakes once
per message, not once per batch.

Same subset of the `queue.Queue` interface the client uses: put(item, timeout),
get(timeout), get_nowait(), qsize(), empty(); `queue.Full` / `queue.Empty` as there;
and `pop()`, the loop's fast path, after which the loop calls `took()` if `asleep`.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

# A full ring's wait for room: 0.2 ms, doubling while no room comes; a wait that would
# be longer than POLL_MAX lasts until the loop is back (took) or finds the ring dry.
POLL_MIN, POLL_MAX = 0.0002, 1.0


class Handoff:
    def __init__(self, maxsize: int) -> None:
        if maxsize < 1:
            raise ValueError(f"maxsize must be >= 1, got {maxsize}")
        self.maxsize = maxsize
        self._items: deque[Any] = deque()
        # The loop waiting for an item says so in `_waiting`, then blocks on `_wake`
        # (a C-level SimpleQueue: a token wakes it). A reader that appends while the
        # flag is up puts a token; with the flag down it does no system call and takes
        # no lock. Order makes it safe: the loop raises the flag, THEN looks at the
        # items once more before it blocks; the reader appends, THEN reads the flag.
        self._waiting = False
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self._room = threading.Event()  # the loop -> a reader waiting for room (ring empty)
        self._poll = POLL_MIN  # the reader's next wait for room: kept across put_all calls
        # The reader sleeps until the loop makes room: took() after the loop's pops
        # puts a token on `_alarm` (a C-level SimpleQueue: right after a long sleep an
        # Event's set() cost the loop 1-3 ms here, a token 0.1-0.8 ms). Order
        # makes it safe: the reader raises the flag, THEN looks at the ring once more
        # before it sleeps; the loop pops, THEN reads the flag. A token left over (the
        # reader woke at its deadline) only makes a later sleep look again.
        self.asleep = False
        self._alarm: queue.SimpleQueue[None] = queue.SimpleQueue()
        # The loop's fast path: the deque's own popleft, a C call with no Python frame
        # around it (after a training step's sleep each frame costs microseconds);
        # IndexError when the ring is empty, and then the loop calls get(), which wakes
        # a reader waiting for room.
        self.pop = self._items.popleft

    def put(self, item: Any, timeout: float) -> None:
        """Append `item`, waiting up to `timeout` s for room (queue.Full after that)."""
        if not self.put_all((item,), timeout):
            raise queue.Full

    def put_all(self, items: Sequence[Any], timeout: float) -> int:
        """Append `items` in order, each waiting for room up to `timeout` s from the
        call; how many were appended (fewer: the time ran out first).

        A loop waiting for an item is woken once, when they are in or before waiting
        for room, not once per item: a message's batches reach an idle loop together.
        """
        ring, maxsize = self._items, self.maxsize
        deadline = None
        done = 0
        for item in items:
            if len(ring) >= maxsize:
                if self._waiting:  # it takes what is in before this waits for room
                    self._wake.put(None)
                if deadline is None:
                    deadline = time.monotonic() + timeout
                while len(ring) >= maxsize:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return done
                    poll = self._poll
                    if poll > POLL_MAX:  # the trainer is away: sleep until it takes an item
                        self.asleep = True
                        if len(ring) >= maxsize:
                            with contextlib.suppress(queue.Empty):
                                self._alarm.get(timeout=left)
                        self.asleep = False
                        continue
                    self._room.wait(min(poll, left))
                    self._room.clear()
                    self._poll = 2 * poll
                self._poll = POLL_MIN
            ring.append(item)
            done += 1
        if self._waiting:
            self._wake.put(None)
        return done

    def took(self) -> None:
        """The loop took an item while the reader sleeps (`asleep`): wake it once half
        the ring is free. Not at the first item: right after the trainer's absence the
        wake-up cost the loop 0.8-1.5 ms here (a cold core), half a ring later at most
        0.1-0.9 ms, and half a ring is time enough for the refill."""
        if len(self._items) <= self.maxsize // 2:
            self.wake()

    def wake(self) -> None:
        """Wake a sleeping reader (`asleep`)."""
        self.asleep = False
        self._alarm.put(None)

    def _ran_dry(self) -> None:
        """The loop found the ring empty: wake the reader, polling or asleep."""
        self._room.set()
        if self.asleep:
            self.wake()

    def get_nowait(self) -> Any:
        try:
            return self._items.popleft()  # atomic in CPython: no lock on the fast path
        except IndexError:
            self._ran_dry()  # (or stop() emptied it)
            raise queue.Empty from None

    def get(self, timeout: float) -> Any:
        """The next item, waiting up to `timeout` s for one (queue.Empty after that)."""
        items = self._items
        deadline = time.monotonic() + timeout
        while True:
            try:
                return items.popleft()
            except IndexError:
                pass
            self._ran_dry()
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
