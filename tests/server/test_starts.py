"""Streams being started go before streams already sending (starts.py): the hold on a
real event loop, then on a real feeder over gRPC."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from concurrent.futures import Executor

import grpc

from tokenfeed.server import datasets
from tokenfeed.server.assembly import BURST_MESSAGES
from tokenfeed.server.starts import GIVES_WAY_AFTER, STORM_STARTS, Starts
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import wait_until
from support.feeders import feeder_params as params
from support.stores import make_positional_store

GUARD = 30.0  # a failure's bound, never reached when the code is right


async def _turns(n: int = 10) -> None:
    """Let the loop run `n` rounds (what a sending stream would do meanwhile)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_nothing_waits_while_nothing_is_prepared() -> None:
    async def main() -> None:
        starts = Starts(quiet_seconds=GUARD, hold_seconds=GUARD)
        await asyncio.wait_for(starts.give_way(), GUARD)
        with starts.preparing_one():
            pass
        await asyncio.sleep(0)
        assert starts.preparing == 0

    asyncio.run(main())


def test_a_few_starts_hold_nobody_a_storm_does() -> None:
    """A next epoch opened ahead or a reconnect must not hold a stream read as fast as
    it comes; the storm_starts-th start in a row does."""

    async def main() -> None:
        starts = Starts(quiet_seconds=GUARD, hold_seconds=GUARD, storm_starts=3)
        with starts.preparing_one():
            pass
        with starts.preparing_one():
            await asyncio.wait_for(starts.give_way(), GUARD)
        await asyncio.wait_for(starts.give_way(), GUARD)
        with starts.preparing_one():  # the third within a quiet moment: a storm
            waiting = asyncio.ensure_future(starts.give_way())
            await _turns()
            assert not waiting.done()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    asyncio.run(main())


def test_streams_sending_wait_until_the_preparations_are_done() -> None:
    async def main() -> None:
        starts = Starts(quiet_seconds=0.01, hold_seconds=GUARD, storm_starts=1)
        first = starts.preparing_one()
        first.__enter__()
        waiting = asyncio.ensure_future(starts.give_way())
        await _turns()
        assert not waiting.done()
        with starts.preparing_one():  # a second one starts, the first ends: still held
            first.__exit__(None, None, None)
            await _turns()
            assert not waiting.done()
        await asyncio.wait_for(waiting, GUARD)  # a quiet moment after the last one
        await asyncio.wait_for(starts.give_way(), GUARD)  # and nobody waits any more
        assert starts.begun == 0

    asyncio.run(main())


def test_a_call_coming_in_within_the_quiet_moment_keeps_the_hold() -> None:
    async def main() -> None:
        starts = Starts(quiet_seconds=GUARD, hold_seconds=GUARD, storm_starts=1)
        with starts.preparing_one():
            pass
        waiting = asyncio.ensure_future(starts.give_way())
        await _turns()
        assert not waiting.done()  # the next call of a storm may be on its way
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    asyncio.run(main())


def test_a_hold_is_bounded_and_none_follows_until_the_starts_pause() -> None:
    """A preparation that waits (object storage, a slow disk) or starts that never
    pause hold the others hold_seconds at most, and nobody again until a quiet moment."""

    async def main() -> None:
        starts = Starts(quiet_seconds=0.01, hold_seconds=0.05, storm_starts=1)
        stuck = starts.preparing_one()
        stuck.__enter__()
        await asyncio.wait_for(starts.give_way(), GUARD)  # let go by the bound
        with starts.preparing_one():  # more calls while it is stuck hold nobody
            await asyncio.wait_for(starts.give_way(), GUARD)
        stuck.__exit__(None, None, None)
        await asyncio.wait_for(starts.give_way(), GUARD)
        await asyncio.sleep(0.05)  # after the quiet moment's timer (timers fire in order)
        assert starts.begun == 0  # the starts paused: the next storm holds again
        with starts.preparing_one():
            waiting = asyncio.ensure_future(starts.give_way())
            await _turns()
            assert not waiting.done()
        await asyncio.wait_for(waiting, GUARD)

    asyncio.run(main())


# ------------------------------------------------------------------ on a real feeder


@contextlib.contextmanager
def _reading(address: str, p: pb.SamplingParams) -> Iterator[list[int]]:
    """A stream read as fast as it comes, in a thread: the batches received so far."""
    got = [0]
    channel = grpc.insecure_channel(address)
    call = pb_grpc.FeederStub(channel).StreamBatches(pb.StreamBatchesRequest(params=p))

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # cancelled at the end
            for msg in call:
                got[0] += len(msg.batches)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        yield got
    finally:
        call.cancel()
        reader.join(GUARD)
        channel.close()


