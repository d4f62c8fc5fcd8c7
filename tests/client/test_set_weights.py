"""Run-time weights through a real feeder on loopback: `FeederClient.set_weights`,
`schedule`, the state dict (docs/mixtures.md, "Run-time weights").

The reference of every run is a second loader constructed with the same change in its
schedule: each step's batch must be byte-identical (input_ids, starts, sources).
"""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tokenfeed.client import FeederClient
from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_REQUEST_BYTES
from tokenfeed.core.store import write_store

from support.feeders import running_feeder
from support.stores import make_mixture_root

SEQ, B = 8, 4
BASE = {"a": 0.5, "b": 0.3, "c": 0.2}


@pytest.fixture(scope="module")
def feeder(tmp_path_factory: pytest.TempPathFactory):
    root = make_mixture_root(tmp_path_factory.mktemp("runtime") / "root")
    write_store(root / "d", np.arange(800, dtype="uint32"), dtype="uint32")
    with running_feeder(root) as f:
        yield f


def loader(address: str, rank: int = 0, world: int = 1, batch_size: int = B, **kw):
    args = dict(mixture=BASE, seq_len=SEQ, batch_size=batch_size, seed=3, shuffle=True)
    return FeederClient(address, rank=rank, world_size=world, prefetch=4, **(args | kw))


def rows(batch: dict) -> tuple:
    """What makes a batch: its step, offset and every row's tokens, start and source."""
    return (
        batch["step"],
        batch["offset"],
        np.asarray(batch["input_ids"]).tobytes(),
        batch["starts"].tobytes(),
        batch["sources"].tobytes(),
    )


def constructed(address: str, schedule: list, steps: int, **kw) -> list[tuple]:
    with loader(address, schedule=schedule, **kw) as ld:
        it = iter(ld)
        return [rows(next(it)) for _ in range(steps)]


def test_a_change_mid_iteration_streams_the_batches_of_the_constructed_run(feeder) -> None:
    w1 = {"a": 0.1, "b": 0.1, "c": 0.8}
    w2 = {"a": "0.7", "b": "0.2", "c": "0.1"}  # decimal strings are weights too
    got = []
    with loader(feeder.address) as ld:
        it = iter(ld)
        got += [rows(next(it)) for _ in range(5)]
        assert ld.set_weights(w1) == 5  # the next step: the buffered ones are dropped
        got += [rows(next(it)) for _ in range(2)]
        assert ld.set_weights(w2, at_step=10) == 10  # a pending change
        got += [rows(next(it)) for _ in range(8)]
        assert ld.schedule == [
            (0, {"a": "0.5", "b": "0.3", "c": "0.2"}),
            (5 * B * SEQ, {"a": "0.1", "b": "0.1", "c": "0.8"}),
            (10 * B * SEQ, {"a": "0.7", "b": "0.2", "c": "0.1"}),
        ]
    schedule = [(5 * B * SEQ, w1), (10 * B * SEQ, {k: float(v) for k, v in w2.items()})]
    want = constructed(feeder.address, schedule, 15)
    assert got == want
    assert got[:5] == constructed(feeder.address, [], 5)


def test_every_rank_changing_at_the_same_step_matches_across_ranks(feeder) -> None:
    w = {"a": 0.0, "b": 0.5, "c": 0.5}
    for rank in range(2):
        with loader(feeder.address, rank, 2, batch_size=3) as ld:
            it = iter(ld)
            got = [rows(next(it)) for _ in range(3)]
            assert ld.set_weights(w, at_step=4) == 4
            got += [rows(next(it)) for _ in range(5)]
        schedule = [(4 * 3 * 2 * SEQ, w)]
        assert got == constructed(feeder.address, schedule, 8, rank=rank, world=2, batch_size=3)
        # no more of a once the items due before the change are out (k positions at most)
        assert all(np.frombuffer(r[4], dtype=np.int64).min() > 0 for r in got[5:])


