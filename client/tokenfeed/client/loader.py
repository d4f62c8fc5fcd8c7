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
without `set_epoch`.

Sizes. `len(loader)` is the steps of a FULL epoch for this rank at the current world
size (what a DataLoader's len() is), whatever the position; `loader.steps_left` is
the steps this rank will still receive in the current epoch from its position, also
right after a resume with another world size (the position is in windows, the steps
are counted at the new world size). Use `steps_left` for a progress bar or a
schedule after a resume. `loader.dataset_info` (one Info call, cached) has the
store's name, total_tokens, vocab_size, eos_token_id, dtype and tokenizer, and the
windows and steps of this request.

Checks. The constructor checks every argument (type and range) and that the
installed torch can use `device`, and contacts no feeder: the first Info call
(`len`, `dataset_info`, the first iteration) does.

Mixtures. `mixture=` (a dict, a list of (name, weight) pairs, or the path of a
YAML/JSON file `{sources: {...}, schedule: [{from_tokens, weights}]}`) and
`schedule=` blend several datasets' train splits by weight (ARCHITECTURE.md).
The stream is endless: `batch["epoch"]` is 0, `len()` and `steps_left` raise
TypeError, `set_epoch(e)` with e > 0 is an error; `batch["sources"]` gives each row's
index into `loader.sources`, and `batch["starts"]` its offset in that source's store.
The state dict also holds the mixture, and a checkpoint may be resumed with another
world size or batch size and with a schedule extended by segments that start at or
after its position; any other change is refused with an error naming what differs.
"""

from __future__ import annotations

import math
import os
import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from functools import partial
from time import perf_counter
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry

from tokenfeed.client.buffers import (
    DOCUMENT_OUTPUTS,
    LAYOUTS,
    batch_array,
    batch_starts,
    document_arrays,
    views,
)
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
from tokenfeed.client.transport import Channels, Security, Timeouts, split_addresses
from tokenfeed.core.dtypes import itemsize
from tokenfeed.core.errors import InvalidArgument, NotFound
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.core.mixture.files import load_mixture
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import steps_per_epoch
from tokenfeed.v1 import feeder_pb2

STATE_KEYS = ("epoch", "offset", "step", "fingerprint", "world_size")


# Auto batches_per_message packs this many bytes per message: gRPC's cost is per
# message, so small batches travel several to a message.
MESSAGE_TARGET_BYTES = 256 << 10
MAX_AUTO_BATCHES_PER_MESSAGE = 16
# Lookahead opens the next epoch's stream this many steps before the epoch's last
# batch reaches the loop, so its first batch (a new stream: the feeder plans the epoch
# and reads its first chunks) is waiting when the epoch ends. An idle open stream
# costs the buffer and a flow-controlled server handler.
LOOKAHEAD_STEPS = 64


MAX_PREFETCH = 1024
MAX_BATCHES_PER_MESSAGE = 1024  # the server's limit


@dataclass(frozen=True)
class DatasetInfo:
    """What the feeder says about the dataset and this request (`loader.dataset_info`)."""

    name: str
    total_tokens: int  # of the whole store
    vocab_size: int | None  # None when the store does not say
    eos_token_id: int | None
    dtype: str  # of the stored tokens: "uint16" or "uint32"
    tokenizer: str | None  # name or path it was prepared with
    split: str
    split_tokens: int  # tokens of this split
    windows: int  # windows of this split's epoch order (all ranks)
    steps: int  # steps of a full epoch for this rank at this world size (= len(loader))
    # a mixture's: each source's train windows (one pass), in `loader.sources` order
    source_windows: tuple[int, ...] = ()

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "").strip()
    try:
        return int(raw) if raw else default
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _check_int(name: str, value: Any, lo: int, hi: int, none_ok: bool = False) -> None:
    if value is None and none_ok:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        allowed = "an integer or None" if none_ok else "an integer"
        raise TypeError(f"FeederClient {name} must be {allowed}, got {value!r}")
    if not lo <= value <= hi:
        raise ValueError(f"FeederClient {name} must be in [{lo}, {hi}], got {value}")


def _check_type(name: str, value: Any, types: type | tuple[type, ...], what: str) -> None:
    if not isinstance(value, types):
        raise TypeError(f"FeederClient {name} must be {what}, got {value!r}")


_PEM = (bytes, str, os.PathLike, type(None))


def _check_arguments(args: dict[str, Any]) -> None:
    """Type and range of every argument that is not SamplingSpec's (see __init__)."""
    address = args["address"]
    if not isinstance(address, str):
        if not isinstance(address, Sequence) or not all(isinstance(a, str) for a in address):
            raise TypeError(
                "FeederClient address must be 'host:port', a comma-separated string or a "
                f"list of them, got {address!r}"
            )
    split_addresses(address)  # ValueError naming a malformed one
    _check_int("rank", args["rank"], 0, 1 << 31, none_ok=True)
    spec = args["spec"]
    if spec is not None and not isinstance(spec, SamplingSpec):
        raise TypeError(f"FeederClient spec must be a SamplingSpec, got {spec!r}")
    if args["layout"] not in LAYOUTS:
        raise ValueError(f"FeederClient layout must be one of {LAYOUTS}, got {args['layout']!r}")
    _check_int("prefetch", args["prefetch"], 1, MAX_PREFETCH)
    _check_int("batches_per_message", args["batches_per_message"], 1, MAX_BATCHES_PER_MESSAGE, True)
    _check_int("metrics_port", args["metrics_port"], 0, 65535, none_ok=True)
    _check_type("metrics_addr", args["metrics_addr"], str, "a host name or IP string")
    registry = args["registry"]
    if registry is not None and not isinstance(registry, CollectorRegistry):
        raise TypeError(
            f"FeederClient registry must be a prometheus_client.CollectorRegistry, got {registry!r}"
        )
    docs = args["documents"]
    if not isinstance(docs, bool) and (
        isinstance(docs, str)
        or not isinstance(docs, Sequence)
        or not docs
        or not all(d in DOCUMENT_OUTPUTS for d in docs)
    ):
        raise ValueError(
            f"FeederClient documents must be True, False or a non-empty list of some of "
            f"{list(DOCUMENT_OUTPUTS)}, got {docs!r}"
        )
    for name in ("tls", "lookahead", "mask_cross_document_labels"):
        _check_type(name, args[name], bool, "True or False")
    for name in ("root_certificates", "certificate_chain", "private_key"):
        value = args[name]
        _check_type(name, value, _PEM, "PEM bytes or a path to a PEM file")
        if value is not None and not isinstance(value, bytes) and not os.path.isfile(value):
            raise ValueError(f"FeederClient {name}: no such file: {os.fspath(value)!r}")
    token = args["token"]
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise TypeError(f"FeederClient token must be a non-empty string or None, got {token!r}")
    if args["backoff"] is not None and not isinstance(args["backoff"], Backoff):
        raise TypeError(f"FeederClient backoff must be a Backoff, got {args['backoff']!r}")
    if args["timeouts"] is not None and not isinstance(args["timeouts"], Timeouts):
        raise TypeError(f"FeederClient timeouts must be a Timeouts, got {args['timeouts']!r}")
    ct = args["connect_timeout"]
    if ct is not None and (
        isinstance(ct, bool) or not isinstance(ct, (int, float)) or not math.isfinite(ct) or ct <= 0
    ):
        raise ValueError(
            f"FeederClient connect_timeout must be a positive number of seconds, got {ct!r}"
        )


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
    `prefetch` batches are buffered (at least: all batches of one message may wait,
    <= ~256 KiB with auto packing); `batches_per_message` None packs ~256 KiB per
    gRPC message (its per-message cost dominates small batches). `lookahead` opens
    the next epoch's stream `LOOKAHEAD_STEPS` steps before this one ends, adopted by
    `set_epoch(epoch + 1)`. `first_batch_seconds` and `metrics` report the wait for
    each stream's first batch apart from the steady-state wait and stall.
    `registry`/`metrics_port` (bound to `metrics_addr`): see `metrics`. `tls`,
    `root_certificates`, `certificate_chain`/`private_key` (mutual TLS; PEM bytes or
    paths) and `token` (sent as `authorization: Bearer <token>`) match the server's
    options. `connect_timeout` (seconds, default 30; also `Timeouts.connect_timeout`)
    bounds how long a client that has never reached a feeder tries before it raises
    FeederUnavailable; `backoff` bounds reconnects after that, `timeouts` the
    keepalive that detects a black-holed connection, one connection attempt, and
    unary calls. Every argument is checked here (TypeError, ValueError), the device
    too, before any feeder is contacted.
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
        connect_timeout: float | None = None,
        documents: bool | Sequence[str] = False,
        mask_cross_document_labels: bool = False,
    ) -> None:
        from tokenfeed.client.device import check_device, resolve_device

        _check_arguments(locals())
        self.rank = _env_int("RANK", 0) if rank is None else rank
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
        self.dataset, self.split = spec.dataset, spec.split
        self.sources: tuple[str, ...] = spec.source_names  # a mixture's, in request order
        self.seq_len, self.batch_size = spec.seq_len, spec.batch_size
        self.layout, self.prefetch = layout, prefetch
        self.batches_per_message = batches_per_message
        # Document outputs to build per batch (in the reader thread) and label masking.
        self.documents: tuple[str, ...] = (
            DOCUMENT_OUTPUTS if documents is True else tuple(documents or ())
        )
        self.mask_cross_document_labels = mask_cross_document_labels
        self.device = resolve_device(device)
        if self.device is not None:
            check_device(self.device)  # imports torch
        self.backoff = backoff or Backoff()
        self.lookahead = lookahead
        security = Security.build(tls, root_certificates, certificate_chain, private_key, token)
        self._metadata = security.metadata
        self._timeouts = timeouts or Timeouts()
        if connect_timeout is not None:
            self._timeouts = replace(self._timeouts, connect_timeout=float(connect_timeout))
        self._channels = Channels(address, security, self._timeouts, start=self.rank)
        self.metrics = ClientMetrics(self.rank, registry)
        if metrics_port is not None:
            self.metrics.serve(metrics_port, metrics_addr)

        self._stager: Any = None
        if self.device is not None:
            from tokenfeed.client.device import TorchStager  # imports torch

            # Slots: the queue's, the loop's current batch, and the one being received.
            self._stager = TorchStager(self.device, self.prefetch + 2)

        self._info: DatasetInfo | None = None
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
        # The loop's last batch and the ones before it, freed by the reader (see _next).
        self._held: dict[str, Any] | None = None
        self._spent: deque[dict[str, Any] | None] = deque(maxlen=64)

    # ------------------------------------------------------------------ request
    @property
    def fingerprint(self) -> str:
        """Hash of what defines the epoch order (SamplingSpec.fingerprint): world size,
        rank and batch size are left out, so a resume may change them."""
        return self.spec.fingerprint()

    @property
    def dataset_info(self) -> DatasetInfo:
        """The dataset's metadata and this request's windows and steps (one Info call,
        then cached: the store and the request do not change)."""
        if self._info is None:
            request = feeder_pb2.InfoRequest(
                dataset=self.dataset, params=self.spec.to_proto(), rank=self.rank
            )
            response = call_with_retry(
                self._channels,
                lambda stub, timeout: stub.Info(request, metadata=self._metadata, timeout=timeout),
                self.backoff,
                self._on_reconnect,
                f"rank {self.rank}: Info",
            )
            if self.is_mixture:  # Info checked the sources (NOT_FOUND, FAILED_PRECONDITION)
                self._info = _mixture_info(response, self.seq_len)
            else:
                self._info = _dataset_info(response, self.dataset, self.split)
        return self._info

    @property
    def is_mixture(self) -> bool:
        return self.spec.is_mixture

    def _no_epochs(self) -> TypeError:
        return TypeError(
            "a mixture stream is endless and has no len() or steps_left; stop at your own "
            "step or token budget"
        )

    def __len__(self) -> int:
        """Steps of a full epoch for this rank at the current world size (see
        `steps_left` for what remains of the current epoch)."""
        if self.is_mixture:
            raise self._no_epochs()
        return self.dataset_info.steps

    @property
    def steps_left(self) -> int:
        """Steps this rank will still receive in the current epoch from the current
        position (right after `load_state_dict`, counted at this client's world size)."""
        if self.is_mixture:
            raise self._no_epochs()
        info = self.dataset_info
        return steps_per_epoch(
            info.windows, self.batch_size, self.world_size, self.rank, self.split, self._offset
        )

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
        state: dict[str, Any] = {
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
        size = self.dataset_info
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
            document_ends=bool(self.documents) or self.mask_cross_document_labels,
        )
        # A message's batches are in memory once it arrives: let them all wait in the
        # buffer (<= ~256 KiB), so the reader takes a message at a time, not a batch.
        q = Handoff(max(self.prefetch, per_message))
        reader = StreamReader(
            self._channels,
            request,
            offset,
            step,
            q,
            partial(self._stage, request.num_windows, self._ahead_step(request, offset, step)),
            self.backoff,
            self._on_reconnect,
            self._metadata,
        )
        reader.start()
        return reader, q

    def _ahead_step(self, request: StreamRequest, offset: int, step: int) -> int:
        """The step whose batch, once the loop takes it, opens the next epoch's stream
        (-1: never; then the epoch's end does, if `lookahead`)."""
        left = request.remaining(offset)
        if not self.lookahead or left <= 0:
            return -1
        return step + max(0, left - 1 - LOOKAHEAD_STEPS)

    def _stage(
        self, num_windows: int, ahead_step: int, msg: feeder_pb2.Batch
    ) -> tuple[dict[str, Any], int, int, Any, bool]:
        """Reader thread: a Batch message -> what the loop takes from the queue: (the
        batch dict, the loop's offset and step after it, the device copy to wait for
        or None, whether to open the next epoch's stream now)."""
        spent = self._spent
        while len(spent) > 1:  # not the newest: the loop may still hold it (see _next)
            spent.popleft()
        arr = batch_array(msg)
        docs = (
            None
            if not (self.documents or self.mask_cross_document_labels)
            else document_arrays(
                msg,
                arr,
                self.seq_len,
                self.documents,
                self.mask_cross_document_labels,
                self.layout,
            )
        )
        if self._stager is None:
            inputs, labels = views(arr, self.seq_len, msg.shift, self.layout)
            pending = None
        else:
            inputs, labels, docs, pending = self._stager.stage_views(
                arr, self.seq_len, msg.shift, self.layout, docs
            )
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
        if docs is not None:
            batch.update(docs)  # masked labels replace the view
        offset = min(msg.offset + self.batch_size * self.world_size, num_windows)
        return batch, offset, msg.step + 1, pending, msg.step == ahead_step

    def _next(self, reader: StreamReader, first: bool = False) -> dict[str, Any]:
        """The training loop's next(): the only place the loop can wait.

        Kept short: the reader thread prepared everything (`_stage`), and the metrics
        are one append (`ClientMetrics.waited`). `first`: the iteration's
        first next(), whose wait is the stream's time to first batch, counted apart.
        """
        if reader is not self._reader:
            if self._done or self._closed:
                raise StopIteration
            raise RuntimeError(
                "this iteration was ended by a newer one (iter, set_epoch, "
                "load_state_dict or close)"
            )
        q = self._queue
        t0 = perf_counter()
        try:
            item = q.get_nowait()  # type: ignore[union-attr]
        except queue.Empty:
            item = self._wait(q, reader, None if first else t0)  # type: ignore[arg-type]
        t1 = perf_counter()
        if type(item) is tuple:
            batch, self._offset, self._step, pending, ahead = item
            if first:
                self.metrics.first_batch_waited(t1 - t0, t1)
            else:
                self.metrics.waits.append(t1 - t0)  # folded in by the reader thread
            if pending is not None:
                self._stager.ready(*pending)
            if ahead:
                self._open_ahead(reader)
            # The previous batch: the loop drops it when it rebinds its variable to this
            # one, and freeing it (tensors, views, the dict) costs up to tens of us after
            # a step's sleep. One more reference, in `_spent`, makes the reader thread
            # (`_stage`) free it instead.
            self._spent.append(self._held)
            self._held = batch
            return batch
        self.metrics.waited(t1 - t0)
        with self._lock:
            if item is END:
                self._done = True
                self._reader, self._queue = None, None
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
            and reader.request.epoch == self._epoch
            and (reader is self._reader or self._done)
        ):
            self._ahead = self._open(self._epoch + 1, 0, 0)

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

    @property
    def first_batch_seconds(self) -> float | None:
        """How long the latest iteration's first next() waited for its stream's first
        batch (connect, first chunk); None before one. Reported apart from the
        steady-state wait and stall: see `tokenfeed.client.metrics`."""
        return self.metrics.first_batch_seconds

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
            self._held = None
            self._spent.clear()
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
        self._first = True  # the next next() waits for the stream's first batch

    def __iter__(self) -> _Epoch:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._finished:
            raise StopIteration
        try:
            batch = self._client._next(self._reader, self._first)
        except BaseException:
            self._finished = True
            raise
        self._first = False
        return batch

    def __len__(self) -> int:
        return len(self._client)


