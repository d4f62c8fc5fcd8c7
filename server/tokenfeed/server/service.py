"""The Feeder gRPC service: requests -> sampling plans -> batches from the chunk cache.

The servicer is thin on purpose: it turns a request into a `sampling.Plan`, asks the
plan for `BatchPlan`s, gathers their rows from the shared `ChunkCache` and writes
them out. Domain errors (errors.py) become gRPC status codes in one place,
`_abort`. The sample order, the store format and the caching live elsewhere.

Where batches are built is a measured trade-off. Anything that may block or take
long runs in the thread pool: opening a store, loading (or waiting for) a chunk, and
messages over `INLINE_MAX_BYTES`, which are double-buffered (a worker builds the next
group of messages while the handler writes this one). A message of at most 1 MiB
whose chunks are all cached is built on the event loop itself: that is a few dozen
microseconds of slice copies per batch, less than the thread hop plus the GIL
hand-over it would otherwise cost, and it doubles single-stream throughput at the
usual batch sizes (see benchmarks/serve_throughput.py). `await context.write` waits
for HTTP/2 flow control, so a stalled trainer holds at most two groups of messages
(a few MiB) of server memory, and cancelling the call drops them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from tokenfeed.server import sampling, wire
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.datasets import Dataset, DatasetRegistry
from tokenfeed.server.errors import FailedPrecondition, FeederError, InvalidArgument
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.v1 import feeder_pb2 as pb

log = logging.getLogger(__name__)

try:  # what a write to a call that already ended (client gone, drain) raises
    from grpc._cython.cygrpc import ExecuteBatchError as _CallEnded
except ImportError:  # pragma: no cover - grpc's internals moved; fall back to the checks
    _CallEnded = ()  # type: ignore[assignment,misc]

SERVICE_NAME = "tokenfeed.v1.Feeder"
GROUP_MESSAGES = 4  # messages built per thread-pool round trip...
GROUP_BYTES = 1 << 20  # ...unless they reach this size first
INLINE_MAX_BYTES = 1 << 20  # messages up to this size from cached chunks: built on the loop
LOOKAHEAD_BATCHES = 8  # batch plans computed ahead of assembly, their chunks prefetched
MAX_BATCHES_PER_MESSAGE = 1024


# ----------------------------------------------------------------- requests -> plans


def plan_for(params: pb.SamplingParams, ds: Dataset, split: str | None = None) -> sampling.Plan:
    """A sampling Plan from wire parameters (InvalidArgument/FailedPrecondition if bad)."""
    mode = params.WhichOneof("shift_mode")
    shift: int | str = 1
    if mode == "shift":
        shift = int(params.shift)
    elif mode == "auto_shift" and params.auto_shift:
        shift = "auto"
    meta = ds.store.meta
    block_tokens = meta.tokens_per_chunk or max((c.tokens for c in meta.chunks), default=0)
    return sampling.Plan(
        total_tokens=ds.store.total_tokens,
        split=params.split if split is None else split,
        split_rate=params.split_rate,
        seq_len=params.seq_len,
        stride=params.stride,
        batch_size=params.batch_size,
        world_size=params.world_size,
        shift=shift,
        seed=params.seed,
        shuffle=params.shuffle,
        shuffle_blocks=params.shuffle_blocks or sampling.DEFAULT_SHUFFLE_BLOCKS,
        block_tokens=max(1, min(block_tokens or sampling.DEFAULT_BLOCK_TOKENS, sampling.MAX_PARAM)),
    )


@dataclass(frozen=True)
class RowLayout:
    """Where a batch's rows live: row i = T[starts[i] : starts[i] + cols]."""

    starts: list[int]
    first: list[int]  # chunk holding each row's first token
    chunks: list[int]  # every non-empty chunk any row touches, ascending
    inside: bool  # no row crosses a chunk boundary (the common, fast case)


