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

Giving up (`Outage`): a client that has never reached a feeder tries for
`Timeouts.connect_timeout` (a wrong address fails fast, naming every address tried
and the last error, and TLS when it is the cause); once one answered, an outage lasts
as long as `Backoff` allows. INTERNAL is retried too (a peer dying mid-message resets
the stream with it), but INTERNAL_ATTEMPTS of them in a row with nothing received in
between end the call with that status: that is a feeder reporting a bug of its own,
which waiting does not fix. Every failed attempt logs a WARNING on `tokenfeed.client`
(address, reason, what happens next); a stream that starts or resumes logs an INFO
line (rank, epoch, offset). The rules for users: docs/client.md, "Reconnects and
giving up".

The queue holds `prefetch` batches: with the one the loop is using and the one the
thread is receiving, that is the double buffer.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from tokenfeed.client.handoff import Handoff
from tokenfeed.client.responses import Batch, Response
from tokenfeed.client.transport import (
    MAX_RECEIVE_BYTES,
    Channels,
    details_of,
    retryable,
    status_of,
    tls_problem,
    to_feeder_error,
)
from tokenfeed.core.errors import FeederError, FeederUnavailable, error_for
from tokenfeed.v1 import feeder_pb2

log = logging.getLogger("tokenfeed.client")


# INTERNAL statuses in a row (nothing received between them) after which a call ends
# with the feeder's error instead of retrying: a bug of the feeder's, not an outage.
INTERNAL_ATTEMPTS = 3


class Outage:
    """Failed attempts in a row at one call, and when to give up.

    Until any feeder has answered (`channels.reached`), the budget is
    `connect_timeout` seconds from the first attempt, the backoff's `max_retries` too:
    a wrong address or a TLS mismatch fails fast. After, it is the backoff's
    (`deadline` from the first failure, `max_retries`). `failed()` logs a WARNING
    per failure and returns the wait before the next attempt, or raises
    FeederUnavailable naming every address tried and the last error.
    """

    def __init__(self, channels: Channels, what: str, rng: random.Random | None = None) -> None:
        self.channels, self.what, self.rng = channels, what, rng
        self.backoff = channels.connection.backoff
        self.timeouts = channels.connection.timeouts
        self.connect_timeout = self.timeouts.connect_timeout
        self.failures = 0
        self.internal = 0  # INTERNAL statuses among the last failures, in a row
        self.first_attempt = time.monotonic()
        self.outage_start = self.first_attempt
        self.tried: dict[str, None] = {}  # addresses, in the order tried
        self.cause = ""  # the last failure that was not a deadline (what a timeout hides)
        self._hints: dict[str, str | None] = {}  # address -> TLS diagnosis

    def succeeded(self) -> None:
        self.failures = self.internal = 0
        self.channels.reached = True

    def rpc_timeout(self) -> float:
        """Deadline of the next unary attempt: within the connect budget until reached."""
        timeout = self.timeouts.rpc_timeout
        if self.channels.reached:
            return timeout
        left = self.connect_timeout - (time.monotonic() - self.first_attempt)
        return max(0.05, min(timeout, left))

    def failed(self, reason: str, message: str) -> float:
        now = time.monotonic()
        connecting = not self.channels.reached
        if self.failures == 0:
            self.outage_start = self.first_attempt if connecting else now
        self.failures += 1
        address = self.channels.current
        self.tried[address] = None
        if address not in self._hints:
            # Probing with a handshake of our own is for first contact only: once a
            # feeder answered, a closed socket is an outage, not a misconfiguration.
            self._hints[address] = tls_problem(
                message, address, self.channels.security, probe=connecting
            )
        hint = self._hints[address]
        reason_text = message + (f"; {hint}" if hint else "")
        last = reason_text
        if reason == "deadline_exceeded" and self.cause:
            # An attempt cut short by the budget's end says nothing of why the ones before failed.
            last += f"; before it: {self.cause}"
        else:
            self.cause = f"{address}: {reason_text}"
        elapsed = now - self.outage_start
        delay = self.backoff.delay(self.failures - 1, self.rng)
        self.internal = self.internal + 1 if reason == "internal" else 0
        error: FeederError | None = None
        if self.internal >= INTERNAL_ATTEMPTS:
            error = error_for(
                "INTERNAL",
                f"{self.what}: the feeder answered INTERNAL {self.internal} times in a row, "
                f"a bug on its side (see its log), not an outage; last at {address}: "
                f"{reason_text}",
            )
        elif connecting:
            left = self.connect_timeout - elapsed
            if left <= 0 or (
                self.backoff.max_retries is not None and self.failures > self.backoff.max_retries
            ):
                error = FeederUnavailable(
                    f"could not reach a feeder within connect_timeout={self.connect_timeout:g} s: "
                    f"gave up after {self.failures} attempts over {elapsed:.1f} s; tried "
                    f"{', '.join(self.tried)}; last error at {address}: {last}"
                )
            delay = min(delay, max(left, 0.0))
        elif self.backoff.exhausted(self.failures, elapsed):
            error = FeederUnavailable(
                f"{self.what}: gave up after {self.failures} attempts over {elapsed:.1f} s; "
                f"last failure at {address}: {last}"
            )
        log.warning(
            "%s %s at %s: %s; attempt %d, %s",
            self.what,
            "could not connect" if connecting else "failed",
            address,
            reason_text,
            self.failures,
            "giving up"
            if error is not None
            else f"retrying at {self.channels.following} in {delay:.2f} s",
        )
        if error is not None:
            raise error
        return delay


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
    document_ends: bool = False  # ask for each batch's document ends
    message_bytes: int = 0  # > 0: the feeder packs by bytes (the client knows no dtype)
    describe: bool = False  # the first response tells the epoch's windows (Info's answer)


