"""`FeederClient`: the trainer-side iterator over one rank's batches.

    loader = FeederClient("feeder:50051", dataset="demo", seq_len=1024, batch_size=16,
                          split_rate=0.9, shuffle=True, seed=42, device="cuda")
    for epoch in range(start_epoch, 3):
        loader.set_epoch(epoch)
        for batch in loader:
            batch["input_ids"], batch["labels"]          # [B, seq_len]
        ...
    state = loader.state_dict()                          # save with the model
    loader.load_state_dict(state)                        # resume: exactly once

Position. The client keeps (epoch, offset, step) of the first batch the training loop
has not received. `offset` is a position in the epoch order, which is the same for
every world size, so a job may resume with more or fewer ranks (elastic) and still
see every window of the epoch exactly once. The reader thread keeps its own position
(the first batch it has not received) for reconnects; batches it holds but the loop
never took are simply not counted, so a restart requests them again.

Epochs. `set_epoch(e)` starts epoch e at offset 0, except right after
`load_state_dict` for that same epoch (the usual `for epoch in range(saved, n):
set_epoch(epoch)` resume loop keeps the loaded position). Iterating again after an
epoch ran to its end runs the same epoch again from the start, like a DataLoader
without `set_epoch`. `len()` is the steps of a full epoch for this rank.

Mixtures. `mixture=` (a dict, a list of (name, weight) pairs, or the path of a
YAML/JSON file `{sources: {...}, schedule: [{from_tokens, weights}]}`) and
`schedule=` blend several datasets' train splits by weight (design.md "Mixtures").
The stream is endless: `batch["epoch"]` is 0, `len()` raises TypeError, `set_epoch(e)`
with e > 0 is an error; `batch["sources"]` gives each row's index into
`loader.sources`, and `batch["starts"]` its offset in that source's store. The state
dict also holds the mixture, and a checkpoint may be resumed with another world size
or batch size and with a schedule extended by segments that start at or after its
position; any other change is refused with an error naming what differs.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from tokenfeed.client.buffers import LAYOUTS, batch_array, batch_starts, views
from tokenfeed.client.handoff import Handoff
from tokenfeed.client.metrics import ClientMetrics
from tokenfeed.client.stream import (
    END,
    Backoff,
    Failure,
    StreamReader,
    StreamRequest,
    call_with_retry,
)
from tokenfeed.client.transport import Channels, Security, Timeouts
from tokenfeed.core.dtypes import itemsize
from tokenfeed.core.errors import InvalidArgument, NotFound
from tokenfeed.core.mixture import load_mixture
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import MAX_TOKENS, steps_per_epoch
from tokenfeed.v1 import feeder_pb2

STATE_KEYS = ("epoch", "offset", "step", "fingerprint", "world_size")


# Auto batches_per_message packs this many bytes per message: gRPC's cost is per
# message, so small batches travel several to a message.
MESSAGE_TARGET_BYTES = 256 << 10
MAX_AUTO_BATCHES_PER_MESSAGE = 16


@dataclass(frozen=True)
class SplitSize:
    windows: int  # of the epoch order (a mixture's: the stream's last position)
    steps: int  # of a full epoch for this rank (a mixture's: 0, endless)
    itemsize: int  # bytes per token of the store


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


class FeederClient:
    """Streams this rank's batches from a feeder; see the module docstring.

    Batches are dicts: `input_ids`, `labels` (numpy views of one buffer when
    `device` is None, else int64 tensors on the device), `shift`, `epoch`, `step`,
    `offset` and `starts` (int64 numpy array: the store offset of each window); a
    mixture's also `sources` (int64 numpy array: each row's index into `sources`).

    Sampling (`dataset` .. `shuffle_blocks`, `world_size`) becomes a SamplingSpec,
    validated here before any feeder is contacted (InvalidArgument, a ValueError,
    naming the field), with the defaults every part uses: `stride` = `seq_len`,
    `split_rate` 1.0 (everything is train), shift 1, `shuffle_blocks` 8. A ready
    `spec=` may be passed instead. `rank`/`world_size` default to RANK/WORLD_SIZE.
    `prefetch` batches are buffered; `batches_per_message` None packs ~256 KiB per
    gRPC message (its per-message cost dominates small batches). `lookahead` opens
    the next epoch's stream as one ends, adopted by `set_epoch(epoch + 1)`.
    `registry`/`metrics_port` (bound to `metrics_addr`): see `metrics`. `tls`,
    `root_certificates`, `certificate_chain`/`private_key` (mutual TLS; PEM bytes or
    paths) and `token` (sent as `authorization: Bearer <token>`) match the server's
    options. `backoff` bounds reconnects, `timeouts` the keepalive that detects a
    black-holed connection, connecting, and unary calls.
    """

    def __init__(
        self,
        address: str | Sequence[str],
        *,
        dataset: str | None = None,
        mixture: Any = None,
        schedule: Any = None,
        seq_len: int | None = None,
        batch_size: int | None = None,
        split: str = "train",
        split_rate: float = 1.0,
        stride: int | None = None,
        shift: int | str = 1,
        seed: int = 0,
        shuffle: bool = False,
        shuffle_blocks: int = 0,
        spec: SamplingSpec | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: Any = None,
        layout: str = "flat",
        prefetch: int = 2,
        batches_per_message: int | None = None,
        metrics_port: int | None = None,
        metrics_addr: str = "127.0.0.1",
        registry: CollectorRegistry | None = None,
        tls: bool = False,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        certificate_chain: bytes | str | os.PathLike[str] | None = None,
        private_key: bytes | str | os.PathLike[str] | None = None,
        token: str | None = None,
        backoff: Backoff | None = None,
        timeouts: Timeouts | None = None,
        lookahead: bool = True,
    ) -> None:
        from tokenfeed.client.device import resolve_device

        self.rank = _env_int("RANK", 0) if rank is None else int(rank)
        if spec is None:
            if dataset is not None and (mixture is not None or schedule is not None):
                raise InvalidArgument(
                    "dataset= and mixture= are mutually exclusive: stream one dataset, or "
                    "name it among the mixture's sources",
                    field="mixture",
                )
            if (dataset is None and mixture is None) or seq_len is None or batch_size is None:
                raise TypeError(
                    "FeederClient needs dataset (or mixture), seq_len and batch_size (or spec=)"
                )
            sources: Any = ()
            if mixture is not None or schedule is not None:
                sources, schedule = load_mixture(mixture, schedule)
            world = _env_int("WORLD_SIZE", 1) if world_size is None else world_size
            spec = SamplingSpec(
                dataset=dataset or "",
                sources=sources,
                schedule=schedule or (),
                seq_len=seq_len,
                batch_size=batch_size,
                split=split,
                split_rate=split_rate,
                stride=stride or 0,
                shift=shift,
                seed=seed,
                shuffle=shuffle,
                shuffle_blocks=shuffle_blocks,
                world_size=world,
            )
        elif world_size is not None:
            spec = spec.with_(world_size=world_size)
        self.spec = spec
        self.world_size = spec.world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(
                f"need 0 <= rank < world_size, got rank={self.rank}, world_size={self.world_size}"
            )
        if layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
        if prefetch < 1 or (batches_per_message is not None and batches_per_message < 1):
            raise ValueError("prefetch and batches_per_message must be at least 1")
        self.dataset, self.split = spec.dataset, spec.split
        self.sources: tuple[str, ...] = spec.source_names  # a mixture's, in request order
        self.seq_len, self.batch_size = spec.seq_len, spec.batch_size
        self.layout, self.prefetch = layout, int(prefetch)
        self.batches_per_message = batches_per_message
        self.device = resolve_device(device)
        self.backoff = backoff or Backoff()
        self.lookahead = lookahead
        security = Security.build(tls, root_certificates, certificate_chain, private_key, token)
        self._metadata = security.metadata
        self._timeouts = timeouts or Timeouts()
        self._channels = Channels(address, security, self._timeouts)
        self.metrics = ClientMetrics(self.rank, registry)
        if metrics_port is not None:
            self.metrics.serve(metrics_port, metrics_addr)

        self._stager: Any = None
        if self.device is not None:
            from tokenfeed.client.device import TorchStager  # imports torch

            # Slots: the queue's, the loop's current batch, and the one being received.
            self._stager = TorchStager(self.device, self.prefetch + 2)

        self._sizes: dict[tuple[int, int], SplitSize] = {}
        self._reader: StreamReader | None = None
        self._queue: Handoff | None = None
        self._epoch, self._offset, self._step = 0, 0, 0
        self._resume = False  # a loaded position not yet streamed
        self._done = False  # the current epoch ran to its end in the loop
        self._closed = False
        self._reconnects = 0
        # Streams of the next epoch opened at the end of this one (see _next).
        self._ahead: tuple[StreamReader, Handoff] | None = None
        self._adopted: tuple[StreamReader, Handoff] | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ request
    @property
    def fingerprint(self) -> str:
        """Hash of what defines the epoch order (SamplingSpec.fingerprint): world size,
        rank and batch size are left out, so a resume may change them."""
        return self.spec.fingerprint()

    @property
    def is_mixture(self) -> bool:
        return self.spec.is_mixture

    def _size(self) -> SplitSize:
        """Windows and steps of this split for this rank (the Info RPC, cached). A
        mixture's Info checks its sources (NOT_FOUND, FAILED_PRECONDITION) early."""
        key = (self.world_size, self.rank)
        if key not in self._sizes:
            request = feeder_pb2.InfoRequest(
                dataset=self.dataset, params=self.spec.to_proto(), rank=self.rank
            )
            response = call_with_retry(
                self._channels,
                lambda stub: stub.Info(
                    request, metadata=self._metadata, timeout=self._timeouts.rpc_timeout
                ),
                self.backoff,
                self._on_reconnect,
            )
            if self.is_mixture:
                dtypes = {ds.dtype for ds in response.datasets}
                self._sizes[key] = SplitSize(
                    MAX_TOKENS // self.seq_len, 0, itemsize(dtypes.pop() if dtypes else "uint32")
                )
            else:
                self._sizes[key] = _split_size(response, self.dataset, self.split)
        return self._sizes[key]

    def __len__(self) -> int:
        if self.is_mixture:
            raise TypeError(
                "a mixture stream is endless and has no len(); stop at your own step or "
                "token budget"
            )
        return self._size().steps

    # ---------------------------------------------------------------- position
    def set_epoch(self, epoch: int) -> None:
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        if epoch > 0 and self.is_mixture:
            raise ValueError(
                f"a mixture stream is endless and has no epochs: set_epoch({epoch}) is not "
                "allowed (set_epoch(0) is)"
            )
        with self._lock:
            if self._resume and epoch == self._epoch:
                return  # keep the position load_state_dict gave
            ahead, self._ahead = self._ahead, None
            self._stop_reader()
            if ahead is None and self._adopted is not None:
                ahead, self._adopted = self._adopted, None  # set_epoch twice
            self._epoch, self._offset, self._step = int(epoch), 0, 0
            self._resume = self._done = False
            if ahead is not None and ahead[0].request.epoch == epoch:
                self._adopted = ahead  # already streaming this epoch from its start
            elif ahead is not None:
                ahead[0].stop()

    def state_dict(self) -> dict[str, Any]:
        """Position of the first batch the training loop has not received (and, for a
        mixture, the mixture itself: a resume checks its sources and schedule)."""
        state = {
            "epoch": self._epoch,
            "offset": self._offset,
            "step": self._step,
            "fingerprint": self.fingerprint,
            "world_size": self.world_size,
        }
        if self.is_mixture:
            state["mixture"] = self.spec.mixture_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        missing = [k for k in STATE_KEYS if k not in state]
        if missing:
            raise ValueError(f"not a FeederClient state: missing {missing}")
        if ("mixture" in state) != self.is_mixture:
            raise ValueError(
                "the state was saved by a "
                + ("mixture" if "mixture" in state else "single-dataset")
                + " loader and this one streams "
                + ("a mixture" if self.is_mixture else f"dataset {self.dataset!r}")
            )
        if self.is_mixture:
            problem = self.spec.resume_problem(state["mixture"], int(state["offset"]))
            if problem:
                raise ValueError(f"cannot resume this mixture checkpoint: {problem}")
            if int(state["epoch"]) != 0:
                raise ValueError(f"a mixture state has epoch 0, got {state['epoch']}")
        if state["fingerprint"] != self.fingerprint:
            raise ValueError(
                f"the state was saved with different sampling parameters (fingerprint "
                f"{state['fingerprint']} != {self.fingerprint}): dataset, split, split_rate, "
                f"seq_len, stride, shift, seed, shuffle and shuffle_blocks must match to "
                f"resume the same epoch order"
            )
        epoch, offset, step = (int(state[k]) for k in ("epoch", "offset", "step"))
        if min(epoch, offset, step) < 0:
            raise ValueError(f"negative epoch/offset/step in state {state}")
        with self._lock:
            self._stop_reader()
            self._drop_adopted()
            self._epoch, self._offset, self._step = epoch, offset, step
            self._resume, self._done = True, False

    # --------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Stream from the current position to the end of the epoch. Starting a new
        iteration ends the previous one (its buffered batches were never delivered,
        so the position is unaffected)."""
        with self._lock:
            self._start()
            return _Epoch(self, self._reader)  # type: ignore[arg-type]

    def _start(self) -> None:
        if self._closed:
            raise RuntimeError("the FeederClient is closed")
        adopted, self._adopted = self._adopted, None
        self._stop_reader()
        if adopted is not None:
            self._reader, self._queue = adopted
            self.metrics.track_occupancy(adopted[1].qsize)
            return
        if self._done and not self._resume:
            self._offset, self._step = 0, 0  # iterate the same epoch again
        self._resume = self._done = False
        self._reader, self._queue = self._open(self._epoch, self._offset, self._step)
        self.metrics.track_occupancy(self._queue.qsize)

    def _open(self, epoch: int, offset: int, step: int) -> tuple[StreamReader, Handoff]:
        """A started reader of `epoch` from (offset, step) and its queue."""
        size = self._size()
        B, W = self.batch_size, self.world_size
        per_message = self.batches_per_message or max(
            1,
            min(
                MAX_AUTO_BATCHES_PER_MESSAGE,
                MESSAGE_TARGET_BYTES // (B * (self.seq_len + 1) * size.itemsize),
            ),
        )
        request = StreamRequest(
            params=self.spec.to_proto(),
            epoch=epoch,
            rank=self.rank,
            batches_per_message=per_message,
            global_batch=B * W,
            num_windows=size.windows,
            remaining=(
                _endless
                if self.is_mixture
                else partial(steps_per_epoch, size.windows, B, W, self.rank, self.split)
            ),
        )
        q = Handoff(self.prefetch)
        reader = StreamReader(
            self._channels,
            request,
            offset,
            step,
            q,
            self._stage,
            self.backoff,
            self._on_reconnect,
            self._metadata,
        )
        reader.start()
        return reader, q

    def _stage(self, msg: feeder_pb2.Batch) -> dict[str, Any]:
        """Reader thread: a Batch message -> the dict the loop receives."""
        arr = batch_array(msg)
        event = None
        if self._stager is None:
            buf = arr
        else:
            buf, event = self._stager.stage(arr)
        inputs, labels = views(buf, self.seq_len, msg.shift, self.layout)
        self.metrics.received(msg.rows * self.seq_len, arr.nbytes)
        batch = {
            "input_ids": inputs,
            "labels": labels,
            "shift": msg.shift,
            "epoch": msg.epoch,
            "step": msg.step,
            "offset": msg.offset,
            "starts": batch_starts(msg),
        }
        if self.sources:
            batch["sources"] = np.array(msg.sources, dtype=np.int64)
        if event is not None:
            batch["_event"] = (buf, event)
        return batch

    def _next(self, reader: StreamReader) -> dict[str, Any]:
        """The training loop's next(): the only place the loop can wait."""
        if reader is not self._reader:
            if self._done or self._closed:
                raise StopIteration
            raise RuntimeError(
                "this iteration was ended by a newer one (iter, set_epoch, "
                "load_state_dict or close)"
            )
        q = self._queue
        assert q is not None
        stall = self.metrics.stall
        stall.begin_wait()
        t0 = time.perf_counter()
        try:
            item = q.get_nowait()
        except queue.Empty:
            item = self._wait(q, reader)
        waited = time.perf_counter() - t0
        stall.end_wait()
        self.metrics.waited(waited)
        if type(item) is dict:
            self._offset = min(
                item["offset"] + self.batch_size * self.world_size, reader.request.num_windows
            )
            self._step = item["step"] + 1
            pending = item.pop("_event", None)
            if pending is not None:
                self._stager.ready(*pending)
            return item
        with self._lock:
            self._stop_reader()
            if item is END:
                self._done = True
                # The usual next call is set_epoch(epoch + 1): start streaming it now, so
                # the new epoch's first batch is waiting instead of a new stream's latency.
                if self.lookahead and not self._closed:
                    self._ahead = self._open(self._epoch + 1, 0, 0)
                raise StopIteration
        assert isinstance(item, Failure)
        raise item.error

    def _wait(self, q: Handoff, reader: StreamReader) -> Any:
        while True:
            try:
                return q.get(timeout=1.0)
            except queue.Empty:
                if not reader.is_alive() and q.empty():
                    return Failure(RuntimeError("the feeder reader thread ended unexpectedly"))

    @property
    def reconnects(self) -> int:
        """Re-connections after failures so far (also the reconnects metric)."""
        return self._reconnects

    def _on_reconnect(self, reason: str) -> None:
        self._reconnects += 1
        self.metrics.reconnect(reason)

    # ----------------------------------------------------------------- closing
    def _stop_reader(self) -> None:
        """Stop the current reader and any streaming ahead (not an adopted one)."""
        reader, self._reader = self._reader, None
        if reader is not None:
            reader.stop()
        self._queue = None
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead[0].stop()

    def _drop_adopted(self) -> None:
        adopted, self._adopted = self._adopted, None
        if adopted is not None:
            adopted[0].stop()

    def close(self) -> None:
        """End the stream, the reader thread, the channel and the metrics server."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._stop_reader()
            self._drop_adopted()
            self._channels.close()
            self.metrics.close()

    def __enter__(self) -> FeederClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Epoch:
    """The iterator `iter(client)` returns: one pass from the current position."""

    def __init__(self, client: FeederClient, reader: StreamReader) -> None:
        self._client, self._reader = client, reader
        self._finished = False

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._finished:
            raise StopIteration
        try:
            return self._client._next(self._reader)
        except BaseException:
            self._finished = True
            raise

    def __len__(self) -> int:
        return len(self._client)


def _endless(offset: int) -> int:
    """Steps a mixture stream has left: always some (it is endless)."""
    return 1


def _split_size(response: feeder_pb2.InfoResponse, dataset: str, split: str) -> SplitSize:
    for ds in response.datasets:
        if ds.name == dataset:
            for s in ds.splits:
                if s.name == split:
                    return SplitSize(int(s.windows), int(s.steps), itemsize(ds.dtype))
            raise NotFound(f"the feeder reports no split {split!r} for dataset {dataset!r}")
    names = [ds.name for ds in response.datasets]
    raise NotFound(f"the feeder has no dataset {dataset!r} (it has {names})")
