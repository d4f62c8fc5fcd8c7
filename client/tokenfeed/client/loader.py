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

The client is a composition of small parts (docs/client.md): `options` and
`connection` check its arguments (the request, the rank, delivery; where the feeder
is and how to reach it) before any feeder is contacted; `position` is the position
of the first batch the loop has not received and what `set_epoch`, `state_dict`,
`load_state_dict`, the end of an epoch and `steps_left` do to it; `epochs` runs one
stream per iteration (a `stream` reader thread, reconnecting over `transport`, into
a `handoff` queue, each batch staged by `buffers` and `device`) and the next epoch's
ahead of time; `metrics` counts; `info` is the feeder's Info answer. This module
puts them together behind the one public class.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from prometheus_client import CollectorRegistry

from tokenfeed.client import allocator
from tokenfeed.client.buffers import NumpyStager
from tokenfeed.client.connection import (
    Backoff,
    Connection,
    Pem,
    Security,
    Timeouts,
    alone,
    with_connect_timeout,
)
from tokenfeed.client.epochs import Epochs
from tokenfeed.client.info import DatasetInfo, KnownInfo, dataset_info, mixture_info
from tokenfeed.client.metrics import ClientMetrics
from tokenfeed.client.options import Options, document_outputs, resolve_rank, sampling_spec
from tokenfeed.client.position import Position, no_epochs
from tokenfeed.client.stream import call_with_retry
from tokenfeed.client.transport import Channels
from tokenfeed.core.request import SamplingSpec
from tokenfeed.v1 import feeder_pb2


