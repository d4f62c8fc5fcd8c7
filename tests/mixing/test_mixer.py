"""OnlineMixer against a real feeder (mixing/mixer.py; docs/mixing.md).

The training loop is simulated (support/mixing.py: each row's loss a function of its
source and the step, exact in any order), so a run is determined by its seeds, and a
trajectory can be checked against a loader constructed with it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tokenfeed.client import FeederClient
from tokenfeed.mixing import Bandit, ExcessLoss, OnlineMixer

from support import ROOT, free_port
from support.feeders import running_feeder
from support.mixing import synthetic_losses
from support.stores import make_mixture_root

SEQ, B = 8, 4
BASE = {"a": 0.5, "b": 0.3, "c": 0.2}


@pytest.fixture(scope="module")
def feeder(tmp_path_factory: pytest.TempPathFactory):
    with running_feeder(make_mixture_root(tmp_path_factory.mktemp("mixing") / "root")) as f:
        yield f


def loader(address: str, **kw) -> FeederClient:
    args = dict(mixture=BASE, seq_len=SEQ, batch_size=B, seed=5, shuffle=True, prefetch=3)
    return FeederClient(address, **(args | kw))


def run(ld: FeederClient, mixer: OnlineMixer, steps: int, tensors: bool = False) -> list[bytes]:
    """`steps` training steps; returns each batch's rows as bytes."""
    out = []
    it = iter(ld)
    for _ in range(steps):
        batch = next(it)
        out.append(np.asarray(batch["input_ids"]).tobytes() + batch["sources"].tobytes())
        loss = synthetic_losses(batch)
        if tensors:
            import torch

            loss = torch.tensor(loss, dtype=torch.float32, requires_grad=True) * 1
        mixer.observe(batch, loss)
        mixer.step()
    return out


def test_the_mixer_sets_bounded_rounded_weights_and_the_stream_follows(feeder) -> None:
    registry = CollectorRegistry()
    with loader(feeder.address, registry=registry) as ld:
        mixer = OnlineMixer(
            ld, Bandit("progress", eta=4.0), every=5, min_weight=0.05, max_change=0.15
        )
        assert mixer.weights == BASE
        got = run(ld, mixer, 40)
        schedule = ld.schedule
        loss_c = registry.get_sample_value(
            "tokenfeed_client_mixer_loss_nats", {"rank": "0", "source": "c"}
        )
    assert loss_c == 5.5
    changes = schedule[1:]
    assert mixer.updates == 8
    assert 3 <= len(changes) <= 8  # an update that leaves the weights as they are adds none
    previous = {n: Fraction(str(w)) for n, w in BASE.items()}
    for tokens, weights in changes:
        assert tokens % (5 * B * SEQ) == 0  # from the step after every 5th
        exact = {n: Fraction(w) for n, w in weights.items()}
        assert sum(exact.values()) == 1  # decimals of 4 places that sum to exactly 1
        assert all(len(w.split(".")[1]) <= 4 for w in weights.values())
        assert all(w >= Fraction("0.05") for w in exact.values())
        assert all(abs(exact[n] - previous[n]) <= Fraction("0.1501") for n in exact)
        previous = exact
    assert previous["c"] < Fraction("0.15")  # noise: no progress, weight away from it
    assert mixer.weights == {n: float(w) for n, w in previous.items()}
    # the stream is the one a loader constructed with that schedule gives
    with loader(feeder.address, schedule=changes) as ref:
        it = iter(ref)
        want = [
            np.asarray(b["input_ids"]).tobytes() + b["sources"].tobytes()
            for b in (next(it) for _ in range(40))
        ]
    assert got == want