def test_a_resume_with_another_world_and_batch_size_keeps_the_trajectory(feeder) -> None:
    """Saved with a change made and one pending; resumed at W=3, B=2: the pending change
    starts where it was set, a new change at the next step where that step is now."""
    w1, w2, w3 = {"a": 1, "b": 0, "c": 1}, {"a": 0, "b": 1, "c": 1}, {"a": 1, "b": 1, "c": 0}
    with loader(feeder.address) as ld:
        it = iter(ld)
        for _ in range(2):
            next(it)
        ld.set_weights(w1)
        for _ in range(2):
            next(it)
        ld.set_weights(w2, at_step=6)
        state = ld.state_dict()
    assert state["offset"] == 4 * B
    assert state["mixture"]["runtime"] == [
        [2 * B * SEQ, [1.0, 0.0, 1.0]],
        [6 * B * SEQ, [0.0, 1.0, 1.0]],
    ]
    # the reference: the same changes declared, saved at the same step, then extended
    with loader(feeder.address, schedule=[(2 * B * SEQ, w1), (6 * B * SEQ, w2)]) as ref:
        rit = iter(ref)
        for _ in range(4):
            next(rit)
        ref_state = ref.state_dict()
    start = state["offset"] + 3 * 3 * 2  # step 7: 3 steps of 3 x 2 after the offset
    schedule = [(2 * B * SEQ, w1), (6 * B * SEQ, w2), (start * SEQ, w3)]
    for rank in range(3):
        with loader(feeder.address, rank, 3, batch_size=2) as ld:
            ld.load_state_dict(state)
            assert ld.schedule[1:] == [
                (2 * B * SEQ, {"a": "1.0", "b": "0.0", "c": "1.0"}),
                (6 * B * SEQ, {"a": "0.0", "b": "1.0", "c": "1.0"}),
            ]
            it = iter(ld)
            got = [rows(next(it)) for _ in range(3)]
            assert got[0][0] == 4
            assert ld.set_weights(w3, at_step=7) == 7
            got += [rows(next(it)) for _ in range(5)]
            assert ld.schedule[-1][0] == start * SEQ != 7 * 3 * 2 * SEQ
        with loader(feeder.address, rank, 3, batch_size=2, schedule=schedule) as ref:
            ref.load_state_dict(ref_state)
            rit = iter(ref)
            assert got == [rows(next(rit)) for _ in range(8)]


def test_rejected_calls_change_nothing(feeder) -> None:
    with loader(feeder.address) as ld, loader(feeder.address) as ref:
        it, rit = iter(ld), iter(ref)
        with pytest.raises(InvalidArgument, match=r"at_step: .*construct the loader"):
            ld.set_weights({"a": 1, "b": 1, "c": 1})  # position 0: the base mixture
        for _ in range(3):
            assert rows(next(it)) == rows(next(rit))
        pending = {"a": 0.2, "b": 0.2, "c": 0.6}
        assert ld.set_weights(pending, at_step=6) == 6
        assert ref.set_weights(pending, at_step=6) == 6
        state, schedule = ld.state_dict(), ld.schedule
        bad = [
            ({"a": -1, "b": 1, "c": 1}, None, ValueError, r"weights\['a'\]: must be >= 0"),
            ({"a": 1, "b": 1, "x": 1}, None, ValueError, r"weights\['x'\]: 'x' is not a source"),
            ({"a": 1, "b": 1}, None, ValueError, r"weights: must name every source.*'c'"),
            ({"a": 0, "b": 0, "c": 0}, None, ValueError, "all weights are 0"),
            ({"a": float("nan"), "b": 1, "c": 1}, None, ValueError, "finite"),
            ({"a": 1, "b": 1, "c": 1}, 2, ValueError, r"at_step: step 2 is in the past"),
            ({"a": 1, "b": 1, "c": 1}, 5, ValueError, "before the run-time change already made"),
            ({"a": 1, "b": 1, "c": 1}, 1.5, ValueError, "at_step: must be an integer"),
            ([("a", 1)], 6, ValueError, "must name every source"),  # at the pending step too
        ]
        for weights, at, error, words in bad:
            with pytest.raises(error, match=words):
                ld.set_weights(weights, at_step=at)
            assert ld.state_dict() == state
            assert ld.schedule == schedule
        # the stream went on as it was: the pending change at step 6 still applies
        for _ in range(6):
            assert rows(next(it)) == rows(next(rit))
    with FeederClient(feeder.address, dataset="d", seq_len=SEQ, batch_size=B) as single:
        with pytest.raises(TypeError, match="mixture"):
            single.set_weights({"d": 1})
        with pytest.raises(TypeError, match="mixture"):
            single.schedule  # noqa: B018


