"""Fair shares of a feeder's sending capacity between jobs, by weight.

A stream sends in turns: one turn is one burst of messages, built and written. At most
`slots` turns run at once. While a slot is free and nobody waits, a turn starts at
once (the uncontended path: a comparison and two counters). When streams wait, the
next turn goes to the job whose share is furthest behind, by start-time fair queuing
over jobs: each job has a finish tag F; a turn of c bytes granted to a job of weight
w starts at S = max(v, F) and moves F to S + c / w; the waiting job with the smallest
S goes next, and the virtual time v follows the start of the turn last granted. So
bytes are divided by weight between the jobs with streams waiting, however many
streams each job has (its streams take its turns in order), and a job that was idle
banks no credit (its S is at least v). A turn is charged the bytes its burst is
expected to take when granted and corrected to what it took when it ends.

A turn that lasts longer than `hold_seconds` while others wait (a write held up by
flow control: a slow trainer; a chunk loading from object storage) stops counting
against the slots, so slow streams never keep the others waiting.

Pure asyncio, on the server's event loop: no gRPC, no locks (one thread uses it).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

HOLD_SECONDS = 0.02


class Account:
    """One job's place in the shares: its weight, finish tag and streams waiting."""

    __slots__ = ("finish", "name", "waiting", "weight")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        self.finish = 0.0
        self.waiting: deque[tuple[asyncio.Future[Turn], int]] = deque()


class Turn:
    """A granted turn: whose, what it was charged, since when, and whether it still
    counts against the slots."""

    __slots__ = ("account", "cost", "lent", "started")

    def __init__(self, account: Account, cost: int, started: float) -> None:
        self.account = account
        self.cost = cost
        self.started = started
        self.lent = False  # held past hold_seconds while others waited: no longer counted


class FairShares:
    """Turns to send, granted by weighted fair queuing over jobs when streams wait."""

    def __init__(
        self,
        slots: int,
        hold_seconds: float = HOLD_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if slots < 1:
            raise ValueError(f"slots must be positive, got {slots}")
        self.slots = slots
        self.hold_seconds = hold_seconds
        self._clock = clock
        self.busy = 0  # turns counted against the slots
        self.vtime = 0.0
        self.accounts: dict[str, Account] = {}
        self._backlog: list[Account] = []  # accounts with streams waiting, oldest first
        self._held: set[Turn] = set()
        self._timer: asyncio.TimerHandle | None = None
        self._pending = False  # a dispatch is scheduled

    def account(self, name: str, weight: float) -> Account:
        """The job's account (made on first use; its weight set to `weight`)."""
        acct = self.accounts.get(name)
        if acct is None:
            acct = self.accounts[name] = Account(name, weight)
        acct.weight = weight
        return acct

    @property
    def waiting(self) -> int:
        return sum(len(a.waiting) for a in self._backlog)

    def try_enter(self, acct: Account, cost: int) -> Turn | None:
        """A turn at once if a slot is free and nobody waits; else None (then `enter`)."""
        if self.busy < self.slots and not self._backlog:
            return self._grant(acct, cost)
        return None

    async def enter(self, acct: Account, cost: int) -> Turn:
        """Wait for a turn of `cost` bytes; `leave` it when the burst is written."""
        turn = self.try_enter(acct, cost)
        if turn is not None:
            return turn
        fut: asyncio.Future[Turn] = asyncio.get_running_loop().create_future()
        acct.waiting.append((fut, cost))
        if len(acct.waiting) == 1:
            self._backlog.append(acct)
        self._arm()
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # granted, then cancelled: give it back
                self.leave(fut.result(), 0)
            elif (fut, cost) in acct.waiting:
                acct.waiting.remove((fut, cost))
                if not acct.waiting:
                    self._backlog.remove(acct)
            raise

    def leave(self, turn: Turn, cost: int) -> None:
        """End a turn that sent `cost` bytes; the next waiting stream may start.

        The slot is granted on the loop's next step, not here: the stream leaving
        asks for its next turn first and competes for it, so a job with few streams
        is not passed over for being between two turns when the slot frees up."""
        acct = turn.account
        acct.finish += (cost - turn.cost) / acct.weight
        self._held.discard(turn)
        if not turn.lent:
            self.busy -= 1
        if self._backlog and not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self._dispatch)

    # ------------------------------------------------------------ internals

    def _grant(self, acct: Account, cost: int) -> Turn:
        start = max(self.vtime, acct.finish)
        acct.finish = start + cost / acct.weight
        self.vtime = start
        self.busy += 1
        turn = Turn(acct, cost, self._clock())
        self._held.add(turn)
        return turn

    def _dispatch(self) -> None:
        """Grant free slots to waiting streams, the job furthest behind first."""
        self._pending = False
        while self.busy < self.slots and self._backlog:
            v = self.vtime
            acct = min(self._backlog, key=lambda a: max(v, a.finish))
            fut, cost = acct.waiting.popleft()
            if not acct.waiting:
                self._backlog.remove(acct)
            if not fut.cancelled():
                fut.set_result(self._grant(acct, cost))

    def _arm(self) -> None:
        if self._timer is None:
            loop = asyncio.get_running_loop()
            self._timer = loop.call_later(self.hold_seconds, self._reap)

    def _reap(self) -> None:
        """Turns held past hold_seconds while streams wait stop counting against the slots."""
        self._timer = None
        if not self._backlog:
            return
        now = self._clock()
        for turn in self._held:
            if not turn.lent and now - turn.started >= self.hold_seconds:
                turn.lent = True
                self.busy -= 1
        self._dispatch()
        if self._backlog:
            self._arm()