def test_a_resume_continues_the_trajectory_exactly(feeder) -> None:
    """Two runs with the same seeds agree; one saved mid-interval (step 17) and resumed
    in a new loader and mixer, losses as torch tensors now, continues it exactly."""

    def policy() -> Bandit:
        return Bandit("progress", gamma=0.05, eta=3.0, seed=11)

    runs = []
    for _ in range(2):
        with loader(feeder.address) as ld:
            mixer = OnlineMixer(ld, policy(), every=4, min_weight=0.02)
            runs.append((run(ld, mixer, 36), ld.schedule, mixer.weights))
    assert runs[0] == runs[1]
    with loader(feeder.address) as ld:
        mixer = OnlineMixer(ld, policy(), every=4, min_weight=0.02)
        first = run(ld, mixer, 17)
        saved = json.loads(json.dumps({"data": ld.state_dict(), "mixer": mixer.state_dict()}))
    assert saved["mixer"]["rows"] != [0.0, 0.0, 0.0]  # a partial interval is in the state
    with loader(feeder.address) as ld:
        mixer = OnlineMixer(ld, policy(), every=4, min_weight=0.02)
        ld.load_state_dict(saved["data"])
        mixer.load_state_dict(saved["mixer"])
        second = run(ld, mixer, 19, tensors=True)
        assert (first + second, ld.schedule, mixer.weights) == runs[0]


def test_excess_loss_raises_the_source_furthest_above_its_reference(feeder) -> None:
    with loader(feeder.address) as ld:
        reference = {"a": 1.0, "b": 2.75, "c": 5.5}  # only a is well above its reference
        mixer = OnlineMixer(ld, ExcessLoss(reference, eta=0.5), every=3)
        run(ld, mixer, 12)
        w = mixer.weights
    assert w["a"] > BASE["a"]
    assert w["c"] < BASE["c"]


def test_bad_mixers_are_refused(feeder) -> None:
    with (
        FeederClient(feeder.address, dataset="a", seq_len=SEQ, batch_size=B) as single,
        pytest.raises(TypeError, match="mixture"),
    ):
        OnlineMixer(single, Bandit(), every=1)
    with loader(feeder.address) as ld:
        for kw, words in [
            (dict(every=0), "every"),
            (dict(every=2, min_weight=0.5), r"min_weight must be in \[0, 1/3\]"),
            (dict(every=2, max_change=0), "max_change"),
            (dict(every=2, resolution=0), "resolution"),
        ]:
            with pytest.raises(ValueError, match=words):
                OnlineMixer(ld, Bandit(), **kw)
        with pytest.raises(TypeError, match="policy"):
            OnlineMixer(ld, object(), every=2)  # type: ignore[arg-type]
        mixer = OnlineMixer(ld, Bandit(), every=2)
        batch = next(iter(ld))
        with pytest.raises(ValueError, match="loss_per_row has 3 values, the batch 4 rows"):
            mixer.observe(batch, [1.0, 2.0, 3.0])
        state = mixer.state_dict()
    with (
        loader(feeder.address, mixture={"a": 1, "b": 1}) as other,
        pytest.raises(ValueError, match="sources"),
    ):
        OnlineMixer(other, Bandit(), every=2).load_state_dict(state)


RANK_SCRIPT = """
import json, sys
import torch.distributed as dist
import numpy as np
sys.path.insert(0, {tests!r})
from tokenfeed.client import FeederClient
from tokenfeed.mixing import Bandit, OnlineMixer
from support.mixing import synthetic_losses

dist.init_process_group("gloo")
rank = dist.get_rank()
ld = FeederClient({address!r}, mixture={base!r}, seq_len={seq}, batch_size={b}, seed=5,
                  shuffle=True)
mixer = OnlineMixer(ld, Bandit("progress", eta=4.0), every=3)
it = iter(ld)
for _ in range(24):
    batch = next(it)
    # each rank's rows differ; rank 1's losses count twice: only the sums agree
    mixer.observe(batch, synthetic_losses(batch, scale=1 + rank))
    mixer.step()
print(json.dumps({{"schedule": ld.schedule, "weights": mixer.weights}}))
ld.close()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_ranks_sum_their_losses_and_change_weights_together(feeder) -> None:
    """Two gloo ranks: the per-source sums are all-reduced, so both compute the same
    weights and set them at the same step."""
    script = RANK_SCRIPT.format(
        tests=str(ROOT / "tests"), address=feeder.address, base=BASE, seq=SEQ, b=B
    )
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "OMP_NUM_THREADS": "1",
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    outs = [json.loads(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs[0] == outs[1]
    assert len(outs[0]["schedule"]) > 1
    assert outs[0]["weights"]["c"] < BASE["c"]
