"""FeederClient under failure: a crashed feeder, failover, a black hole, a reset.

Every test checks by window starts that the epoch is delivered exactly once: nothing
lost, nothing repeated, whatever broke in between.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenfeed.client import Backoff, FeederClient, FeederUnavailable, Timeouts

from support.faultproxy import FaultProxy
from support.feeders import FeederProcess, running_feeder
from support.stores import make_positional_store

pytestmark = pytest.mark.slow

# ~1,500 steps of 4 KiB: much more than the socket buffers hold, so a fault really
# lands mid-stream.
KW = {
    "dataset": "big",
    "seq_len": 128,
    "stride": 16,
    "batch_size": 8,
    "rank": 0,
    "world_size": 1,
    "shuffle": True,
    "seed": 5,
}
FAST = Backoff(initial=0.05, maximum=0.5, deadline=60)


@pytest.fixture
def feeder_root(tmp_path: Path) -> Path:
    make_positional_store(tmp_path / "big", 200_000, 20_000)
    return tmp_path


def _expected(feeder_address: str) -> list[int]:
    with FeederClient(feeder_address, **KW) as c:
        return [s for b in c for s in b["starts"].tolist()]


def _consume(it, limit: int | None = None) -> list[int]:
    out: list[int] = []
    for i, batch in enumerate(it):
        out += batch["starts"].tolist()
        if limit is not None and i + 1 == limit:
            break
    return out


def test_feeder_killed_and_restarted_mid_epoch_loses_and_repeats_nothing(feeder_root: Path) -> None:
    with FeederProcess(feeder_root) as proc:
        expected = _expected(proc.address)
        with FeederClient(proc.address, backoff=FAST, prefetch=4, **KW) as c:
            it = iter(c)
            seen = _consume(it, limit=50)
            proc.kill()  # SIGKILL: no drain, batches in flight are lost on the wire
            proc.restart()  # same port
            seen += _consume(it)
            assert c.reconnects >= 1
            assert c.metrics.registry.get_sample_value(
                "tokenfeed_client_batches_received_total", {"rank": "0"}
            ) >= len(c)
    assert seen == expected


def test_two_address_failover(feeder_root: Path) -> None:
    with FeederProcess(feeder_root) as a, FeederProcess(feeder_root) as b:
        expected = _expected(b.address)
        with FeederClient([a.address, b.address], backoff=FAST, **KW) as c:
            it = iter(c)
            seen = _consume(it, limit=30)
            a.kill()
            seen += _consume(it)
            assert c.reconnects >= 1
    assert seen == expected


def test_first_address_down_from_the_start(feeder_root: Path) -> None:
    with FeederProcess(feeder_root) as a:
        dead = FeederProcess(feeder_root)
        dead_address = dead.address
        dead.stop()
        with FeederClient(f"{dead_address},{a.address}", backoff=FAST, **KW) as c:
            assert _consume(c) == _expected(a.address)


def test_black_holed_connection_is_detected_and_failed_over(feeder_root: Path) -> None:
    with running_feeder(feeder_root) as f:
        proxy = FaultProxy(("127.0.0.1", f.port)).start()
        try:
            expected = _expected(f.address)
            quick = Timeouts(keepalive_time=0.5, keepalive_timeout=1.0, attempt_timeout=2.0)
            with FeederClient([proxy.address, f.address], backoff=FAST, timeouts=quick, **KW) as c:
                it = iter(c)
                seen = _consume(it, limit=20)
                proxy.blackhole()  # the connection stays open, nothing moves
                seen += _consume(it)
                assert c.reconnects >= 1
        finally:
            proxy.stop()
    assert seen == expected


def test_connection_reset_mid_message(feeder_root: Path) -> None:
    with running_feeder(feeder_root) as f:
        proxy = FaultProxy(("127.0.0.1", f.port)).start()
        try:
            expected = _expected(f.address)
            with FeederClient(proxy.address, backoff=FAST, **KW) as c:
                it = iter(c)
                seen = _consume(it, limit=10)
                proxy.reset_after(20_000)  # dies in the middle of a message
                seen += _consume(it)
                assert proxy.resets == 1
                assert c.reconnects >= 1
        finally:
            proxy.stop()
    assert seen == expected


def test_gives_up_after_the_retry_budget_with_the_last_error(feeder_root: Path) -> None:
    dead = FeederProcess(feeder_root)
    address = dead.address
    dead.stop()
    with FeederClient(
        address, backoff=Backoff(initial=0.01, maximum=0.05, max_retries=3, deadline=None), **KW
    ) as c:
        with pytest.raises(FeederUnavailable, match="gave up after 4 attempts") as info:
            next(iter(c))
        assert address in str(info.value)
