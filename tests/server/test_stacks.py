"""SIGUSR1's dump (stacks.py): where each stream of a real feeder waits, and every
thread's stack from a real `tokenfeed serve`, which serves on."""

from __future__ import annotations

import asyncio
import re
import signal
from pathlib import Path

import grpc

from tokenfeed.server.stacks import tasks_text
from tokenfeed.server.starts import STORM_STARTS
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import wait_until
from support.feeders import FEEDER_DATASET, FeederProcess, feeder_params
from support.stores import make_positional_store

GUARD = 30.0  # a failure's bound, never reached when the code is right
# one step per message
LONG = pb.StreamBatchesRequest(params=feeder_params(stride=1, batch_size=1))


async def _tasks() -> str:
    return tasks_text(asyncio.get_running_loop())


def _place(text: str, functions: list[str]) -> tuple[int, list[str]]:
    """The first place in `text` whose chain holds all of `functions`: its tasks, and
    those functions in the chain's order."""
    for count, place in re.findall(r"^(\d+) tasks? at:\n((?:  .*\n?)+)", text, re.M):
        names = re.findall(r"\bin (\w+)$", place, re.M)
        if set(functions) <= set(names):
            return int(count), [n for n in names if n in functions]
    raise AssertionError(f"no task waits in {functions}:\n{text}")


def test_a_dump_shows_where_a_held_stream_waits(feeder) -> None:
    """A storm's hold that is never let go would stop every stream after its first
    batch: the task list names the stream and the hold it waits for."""
    service = feeder.server.service
    held = [service.starts.preparing_one() for _ in range(STORM_STARTS)]

    async def hold() -> None:
        for h in held:
            h.__enter__()

    async def release() -> None:
        while held:
            held.pop().__exit__(None, None, None)

    feeder.call(hold())
    with grpc.insecure_channel(feeder.address) as ch:
        call = pb_grpc.FeederStub(ch).StreamBatches(LONG)
        try:
            assert next(call).batches[0].step == 0
            wait_until(lambda: service.starts.waiting == 1, GUARD, "the stream held")
            text = feeder.call(_tasks())
            chain = ["StreamBatches", "_stream", "give_way"]
            assert _place(text, chain) == (1, chain), text
            feeder.call(release())
            assert next(call).batches[0].step == 1  # the dump took nothing away
        finally:
            feeder.call(release())
            call.cancel()


def test_sigusr1_dumps_every_thread_and_stream_and_the_feeder_serves_on(tmp_path: Path) -> None:
    # a million one-batch messages: the stream is still open when its dump comes
    make_positional_store(tmp_path / FEEDER_DATASET, 1_000_000, 100_000)
    with FeederProcess(tmp_path, assembly_threads=2) as proc:
        with grpc.insecure_channel(proc.address) as ch:
            stream = pb_grpc.FeederStub(ch).StreamBatches(LONG)
            steps = [next(stream).batches[0].step]
            proc.proc.send_signal(signal.SIGUSR1)
            wait_until(lambda: "tasks on the event loop" in proc.log(), GUARD, "the task list")
            log = proc.log()
            # faulthandler's half: a stack per thread, each headed by its id
            dumped = set(re.findall(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", log, re.M))
            # the loop's half: which thread is which, then the tasks
            threads = re.findall(r"(0x[0-9a-f]{16}) ([\w-]+)", log)
            named = {name: ident for ident, name in threads}
            workers = [n for n in named if n.startswith("tokenfeed-batch")]
            assert len(workers) == 2, named
            assert {named["MainThread"], *(named[n] for n in workers)} <= dumped, log
            assert "concurrent/futures/thread.py" in log  # a worker thread's frames
            assert _place(log, ["StreamBatches", "_stream"])[0] == 1, log
            # and it serves on: the open stream in order, a new call
            steps += [next(stream).batches[0].step for _ in range(100)]
            assert steps == list(range(101))
            stream.cancel()
            info = pb_grpc.FeederStub(ch).Info(pb.InfoRequest(), timeout=GUARD)
            assert info.datasets
        assert proc.terminate() == 0