def locate_rows(ds: Dataset, starts: np.ndarray, cols: int) -> RowLayout:
    bounds = ds.chunk_bounds
    starts_l = starts.tolist()
    if len(starts_l) <= 64:  # pure Python beats numpy's per-call cost on small batches
        first = [bisect_right(bounds, s) - 1 for s in starts_l]
        inside = all(s + cols <= bounds[f + 1] for f, s in zip(first, starts_l, strict=True))
    else:
        cs = ds.store.chunk_starts
        first_np = np.searchsorted(cs, starts, side="right") - 1
        inside = bool((starts + cols <= cs[first_np + 1]).all())
        first = first_np.tolist()
    if inside:
        chunks = sorted(set(first))
    else:  # windows cross chunks freely: add every chunk up to each row's last token
        chunks = sorted({
            c for f, s in zip(first, starts_l, strict=True)
            for c in range(f, bisect_right(bounds, s + cols - 1))
            if bounds[c] != bounds[c + 1]
        })
    return RowLayout(starts_l, first, chunks, inside)


def gather_tokens(
    ds: Dataset, cache: ChunkCache, starts: np.ndarray, cols: int,
    layout: RowLayout | None = None,
) -> bytes:
    """The bytes of rows T[s : s + cols] for s in `starts`, in the store's dtype
    (little-endian), row after row. Windows may cross chunks.

    When every chunk is cached, they are pinned in one go and the row slices joined
    straight into the payload (`join_rows`). Otherwise chunk by chunk, one pinned at
    a time (the cache's no-deadlock rule): load or wait, copy that chunk's part of
    each row, release.
    """
    lay = layout if layout is not None else locate_rows(ds, starts, cols)
    views = pin_views(ds, cache, lay.chunks)
    if views is not None:
        try:
            return join_rows(ds, views[1], lay, cols)
        finally:
            cache.release_all(views[0])
    store, bounds = ds.store, ds.chunk_bounds
    out = np.empty((len(lay.starts), cols), dtype=store.dtype)
    for c in lay.chunks:
        load: Callable[[], np.ndarray] = lambda c=c: store.read_chunk(c)  # noqa: E731
        with cache.pinned(ds.chunk_key(c), store.chunk_nbytes(c), load) as chunk:
            _copy_rows(out, chunk, bounds, c, lay.starts, cols)
    return out.tobytes()


def pin_views(
    ds: Dataset, cache: ChunkCache, chunks: list[int]
) -> tuple[list[Any], dict[int, memoryview]] | None:
    """Pin `chunks` if all are cached: (entries to release, chunk -> byte view); else None.

    Byte views because slicing a memoryview is several times cheaper than numpy.
    """
    entries = cache.pin_resident([ds.chunk_key(c) for c in chunks])
    if entries is None:
        return None
    return entries, {c: e.view for c, e in zip(chunks, entries, strict=True)}


def row_parts(ds: Dataset, views: dict[int, memoryview], lay: RowLayout, cols: int) -> list:
    """The rows of `lay` as byte slices of pinned chunk views (no copy yet)."""
    bounds = ds.chunk_bounds
    size = ds.store.dtype.itemsize
    if lay.inside:
        return [
            views[c][(s - bounds[c]) * size : (s - bounds[c] + cols) * size]
            for c, s in zip(lay.first, lay.starts, strict=True)
        ]
    parts = []
    for c, s in zip(lay.first, lay.starts, strict=True):
        pos, end = s, s + cols
        while pos < end:  # the row's piece in chunk c, then in the next (non-empty) chunks
            if c in views:
                hi = min(end, bounds[c + 1])
                parts.append(views[c][(pos - bounds[c]) * size : (hi - bounds[c]) * size])
                pos = hi
            c += 1
    return parts


def join_rows(ds: Dataset, views: dict[int, memoryview], lay: RowLayout, cols: int) -> bytes:
    """The rows of `lay` from pinned chunk views, joined into one payload (one copy)."""
    return b"".join(row_parts(ds, views, lay, cols))


def _copy_rows(
    out: np.ndarray, chunk: np.ndarray, bounds: list[int], c: int, starts: list[int], cols: int
) -> None:
    """Copy chunk c's part of every row (rows that miss it copy nothing)."""
    a, b = bounds[c], bounds[c + 1]
    for r, s in enumerate(starts):
        lo, hi = max(s, a), min(s + cols, b)
        if lo < hi:
            out[r, lo - s : hi - s] = chunk[lo - a : hi - a]