def test_a_starting_stream_goes_before_the_bursts_of_one_already_sending(feeder) -> None:
    service = feeder.server.service
    long = params(seq_len=8, stride=1, batch_size=1)  # ~9,000 batches: it keeps sending
    with _reading(feeder.address, long):
        wait_until(lambda: service.streams.entries, GUARD, "the first stream open")
        (sending,) = service.streams.entries.values()
        ahead = 1 + (GIVES_WAY_AFTER - 1) * BURST_MESSAGES  # its bursts before it gives way
        wait_until(lambda: sending.batches > ahead, GUARD, "the first stream sending")
        # a storm's preparations, as they are counted on the loop
        held = [service.starts.preparing_one() for _ in range(STORM_STARTS)]

        async def hold() -> int:
            for h in held:
                h.__enter__()
            assert service.starts.holding
            return sending.batches

        at_hold = feeder.call(hold())
        # another stream starts and gets its first batch while the first one waits
        with grpc.insecure_channel(feeder.address) as ch:
            call = pb_grpc.FeederStub(ch).StreamBatches(pb.StreamBatchesRequest(params=params()))
            assert len(next(call).batches) == 1
            call.cancel()
        # the first one finished at most the burst it was writing
        assert sending.batches - at_hold <= BURST_MESSAGES

        async def release() -> None:
            for h in held:
                h.__exit__(None, None, None)

        feeder.call(release())
        wait_until(lambda: sending.batches > at_hold + 4 * BURST_MESSAGES, GUARD, "it going on")


def test_in_a_storm_a_starting_stream_sends_its_first_batch_alone(feeder) -> None:
    """Every rank's first batch goes before any rank's second: while a storm is held, a
    stream that has sent its first batch waits, and goes on once the storm is over."""
    service = feeder.server.service
    held = [service.starts.preparing_one() for _ in range(STORM_STARTS)]

    async def hold() -> None:
        for h in held:
            h.__enter__()
        assert service.starts.holding

    async def release() -> None:
        for h in held:
            h.__exit__(None, None, None)

    feeder.call(hold())
    with _reading(feeder.address, params()) as got:
        wait_until(lambda: service.starts.waiting == 1, GUARD, "the stream waiting")
        wait_until(lambda: got[0], GUARD, "its first batch")
        (entry,) = service.streams.entries.values()
        assert entry.batches == got[0] == 1
        feeder.call(release())
        wait_until(lambda: got[0] > 1, GUARD, "its next batches")


class _Counted(Executor):
    """The feeder's thread pool, with the functions it was handed recorded."""

    def __init__(self, pool: Executor) -> None:
        self.pool, self.names = pool, []

    def submit(self, fn, /, *args, **kwargs):  # type: ignore[no-untyped-def]
        self.names.append(fn.__name__)
        return self.pool.submit(fn, *args, **kwargs)


def test_in_a_storm_a_first_batch_read_in_place_is_built_on_the_loop(feeder) -> None:
    """A storm's first batches are what its ranks wait for: one whose chunk files are
    open already is built without a hop to the thread pool, while streams are being
    prepared there (later bursts wait for the preparations: the GIL is theirs)."""
    service = feeder.server.service
    p = params(world_size=16)  # rows read in place from the chunk files
    request = pb.StreamBatchesRequest(params=p, rank=1)
    held = [service.starts.preparing_one() for _ in range(STORM_STARTS)]

    async def hold() -> None:
        for h in held:
            h.__enter__()

    async def release() -> None:
        for h in held:
            h.__exit__(None, None, None)

    pool = service.executor
    feeder.call(hold())
    with grpc.insecure_channel(feeder.address) as ch:
        # a rank that started first: the files of rank 1's first batch open, in use (it
        # waits after its first batch: no later burst of its own opens other files)
        started = pb_grpc.FeederStub(ch).StreamBatches(request)
        try:
            first = next(started).batches[0].starts
            wait_until(lambda: service.starts.waiting == 1, GUARD, "the first stream waiting")
            service.executor = counted = _Counted(pool)
            call = pb_grpc.FeederStub(ch).StreamBatches(request)
            assert next(call).batches[0].starts == first
            call.cancel()
        finally:
            service.executor = pool
            feeder.call(release())
            started.cancel()
    assert counted.names == ["_prepare_stream"]


def test_the_first_requests_of_an_epoch_start_list_a_store_once(tmp_path, monkeypatch) -> None:
    """Telling a store's format lists its folder (60,000 chunk files at 10^12 tokens):
    requests that come in together while nothing is known of it list it once."""
    make_positional_store(tmp_path / "ds", 2_000, 1_000)
    catalog = datasets.Catalog(tmp_path)
    threads, calls, arrived = 8, [], threading.Semaphore(0)
    detect = datasets.detect

    def counted(path):  # the first one waits until every request has come in
        calls.append(path)
        if len(calls) == 1:
            for _ in range(threads):
                assert arrived.acquire(timeout=GUARD)
        return detect(path)

    monkeypatch.setattr(datasets, "detect", counted)

    def request() -> None:
        arrived.release()
        catalog.locate("ds")

    workers = [threading.Thread(target=request) for _ in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(GUARD)
    assert len(calls) == 1