@dataclass(frozen=True)
class EpochSizes:
    """What a reader needs to know of its epoch: known when it opens, or learned from
    its stream's first response."""

    num_windows: int  # of the epoch order: the offset never passes it
    remaining: Callable[[int], int]  # steps this rank still has from an offset
    stage: Callable[[Sequence[Batch]], list[Any]]  # a message's batches -> items


class StreamReader(threading.Thread):
    """Reads one epoch for one rank, from (offset, step), into `out`.

    `sizes`: the epoch's, when known as it opens; else `learn` makes them from the
    stream's first response (the one `describe` or `message_bytes` asked for, or, from
    a feeder that predates them, its first batches: None when there were none).
    """

    def __init__(
        self,
        channels: Channels,
        request: StreamRequest,
        offset: int,
        step: int,
        out: Handoff,
        sizes: EpochSizes | None,
        learn: Callable[[Response | None], EpochSizes],
        on_reconnect: Callable[[str], None],
    ) -> None:
        super().__init__(name=f"tokenfeed-reader-rank{request.rank}", daemon=True)
        self.channels, self.request = channels, request
        self.offset, self.step = offset, step
        self.out, self.sizes, self.learn = out, sizes, learn
        self.on_reconnect = on_reconnect
        self.metadata = channels.connection.metadata
        self._stop_event = threading.Event()
        self._call: grpc.Call | None = None
        self._early: Any = None  # the first call, made by start()
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
    def start(self) -> None:
        """Start the thread, the stream's call first: the request is on its way while
        the thread starts (on a busy machine, up to milliseconds). A call that cannot
        be made here (an address to resolve, a closed channel) is left to the thread,
        which retries it as any other failure."""
        try:
            self._early = self._invoke()
            with self._call_lock:
                self._call = self._early
        except (grpc.RpcError, OSError, ValueError):
            pass
        super().start()

    def _invoke(self) -> Any:
        """The stream's call from the reader's position."""
        req = self.request
        return self.channels.stream_batches()(
            feeder_pb2.StreamBatchesRequest(
                params=req.params,
                epoch=req.epoch,
                rank=req.rank,
                offset=self.offset,
                step=self.step,
                batches_per_message=req.batches_per_message,
                max_message_bytes=MAX_RECEIVE_BYTES,
                document_ends=req.document_ends,
                message_bytes=req.message_bytes,
                describe=req.describe and self.sizes is None,
            ),
            metadata=self.metadata,
        )

    def run(self) -> None:
        try:
            self._run()
        except BaseException as e:  # every error must reach the loop
            self._put(Failure(e))

    def _put(self, item: Any) -> bool:
        return self._put_all([item])

    def _put_all(self, items: list[Any]) -> bool:
        # stop() empties the ring, which wakes a put waiting for room (Handoff), so the
        # timeout is a safety net only.
        done = 0
        while not self._stop_event.is_set():
            done += self.out.put_all(items[done:], timeout=10.0)
            if done == len(items):
                return True
        return False

    def _run(self) -> None:
        req = self.request
        outage = Outage(self.channels, f"rank {req.rank}: epoch {req.epoch} stream")
        resumed = self.offset > 0  # from a saved position, or (below) after a failure
        while not self._stop_event.is_set():
            reason = ""
            try:
                call, self._early = self._early or self._invoke(), None
                with self._call_lock:
                    self._call = call
                if self._stop_event.is_set():
                    call.cancel()
                first = True
                sizes = self.sizes
                for response in call:
                    if sizes is None:
                        sizes = self.sizes = self.learn(response)
                    if first and response.batches:  # (a first response may be the answer alone)
                        first = False
                        outage.succeeded()
                        self._log_start(resumed)
                    # A message's batches go to the loop together (one wake of an idle
                    # loop per message; Handoff.put_all).
                    batches = response.batches
                    if batches:
                        if not self._put_all(sizes.stage(batches)):
                            return
                        last = batches[-1]
                        self.offset = min(last.offset + req.global_batch, sizes.num_windows)
                        self.step = last.step + 1
                if sizes is None:  # a feeder that predates `describe`, and no batch
                    sizes = self.sizes = self.learn(None)
                # The server ended the stream cleanly; believe it only at the epoch's end.
                if sizes.remaining(self.offset) == 0:
                    self._put(END)
                    return
                reason = "ended_early"
                message = "the feeder ended the stream before the epoch did"
            except grpc.RpcError as e:
                if self._stop_event.is_set():
                    return
                code = status_of(e)
                if not retryable(e):
                    raise to_feeder_error(e, self.channels.current) from None
                reason, message = code.name.lower(), f"{code.name}: {details_of(e)}"
            except OSError as e:  # resolving a name failed: retried like an unreachable server
                reason, message = "resolve", f"cannot resolve the address: {e}"
            except ValueError as e:
                if not closed_by_another_stream(e):
                    raise
                continue  # at once: that stream already moved to the next address
            finally:
                with self._call_lock:
                    self._call = None
            if self._stop_event.is_set():
                return
            if self.sizes is not None and self.sizes.remaining(self.offset) == 0:
                # broke after the last batch: done
                self._put(END)
                return
            # Retry: backoff, next address, same position.
            outage.what = (
                f"rank {req.rank}: epoch {req.epoch} stream at offset {self.offset} "
                f"(step {self.step})"
            )
            delay = outage.failed(reason, message)
            resumed = True
            self.reconnects += 1
            self.on_reconnect(reason)
            self.channels.rotate()
            self._stop_event.wait(delay)

    def _log_start(self, resumed: bool) -> None:
        log.info(
            "rank %d: epoch %d stream %s at offset %d (step %d) from %s",
            self.request.rank,
            self.request.epoch,
            "resumed" if resumed else "started",
            self.offset,
            self.step,
            self.channels.current,
        )


