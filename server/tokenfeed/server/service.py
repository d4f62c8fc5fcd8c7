"""The Feeder gRPC service: requests -> samplers -> messages from the chunk cache.

The servicer is thin on purpose: it turns a request into a `sampling.DatasetSampler` and an
`assembly.MessageBuilder`, and writes out the messages it builds. Domain errors
(errors.py) become gRPC status codes in one place, `_abort` (which code for which
outcome: docs/request.md, "Status codes"). The sample order, the store format, the
caching and the message assembly live elsewhere; the RPCs, messages and limits are
specified in docs/serving.md.

Where messages are built is a measured trade-off. Anything that may block or take
long runs in the thread pool: opening a store, loading (or waiting for) a chunk, and
messages over `INLINE_MAX_BYTES`, which are double-buffered (a worker builds the next
burst of messages while the handler writes this one). A message of at most 1 MiB
whose chunks are all cached is built on the event loop itself (assembly.py: a burst
of up to 4 messages at a time), which costs less than the thread hop plus the GIL
hand-over it would otherwise take (benchmarks/serve_throughput.py measures both).
`await context.write` waits for HTTP/2 flow control, so a stalled trainer holds at
most two bursts of messages (a few MiB) of server memory, and cancelling the call
drops them.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc

from tokenfeed.core import sampling
from tokenfeed.core.errors import (
    FeederError,
    FeederUnavailable,
    InvalidArgument,
    ResourceExhausted,
)
from tokenfeed.core.limits import MAX_PARAM, packed_batches
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.core.request import SPLITS, SamplingSpec
from tokenfeed.server import documents, wire
from tokenfeed.server.access import Access
from tokenfeed.server.assembly import Message, MessageBuilder, fit_client_limit
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Catalog, Dataset
from tokenfeed.server.inplace import KEEP_SECONDS, FilePool
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.opened import Opened, OpenedMixtures
from tokenfeed.server.shares import FairShares
from tokenfeed.server.source_counters import SourceCounters
from tokenfeed.server.starts import GIVES_WAY_AFTER, Starts
from tokenfeed.server.status import feeder_status
from tokenfeed.server.streams import OpenStreams, StreamEntry
from tokenfeed.server.tenants import Job, Tenants
from tokenfeed.v1 import feeder_pb2 as pb

log = logging.getLogger(__name__)

_T = TypeVar("_T")

try:  # what a write to a call that already ended (client gone, drain) raises
    from grpc._cython.cygrpc import ExecuteBatchError as _CallEnded
except ImportError:  # pragma: no cover - grpc's internals moved; fall back to the checks
    _CallEnded = ()

SERVICE_NAME = "tokenfeed.v1.Feeder"
INLINE_MAX_BYTES = 1 << 20  # messages up to this size from cached chunks: built on the loop
MAX_BATCHES_PER_MESSAGE = 1024  # docs/serving.md, "Limits"
# Bursts being built and written at once, between which fair shares are kept
# (shares.py); enough to keep the event loop busy while some wait for gRPC.
SHARE_SLOTS = 4
# A burst whose writes took this long in all waited for its client to read (a paced
# consumer): the stream's bursts stop growing (MessageBuilder.paced).
PACED_SECONDS = 0.1
# Dataset samplers kept for the streams that ask the same (service.sampler_for): the
# jobs a feeder serves at once, each with its train and validation requests.
SAMPLERS_KEPT = 64


# ----------------------------------------------------------------- requests -> samplers


def block_tokens(ds: Dataset) -> int:
    """Shuffle blocks are about one chunk of tokens."""
    meta = ds.store.meta
    tokens = meta.tokens_per_chunk or max((c.tokens for c in meta.chunks), default=0)
    return max(1, min(tokens or sampling.DEFAULT_BLOCK_TOKENS, MAX_PARAM))


def sampler_for(spec: SamplingSpec, ds: Dataset) -> sampling.DatasetSampler:
    """The spec's sampler over a dataset (FailedPrecondition if its split is too short)."""
    return _dataset_sampler(spec, ds.store.total_tokens, block_tokens(ds))