def _endless(offset: int) -> int:
    """Steps a mixture stream has left: always some (it is endless)."""
    return 1


def _mixture_info(response: feeder_pb2.InfoResponse, seq_len: int) -> DatasetInfo:
    """A mixture's DatasetInfo: its sources' shared dtype and vocabulary (the first
    source's metadata), the train split, and an endless stream (steps 0)."""
    if not response.datasets:
        raise NotFound("the feeder reports none of the mixture's sources")
    ds = response.datasets[0]
    return DatasetInfo(
        name=",".join(d.name for d in response.datasets),
        total_tokens=sum(int(d.total_tokens) for d in response.datasets),
        vocab_size=int(ds.vocab_size) or None,
        eos_token_id=None if ds.eos_token_id < 0 else int(ds.eos_token_id),
        dtype=ds.dtype,
        tokenizer=ds.tokenizer or None,
        split="train",
        split_tokens=sum(int(d.splits[0].tokens) for d in response.datasets if d.splits),
        windows=MAX_TOKENS // seq_len,
        steps=0,
        source_windows=tuple(int(s.windows) for s in response.sources),
    )


def _dataset_info(response: feeder_pb2.InfoResponse, dataset: str, split: str) -> DatasetInfo:
    for ds in response.datasets:
        if ds.name == dataset:
            for s in ds.splits:
                if s.name == split:
                    return DatasetInfo(
                        name=ds.name,
                        total_tokens=int(ds.total_tokens),
                        vocab_size=int(ds.vocab_size) or None,
                        eos_token_id=None if ds.eos_token_id < 0 else int(ds.eos_token_id),
                        dtype=ds.dtype,
                        tokenizer=ds.tokenizer or None,
                        split=split,
                        split_tokens=int(s.tokens),
                        windows=int(s.windows),
                        steps=int(s.steps),
                    )
            raise NotFound(f"the feeder reports no split {split!r} for dataset {dataset!r}")
    names = [ds.name for ds in response.datasets]
    raise NotFound(f"the feeder has no dataset {dataset!r} (it has {names})")
