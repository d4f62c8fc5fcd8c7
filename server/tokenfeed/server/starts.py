"""Streams being started go before streams already sending: an epoch-start storm.

When a job starts, or a new epoch begins, all its ranks open their streams within a
second, and a data-parallel step waits for every rank's first batch. Meanwhile the
streams opened first would keep sending: gRPC's flow control lets a stream run as far
ahead of its consumer as the client's receive window, which grows to megabytes on a
fast link (a hundred batches of 8 x 2,048 tokens and more). Building and writing those
bursts kept the event loop busy, and grpc.aio takes one new call per turn of the loop:
a busy loop took a few calls a second (gRPC cancels a call not taken within 30 s), its
GIL was not free for the preparations on worker threads, and the last ranks' first
batches came tens of seconds late.

So when streams start in numbers (STORM_STARTS, each begun within `quiet_seconds` of
the one before: the ranks of a job starting together), a stream that has sent its
first burst (its first batch alone) waits before building its next one, until no
stream has been prepared for `quiet_seconds` (the next call of a storm comes in within
that). Only the first batch: a second burst (up to 4 messages) built for every rank
during the storm was a third of a start's cost, and the last ranks' first batches
waited for it. A start or a few (the next epoch opened ahead, a reconnect) hold
nobody: a consumer that reads as fast as batches come would wait for each. A hold
lasts at most `hold_seconds` (a trickle of starts that never pauses, a preparation
waiting on object storage): after that none waits until the starts pause.
In a data-parallel job no rank takes its second step before every rank has its first
batch, so the wait costs the job nothing.

Pure asyncio, on the server's event loop (one thread uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

# Bursts a stream sends before it gives way: its first batch (a burst of one message).
GIVES_WAY_AFTER = 1
# Starts in a row, each within QUIET_SECONDS of the one before, that make a storm.
STORM_STARTS = 16
# On a loaded machine a process waits tens of ms for a core: a shorter quiet moment or
# bound let go of the hold in the middle of a storm (measured at load 15; quiet, the
# storm's p99 in benchmarks/scale.py had a longer tail at 0.1 s than at 0.25 s).
QUIET_SECONDS = 0.25
HOLD_SECONDS = 10.0


class Starts:
    """The streams being prepared, and the wait of the streams already sending."""

    def __init__(
        self,
        quiet_seconds: float = QUIET_SECONDS,
        hold_seconds: float = HOLD_SECONDS,
        storm_starts: int = STORM_STARTS,
    ) -> None:
        self.quiet_seconds = quiet_seconds
        self.hold_seconds = hold_seconds
        self.storm_starts = storm_starts
        self.preparing = 0
        self.begun = 0  # starts since the last quiet moment
        self.waiting = 0  # streams waiting for the hold to end
        self._go: asyncio.Event | None = None  # clear while the streams sending wait
        self._quiet: asyncio.TimerHandle | None = None
        self._bound: asyncio.TimerHandle | None = None
        self._spent = False  # a hold ended by its bound: none until a quiet moment

    @contextlib.contextmanager
    def preparing_one(self) -> Iterator[None]:
        """Count a stream as being prepared for the duration of the block (on the loop)."""
        self.preparing += 1
        self.begun += 1
        if self._quiet is not None:  # the starts go on
            self._quiet.cancel()
            self._quiet = None
        if self.begun >= self.storm_starts and not self._spent and not self.holding:
            self._hold()
        try:
            yield
        finally:
            self.preparing -= 1
            if not self.preparing:
                self._quiet = asyncio.get_running_loop().call_later(self.quiet_seconds, self._pause)

    @property
    def holding(self) -> bool:
        return self._go is not None and not self._go.is_set()

    async def give_way(self) -> None:
        """Return once no storm of starts is being prepared (or its hold is over)."""
        if self.holding:
            self.waiting += 1
            try:
                await self._go.wait()  # type: ignore[union-attr]
            finally:
                self.waiting -= 1

    def _hold(self) -> None:
        if self._go is None:  # made on the loop's thread
            self._go = asyncio.Event()
        self._go.clear()
        self._bound = asyncio.get_running_loop().call_later(self.hold_seconds, self._expire)

    def _expire(self) -> None:
        """The hold's bound: the streams sending go on, and no hold until a quiet moment."""
        self._bound, self._spent = None, True
        self._let_go()

    def _pause(self) -> None:
        """No stream prepared for quiet_seconds: the storm is over."""
        self._quiet, self.begun, self._spent = None, 0, False
        if self._bound is not None:
            self._bound.cancel()
            self._bound = None
        self._let_go()

    def _let_go(self) -> None:
        if self._go is not None:
            self._go.set()