class FeederClient:
    """Streams this rank's batches from a feeder; see the module docstring.

    Batches are dicts: `input_ids`, `labels` (read-only numpy views of one buffer
    when `device` is None, else two independent contiguous int64 tensors on the
    device; docs/client.md, "Devices and layouts"), `shift`, `epoch`, `step`,
    `offset` and `starts` (int64 numpy array: the store offset of each window); a
    mixture's also `sources` (int64 numpy array: each row's index into `sources`).

    Sampling (`dataset` .. `shuffle_blocks`, `world_size`) becomes a SamplingSpec,
    validated here before any feeder is contacted (InvalidArgument, a ValueError,
    naming the field), with the defaults every part uses: `stride` = `seq_len`,
    `split_rate` 1.0 (everything is train), shift 1, `shuffle_blocks` 8. A ready
    `spec=` may be passed instead. `rank`/`world_size` default to RANK/WORLD_SIZE.
    `mixture=` (a dict, a list of (name, weight) pairs, or the path of a YAML/JSON
    file `{sources: {...}, schedule: [{from_tokens, weights}]}`) and `schedule=`
    blend several datasets' train splits by weight into one endless stream
    (docs/mixtures.md): `len()` and `steps_left` raise TypeError, `set_epoch(e > 0)`
    is an error, and a checkpoint resumes with another world size or batch size or
    with segments added at or after its position.

    Delivery (`options.Options`): `prefetch` batches are buffered (at least: all
    batches of one message may wait, <= ~1 MiB with auto packing);
    `batches_per_message` None packs ~1 MiB per gRPC message (its per-message cost
    dominates small batches). `lookahead` opens the next epoch's stream
    `LOOKAHEAD_STEPS` steps before this one ends, adopted by `set_epoch(epoch + 1)`.
    `documents` (True, or some of position_ids, document_ids, cu_seqlens,
    max_seqlen) and `mask_cross_document_labels` keep attention and loss inside each
    document (docs/documents.md). `first_batch_seconds` and `metrics` report the
    wait for each stream's first batch apart from the steady-state wait and stall;
    `registry`/`metrics_port` (bound to `metrics_addr`): see `metrics`.

    Where the feeder is and how to reach it is one `Connection` (`connection=`), or
    the address and the flat keywords that build it:
    `tls`, `root_certificates`, `certificate_chain`/`private_key` (mutual TLS; PEM
    bytes or paths) and `token` (sent as `authorization: Bearer <token>`) match the
    server's options; `timeouts` (`Timeouts`) bound how long a client that has never
    reached a feeder tries before it raises FeederUnavailable, the keepalive that
    detects a black-holed connection, one connection attempt, and unary calls;
    `connect_timeout` (seconds, default 30) is a shorthand for
    `Timeouts.connect_timeout`; `backoff` bounds reconnects once a feeder answered.

    Every argument is checked here (TypeError, ValueError), the device too; the
    first stream (the first iteration) or Info call (`len`, `dataset_info` before
    it) contacts the feeder; the stream tells what Info would, so iterating first
    needs no Info call.
    `len(loader)` is the steps of a FULL epoch for this rank at this world size,
    `steps_left` what remains of the current one from the position.
    """

    def __init__(
        self,
        address: str | Sequence[str] | None = None,
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
        root_certificates: Pem | None = None,
        certificate_chain: Pem | None = None,
        private_key: Pem | None = None,
        token: str | None = None,
        backoff: Backoff | None = None,
        timeouts: Timeouts | None = None,
        lookahead: bool = True,
        connect_timeout: float | None = None,
        documents: bool | Sequence[str] = False,
        mask_cross_document_labels: bool = False,
        connection: Connection | None = None,
    ) -> None:
        from tokenfeed.client.device import check_device, resolve_device

        # Every check first, before anything is started or contacted.
        options = Options(
            layout=layout,
            prefetch=prefetch,
            batches_per_message=batches_per_message,
            lookahead=lookahead,
            documents=document_outputs(documents),
            mask_cross_document_labels=mask_cross_document_labels,
            registry=registry,
            metrics_port=metrics_port,
            metrics_addr=metrics_addr,
        )
        if connection is None:  # the flat keywords describe one
            if address is None:
                raise TypeError("FeederClient needs the feeder's address (or connection=)")
            connection = Connection(
                address,
                security=Security(tls, root_certificates, certificate_chain, private_key),
                token=token,
                timeouts=with_connect_timeout(timeouts, connect_timeout),
                backoff=backoff,
            )
        else:
            alone(
                connection,
                address=address,
                tls=tls,
                root_certificates=root_certificates,
                certificate_chain=certificate_chain,
                private_key=private_key,
                token=token,
                timeouts=timeouts,
                backoff=backoff,
                connect_timeout=connect_timeout,
            )
        self.connection = connection
        spec = sampling_spec(
            spec,
            world_size,
            os.environ,
            dataset=dataset,
            mixture=mixture,
            schedule=schedule,
            seq_len=seq_len,
            batch_size=batch_size,
            split=split,
            split_rate=split_rate,
            stride=stride,
            shift=shift,
            seed=seed,
            shuffle=shuffle,
            shuffle_blocks=shuffle_blocks,
        )
        self.rank = resolve_rank(rank, spec.world_size, os.environ)
        self.device = resolve_device(device)
        if self.device is not None:
            check_device(self.device)  # imports torch

        self.options = options
        # The public names of the request's and the options' values.
        self.dataset, self.split = spec.dataset, spec.split
        self.world_size, self.seq_len, self.batch_size = (
            spec.world_size,
            spec.seq_len,
            spec.batch_size,
        )
        self.sources: tuple[str, ...] = spec.source_names  # a mixture's, in request order
        self.layout, self.prefetch = options.layout, options.prefetch
        self.batches_per_message, self.lookahead = options.batches_per_message, options.lookahead
        self.documents = options.documents
        self.mask_cross_document_labels = options.mask_cross_document_labels

        allocator.tune()  # the process's malloc, for its streams' messages
        self._channels = Channels(self.connection, start=self.rank)
        self.metrics = ClientMetrics(self.rank, options.registry)
        if options.metrics_port is not None:
            self.metrics.serve(options.metrics_port, options.metrics_addr)
        stage = (self.seq_len, self.layout, self.documents, self.mask_cross_document_labels)
        stager: Any = NumpyStager(*stage)
        if self.device is not None:
            from tokenfeed.client.device import make_stager  # imports torch

            stager = make_stager(self.device, *stage)
        self._info = KnownInfo(self._parse_info, self._ask_info)
        self._reconnects = 0
        self._position = Position(spec, self.rank)
        self.metrics.track_weights(self._position.weights_in_force)
        self._epochs = Epochs(
            spec,
            self.rank,
            options,
            self._position,
            self._channels,
            self.metrics,
            stager,
            self._info,
            self._on_reconnect,
        )

    # ------------------------------------------------------------------ request
    @property
    def spec(self) -> SamplingSpec:
        """The request: the arguments' SamplingSpec, with a mixture's run-time segments."""
        return self._position.spec

    @property
    def backoff(self) -> Backoff:
        """The reconnect backoff (`connection.backoff`)."""
        return self.connection.backoff

    @property
    def fingerprint(self) -> str:
        """Hash of what defines the epoch order (SamplingSpec.fingerprint): world size,
        rank and batch size are left out, so a resume may change them."""
        return self.spec.fingerprint()

    @property
    def dataset_info(self) -> DatasetInfo:
        """The dataset's metadata and this request's windows and steps: what the first
        stream told, else one Info call; then cached (the store and the request do not
        change)."""
        return self._info.get()

    def _ask_info(self) -> feeder_pb2.InfoResponse:
        request = feeder_pb2.InfoRequest(
            dataset=self.dataset, params=self.spec.to_proto(), rank=self.rank
        )
        metadata = self.connection.metadata
        response: feeder_pb2.InfoResponse = call_with_retry(
            self._channels,
            lambda stub, timeout: stub.Info(request, metadata=metadata, timeout=timeout),
            self._on_reconnect,
            f"rank {self.rank}: Info",
        )
        return response

    def _parse_info(self, response: feeder_pb2.InfoResponse) -> DatasetInfo:
        if self.is_mixture:  # Info checked the sources (NOT_FOUND, FAILED_PRECONDITION)
            return mixture_info(response, self.seq_len)
        return dataset_info(response, self.dataset, self.split)

    @property
    def is_mixture(self) -> bool:
        return self.spec.is_mixture

    def __len__(self) -> int:
        """Steps of a full epoch for this rank at the current world size (see
        `steps_left` for what remains of the current epoch)."""
        if self.is_mixture:
            raise no_epochs()
        return self.dataset_info.steps

    @property
    def steps_left(self) -> int:
        """Steps this rank will still receive in the current epoch from the current
        position (right after `load_state_dict`, counted at this client's world size)."""
        if self.is_mixture:
            raise no_epochs()  # before the Info call
        return self._position.steps_left(self.dataset_info.windows)

    # ---------------------------------------------------------------- position
    def set_epoch(self, epoch: int) -> None:
        """Start `epoch` from its start, except right after `load_state_dict` of that
        same epoch: the usual `for epoch in range(saved, n): set_epoch(epoch)` resume
        loop keeps the loaded position (docs/client.md, "Epochs")."""
        self._epochs.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """Position of the first batch the training loop has not received (and, for a
        mixture, the mixture itself: a resume checks its sources and schedule)."""
        return self._position.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()`, also at another world size (ValueError,
        changing nothing, if it was saved for another order); a mixture's run-time
        weight changes are the saved ones from then on."""
        self._epochs.load_state_dict(state)

    # ---------------------------------------------------------- run-time weights
    def set_weights(self, weights: Mapping[str, float | str], *, at_step: int | None = None) -> int:
        """From global step `at_step` on (None: the next step the loop has not
        received), the mixture follows `weights` (every source named, as in a schedule
        segment); returns that step (docs/mixtures.md, "Run-time weights").

        It adds the segment from the step's position (after an elastic resume too):
        the run streams exactly the batches of a run constructed with that segment in
        its schedule. Every rank calls it with the same arguments at the same step.
        Batches buffered from the old weights are dropped and asked for again. Bad
        weights, a source not in the mixture, a step in the past or before the first
        batch, or before the last change: InvalidArgument (a ValueError), and nothing
        changes; a single-dataset loader: TypeError."""
        return self._epochs.set_weights(weights, at_step)

    @property
    def weights(self) -> dict[str, float]:
        """A mixture's normalized weights at the loop's position (the next step's)."""
        if not self.is_mixture:
            raise TypeError(f"weights are a mixture's; this loader streams {self.dataset!r}")
        return self._position.weights_in_force()

    @property
    def schedule(self) -> list[tuple[int, dict[str, str]]]:
        """A mixture's segments in force from token 0: `(from_tokens, {name: weight as
        a decimal string})`, the constructor's schedule and the run-time changes merged
        by from_tokens (a run-time change wins at an equal from_tokens)."""
        if not self.is_mixture:
            raise TypeError(f"a schedule is a mixture's; this loader streams {self.dataset!r}")
        return self._position.spec.mixture.schedule()

    # --------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Stream from the current position to the end of the epoch. Starting a new
        iteration ends the previous one (its buffered batches were never delivered,
        so the position is unaffected); iterating again after an epoch ran to its end
        runs it again from its start, like a DataLoader without `set_epoch`."""
        return self._epochs.iterate(self)

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

    def close(self) -> None:
        """End the stream, the reader thread and the metrics server; release the channel
        (closed unless another client of the process holds it)."""
        if self._epochs.close():
            self._channels.close()
            self.metrics.close()

    def __enter__(self) -> FeederClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