@functools.lru_cache(maxsize=SAMPLERS_KEPT)
def _dataset_sampler(
    spec: SamplingSpec, total_tokens: int, block_tokens: int
) -> sampling.DatasetSampler:
    """One sampler per request (the rank aside) and store size: the ranks of a job
    share it, and with it its epoch orders (a rank's start no longer keys every shuffle
    group it reads again)."""
    return sampling.DatasetSampler(spec, total_tokens, block_tokens=block_tokens)


def mixture_sampler_for(spec: SamplingSpec, sources: list[Dataset]) -> MixtureSampler:
    """A mixture spec's sampler over its sources' stores (FailedPrecondition naming a
    source without a train window)."""
    return MixtureSampler(
        spec,
        tuple(ds.store.total_tokens for ds in sources),
        tuple(block_tokens(ds) for ds in sources),
    )


def _describe(resp: pb.InfoResponse, ds: Dataset) -> pb.DatasetInfo:
    """Add `ds`'s DatasetInfo (metadata, no splits yet) to `resp`."""
    meta = ds.store.meta
    return resp.datasets.add(
        name=ds.name,
        total_tokens=ds.store.total_tokens,
        num_chunks=ds.store.num_chunks,
        dtype=meta.dtype,
        vocab_size=meta.vocab_size or 0,
        eos_token_id=-1 if meta.eos_token_id is None else meta.eos_token_id,
        tokenizer=meta.tokenizer or "",
        tokens_per_chunk=meta.tokens_per_chunk or 0,
    )


# --------------------------------------------------------------------------- service


@dataclass
class _Undecodable:
    """What the request deserializer returns for bytes that are not a valid request."""

    error: str


@dataclass(frozen=True)
class Received:
    """A decoded request, and its params' bytes as the client sent them (what a large
    mixture's spec is remembered by: SamplingSpec.from_proto), None if not sent once."""

    message: Any
    params: memoryview | None


def _safe_parse(message_type: Any) -> Callable[[bytes], Received | _Undecodable]:
    params = message_type.DESCRIPTOR.fields_by_name["params"].number

    def parse_or_mark(data: bytes) -> Received | _Undecodable:
        try:
            message = message_type.FromString(data)
        except Exception as e:  # reported as INVALID_ARGUMENT
            return _Undecodable(f"{type(e).__name__}: {e}")
        return Received(message, wire.field_bytes(data, params))

    return parse_or_mark


