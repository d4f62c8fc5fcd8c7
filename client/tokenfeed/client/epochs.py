"""The streams of a client's epochs, and the training loop's next() over them.

One stream per iteration (`iterate`), from the loop's `Position`: a `StreamReader`
thread fills a `Handoff` queue with batches staged for the loop (`_stage`, in the
reader thread), and `next()` takes them. Near an epoch's end the next epoch's stream
is opened ahead of time, and `set_epoch(epoch + 1)` adopts it, so its first batch is
waiting instead of a new stream's latency. `set_epoch`, `load_state_dict` and
`close` stop the streams they make stale; all of that under one lock, which `next()`
takes only at an epoch's end or on an error. A mixture's `set_weights` changes the
request under a running iteration: the batches buffered from the old one are dropped
and the iteration goes on with a stream of the new one from the position.

The loop's path is kept short: the reader thread prepares everything and frees what
the loop dropped (`_stage`); `next()` takes an item, stores the position after it
and appends its wait (see `ClientMetrics.waited`).
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence, Sized
from functools import partial
from time import perf_counter
from typing import Any, NoReturn

from tokenfeed.client.buffers import batch_array
from tokenfeed.client.handoff import Handoff
from tokenfeed.client.info import KnownInfo
from tokenfeed.client.metrics import ClientMetrics
from tokenfeed.client.options import MESSAGE_TARGET_BYTES, Options
from tokenfeed.client.position import Position
from tokenfeed.client.responses import Batch, Response
from tokenfeed.client.stream import END, EpochSizes, Failure, StreamReader, StreamRequest
from tokenfeed.client.transport import Channels
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.core.request import SamplingSpec

# Lookahead opens the next epoch's stream this many steps before the epoch's last
# batch reaches the loop, so its first batch (a new stream: the feeder plans the epoch
# and reads its first chunks) is waiting when the epoch ends. An idle open stream
# costs the buffer and a flow-controlled server handler.
LOOKAHEAD_STEPS = 64


class Epochs:
    """The streams of rank `rank` of `spec`, moving `position` as the loop receives.

    `info` is what the feeder told of the dataset (a stream's first response, or an
    Info call), `stager` makes each batch's arrays or tensors (buffers.NumpyStager,
    device.make_stager), `on_reconnect` is told each reconnect's reason.
    """

    def __init__(
        self,
        spec: SamplingSpec,
        rank: int,
        options: Options,
        position: Position,
        channels: Channels,
        metrics: ClientMetrics,
        stager: Any,
        info: KnownInfo,
        on_reconnect: Callable[[str], None],
    ) -> None:
        self.rank, self.options = rank, options
        # What the reader thread reads for every batch (`_stage`), as plain attributes;
        # the request itself is the position's spec (a mixture's weights may change).
        self.seq_len, self.batch_size, self.world_size = (
            spec.seq_len,
            spec.batch_size,
            spec.world_size,
        )
        self.sources = spec.source_names
        self.prefetch = options.prefetch
        # A mixture stream is endless: it has no next epoch to open ahead.
        self.lookahead = options.lookahead and not spec.is_mixture
        self.metrics, self._stager = metrics, stager
        self._position, self._channels = position, channels
        self._info, self._on_reconnect = info, on_reconnect

        self._reader: StreamReader | None = None
        self._queue: Handoff | None = None
        # The running iteration (the _Epoch holds it): its stream may be replaced.
        self._iteration: object | None = None
        self._closed = False
        # Streams of the next epoch opened at the end of this one (see _Epoch.__next__).
        self._ahead: tuple[StreamReader, Handoff] | None = None
        self._adopted: tuple[StreamReader, Handoff] | None = None
        self._lock = threading.Lock()
        # The loop's last batch and the ones before it, freed by the reader (see _Epoch.__next__).
        self._held: dict[str, Any] | None = None
        self._spent: deque[dict[str, Any] | None] = deque(maxlen=64)

    # ---------------------------------------------------------------- position
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its start, except right after `load_state_dict` of that
        same epoch (see `Position.set_epoch`); a stream of it opened ahead is adopted."""
        with self._lock:
            if not self._position.set_epoch(epoch):
                return  # keep the position load_state_dict gave
            ahead, self._ahead = self._ahead, None
            self._stop_reader()
            if ahead is None and self._adopted is not None:
                ahead, self._adopted = self._adopted, None  # set_epoch twice
            if ahead is not None and ahead[0].request.epoch == epoch:
                self._adopted = ahead  # already streaming this epoch from its start
            elif ahead is not None:
                ahead[0].stop()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `Position.state_dict()` (ValueError, changing nothing, if it
        was saved for another order); the streams from the old position stop."""
        with self._lock:
            self._position.load_state_dict(state)
            self._stop_reader()
            self._drop_adopted()

    def set_weights(self, weights: Any, at_step: int | None) -> int:
        """A mixture's weights from `at_step` on (`Position.set_weights`: InvalidArgument
        changing nothing, a pending change included); a running iteration drops what
        it buffered of the old request and streams the new one from the position (the
        batches before `at_step` are the same)."""
        with self._lock:
            step = self._position.set_weights(weights, at_step)
            iteration = self._iteration
            if iteration is not None and self._reader is not None:
                self._stop_reader()
                self._stream_from_position()
                self._iteration = iteration
            return step

    # --------------------------------------------------------------- iteration
    def iterate(self, sized: Sized) -> Iterator[dict[str, Any]]:
        """A new iteration from the position to the end of the epoch (`len()`: that of
        `sized`). It ends the previous one (its buffered batches were never
        delivered, so the position is unaffected)."""
        with self._lock:
            self._start()
            self._iteration = iteration = object()
            return _Epoch(self, iteration, sized)

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("the FeederClient is closed")
        adopted, self._adopted = self._adopted, None
        self._stop_reader()
        if adopted is not None:
            self._reader, self._queue = adopted
            self.metrics.track_occupancy(adopted[1].qsize)
            return
        self._position.start()
        self._stream_from_position()

    def _stream_from_position(self) -> None:
        position = self._position
        self._reader, self._queue = self._open(position.epoch, position.offset, position.step)
        self.metrics.track_occupancy(self._queue.qsize)

    def _open(self, epoch: int, offset: int, step: int) -> tuple[StreamReader, Handoff]:
        """A started reader of `epoch` from (offset, step) and its queue. What the
        reader needs to know of the epoch (its windows; the batches per message, which
        depend on the dtype) comes from the feeder's first answer when this client has
        had none yet: the stream asks for it (`describe`, `message_bytes`) instead of
        waiting for an Info call first."""
        known, spec, options = self._info.known, self._position.spec, self.options
        windows = per_message = None
        if known is not None:
            windows = known.windows
            per_message = options.message_batches(spec.batch_size, spec.seq_len, known.itemsize)
        else:
            per_message = options.batches_per_message  # None: the feeder picks by bytes
            if spec.is_mixture:
                windows = MAX_TOKENS // spec.seq_len  # endless: the offset never gets there
        request = StreamRequest(
            params=spec.to_proto(),
            epoch=epoch,
            rank=self.rank,
            batches_per_message=per_message or 1,  # what a feeder without message_bytes packs
            global_batch=spec.global_batch,
            document_ends=options.document_ends,
            message_bytes=0 if per_message else MESSAGE_TARGET_BYTES,
            describe=windows is None,
        )
        # A message's batches are in memory once it arrives: let them all wait in the
        # buffer (<= ~1 MiB), so the reader takes a message at a time, not a batch.
        q = Handoff(max(self.prefetch, per_message or 1))

        def learn(first: Response | None) -> EpochSizes:
            """The epoch's sizes from the stream's first response (or, from a feeder
            that does not answer `describe`, an Info call)."""
            n = windows
            if n is None and first is not None and first.info is not None:
                n = self._info.told(first.info).windows
            elif n is None:
                n = self._info.get().windows
            packed = per_message or (first.batches_per_message if first is not None else 0)
            return self._sizes(q, offset, step, n, packed or 1)

        sizes = None
        if windows is not None and per_message is not None:
            sizes = self._sizes(q, offset, step, windows, per_message)
        reader = StreamReader(
            self._channels, request, offset, step, q, sizes, learn, self._on_reconnect
        )
        reader.start()
        return reader, q

    def _sizes(
        self, q: Handoff, offset: int, step: int, windows: int, per_message: int
    ) -> EpochSizes:
        """A reader's epoch sizes from (offset, step), given its windows and the
        batches per message (which size its queue)."""
        q.maxsize = max(self.prefetch, per_message)
        remaining = self._position.remaining(windows)
        ahead_step = self._ahead_step(remaining(offset), step)
        return EpochSizes(windows, remaining, partial(self._stage, windows, ahead_step))

    def _ahead_step(self, left: int, step: int) -> int:
        """The step whose batch, once the loop takes it, opens the next epoch's stream
        (-1: never; then the epoch's end does, if `lookahead`), from a stream at `step`
        with `left` steps to go."""
        if not self.lookahead or left <= 0:
            return -1
        return step + max(0, left - 1 - LOOKAHEAD_STEPS)

    def _stage(
        self, num_windows: int, ahead_step: int, msgs: Sequence[Batch]
    ) -> list[tuple[dict[str, Any], int, int, Any, bool]]:
        """Reader thread: a message's Batches -> what the loop takes from the queue, one
        item each: (the batch dict, the loop's offset and step after it, the device
        copy to wait for or None, whether to open the next epoch's stream now)."""
        spent = self._spent
        while len(spent) > 1:  # not the newest: the loop may still hold it (_Epoch.__next__)
            spent.popleft()
        stage, seq_len, sources = self._stager.stage, self.seq_len, self.sources
        global_batch = self.batch_size * self.world_size
        items = []
        tokens = nbytes = 0
        for msg in msgs:
            arr = batch_array(msg)
            # First: on CUDA it sets this thread's device before anything frees tensors.
            inputs, labels, docs, pending = stage(msg, arr)
            tokens += msg.rows * seq_len
            nbytes += arr.nbytes
            step = msg.step
            batch = {
                "input_ids": inputs,
                "labels": labels,
                "shift": msg.shift,
                "epoch": msg.epoch,
                "step": step,
                "offset": msg.offset,
                "starts": msg.starts,
            }
            if sources:
                batch["sources"] = msg.sources
            if docs is not None:
                batch.update(docs)
            offset = min(batch["offset"] + global_batch, num_windows)
            items.append((batch, offset, step + 1, pending, step == ahead_step))
        self.metrics.received(tokens, nbytes, len(items))
        return items

    def stale(self) -> NoReturn:
        """next() of an iteration that a newer one ended (or that ran to its end)."""
        if self._position.ended or self._closed:
            raise StopIteration
        raise RuntimeError(
            "this iteration was ended by a newer one (iter, set_epoch, load_state_dict or close)"
        )

    def ended(self, item: Any, reader: StreamReader, waited: float) -> NoReturn:
        """next() took the stream's last item: `END` (StopIteration, the next epoch's
        stream opened if it is not yet) or a `Failure` (its error, the reader stopped)."""
        self.metrics.waited(waited)
        with self._lock:
            if item is END:
                self._position.end()
                self._reader, self._queue, self._iteration = None, None, None
                reader.stop()
                self._open_ahead(reader, locked=True)  # if not open yet
                raise StopIteration
            self._stop_reader()
        assert isinstance(item, Failure)
        raise item.error

    def _open_ahead(self, reader: StreamReader, locked: bool = False) -> None:
        """Start streaming the next epoch from its start: the usual next call is
        set_epoch(epoch + 1), which adopts it, so its first batch is already waiting
        instead of a new stream's latency. Called LOOKAHEAD_STEPS before the epoch's
        end (or at the end, when the epoch had fewer steps left)."""
        if not locked:
            with self._lock:
                return self._open_ahead(reader, locked=True)
        if (
            self.lookahead
            and self._ahead is None
            and not self._closed
            and reader.request.epoch == self._position.epoch
            and (reader is self._reader or self._position.ended)
        ):
            self._ahead = self._open(self._position.epoch + 1, 0, 0)

    def _wait(self, q: Handoff, reader: StreamReader, since: float | None) -> Any:
        """The ring was empty: block for the next item. `since`: when this wait began,
        shown as a stall in progress (None for a first batch, which is not a stall)."""
        stall = self.metrics.stall
        if since is not None:
            stall.begin_wait(since)
        try:
            while True:
                try:
                    return q.get(timeout=1.0)
                except queue.Empty:
                    if not reader.is_alive() and q.empty():
                        return Failure(RuntimeError("the feeder reader thread ended unexpectedly"))
        finally:
            stall.clear_wait()

    # ----------------------------------------------------------------- closing
    def _stop_reader(self) -> None:
        """Stop the current reader (ending its iteration) and any streaming ahead (not
        an adopted one)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.stop()
        self._queue, self._iteration = None, None
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[0].stop()

    def _drop_adopted(self) -> None:
        adopted, self._adopted = self._adopted, None
        if adopted is not None:
            adopted[0].stop()

    def close(self) -> bool:
        """Stop every stream and reader thread; True the first time."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            self._stop_reader()
            self._drop_adopted()
            self._held = None
            self._spent.clear()
            return True


class _Epoch:
    """The iterator `iter(client)` returns: one pass from the current position."""

    def __init__(self, epochs: Epochs, iteration: object, sized: Sized) -> None:
        self._epochs, self._iteration, self._sized = epochs, iteration, sized
        self._finished = False
        self._first = True  # the next next() waits for the stream's first batch

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> dict[str, Any]:
        """The training loop's next(): the only place the loop can wait.

        One Python frame when a batch is ready (after a training step's sleep each
        frame costs the loop microseconds): the reader thread prepared everything
        (`Epochs._stage`), the ring's pop is C and the metrics are one append
        (`ClientMetrics.waited`). The iteration's first next() waits for the stream's
        first batch, counted apart from stalls.
        """
        if self._finished:
            raise StopIteration
        epochs = self._epochs
        try:
            if self._iteration is not epochs._iteration:
                epochs.stale()
            # the iteration's stream: set with it (set_weights may have replaced it)
            reader, q, position = epochs._reader, epochs._queue, epochs._position
            first = self._first
            t0 = perf_counter()
            try:
                item = q.pop()  # type: ignore[union-attr]
                if q.asleep:  # type: ignore[union-attr]  # back from an absence: refill
                    q.took()  # type: ignore[union-attr]
            except IndexError:  # the ring is empty: get() wakes the reader and waits
                item = epochs._wait(q, reader, None if first else t0)  # type: ignore[arg-type]
            t1 = perf_counter()
            if type(item) is not tuple:
                epochs.ended(item, reader, t1 - t0)  # type: ignore[arg-type]
            batch, position.offset, position.step, pending, ahead = item  # received
            if first:
                self._first = False
                epochs.metrics.first_batch_waited(t1 - t0, t1)
            else:
                epochs.metrics.waits.append(t1 - t0)  # folded in by the reader thread
            if pending is not None:
                epochs._stager.ready(*pending)
            if ahead:
                epochs._open_ahead(reader)  # type: ignore[arg-type]
            # The previous batch: the loop drops it when it rebinds its variable to this
            # one, and freeing it (tensors, views, the dict) costs up to tens of us after
            # a step's sleep. One more reference, in `_spent`, makes the reader thread
            # (`_stage`) free it instead.
            epochs._spent.append(epochs._held)
            epochs._held = batch
            return batch
        except BaseException:
            self._finished = True
            raise

    def __len__(self) -> int:
        return len(self._sized)