def test_a_change_before_a_declared_segment_leaves_it_in_force(feeder) -> None:
    later = (12 * B * SEQ, {"a": 0, "b": 0, "c": 1})
    with loader(feeder.address, schedule=[later]) as ld:
        it = iter(ld)
        got = [rows(next(it)) for _ in range(2)]
        ld.set_weights({"a": 1, "b": 0, "c": 0})
        got += [rows(next(it)) for _ in range(14)]
        assert [tok for tok, _ in ld.schedule] == [0, 2 * B * SEQ, 12 * B * SEQ]
    want = constructed(feeder.address, [(2 * B * SEQ, {"a": 1, "b": 0, "c": 0}), later], 16)
    assert got == want
    sources = np.concatenate([np.frombuffer(r[4], dtype=np.int64) for r in got])
    assert set(sources[3 * B : 12 * B].tolist()) == {0}  # items due before: k positions
    assert set(sources[13 * B :].tolist()) == {2}


def test_the_weight_metric_follows_the_loops_position(feeder) -> None:
    registry = CollectorRegistry()
    with loader(feeder.address, registry=registry) as ld:

        def weight(source: str) -> float | None:
            return registry.get_sample_value(
                "tokenfeed_client_mixture_weight_ratio", {"rank": "0", "source": source}
            )

        assert weight("a") == 0.5
        it = iter(ld)
        next(it)
        ld.set_weights({"a": 1, "b": 3, "c": 0}, at_step=3)
        assert weight("b") == 0.3  # not yet: the loop is at step 1
        for _ in range(2):
            next(it)
        assert (weight("a"), weight("b"), weight("c")) == (0.25, 0.75, 0.0)
        ld.metrics.mixer_loss({"a": 2.5, "b": float("nan"), "c": 1.0})
        assert (
            registry.get_sample_value(
                "tokenfeed_client_mixer_loss_nats", {"rank": "0", "source": "a"}
            )
            == 2.5
        )


def test_a_change_that_would_outgrow_the_feeders_request_limit_is_refused() -> None:
    """256 sources: a run-time segment takes 2 kB on the wire, so a few thousand reach
    the limit. The loader needs no feeder for this (set_weights outside an iteration)."""
    names = [f"s{i:03d}" for i in range(256)]
    ld = FeederClient("127.0.0.1:1", mixture={n: 1 for n in names}, seq_len=SEQ, batch_size=1)
    state = ld.state_dict()
    last = MAX_REQUEST_BYTES // (8 * 257) - 10  # a trajectory ten changes short of it
    trajectory = []  # one source at 2 and the next at 0 in each change
    for step in range(1, last + 1):
        weights = [1.0] * 256
        weights[step % 256], weights[(step + 1) % 256] = 2.0, 0.0
        trajectory.append([step * SEQ, weights])
    mixture = {**state["mixture"], "runtime": trajectory}
    ld.load_state_dict({**state, "offset": last, "step": last, "mixture": mixture})
    step, refused = last, None
    while refused is None and step < last + 100:
        try:
            ld.set_weights({n: 1 for n in names} | {names[step % 256]: 3}, at_step=step)
            step += 1
        except ValueError as e:
            refused = str(e)
    assert refused is not None
    assert f"over the feeder's limit of {MAX_REQUEST_BYTES}" in refused
    assert "change the weights less often" in refused
    assert last < step < last + 20
    assert len(ld.spec.to_proto().SerializeToString()) <= MAX_REQUEST_BYTES
    # steps last .. step - 1 made it, the first replacing the saved change at step last
    assert len(ld.state_dict()["mixture"]["runtime"]) == step - 1
    ld.close()