def call_with_retry(
    channels: Channels,
    call: Callable[[Any, float], Any],
    on_reconnect: Callable[[str], None],
    what: str = "Info",
    rng: random.Random | None = None,
) -> Any:
    """`call(stub, timeout)` for a unary RPC, retried like the stream (backoff, next
    address; `Outage` decides when to give up and passes the call's deadline)."""
    outage = Outage(channels, what, rng)
    while True:
        try:
            result = call(channels.stub(), outage.rpc_timeout())
            outage.succeeded()
            return result
        except grpc.RpcError as e:
            code = status_of(e)
            if not retryable(e):
                raise to_feeder_error(e, channels.current) from None
            reason, message = code.name.lower(), f"{code.name}: {details_of(e)}"
        except OSError as e:
            reason, message = "resolve", f"cannot resolve the address: {e}"
        except ValueError as e:
            if not closed_by_another_stream(e):
                raise
            continue  # at once: that stream already moved to the next address
        delay = outage.failed(reason, message)
        on_reconnect(reason)
        channels.rotate()
        time.sleep(delay)


def closed_by_another_stream(error: ValueError) -> bool:
    """A rank's streams (the epoch's, the next epoch's lookahead, Info) share one
    channel; when one of them fails over it releases that channel, which closes it when
    no other client holds it, and a call another one makes on it at that moment raises
    this ValueError rather than a gRPC error.
    The caller simply tries again, on the channel the failing stream moved to."""
    text = str(error).lower()  # "Channel closed!", "Cannot invoke RPC on closed channel!"
    return "closed" in text and "channel" in text
