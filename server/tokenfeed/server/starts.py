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

So while streams are being prepared, a stream that has sent its first two bursts (its
first batch alone, then up to 4 messages) waits before building its next one: until no
stream has been prepared for `quiet_seconds` (the next call of a storm comes in within
that), or until no preparation ended for `stall_seconds` (one waiting on object
storage, say); a hold let go that way begins again only once all are done. In a
data-parallel job no rank takes its second step before every rank has its first batch,
so the wait costs the job nothing.

Pure asyncio, on the server's event loop (one thread uses it).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

# Bursts a stream sends before it gives way: its first batch (a burst of one message)
# and one burst more, so a consumer that started early has a few batches to go on with.
GIVES_WAY_AFTER = 2
# On a loaded machine a process waits tens of ms for a core: a shorter quiet moment or
# stall bound let go of the hold in the middle of a storm (measured at load 15).
QUIET_SECONDS = 0.1
STALL_SECONDS = 5.0


class Starts:
    """The streams being prepared, and the wait of the streams already sending."""

    def __init__(
        self, quiet_seconds: float = QUIET_SECONDS, stall_seconds: float = STALL_SECONDS
    ) -> None:
        self.quiet_seconds = quiet_seconds
        self.stall_seconds = stall_seconds
        self.preparing = 0
        self._go: asyncio.Event | None = None  # set when the streams sending may go on
        self._timer: asyncio.TimerHandle | None = None

    @contextlib.contextmanager
    def preparing_one(self) -> Iterator[None]:
        """Count a stream as being prepared for the duration of the block (on the loop)."""
        self.preparing += 1
        if self.preparing == 1:  # the first of a storm (or of one call)
            self._hold()
        try:
            yield
        finally:
            self.preparing -= 1
            # let go once none came in for a moment, or none ended for stall_seconds (a
            # hold let go while some are prepared begins again only with the next first)
            self._arm(self.stall_seconds if self.preparing else self.quiet_seconds)

    async def give_way(self) -> None:
        """Return once no stream is being prepared (or the preparations stall)."""
        if self._go is not None and not self._go.is_set():
            await self._go.wait()

    def _hold(self) -> None:
        if self._go is None:  # made on the loop's thread
            self._go = asyncio.Event()
        self._go.clear()
        self._arm(self.stall_seconds)

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(seconds, self._release)

    def _release(self) -> None:
        self._timer = None
        if self._go is not None:
            self._go.set()
