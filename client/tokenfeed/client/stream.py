"""The reader thread: one rank's stream of one epoch into a bounded queue, exactly once.

The thread owns the stream position: the offset and step just after the last batch it
RECEIVED (put into the queue). When the stream breaks (UNAVAILABLE, a reset, a
black-holed connection caught by keepalive, a deadline) it waits with exponential
backoff and jitter, moves to the next address, and asks for the epoch again from that
position, so batches already in the queue are not requested twice and none is
skipped. A non-retryable status (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION,
DATA_LOSS, UNAUTHENTICATED, PERMISSION_DENIED, ...) ends the thread at once. Either
way the outcome goes into the queue (a batch, `END`, or a `Failure`), so the training
loop re-raises the thread's error instead of waiting forever.

The queue holds `prefetch` batches: with the one the loop is using and the one the
thread is receiving, that is the double buffer.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tokenfeed.client.handoff import Handoff
from tokenfeed.client.transport import (
    RETRYABLE,
    Channels,
    details_of,
    status_of,
    to_feeder_error,
)
from tokenfeed.core.errors import FeederUnavailable
from tokenfeed.v1 import feeder_pb2


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff with jitter between reconnect attempts.

    Attempt n (0-based) waits a random time in [(1 - jitter) * d, d] with
    d = min(maximum, initial * multiplier**n): spread out so a restarted feeder is not
    hit by every trainer in the same millisecond. The client gives up, raising
    `FeederUnavailable`, after `max_retries` consecutive failed attempts (None: no
    count limit) or `deadline` seconds since the first failure of an outage (None: no
    time limit); a batch received ends the outage and resets both.
    """

    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5
    max_retries: int | None = None
    deadline: float | None = 120.0

    def __post_init__(self) -> None:
        if not (0 <= self.initial <= self.maximum and self.multiplier >= 1):
            raise ValueError(f"bad backoff: need 0 <= initial <= maximum, multiplier >= 1: {self}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff jitter must be in [0, 1], got {self.jitter}")
        if self.max_retries is None and self.deadline is None:
            raise ValueError("backoff needs max_retries or deadline: retries must be bounded")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        d = min(self.maximum, self.initial * self.multiplier ** min(attempt, 64))
        u = (rng or random).random()
        return d * (1 - self.jitter * u)

    def exhausted(self, failures: int, outage_seconds: float) -> bool:
        return (self.max_retries is not None and failures > self.max_retries) or (
            self.deadline is not None and outage_seconds > self.deadline
        )


END = object()  # the epoch is complete


@dataclass
class Failure:
    """An error from the thread, re-raised by the training loop."""

    error: BaseException


@dataclass(frozen=True)
class StreamRequest:
    params: feeder_pb2.SamplingParams
    epoch: int
    rank: int
    batches_per_message: int
    global_batch: int  # batch_size * world_size: how far one step moves the offset
    num_windows: int  # of the epoch order: the offset never passes it
    remaining: Callable[[int], int]  # steps this rank still has from an offset


class StreamReader(threading.Thread):
    """Reads one epoch for one rank, from (offset, step), into `out`."""

    def __init__(
        self,
        channels: Channels,
        request: StreamRequest,
        offset: int,
        step: int,
        out: Handoff,
        stage: Callable[[feeder_pb2.Batch], Any],
        backoff: Backoff,
        on_reconnect: Callable[[str], None],
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(name=f"tokenfeed-reader-rank{request.rank}", daemon=True)
        self.channels, self.request = channels, request
        self.offset, self.step = offset, step
        self.out, self.stage = out, stage
        self.backoff, self.on_reconnect = backoff, on_reconnect
        self.metadata = metadata
        self._stop_event = threading.Event()
        self._call: grpc.Call | None = None
        self._call_lock = threading.Lock()
        self.reconnects = 0

    # ----------------------------------------------------------------- control
    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the stream and end the thread (queued batches are dropped)."""
        self._stop_event.set()
        with self._call_lock:
            if self._call is not None:
                self._call.cancel()
        # Unblock a put() on a full queue.
        while True:
            try:
                self.out.get_nowait()
            except queue.Empty:
                break
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout)

    @property
    def stopped(self) -> bool:
        return self._stop_event.is_set()

    # -------------------------------------------------------------------- body
    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # noqa: BLE001 - every error must reach the loop
            self._put(Failure(e))

    def _put(self, item: Any) -> bool:
        while not self._stop_event.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        req = self.request
        failures, outage_start = 0, 0.0
        while not self._stop_event.is_set():
            reason = ""
            try:
                stub = self.channels.stub()
                call = stub.StreamBatches(
                    feeder_pb2.StreamBatchesRequest(
                        params=req.params,
                        epoch=req.epoch,
                        rank=req.rank,
                        offset=self.offset,
                        step=self.step,
                        batches_per_message=req.batches_per_message,
                    ),
                    metadata=self.metadata,
                )
                with self._call_lock:
                    self._call = call
                if self._stop_event.is_set():
                    call.cancel()
                for response in call:
                    for batch in response.batches:
                        item = self.stage(batch)
                        if not self._put(item):
                            return
                        self.offset = min(batch.offset + req.global_batch, req.num_windows)
                        self.step = batch.step + 1
                        failures = 0
                # The server ended the stream cleanly; believe it only at the epoch's end.
                if req.remaining(self.offset) == 0:
                    self._put(END)
                    return
                reason, message = "ended_early", "the stream ended before the epoch did"
            except grpc.RpcError as e:
                if self._stop_event.is_set():
                    return
                code = status_of(e)
                if code not in RETRYABLE:
                    raise to_feeder_error(e, self.channels.current) from None
                reason, message = code.name.lower(), details_of(e)
            except OSError as e:  # resolving a name failed: retried like an unreachable server
                reason, message = "resolve", str(e)
            finally:
                with self._call_lock:
                    self._call = None
            if self._stop_event.is_set():
                return
            if req.remaining(self.offset) == 0:  # broke after the last batch: done
                self._put(END)
                return
            # Retry: backoff, next address, same position.
            now = time.monotonic()
            if failures == 0:
                outage_start = now
            failures += 1
            address = self.channels.current
            if self.backoff.exhausted(failures, now - outage_start):
                raise FeederUnavailable(
                    f"gave up after {failures} attempts over {now - outage_start:.1f} s; "
                    f"last failure at {address}: {message} ({reason})"
                )
            self.reconnects += 1
            self.on_reconnect(reason)
            self.channels.rotate()
            self._stop_event.wait(self.backoff.delay(failures - 1))


def call_with_retry(
    channels: Channels,
    call: Callable[[Any], Any],
    backoff: Backoff,
    on_reconnect: Callable[[str], None],
    rng: random.Random | None = None,
) -> Any:
    """`call(stub)` for a unary RPC, retried like the stream (backoff, next address)."""
    failures, outage_start = 0, time.monotonic()
    while True:
        try:
            return call(channels.stub())
        except grpc.RpcError as e:
            code = status_of(e)
            if code not in RETRYABLE:
                raise to_feeder_error(e, channels.current) from None
            reason, message = code.name.lower(), details_of(e)
        except OSError as e:
            reason, message = "resolve", str(e)
        failures += 1
        elapsed = time.monotonic() - outage_start
        if backoff.exhausted(failures, elapsed):
            raise FeederUnavailable(
                f"gave up after {failures} attempts over {elapsed:.1f} s; last failure at "
                f"{channels.current}: {message} ({reason})"
            )
        on_reconnect(reason)
        channels.rotate()
        time.sleep(backoff.delay(failures - 1, rng))
