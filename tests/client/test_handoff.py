"""The reader -> loop handoff: FIFO, bounded, wakes whoever waits, and costs the
loop's next() no Python call when a batch is ready."""

from __future__ import annotations

import queue
import sys
import threading
import time
from types import FrameType
from typing import Any

import pytest

from tokenfeed.client import FeederClient, handoff
from tokenfeed.client.handoff import Handoff

from support import wait_until
from support.feeders import FEEDER_DATASET


def test_fifo_bounded_and_queue_compatible() -> None:
    h = Handoff(2)
    assert h.empty()
    assert h.qsize() == 0
    h.put(1, timeout=1)
    h.put(2, timeout=1)
    with pytest.raises(queue.Full):
        h.put(3, timeout=0.01)
    assert h.qsize() == 2
    assert h.get_nowait() == 1
    assert h.get(timeout=1) == 2
    with pytest.raises(queue.Empty):
        h.get_nowait()
    with pytest.raises(queue.Empty):
        h.get(timeout=0.01)
    with pytest.raises(ValueError, match="maxsize must be >= 1"):
        Handoff(0)


def waiting_loop(h: Handoff, takes: int = 1) -> tuple[threading.Thread, list[int]]:
    """A loop that takes `takes` items, once it waits on the empty ring; what it got."""
    got: list[int] = []
    t = threading.Thread(target=lambda: got.extend(h.get(timeout=120) for _ in range(takes)))
    t.start()
    wait_until(lambda: h._waiting, 30, "the loop to wait for an item")
    return t, got


def test_a_waiting_loop_is_woken_by_the_reader() -> None:
    h = Handoff(1)
    t, got = waiting_loop(h)
    h.put(7, timeout=1)
    t.join(30)
    assert got == [7]


def test_a_reader_blocked_on_a_full_ring_gets_room() -> None:
    """Many items through a ring of one: every put finds room, order is kept."""
    h = Handoff(1)
    n = 2000
    t = threading.Thread(target=lambda: [h.put(i, timeout=30) for i in range(n)])
    t.start()
    out = [h.get(timeout=30) for _ in range(n)]
    t.join(30)
    assert out == list(range(n))


def test_a_timed_out_get_or_a_stale_wake_leaves_no_trap() -> None:
    h = Handoff(4)
    for _ in range(3):
        with pytest.raises(queue.Empty):
            h.get(timeout=0.001)
    h._wake.put(None)  # left by a put that raced with a loop that found its item anyway

    def put_once_the_token_is_spent() -> None:
        # the loop took the stale token, looked again and waits once more
        wait_until(lambda: h._wake.empty() and h._waiting, 30, "the loop to wait again")
        h.put(1, timeout=1)

    t = threading.Thread(target=put_once_the_token_is_spent)
    t.start()
    assert h.get(timeout=30) == 1  # the stale token only made it look again
    t.join(30)
    assert h.empty()


def test_a_loop_and_a_reader_at_uneven_paces_lose_nothing() -> None:
    import random

    h = Handoff(2)
    rng = random.Random(3)
    n = 500
    pauses = [rng.choice((0, 0, 0, 1e-4)) for _ in range(2 * n)]

    # the pauses are the uneven paces under test, not waits for anything
    def produce() -> None:
        for i in range(n):
            if pauses[i]:
                time.sleep(pauses[i])
            h.put(i, timeout=30)

    t = threading.Thread(target=produce)
    t.start()
    out = []
    for i in range(n):
        if pauses[n + i]:
            time.sleep(pauses[n + i])
        try:
            out.append(h.get_nowait())
        except queue.Empty:
            out.append(h.get(timeout=30))
    t.join(30)
    assert out == list(range(n))


def test_the_loop_wakes_a_reader_waiting_for_room_only_when_the_ring_runs_dry() -> None:
    """The loop's fast path sets nothing (a reader on a full ring finds room by its own
    backing-off polls); a get that finds the ring empty, or stop()'s draining, wakes
    it at once."""
    h = Handoff(4)
    for i in range(4):
        h.put(i, timeout=1)
    assert h.get_nowait() == 0
    assert h.get(timeout=1) == 1
    assert not h._room.is_set()  # items left: the loop woke nobody
    h.put(4, timeout=1)  # room: no wait
    h.put(5, timeout=1)
    t = threading.Thread(target=lambda: h.put(6, timeout=60))  # full: polls for room
    t.start()
    assert [h.get_nowait() for _ in range(4)] == [2, 3, 4, 5]
    t.join(30)  # found the room by polling
    assert not t.is_alive()
    assert h.get_nowait() == 6
    with pytest.raises(queue.Empty):
        h.get_nowait()
    assert h._room.is_set()  # ran dry: a reader about to wait is woken at once