class _StreamPipeline:
    """One stream's batch plans -> serialized messages; called from one thread at a time."""

    def __init__(
        self, ds: Dataset, plan: sampling.Plan, batches: Iterator[sampling.BatchPlan],
        per_message: int, cache: ChunkCache, metrics: ServerMetrics,
    ) -> None:
        self.ds, self.plan, self.cache, self.metrics = ds, plan, cache, metrics
        self.batches = batches
        self.per_message = per_message
        self.dtype_name = ds.store.meta.dtype
        self.pending: deque[tuple[sampling.BatchPlan, RowLayout]] = deque()
        self.exhausted = False
        self.lookahead = max(LOOKAHEAD_BATCHES, 2 * per_message)
        self.message_bytes = per_message * plan.batch_size * (
            plan.seq_len + plan.max_shift) * ds.store.dtype.itemsize
        self._planned = 0  # batch plans taken so far
        self._prefetched: dict[int, int] = {}  # chunk -> plan count when last prefetched

    def _fill(self) -> None:
        while not self.exhausted and len(self.pending) < self.per_message + self.lookahead:
            bp = next(self.batches, None)
            if bp is None:
                self.exhausted = True
                return
            layout = locate_rows(self.ds, bp.starts, self.plan.seq_len + bp.shift)
            self.pending.append((bp, layout))
            self._planned += 1
            self._prefetch(layout.chunks)

    def _prefetch(self, chunks: list[int]) -> None:
        """Read ahead the chunks of a batch planned `lookahead` batches from now (and, in
        an unshuffled order, the chunk after them). Asked again at most every 64 plans."""
        store = self.ds.store
        if not self.plan.shuffle and chunks and chunks[-1] + 1 < store.num_chunks:
            chunks = [*chunks, chunks[-1] + 1]
        for c in chunks:
            last = self._prefetched.get(c)
            if last is not None and self._planned - last < 64:
                continue
            self._prefetched[c] = self._planned
            nbytes = store.chunk_nbytes(c)
            if nbytes:
                self.cache.prefetch(self.ds.chunk_key(c), nbytes, lambda c=c: store.read_chunk(c))
        if len(self._prefetched) > 4096:
            self._prefetched.clear()

    @property
    def finished(self) -> bool:
        return self.exhausted and not self.pending

    def next_group(self, inline: bool = False) -> list[tuple[bytes, int, int, int]]:
        """Up to GROUP_MESSAGES messages (GROUP_BYTES in all); empty at the end.

        Handing over a few messages per thread-pool round trip matters: the hop to a
        worker and back costs more than building one small batch. `inline` (on the
        event loop) stops before a message that would have to wait for a chunk load.
        """
        group: list[tuple[bytes, int, int, int]] = []
        size = 0
        while len(group) < GROUP_MESSAGES and size < GROUP_BYTES:
            msg = self.next_message(inline)
            if msg is None:
                break
            group.append(msg)
            size += len(msg[0])
        return group

    def next_message(self, inline: bool = False) -> tuple[bytes, int, int, int] | None:
        """(serialized response, batches, tokens, payload bytes); None at the end or,
        `inline`, when a chunk would have to be loaded (the batches stay pending).

        The chunks of all the message's batches are pinned at once when cached (one
        cache round trip per message); otherwise each batch loads what it needs.
        """
        self._fill()
        if not self.pending:
            return None
        t0 = time.perf_counter()
        taken = [self.pending.popleft() for _ in range(min(self.per_message, len(self.pending)))]
        chunks = sorted({c for _, lay in taken for c in lay.chunks})
        views = pin_views(self.ds, self.cache, chunks)
        if views is None and inline:  # leave the message to a worker thread
            self.pending.extendleft(reversed(taken))
            return None
        encoded = []
        tokens = nbytes = 0
        itemsize = self.ds.store.dtype.itemsize
        try:
            for bp, lay in taken:
                cols = self.plan.seq_len + bp.shift
                if views is not None:  # slices of the pinned chunks, copied once by the join
                    payload = row_parts(self.ds, views[1], lay, cols)
                else:
                    payload = [gather_tokens(self.ds, self.cache, bp.starts, cols, lay)]
                size = len(lay.starts) * cols * itemsize
                encoded.append(wire.batch(
                    bp.epoch, bp.step, bp.offset, bp.shift, len(lay.starts), cols,
                    self.dtype_name, payload, size, lay.starts,
                ))
                tokens += len(lay.starts) * cols
                nbytes += size
            message = wire.response(encoded)
        finally:
            if views is not None:
                self.cache.release_all(views[0])
        elapsed = (time.perf_counter() - t0) / len(taken)
        for _ in taken:
            self.metrics.batch_build_seconds.observe(elapsed)
        return message, len(taken), tokens, nbytes


