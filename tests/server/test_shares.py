"""FairShares: turns divided between jobs by weight, not by their streams, on a real
event loop (the feeder's use of it is benchmarks/tenants.py's and test_tenants.py's)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.server.shares import FairShares

from support import fewer_examples, until


async def _contend(
    jobs: dict[str, tuple[float, int]], turns: int, slots: int = 1, cost: int = 1000
) -> dict[str, int]:
    """Streams of each job (weight, streams) take turns of `cost` bytes, each yielding
    to the loop once while it holds one, until `turns` turns were granted in all;
    the bytes each job got."""
    shares = FairShares(slots, hold_seconds=60)
    got = dict.fromkeys(jobs, 0)
    done = asyncio.Event()
    granted = 0

    async def stream(job: str, weight: float) -> None:
        nonlocal granted
        acct = shares.account(job, weight)
        while not done.is_set():
            turn = await shares.enter(acct, cost)
            try:
                granted += 1
                got[job] += cost
                await asyncio.sleep(0)  # the burst's write
            finally:
                shares.leave(turn, cost)
            if granted >= turns:
                done.set()

    tasks = [
        asyncio.ensure_future(stream(job, w)) for job, (w, n) in jobs.items() for _ in range(n)
    ]
    await done.wait()
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    assert (shares.busy, shares.waiting) == (0, 0), "every turn given back"
    return got


def test_shares_follow_weights_not_stream_counts() -> None:
    got = asyncio.run(_contend({"small": (1, 4), "large": (1, 32)}, turns=3600))
    assert abs(got["small"] / sum(got.values()) - 0.5) < 0.02, got
    got = asyncio.run(_contend({"small": (3, 4), "large": (1, 32)}, turns=3600))
    assert abs(got["small"] / sum(got.values()) - 0.75) < 0.02, got


@fewer_examples(3)
@given(
    weights=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    extra=st.lists(st.integers(0, 6), min_size=4, max_size=4),
    slots=st.integers(1, 3),
)
def test_every_job_gets_its_weighted_share(
    weights: list[int], extra: list[int], slots: int
) -> None:
    """Every job with at least `slots` streams (a job's streams carry one turn each at
    a time, so fewer could not take a larger share) gets its weight's share."""
    jobs = {f"j{i}": (float(w), slots + extra[i]) for i, w in enumerate(weights)}
    turns = 120 * sum(weights)
    got = asyncio.run(_contend(jobs, turns, slots))
    total = sum(got.values())
    for job, (w, _) in jobs.items():
        want = w / sum(weights)
        # a job is at most a few turns (one per slot, one per its streams' round) off
        assert abs(got[job] / total - want) <= 0.05, (job, got, jobs)


def test_uncontended_turns_start_at_once_and_charge_what_was_sent() -> None:
    async def main() -> None:
        shares = FairShares(2)
        acct = shares.account("a", 2.0)
        t1 = shares.try_enter(acct, 100)
        t2 = shares.try_enter(acct, 100)
        assert t1 is not None
        assert t2 is not None
        assert shares.busy == 2
        assert shares.try_enter(acct, 100) is None  # both slots taken
        shares.leave(t1, 300)  # sent more than estimated: charged what it sent
        shares.leave(t2, 100)
        assert acct.finish == pytest.approx((300 + 100) / 2)
        assert shares.busy == 0

    asyncio.run(main())


def test_an_idle_job_banks_no_credit() -> None:
    async def main() -> None:
        shares = FairShares(1)
        busy, idle = shares.account("busy", 1), shares.account("idle", 1)
        for _ in range(50):  # `busy` alone for a while
            shares.leave(await shares.enter(busy, 10), 10)
        # now both wait: `idle` must not get 50 turns in a row for having been away
        holder = await shares.enter(busy, 10)
        order: list[str] = []

        async def take(acct, n: int) -> None:
            for _ in range(n):
                t = await shares.enter(acct, 10)
                order.append(acct.name)
                await asyncio.sleep(0)
                shares.leave(t, 10)

        tasks = [asyncio.ensure_future(take(idle, 10)), asyncio.ensure_future(take(busy, 10))]
        await asyncio.sleep(0)
        shares.leave(holder, 10)
        await asyncio.gather(*tasks)
        assert "busy" in order[:3], order

    asyncio.run(main())


def test_a_turn_held_too_long_stops_blocking_the_others() -> None:
    async def main() -> None:
        shares = FairShares(1, hold_seconds=0.01)
        slow = await shares.enter(shares.account("slow", 1), 10)  # never written out
        fast = shares.account("fast", 1)
        for _ in range(5):  # would wait forever if the slow turn kept its slot
            shares.leave(await asyncio.wait_for(shares.enter(fast, 10), 30), 10)
        shares.leave(slow, 10)
        assert shares.busy == 0

    asyncio.run(main())


def test_a_cancelled_waiter_gives_its_place_back() -> None:
    async def main() -> None:
        shares = FairShares(1, hold_seconds=3600)  # the holder is never reaped meanwhile
        acct = shares.account("a", 1)
        holder = await shares.enter(acct, 10)
        waiter = asyncio.ensure_future(shares.enter(acct, 10))
        await until(lambda: shares.waiting == 1, 10, "a waiter")
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert shares.waiting == 0
        shares.leave(holder, 10)
        assert shares.busy == 0
        assert shares.try_enter(acct, 10) is not None  # the fast path is open again

    asyncio.run(main())