class CountedEvent(threading.Event):
    """An Event that records the timeout of every wait on it."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_a_reader_whose_loop_is_away_sleeps_until_the_loop_takes_an_item(monkeypatch) -> None:
    """Once its polls for room would be longer than POLL_MAX, a reader on a full ring
    stops polling and says so (`asleep`; an idle client takes no CPU): room made by a
    pop alone is not seen, the loop's took() after it (next() calls it) wakes it once
    half the ring is free, and the reader's next wait for room polls again."""
    monkeypatch.setattr(handoff, "POLL_MAX", 0.01)
    h = Handoff(2)
    h._room = room = CountedEvent()
    h.put_all([0, 1], timeout=1)
    t = threading.Thread(target=lambda: h.put_all([2, 3, 4], timeout=120))
    t.start()
    wait_until(lambda: h.asleep, 30, "the reader to stop polling")
    polls = list(room.timeouts)
    assert polls == [0.0002 * 2**k for k in range(len(polls))]
    assert 0.005 < polls[-1] <= 0.01
    assert h.pop() == 0  # room, but a pop alone wakes nobody ...
    assert h.qsize() == 1  # ... and the sleeping reader does not look
    h.took()  # what next() does after a pop that found the reader asleep: half free
    wait_until(lambda: h.qsize() == 2, 30, "the woken reader to refill")
    assert [h.pop(), h.get(timeout=30), h.get(timeout=30)] == [1, 2, 3]
    t.join(30)
    assert h._poll == handoff.POLL_MIN  # it found room: its next wait polls again
    assert h.get_nowait() == 4


def test_a_sleeping_reader_is_woken_by_a_loop_that_finds_the_ring_dry(monkeypatch) -> None:
    monkeypatch.setattr(handoff, "POLL_MAX", 0.01)
    h = Handoff(1)
    h.put(0, timeout=1)
    t = threading.Thread(target=lambda: h.put(1, timeout=120))
    t.start()
    wait_until(lambda: h.asleep, 30, "the reader to sleep")
    assert h.get_nowait() == 0  # the loop's fast path through get_nowait: wakes nobody
    assert h.get(timeout=30) == 1  # found the ring dry: woken, the reader refills
    t.join(30)


def test_a_message_reaches_a_waiting_loop_with_one_wake() -> None:
    h = Handoff(8)
    t, got = waiting_loop(h)
    assert h.put_all([1, 2, 3], timeout=1) == 3
    t.join(30)
    assert got == [1]
    assert h._wake.empty()  # one token, which the loop took
    assert [h.get_nowait(), h.get_nowait()] == [2, 3]


def test_put_all_appends_what_fits_in_time() -> None:
    h = Handoff(2)
    assert h.put_all([1, 2, 3], timeout=0.01) == 2
    assert [h.get_nowait(), h.get_nowait()] == [1, 2]
    assert h.put_all([], timeout=1) == 0
    with pytest.raises(queue.Empty):
        h.get_nowait()


def test_a_message_larger_than_the_ring_wakes_the_loop_before_waiting_for_room() -> None:
    """The loop waits on an empty ring; a reader's put_all fills it and must wake the
    loop before it waits for room, or each side waits for the other until put_all's
    time runs out."""
    h = Handoff(2)
    t, got = waiting_loop(h, takes=5)
    assert h.put_all([0, 1, 2, 3, 4], timeout=20) == 5
    t.join(30)
    assert got == [0, 1, 2, 3, 4]


def test_pop_is_the_loops_fast_path_and_an_empty_ring_goes_to_get() -> None:
    h = Handoff(2)
    h.put_all([1, 2], timeout=1)
    assert [h.pop(), h.pop()] == [1, 2]
    with pytest.raises(IndexError):
        h.pop()
    assert not h._room.is_set()  # pop wakes nobody: the loop's get() does, below
    with pytest.raises(queue.Empty):
        h.get(timeout=0.001)
    assert h._room.is_set()


def test_a_next_that_finds_a_batch_is_one_python_frame(feeder) -> None:
    """After a training step's sleep every Python frame on next()'s path costs
    microseconds of stall: with a batch in the ring, next() runs the iterator's
    __next__ and no other Python function (the ring's pop is C)."""
    kw = {"seq_len": 16, "batch_size": 4, "rank": 0, "world_size": 1, "shuffle": True}
    with FeederClient(feeder.address, dataset=FEEDER_DATASET, **kw) as c:
        it = iter(c)
        next(it)  # the first batch: the stream's start, not the fast path
        ring = c._epochs._queue
        assert ring is not None
        wait_until(lambda: ring.qsize() >= 2, 30, "the reader to queue batches")
        calls: list[str] = []

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event == "call":
                calls.append(frame.f_code.co_qualname)

        sys.setprofile(profile)
        try:
            batch = next(it)
        finally:
            sys.setprofile(None)
        assert batch["step"] == 1
        assert calls == ["_Epoch.__next__"]


def test_next_wakes_a_reader_that_slept_through_the_loops_absence(feeder, monkeypatch) -> None:
    """A trainer back from an evaluation: once half the buffer is free, next() wakes
    the sleeping reader, which refills it while the loop works, not once it is empty."""
    monkeypatch.setattr(handoff, "POLL_MAX", 0.01)
    kw = {"seq_len": 16, "batch_size": 4, "rank": 0, "world_size": 1, "prefetch": 4}
    with FeederClient(feeder.address, dataset=FEEDER_DATASET, batches_per_message=1, **kw) as c:
        it = iter(c)
        next(it)
        ring = c._epochs._queue
        assert ring is not None
        wait_until(lambda: ring.asleep, 30, "the reader to sleep on a full buffer")
        assert ring.maxsize == 4
        assert ring.qsize() == 4
        assert next(it)["step"] == 1
        assert ring.asleep  # 3 of 4 left: no wake-up in next() yet
        assert next(it)["step"] == 2  # half the buffer free: woken
        # woken, it refills at once; asleep, it would wait for its 10 s safety net
        wait_until(lambda: ring.qsize() == ring.maxsize, 5, "the reader to refill")
