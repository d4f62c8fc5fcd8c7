"""Several feeder replicas: ranks spread over them, and a replica lost mid-epoch.

Real `tokenfeed serve` processes and real clients, one per rank (threads): rank r
starts on endpoint r mod n, so each replica serves its share (its own metrics say
so), and when one is SIGKILLed its ranks (which share one channel to it) move on to
the next and every window of the epoch is still delivered exactly once.
"""

from __future__ import annotations

import threading
import urllib.request
from contextlib import ExitStack
from pathlib import Path

import pytest

from tokenfeed.client import Backoff, FeederClient
from tokenfeed.client.channel_pool import POOL

from support import free_port
from support.feeders import FeederProcess
from support.stores import assert_positional_batch, make_positional_store, make_sampler

pytestmark = pytest.mark.slow

SAMPLING = {"dataset": "big", "seq_len": 64, "stride": 32, "batch_size": 4, "seed": 3}
FAST = Backoff(initial=0.05, maximum=0.5, deadline=60)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    make_positional_store(tmp_path / "big", 100_000, 10_000)
    return tmp_path


def _batches_sent(metrics_port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
    total = 0.0
    for line in text.read().decode().splitlines():
        if line.startswith("tokenfeed_server_batches_sent_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _run_ranks(addresses: list[str], world: int, hook=None) -> list[list[int]]:
    """Every rank's window starts over one epoch (shuffled), each rank in a thread;
    `hook(rank, step)` runs after each batch."""
    starts: list[list[int]] = [[] for _ in range(world)]
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            # no lookahead: the next epoch's stream would add its buffered batches to the
            # replicas' counts
            with FeederClient(
                addresses,
                rank=rank,
                world_size=world,
                shuffle=True,
                backoff=FAST,
                lookahead=False,
                **SAMPLING,
            ) as c:
                for batch in c:
                    assert_positional_batch(batch, SAMPLING["seq_len"])
                    starts[rank] += batch["starts"].tolist()
                    if hook is not None:
                        hook(rank, batch["step"])
        except BaseException as e:  # re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    return starts


def _expected(world: int) -> list[int]:
    sampler = make_sampler(100_000, block_tokens=10_000, world_size=world, shuffle=True, **SAMPLING)
    return sorted(s for r in range(world) for b in sampler.batches(0, r) for s in b.starts.tolist())


@pytest.mark.parametrize(("replicas", "world"), [(2, 4), (3, 6)])
def test_ranks_spread_over_replicas(root: Path, replicas: int, world: int) -> None:
    ports = [free_port() for _ in range(replicas)]
    with ExitStack() as stack:
        feeders = [stack.enter_context(FeederProcess(root, metrics_port=p)) for p in ports]
        starts = _run_ranks([f.address for f in feeders], world)
        sent = [_batches_sent(p) for p in ports]
    assert sorted(s for r in starts for s in r) == _expected(world)
    # rank r was served by replica r mod n: each replica sent its ranks' batches
    per_rank = [len(s) // SAMPLING["batch_size"] for s in starts]
    assert sent == [sum(per_rank[i::replicas]) for i in range(replicas)]


def test_a_replica_killed_mid_epoch_loses_and_repeats_nothing(root: Path) -> None:
    """Ranks 1 and 4 stream from replica 1 over one shared channel when it is killed."""
    world = 6
    with ExitStack() as stack:
        feeders = [stack.enter_context(FeederProcess(root)) for _ in range(3)]
        rank4_streaming, killed = threading.Event(), threading.Event()
        sharing: list[int] = []

        def kill_once(rank: int, step: int) -> None:
            if rank == 4 and step == 10:
                rank4_streaming.set()
                assert killed.wait(120)  # rank 4 stays mid-stream until the kill
            if rank == 1 and step == 20 and not killed.is_set():
                assert rank4_streaming.wait(120)
                sharing.extend(s.holders for s in POOL.pooled(feeders[1].address))
                feeders[1].kill()  # ranks 1 and 4 were on it: they move to replica 2
                killed.set()

        starts = _run_ranks([f.address for f in feeders], world, hook=kill_once)
    assert killed.is_set()
    assert sharing == [2]  # one channel, held by both ranks
    got = sorted(s for r in starts for s in r)
    assert got == _expected(world)  # every window exactly once
    assert POOL.pooled() == []  # every client closed, every channel released