# --------------------------------------------------------------------------- service


@dataclass
class _Undecodable:
    """What the request deserializer returns for bytes that are not a valid request."""

    error: str


def _safe_parse(parse: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def parse_or_mark(data: bytes) -> Any:
        try:
            return parse(data)
        except Exception as e:  # noqa: BLE001 - reported as INVALID_ARGUMENT
            return _Undecodable(f"{type(e).__name__}: {e}")

    return parse_or_mark


class FeederService:
    """The `tokenfeed.v1.Feeder` servicer."""

    def __init__(
        self,
        registry: DatasetRegistry,
        cache: ChunkCache,
        metrics: ServerMetrics,
        executor: Executor,
        max_streams: int,
        max_batch_bytes: int,
    ) -> None:
        self.datasets = registry
        self.cache = cache
        self.metrics = metrics
        self.executor = executor
        self.max_streams = max_streams
        self.max_batch_bytes = max_batch_bytes
        self.active_streams = 0
        self.draining = False

    def handler(self) -> grpc.GenericRpcHandler:
        """The generic handler to register. Responses of StreamBatches are pre-serialized
        in the worker threads, so the event loop only moves bytes."""
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Info": grpc.unary_unary_rpc_method_handler(
                    self.Info,
                    request_deserializer=_safe_parse(pb.InfoRequest.FromString),
                    response_serializer=pb.InfoResponse.SerializeToString,
                ),
                "StreamBatches": grpc.unary_stream_rpc_method_handler(
                    self.StreamBatches,
                    request_deserializer=_safe_parse(pb.StreamBatchesRequest.FromString),
                    response_serializer=bytes,
                ),
            },
        )

    # ---------------------------------------------------------------- errors

    async def _abort(self, context: grpc.aio.ServicerContext, code: str, message: str) -> None:
        """The one place a call ends with an error status (counted by code)."""
        self.metrics.errors.labels(code=code).inc()
        await context.abort(getattr(grpc.StatusCode, code), self.datasets.redact(message))

    async def _run_guarded(self, context: grpc.aio.ServicerContext, coro: Any) -> Any:
        try:
            return await coro
        except FeederError as e:
            await self._abort(context, e.code, e.message)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except _CallEnded:
            log.debug("stream ended by the client or the drain during a write")
            return None
        except Exception as e:  # noqa: BLE001 - a bug must not take the server down
            if context.cancelled() or context.done() or self.draining:
                # the client went away, or the drain ended the call, mid-write
                # (ExecuteBatchError): a cancel, not a bug
                log.debug("stream ended by the client: %s", type(e).__name__)
                return None
            log.exception("internal error")
            await self._abort(context, "INTERNAL", f"internal error ({type(e).__name__})")

    @staticmethod
    def _decoded(request: Any) -> Any:
        if isinstance(request, _Undecodable):
            raise InvalidArgument(
                f"the request could not be decoded (strings must be valid UTF-8): {request.error}"
            )
        return request

    # ------------------------------------------------------------------ Info

    async def Info(self, request: Any, context: grpc.aio.ServicerContext) -> pb.InfoResponse:
        loop = asyncio.get_running_loop()
        return await self._run_guarded(
            context, loop.run_in_executor(self.executor, self._info, request)
        )

    def _info(self, request: Any) -> pb.InfoResponse:
        request = self._decoded(request)
        if request.dataset:
            found = [self.datasets.get(request.dataset)]
        else:
            found = self.datasets.all()
        resp = pb.InfoResponse()
        for ds in found:
            meta = ds.store.meta
            info = resp.datasets.add(
                name=ds.name,
                total_tokens=ds.store.total_tokens,
                num_chunks=ds.store.num_chunks,
                dtype=meta.dtype,
                vocab_size=meta.vocab_size or 0,
                eos_token_id=-1 if meta.eos_token_id is None else meta.eos_token_id,
                tokenizer=meta.tokenizer or "",
                tokens_per_chunk=meta.tokens_per_chunk or 0,
            )
            if request.HasField("params"):
                for split in sampling.SPLITS:
                    info.splits.append(self._split_info(request.params, ds, split, request.rank))
        return resp

    @staticmethod
    def _split_info(params: Any, ds: Dataset, split: str, rank: int) -> pb.SplitInfo:
        begin, end = sampling.split_bounds(ds.store.total_tokens, split, params.split_rate)
        try:
            plan = plan_for(params, ds, split)
        except FailedPrecondition:  # too short for this split: nothing to stream from it
            return pb.SplitInfo(name=split, tokens=end - begin, windows=0, steps=0)
        return pb.SplitInfo(
            name=split, tokens=end - begin, windows=plan.num_windows, steps=plan.steps(rank)
        )

    # --------------------------------------------------------- StreamBatches

    def _prepare_stream(self, request: Any) -> _StreamPipeline:
        request = self._decoded(request)
        ds = self.datasets.get(request.params.dataset)
        plan = plan_for(request.params, ds)
        if not 0 <= request.batches_per_message <= MAX_BATCHES_PER_MESSAGE:
            raise InvalidArgument(
                f"batches_per_message must be in [0, {MAX_BATCHES_PER_MESSAGE}] (0 or 1 = one "
                f"batch per message), got {request.batches_per_message}"
            )
        per_message = max(1, request.batches_per_message)
        if request.epoch < 0 or request.step < 0:
            raise InvalidArgument(
                f"epoch and step must be non-negative, got epoch={request.epoch} "
                f"step={request.step}"
            )
        plan.steps(request.rank, request.offset)  # validates rank and offset
        cols = plan.seq_len + plan.max_shift
        message_bytes = per_message * plan.batch_size * cols * ds.store.dtype.itemsize
        if message_bytes > self.max_batch_bytes:  # the same as _StreamPipeline.message_bytes
            raise InvalidArgument(
                f"a message of {per_message} batch(es) x {plan.batch_size} rows x {cols} tokens "
                f"x {ds.store.dtype.itemsize} bytes = {message_bytes} bytes exceeds the server's "
                f"--max-batch-bytes {self.max_batch_bytes}; lower batch_size or "
                "batches_per_message (or raise --max-batch-bytes)"
            )
        batches = plan.batches(request.epoch, request.rank, request.offset, request.step)
        return _StreamPipeline(ds, plan, batches, per_message, self.cache, self.metrics)

    async def StreamBatches(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await self._abort(
                context, "UNAVAILABLE", "the feeder is shutting down; retry on another replica"
            )
        if self.active_streams >= self.max_streams:
            await self._abort(
                context, "RESOURCE_EXHAUSTED",
                f"the feeder already serves {self.active_streams} streams (--max-streams "
                f"{self.max_streams}); retry later or add a replica",
            )
        self.active_streams += 1
        self.metrics.streams_active.inc()
        try:
            await self._run_guarded(context, self._stream(request, context))
        finally:
            self.active_streams -= 1
            self.metrics.streams_active.dec()

    async def _stream(self, request: Any, context: grpc.aio.ServicerContext) -> None:
        loop = asyncio.get_running_loop()
        pipe = await loop.run_in_executor(self.executor, self._prepare_stream, request)
        labels = {"dataset": pipe.ds.name, "split": pipe.plan.split}
        batches_sent = self.metrics.batches_sent.labels(**labels)
        tokens_sent = self.metrics.tokens_sent.labels(**labels)
        bytes_sent = self.metrics.bytes_sent.labels(**labels)
        small = pipe.message_bytes <= INLINE_MAX_BYTES
        building: asyncio.Future[Any] | None = None
        try:
            while True:
                if building is not None:
                    group, building = await building, None
                else:
                    group = pipe.next_group(inline=True) if small else []
                    if not group and not pipe.finished:
                        group = await loop.run_in_executor(self.executor, pipe.next_group)
                if not group:
                    return
                if not small:  # double buffering: build the next group while writing
                    building = loop.run_in_executor(self.executor, pipe.next_group)
                for data, _, _, _ in group:
                    await context.write(data)  # waits for HTTP/2 flow control
                # counted once per group, after it is written: fewer metric updates per message
                batches_sent.inc(sum(g[1] for g in group))
                tokens_sent.inc(sum(g[2] for g in group))
                bytes_sent.inc(sum(g[3] for g in group))
        finally:
            if building is not None:
                building.cancel()  # a running build finishes its group; the result is dropped