class FeederService:
    """The `tokenfeed.v1.Feeder` servicer."""

    def __init__(
        self,
        catalog: Catalog,
        cache: ChunkCache,
        metrics: ServerMetrics,
        executor: Executor,
        max_streams: int,
        max_batch_bytes: int,
        tenants: Tenants | None = None,
        shares: FairShares | None = None,
    ) -> None:
        self.catalog = catalog
        self.cache = cache
        self.metrics = metrics
        self.executor = executor
        self.max_streams = max_streams
        self.max_batch_bytes = max_batch_bytes
        self.active_streams = 0
        self.starts = Starts()  # streams being prepared on worker threads, ahead of the rest
        self.draining = False
        self.access = Access(catalog, tenants)  # who a call is, what it may read
        self.shares = shares if shares is not None else FairShares(SHARE_SLOTS)
        self.streams = OpenStreams()  # the calls in progress (status page, audit)
        # the chunk files streams read in place, shared, kept a while after the last
        self.files = FilePool(KEEP_SECONDS)
        self._expiry: asyncio.TimerHandle | None = None  # when the kept ones may close
        self.mixtures = OpenedMixtures(catalog, self.access, mixture_sampler_for)
        self.source_counters: dict[str, Any] = {}  # a source's two counters, by its name

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler to register. Responses of StreamBatches are pre-serialized
        in the worker threads, so the event loop only moves bytes."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Info": grpc.unary_unary_rpc_method_handler(
                    self.Info,
                    request_deserializer=_safe_parse(pb.InfoRequest),
                    response_serializer=pb.InfoResponse.SerializeToString,
                ),
                "StreamBatches": grpc.unary_stream_rpc_method_handler(
                    self.StreamBatches,
                    request_deserializer=_safe_parse(pb.StreamBatchesRequest),
                    response_serializer=bytes,
                ),
            },
        )

    # ---------------------------------------------------------------- errors

    async def _abort(
        self,
        context: grpc.aio.ServicerContext,
        code: str,
        message: str,
        entry: StreamEntry | None = None,
    ) -> NoReturn:
        """The one place a call ends with an error status (counted by code): grpc's
        context.abort raises AbortError, which ends the call."""
        self.metrics.errors.labels(code=code).inc()
        if entry is not None:
            entry.outcome = code
        await context.abort(getattr(grpc.StatusCode, code), self.catalog.redact(message))
        raise AssertionError("context.abort returned instead of raising AbortError")

    async def _run_guarded(
        self,
        context: grpc.aio.ServicerContext,
        coro: Awaitable[_T],
        entry: StreamEntry | None = None,
    ) -> _T | None:
        try:
            return await coro
        except FeederError as e:
            await self._abort(context, e.code, e.message, entry)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except _CallEnded:
            log.debug("stream ended by the client or the drain during a write")
            return None
        except Exception as e:  # a bug must not take the server down
            if context.cancelled() or context.done() or self.draining:
                # the client went away, or the drain ended the call, mid-write
                # (ExecuteBatchError): a cancel, not a bug
                log.debug("stream ended by the client: %s", type(e).__name__)
                return None
            log.exception("internal error")
            await self._abort(context, "INTERNAL", f"internal error ({type(e).__name__})", entry)

    @staticmethod
    def _decoded(request: Received | _Undecodable) -> Received:
        if isinstance(request, _Undecodable):
            raise InvalidArgument(
                f"the request could not be decoded (strings must be valid UTF-8): {request.error}"
            )
        return request

    # ------------------------------------------------------------------ Info

    async def Info(self, request: Any, context: grpc.aio.ServicerContext) -> pb.InfoResponse | None:
        loop = asyncio.get_running_loop()
        try:
            job = self.access.job(context.invocation_metadata())
        except FeederError as e:
            await self._abort(context, e.code, e.message)
        return await self._run_guarded(
            context, loop.run_in_executor(self.executor, self._info, request, job)
        )

    def _info(self, received: Received | _Undecodable, job: Job) -> pb.InfoResponse:
        received = self._decoded(received)
        request = received.message
        if request.HasField("params") and len(request.params.sources):
            mix = SamplingSpec.from_proto(request.params, wire=received.params)
            with self.catalog.names_once():
                opened = self.mixtures.open(mix, job)  # the grant, the sources, the dtypes
                return self._mixture_info(
                    mix, opened, request.rank, request.dataset, request.budget_tokens
                )
        if request.dataset:
            self.access.real_names(job, request.dataset)
            found = [self.catalog.get(request.dataset)]
        else:
            found = self.access.datasets(job)
        resp = pb.InfoResponse()
        for ds in found:
            spec = None
            if request.HasField("params"):
                spec = SamplingSpec.from_proto(request.params, dataset=ds.name)
            self._dataset_info(resp, ds, spec, request.rank)
        return resp

    def _dataset_info(
        self, resp: pb.InfoResponse, ds: Dataset, spec: SamplingSpec | None, rank: int
    ) -> None:
        """Add `ds`'s DatasetInfo to `resp`, with its splits under `spec` if given."""
        info = _describe(resp, ds)
        if spec is not None:
            for split in SPLITS:
                info.splits.append(self._split_info(spec.with_(split=split), ds, rank))

    def _mixture_info(
        self, spec: SamplingSpec, opened: Opened, rank: int, dataset: str, budget_tokens: int
    ) -> pb.InfoResponse:
        """Info of a mixture: each source's DatasetInfo (its splits for the params) and
        SourceInfo (train tokens and windows, and what `budget_tokens` draws)."""
        if dataset and dataset not in spec.source_names:
            raise InvalidArgument(
                f"dataset: {dataset!r} is not a source of the mixture in params",
                field="dataset",
            )
        if budget_tokens < 0:
            raise InvalidArgument(
                f"budget_tokens must be >= 0, got {budget_tokens}", field="budget_tokens"
            )
        sources, sampler = opened.space.sources, opened.sampler
        budget = sampler.budget(budget_tokens)
        resp = pb.InfoResponse()
        # each source's splits under the params: one spec per split serves them all
        one = spec.with_(sources=(), schedule=(), runtime=b"", dataset=sources[0].name)
        splits = [one.with_(split=split) for split in SPLITS]
        for ds, b, tokens in zip(sources, budget.sources, sampler.train_tokens, strict=True):
            info = _describe(resp, ds)
            for split_spec in splits:
                info.splits.append(self._split_info(split_spec, ds, rank))
            resp.sources.add(
                name=ds.name,
                tokens=tokens,
                windows=b.windows,
                windows_drawn=b.windows_drawn,
                tokens_drawn=b.tokens_drawn,
                passes=float(b.passes),
                shares=b.share_floats,
            )
        return resp

    @staticmethod
    def _split_info(spec: SamplingSpec, ds: Dataset, rank: int) -> pb.SplitInfo:
        """A split's tokens and windows for the params, and `rank`'s steps of a fresh
        epoch (0 when the split cannot fill one global batch)."""
        if not 0 <= rank < spec.world_size:
            raise InvalidArgument(f"rank must be in [0, world_size={spec.world_size}), got {rank}")
        tokens, windows = sampling.split_windows(spec, ds.store.total_tokens)
        steps = sampling.steps_per_epoch(
            windows, spec.batch_size, spec.world_size, rank, spec.split
        )
        return pb.SplitInfo(name=spec.split, tokens=tokens, windows=windows, steps=steps)

    # --------------------------------------------------------- StreamBatches

    def _prepare_stream(
        self, request: Any, entry: StreamEntry
    ) -> tuple[MessageBuilder, bytes | None]:
        """The stream's message builder, and what the first response tells the client
        beside its batches (`describe`, `message_bytes`), if it asked."""
        with self.catalog.names_once():  # the grant's check and the opening share lookups
            return self._prepare(request, entry)

    def _prepare(self, received: Any, entry: StreamEntry) -> tuple[MessageBuilder, bytes | None]:
        received = self._decoded(received)
        request = received.message
        spec = SamplingSpec.from_proto(request.params, wire=received.params)
        assert entry.job is not None
        entry.world_size = spec.world_size
        ds: Dataset
        sampler: sampling.DatasetSampler | MixtureSampler
        opened: Opened | None = None
        if spec.is_mixture:  # kept from an open of the same mixture where it can be
            opened = self.mixtures.open(spec, entry.job)
            entry.real, ds, sampler = opened.real, opened.space, opened.sampler
        else:
            entry.real = self.access.check(entry.job, spec)
            ds = self.catalog.get(spec.dataset)
            sampler = sampler_for(spec, ds)
        if not 0 <= request.batches_per_message <= MAX_BATCHES_PER_MESSAGE:
            raise InvalidArgument(
                f"batches_per_message must be in [0, {MAX_BATCHES_PER_MESSAGE}] (0 or 1 = one "
                f"batch per message), got {request.batches_per_message}"
            )
        if request.epoch < 0 or request.step < 0:
            raise InvalidArgument(
                f"epoch and step must be non-negative, got epoch={request.epoch} "
                f"step={request.step}"
            )
        if isinstance(sampler, MixtureSampler):
            if request.epoch != 0:
                raise InvalidArgument(
                    f"epoch: a mixture stream is endless and has no epochs; epoch must be 0, "
                    f"got {request.epoch}",
                    field="epoch",
                )
            sampler.check(request.rank, request.offset, request.step)
        else:
            sampler.steps(request.rank, request.offset)  # validates rank and offset
        if request.message_bytes < 0:
            raise InvalidArgument(
                f"message_bytes must be non-negative, got {request.message_bytes}",
                field="message_bytes",
            )
        wanted = request.batches_per_message
        if request.message_bytes:  # the client leaves the count to the dtype, unknown to it
            itemsize = ds.store.dtype.itemsize
            wanted = packed_batches(
                request.message_bytes, sampler.batch_size, sampler.seq_len, itemsize
            )
        cols = sampler.seq_len + sampler.max_shift
        per_message = fit_client_limit(
            max(1, wanted),
            request.max_message_bytes,
            sampler.batch_size,
            cols,
            ds.store.dtype.itemsize,
            request.document_ends,
        )
        message_bytes = per_message * sampler.batch_size * cols * ds.store.dtype.itemsize
        if message_bytes > self.max_batch_bytes:  # the same as MessageBuilder.message_bytes
            raise InvalidArgument(
                f"a message of {per_message} batch(es) x {sampler.batch_size} rows x {cols} tokens "
                f"x {ds.store.dtype.itemsize} bytes = {message_bytes} bytes exceeds the server's "
                f"--max-batch-bytes {self.max_batch_bytes}; lower batch_size or "
                "batches_per_message (or raise --max-batch-bytes)"
            )
        then = None  # a mixture has no epochs: its passes run on within one order
        if isinstance(sampler, MixtureSampler):
            rounds = sampler.rounds(request.rank, request.offset, request.step)
        else:
            rounds = sampler.rounds(request.epoch, request.rank, request.offset, request.step)
            then = sampler.rounds(request.epoch + 1, request.rank)  # a generator: nothing runs yet
        ends = documents.for_dataset(ds) if request.document_ends else None
        pipe = MessageBuilder(
            ds,
            sampler,
            rounds,
            per_message,
            self.cache,
            self.metrics,
            ends,
            then=then,
            files=self.files,
        )
        header = None
        if request.describe or request.message_bytes:  # what the client did not know
            header = pb.StreamBatchesResponse(batches_per_message=per_message)
            if request.describe and opened is not None:
                header.info.CopyFrom(self._mixture_info(spec, opened, request.rank, "", 0))
            elif request.describe:  # what Info says, the access checked above
                self._dataset_info(header.info, ds, spec, request.rank)
        return pipe, None if header is None else header.SerializeToString()

    def _admit(self, entry: StreamEntry) -> None:
        """The feeder's and the job's stream limits: the error that refuses the call."""
        if self.draining:
            raise FeederUnavailable("the feeder is shutting down; retry on another replica")
        if self.active_streams >= self.max_streams:
            raise ResourceExhausted(
                f"the feeder already serves {self.active_streams} streams (--max-streams "
                f"{self.max_streams}); retry later or add a replica"
            )
        self.streams.check_limit(entry)

    async def StreamBatches(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        entry = StreamEntry.of(
            None if isinstance(request, _Undecodable) else request.message, context.peer()
        )
        try:
            entry.job = self.access.job(context.invocation_metadata())
            self._admit(entry)
        except FeederError as e:
            try:
                await self._abort(context, e.code, e.message, entry)
            finally:
                self.streams.remove(entry)  # the refusal's record
        self.active_streams += 1
        self.metrics.streams_active.inc()
        self.streams.add(entry)
        entry.task = asyncio.current_task()
        try:
            await self._run_guarded(context, self._stream(request, context, entry), entry)
        except asyncio.CancelledError:
            if entry.revoked is None:
                raise
            # a reload withdrew the token or the grant (set_tenants): the cancel was ours
            await self._abort(context, entry.revoked.code, entry.revoked.message, entry)
        finally:
            self.active_streams -= 1
            self.metrics.streams_active.dec()
            self.streams.remove(entry)

    async def _stream(
        self, request: Any, context: grpc.aio.ServicerContext, entry: StreamEntry
    ) -> None:
        loop = asyncio.get_running_loop()
        with self.starts.preparing_one():
            pipe, header = await loop.run_in_executor(
                self.executor, self._prepare_stream, request, entry
            )
        self.streams.opened(entry)
        labels = {"dataset": pipe.ds.name, "split": pipe.sampler.split}
        batches_sent = self.metrics.batches_sent.labels(**labels)
        tokens_sent = self.metrics.tokens_sent.labels(**labels, source="")
        bytes_sent = self.metrics.bytes_sent.labels(**labels)
        by_source = SourceCounters.of(self.metrics, pipe, self.source_counters)
        small = pipe.message_bytes <= INLINE_MAX_BYTES
        shares, per_job = self.shares, self.streams.per_job
        estimate = pipe.message_bytes * pipe.burst_messages  # a turn's bytes, until known
        building: asyncio.Future[list[Message]] | None = None

        def count(messages: list[Message]) -> None:
            batches = sum(g[1] for g in messages)
            entry.sent(batches, sum(g[2] for g in messages))
            batches_sent.inc(batches)
            if by_source is None:
                tokens_sent.inc(sum(g[2] for g in messages))
                bytes_sent.inc(sum(g[3] for g in messages))
            else:
                by_source.count(len(messages))

        burst: list[Message] = []
        written = 0  # messages of `burst` written and not yet counted
        bursts = 0
        try:
            while True:
                job = entry.job
                assert job is not None
                # turns only while jobs compete: one job alone has nothing to divide
                turn = None
                if len(per_job) > 1 or shares.busy:
                    acct = shares.account(job.name, job.weight)  # a reload may move the stream
                    turn = shares.try_enter(acct, estimate) or await shares.enter(acct, estimate)
                try:
                    if building is not None:
                        burst, building = await building, None
                    else:
                        # rows read in place on the loop: a first batch always (what a
                        # storm's ranks wait for; a hop costs more than its reads), later
                        # ones only while no stream is being prepared (a busy loop holds
                        # the GIL, which the preparations on worker threads wait for)
                        reads = not bursts or not self.starts.preparing
                        burst = pipe.next_burst(inline=True, read_files=reads) if small else []
                        if not burst and not pipe.finished:
                            burst = await loop.run_in_executor(self.executor, pipe.next_burst)
                    if not burst:
                        if header is not None:  # an epoch with nothing left to send
                            await context.write(header)
                        entry.outcome = "ok"
                        return
                    if not small:  # double buffering: build the next burst while writing
                        building = loop.run_in_executor(self.executor, pipe.next_burst)
                    began = loop.time()
                    for data, _, _, _ in burst:
                        if header is not None:  # one message: the fields merge (protobuf)
                            data, header = header + data, None
                        await context.write(data)  # waits for HTTP/2 flow control
                        written += 1
                    if loop.time() - began >= PACED_SECONDS:
                        pipe.paced()
                finally:
                    if turn is not None:
                        shares.leave(turn, sum(g[3] for g in burst[:written]))
                # counted once per burst, after it is written: fewer metric updates per message
                count(burst)
                written = 0
                bursts += 1
                if bursts >= GIVES_WAY_AFTER:  # streams starting go first (starts.py)
                    await self.starts.give_way()
        finally:
            if building is not None:
                building.cancel()  # a running build finishes its burst; the result is dropped
            if written:  # the stream ended mid-burst: what went on the wire still counts
                count(burst[:written])
            pipe.close()
            if pipe.files is not None and self._expiry is None:
                self._expiry = loop.call_later(self.files.keep_seconds, self._expire_files)
            if by_source is not None:
                by_source.flush()  # what was written and not yet counted

    def _expire_files(self) -> None:
        """Close the chunk files kept for no stream once their time is up; if streams
        read in place meanwhile, the last of them to end asks again."""
        left = self.files.expire()
        self._expiry = None
        if left is not None:
            self._expiry = asyncio.get_running_loop().call_later(left, self._expire_files)

    # -------------------------------------------------------- reloads, status

    def set_tenants(self, tenants: Tenants | None) -> None:
        """A reload's jobs: new calls are checked against them, and an open stream whose
        token was withdrawn, or whose stores left its job's grant, ends with
        UNAUTHENTICATED or PERMISSION_DENIED (StreamEntry.revoke)."""
        self.access.tenants = tenants
        for entry in list(self.streams.entries.values()):
            outcome = self.access.recheck(entry)
            if isinstance(outcome, FeederError):
                entry.revoke(outcome)
            else:
                self.streams.rejob(entry, outcome)
        for job in tenants.jobs if tenants is not None else ():
            if job.name in self.shares.accounts:
                self.shares.account(job.name, job.weight)

    def status(self) -> dict[str, Any]:
        """What the status page shows of this process (status.py)."""
        return feeder_status(self.catalog, self.cache, self.streams)
