"""Mixtures end to end: a real feeder on loopback, real clients (docs/mixtures.md).

Sources are positional stores with distinct token ranges (`a`: token i is i; `b`: token
i is i + 1,000,000), so every row names its source and start by its tokens alone.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.client import FeederClient
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import write_store
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

from support import wait_until
from support.feeders import running_feeder
from support.stores import make_positional_store

SEQ, B = 16, 4
OFFSET = {"a": 0, "b": 1_000_000}
TOTAL = {"a": 10_000, "b": 3_000}


def make_mixture_root(root: Path) -> Path:
    make_positional_store(root / "a", TOTAL["a"], 1_000)
    write_store(
        root / "b",
        (np.arange(TOTAL["b"]) + OFFSET["b"]).astype("uint32"),
        dtype="uint32",
        tokens_per_chunk=500,
    )
    write_store(root / "tiny", np.arange(10, dtype="uint32"), dtype="uint32")
    write_store(root / "narrow", np.arange(2000, dtype="uint16"), dtype="uint16")
    return root


@pytest.fixture(scope="module")
def mix_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_mixture_root(tmp_path_factory.mktemp("mix") / "root")


@pytest.fixture(scope="module")
def mix_feeder(mix_root: Path):
    with running_feeder(mix_root) as f:
        yield f


def check_rows(batch: dict, names: tuple[str, ...]) -> None:
    """Every row is the window at its start in its own source's store."""
    ids = np.asarray(batch["input_ids"])
    cols = ids.shape[1]
    base = np.array([OFFSET[n] for n in names])[batch["sources"]]
    want = batch["starts"][:, None] + np.arange(cols) + base[:, None]
    np.testing.assert_array_equal(ids, want)
    np.testing.assert_array_equal(np.asarray(batch["labels"]), want + batch["shift"])


def stream(loader: FeederClient, steps: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(steps)]


def delivered(batches: list[dict], names: tuple[str, ...]) -> Counter:
    out: Counter = Counter()
    for b in batches:
        out.update((names[s], int(x)) for s, x in zip(b["sources"], b["starts"], strict=True))
    return out


def loader(address: str, rank: int, world: int, batch_size: int = B, **kw) -> FeederClient:
    args = dict(
        mixture={"a": 0.5, "b": 0.5}, seq_len=SEQ, batch_size=batch_size, shuffle=True, seed=7
    )
    return FeederClient(address, rank=rank, world_size=world, **(args | kw))


def test_each_sources_pass_is_delivered_exactly_once_across_ranks(mix_feeder) -> None:
    names = ("a", "b")
    windows = {"a": (TOTAL["a"] - SEQ - 1) // SEQ + 1, "b": (TOTAL["b"] - SEQ - 1) // SEQ + 1}
    steps = 170  # 170 steps x 8 windows: a's first pass (624) and b's first 7 (187 each)
    got: Counter = Counter()
    for rank in range(2):
        with loader(mix_feeder.address, rank, 2) as ld:
            assert ld.sources == names
            batches = stream(ld, steps)
        for b in batches:
            check_rows(b, names)
            assert b["epoch"] == 0
        assert [b["step"] for b in batches] == list(range(steps))
        got += delivered(batches, names)
    assert sum(got.values()) == steps * B * 2
    for name in names:
        counts = Counter(v for (n, _), v in got.items() if n == name)
        drawn = sum(v for (n, _), v in got.items() if n == name)
        full, rest = divmod(drawn, windows[name])
        starts = {s for (n, s) in got if n == name}
        assert starts <= {k * SEQ for k in range(windows[name])}
        # every window `full` times, `rest` of them once more: each pass exactly once
        assert counts == +Counter({full + 1: rest, full: windows[name] - rest})
        assert full >= 1


def test_elastic_resume_across_a_schedule_change(mix_feeder) -> None:
    names = ("a", "b")
    first: list[dict] = []
    states = []
    for rank in range(2):
        with loader(mix_feeder.address, rank, 2) as ld:
            first += stream(ld, 9)
            states.append(ld.state_dict())
    assert states[0] == states[1]
    assert states[0]["offset"] == 9 * B * 2
    state = states[0]
    position_tokens = state["offset"] * SEQ
    schedule = [{"from_tokens": position_tokens + 5, "weights": {"a": 0.1, "b": 0.9}}]
    second: list[dict] = []
    for rank in range(3):  # another world size and batch size
        with loader(mix_feeder.address, rank, 3, batch_size=3, schedule=schedule) as ld:
            ld.load_state_dict(state)
            batches = stream(ld, 11)
            assert batches[0]["step"] == 9
            assert batches[0]["offset"] == state["offset"]
            second += batches
    for b in first + second:
        check_rows(b, names)
    # the same windows as one uninterrupted stream with the new schedule
    end = state["offset"] + 11 * 3 * 3
    spec = SamplingSpec(
        dataset="",
        seq_len=SEQ,
        batch_size=end,
        shuffle=True,
        seed=7,
        sources={"a": 0.5, "b": 0.5},
        schedule=schedule,
    )
    ref = next(MixtureSampler(spec, (TOTAL["a"], TOTAL["b"]), (1000, 500)).batches(0))
    want = Counter(
        (names[s], int(x)) for s, x in zip(ref.sources.tolist(), ref.starts.tolist(), strict=True)
    )
    assert delivered(first, names) + delivered(second, names) == want
    # after the new segment starts, b gets about 9 in 10 windows
    late = Counter(n for b in second for n in b["sources"].tolist())
    assert late[1] > late[0]


def test_resume_refuses_other_changes_naming_them(mix_feeder) -> None:
    with loader(mix_feeder.address, 0, 1) as ld:
        stream(ld, 3)
        state = ld.state_dict()
    assert json.loads(json.dumps(state)) == state  # plain JSON
    cases = {
        "weights": dict(mixture={"a": 0.6, "b": 0.4}),
        "sources differ": dict(mixture={"b": 0.5, "a": 0.5}),
        "starts before": dict(schedule=[(SEQ, {"a": 1, "b": 1})]),
        "fingerprint": dict(seed=8),
    }
    for words, change in cases.items():
        with (
            loader(mix_feeder.address, 0, 1, **change) as other,
            pytest.raises(ValueError, match=words),
        ):
            other.load_state_dict(state)
    saved = dict(state, mixture=dict(state["mixture"], schedule=[[10**9, [["a", 1], ["b", 0]]]]))
    with loader(mix_feeder.address, 0, 1) as other, pytest.raises(ValueError, match="missing"):
        other.load_state_dict(saved)
    with (
        FeederClient(mix_feeder.address, dataset="a", seq_len=SEQ, batch_size=B) as single,
        pytest.raises(ValueError, match="mixture"),
    ):
        single.load_state_dict(state)


def test_a_mixture_is_endless(mix_feeder) -> None:
    with loader(mix_feeder.address, 0, 1) as ld:
        with pytest.raises(TypeError):
            len(ld)
        with pytest.raises(ValueError, match="epochs"):
            ld.set_epoch(1)
        ld.set_epoch(0)
        batches = stream(ld, 3)
        assert all(b["epoch"] == 0 for b in batches)
        assert batches[0]["sources"].dtype == np.int64


def test_the_same_mixture_file_works_as_yaml_and_json(mix_feeder, tmp_path: Path) -> None:
    doc = {
        "sources": {"a": 0.25, "b": 0.75},
        "schedule": [{"from_tokens": 64 * SEQ, "weights": {"a": 1, "b": 0}}],
    }
    (tmp_path / "mix.json").write_text(json.dumps(doc))
    (tmp_path / "mix.yaml").write_text(
        "sources: {a: 0.25, b: 0.75}\nschedule:\n  - from_tokens: 1024\n    weights: {a: 1, b: 0}\n"
    )
    runs = []
    for path in ("mix.json", "mix.yaml"):
        with loader(mix_feeder.address, 0, 1, mixture=tmp_path / path) as ld:
            runs.append(delivered(stream(ld, 20), ld.sources))
    with loader(
        mix_feeder.address,
        0,
        1,
        mixture=[("a", 0.25), ("b", 0.75)],
        schedule=[(1024, {"a": 1, "b": 0})],
    ) as ld:
        runs.append(delivered(stream(ld, 20), ld.sources))
    assert runs[0] == runs[1] == runs[2]
    with pytest.raises(ValueError, match="mutually exclusive"):
        FeederClient(mix_feeder.address, dataset="a", mixture={"a": 1}, seq_len=4, batch_size=1)


# ------------------------------------------------------------------ wire, errors


def params(**kw) -> pb.SamplingParams:
    mixture = kw.pop("mixture", {"a": 0.7, "b": 0.3})
    schedule = kw.pop("schedule", [])
    p = pb.SamplingParams(seq_len=SEQ, batch_size=B, **kw)
    for name, w in mixture.items() if isinstance(mixture, dict) else mixture:
        p.sources.add(name=name, weight=w)
    for tok, ws in schedule:
        seg = p.schedule.add(from_tokens=tok)
        for name, w in ws:
            seg.weights.add(name=name, weight=w)
    return p


ERRORS = [
    ("NOT_FOUND", "sources['nope']", dict(mixture={"a": 1, "nope": 1})),
    ("INVALID_ARGUMENT", "sources['a']", dict(mixture={"a": -1, "b": 1})),
    ("INVALID_ARGUMENT", "sources['a']", dict(mixture={"a": math.nan, "b": 1})),
    ("INVALID_ARGUMENT", "sources", dict(mixture={"a": 0, "b": 0})),
    ("INVALID_ARGUMENT", "sources[1].name", dict(mixture=[("a", 1), ("a", 2)])),
    (
        "INVALID_ARGUMENT",
        "schedule[1].from_tokens",
        dict(schedule=[(100, [("a", 1), ("b", 1)]), (100, [("a", 1), ("b", 2)])]),
    ),
    ("INVALID_ARGUMENT", "schedule[0].weights", dict(schedule=[(100, [("a", 1)])])),
    (
        "INVALID_ARGUMENT",
        "schedule[0].weights['c']",
        dict(schedule=[(100, [("a", 1), ("b", 1), ("c", 1)])]),
    ),
    ("INVALID_ARGUMENT", "split", dict(split="validation")),
    ("INVALID_ARGUMENT", "dataset", dict(dataset="a")),
    ("INVALID_ARGUMENT", "epoch", dict()),
    ("FAILED_PRECONDITION", "sources['tiny']", dict(mixture={"a": 1, "tiny": 1})),
    ("FAILED_PRECONDITION", "sources['narrow']", dict(mixture={"a": 1, "narrow": 1})),
]


@pytest.mark.parametrize(("code", "field", "kw"), ERRORS, ids=[f"{c}:{f}" for c, f, _ in ERRORS])
def test_errors_name_the_field_and_the_feeder_keeps_serving(mix_feeder, code, field, kw) -> None:
    kw = dict(kw)
    epoch = 1 if field == "epoch" else 0
    with grpc.insecure_channel(mix_feeder.address) as ch:
        stub = feeder_pb2_grpc.FeederStub(ch)
        with pytest.raises(grpc.RpcError) as err:
            next(
                iter(stub.StreamBatches(pb.StreamBatchesRequest(params=params(**kw), epoch=epoch)))
            )
        assert err.value.code().name == code
        assert err.value.details().startswith(field), err.value.details()
        # the same mixture, well-formed: streams
        call = stub.StreamBatches(pb.StreamBatchesRequest(params=params()))
        assert next(iter(call)).batches[0].sources
        call.cancel()


def test_info_reports_each_source_and_a_budget(mix_feeder) -> None:
    with grpc.insecure_channel(mix_feeder.address) as ch:
        resp = feeder_pb2_grpc.FeederStub(ch).Info(
            pb.InfoRequest(params=params(), budget_tokens=10**6)
        )
    by = {s.name: s for s in resp.sources}
    assert list(by) == ["a", "b"]
    assert by["a"].tokens == TOTAL["a"]
    assert by["a"].windows == (TOTAL["a"] - SEQ - 1) // SEQ + 1
    assert by["a"].windows_drawn + by["b"].windows_drawn == 10**6 // SEQ
    assert by["a"].tokens_drawn == by["a"].windows_drawn * SEQ
    assert by["b"].passes == pytest.approx(by["b"].windows_drawn / by["b"].windows)
    assert list(by["a"].shares) == pytest.approx([0.7])
    assert [d.name for d in resp.datasets] == ["a", "b"]
    # the client's dataset_info carries each source's windows (a pass), in source order
    with loader(mix_feeder.address, 0, 1) as ld:
        assert ld.dataset_info.source_windows == (by["a"].windows, by["b"].windows)


def test_tokens_and_cache_are_counted_by_source(mix_root: Path) -> None:
    with running_feeder(mix_root) as f:
        # one batch per message; every message written counts, also those of a burst the
        # client closed mid-way
        with loader(f.address, 0, 1, batches_per_message=1) as ld:
            stream(ld, 30)
        # the stream's last counts land when its handler ends, after the client closed
        wait_until(lambda: not f.server.service.active_streams, 30, "the stream to end")
        reg = f.registry

        def value(name: str, **labels) -> float:
            return reg.get_sample_value(name, labels) or 0.0

        a = value("tokenfeed_server_tokens_sent_total", dataset="a", split="train", source="a")
        b = value("tokenfeed_server_tokens_sent_total", dataset="b", split="train", source="b")
        assert a > 0
        assert b > 0
        batches = value("tokenfeed_server_batches_sent_total", dataset="(mixture)", split="train")
        assert batches >= 30
        assert a + b == batches * B * (SEQ + 1)
        assert value("tokenfeed_server_bytes_sent_total", dataset="a", split="train") == a * 4
        for name in ("a", "b"):  # both series exist from a source's first load on
            hits = reg.get_sample_value("tokenfeed_cache_dataset_hits_total", {"dataset": name})
            misses = reg.get_sample_value("tokenfeed_cache_dataset_misses_total", {"dataset": name})
            assert hits is not None
            assert misses is not None
            assert hits + misses >= 1
        # every hit counted by its dataset too; a burst that was being built when the client
        # closed still finishes in its worker thread (its messages are dropped, its pins
        # counted), so the two counters agree once it has
        wait_until(
            lambda: (
                value("tokenfeed_cache_hits_total")
                == sum(value("tokenfeed_cache_dataset_hits_total", dataset=n) for n in ("a", "b"))
            ),
            10,
            "the cache's hits to equal their sum by dataset",
        )


# ----------------------------------------------------------------------------- CLI


def test_info_prints_the_plan_of_a_mixture(mix_root: Path, tmp_path: Path) -> None:
    import subprocess
    import sys

    mix = tmp_path / "mix.yaml"
    mix.write_text(
        "sources: {a: 0.7, b: 0.3}\n"
        "schedule:\n  - from_tokens: 2e9\n    weights: {a: 0.2, b: 0.8}\n"
    )
    base = [sys.executable, "-m", "tokenfeed", "info", "--data-root", str(mix_root)]
    run = [*base, "--mixture", str(mix), "--tokens", "1e10", "--seq-len", str(SEQ), "--json"]
    doc = json.loads(subprocess.run(run, check=True, capture_output=True, text=True).stdout)
    spec = SamplingSpec(dataset="", seq_len=SEQ, batch_size=1, sources={"a": 0.7, "b": 0.3})
    spec = spec.with_(schedule=((2 * 10**9, (("a", 0.2), ("b", 0.8))),))
    counts = spec.mixture.counts(10**10 // SEQ)
    assert [s["windows_drawn"] for s in doc["sources"]] == list(counts)
    assert [s["shares"] for s in doc["sources"]] == [[0.7, 0.2], [0.3, 0.8]]
    assert doc["sources"][1]["passes"] == pytest.approx(counts[1] / doc["sources"][1]["windows"])
    text = subprocess.run(
        [*base, "--mixture", "a=0.7,b=0.3", "--tokens", "1e12", "--seq-len", "16"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert "passes" in text
    assert "700,000,000,000" in text
    bad = subprocess.run(
        [*base, "--mixture", "a=1,nope=1", "--tokens", "1e6", "--seq-len", "16"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    assert "sources['nope']" in bad.stderr


@pytest.mark.parametrize("shift", [1, "auto"])
@pytest.mark.parametrize("per_message", [1, 3, 7])
def test_source_counters_count_exactly_the_tokens_of_each_source(
    mix_root: Path, per_message, shift
):
    """SourceCounters (source_counters.py) against the messages themselves: after the written
    messages are counted and flushed, each source's tokens_sent is the tokens of the
    rows carrying its index, also for messages spanning rounds (rounds start at one
    step and double, so 3 and 7 batches per message straddle them) and when not every
    message built is counted yet; with `auto` shifts, batches of different widths."""
    from prometheus_client import CollectorRegistry

    from tokenfeed.server import service
    from tokenfeed.server.assembly import MessageBuilder
    from tokenfeed.server.cache import ChunkCache
    from tokenfeed.server.datasets import Catalog
    from tokenfeed.server.metrics import ServerMetrics
    from tokenfeed.server.mixtures import MixtureSpace
    from tokenfeed.server.source_counters import SourceCounters

    registry = CollectorRegistry()
    metrics = ServerMetrics(registry)
    catalog = Catalog(mix_root)
    sources = [catalog.get("a"), catalog.get("b")]
    spec = SamplingSpec(
        "",
        sources=(("a", 0.7), ("b", 0.3)),
        seq_len=SEQ,
        batch_size=B,
        shuffle=True,
        seed=3,
        shift=shift,
    )
    sampler = service.mixture_sampler_for(spec, sources)
    pipe = MessageBuilder(
        MixtureSpace.of(sources),
        sampler,
        sampler.rounds(0),
        per_message,
        ChunkCache(1 << 24),
        metrics,
    )
    counters = SourceCounters.of(metrics, pipe)
    assert counters is not None
    want = [0, 0]
    widths = set()
    held = 0  # messages built, not yet counted: the last burst's
    for _ in range(12):
        counters.count(held)
        burst = pipe.next_burst()
        for data, _, _, _ in burst:
            for batch in pb.StreamBatchesResponse.FromString(data).batches:
                widths.add(batch.cols)
                for s in batch.sources:
                    want[s] += batch.cols
        held = len(burst)
    counters.flush()
    assert (len(widths) > 1) == (shift == "auto")  # auto: batches of several widths

    def sent(name: str) -> float:
        labels = {"dataset": name, "split": "train", "source": name}
        return registry.get_sample_value("tokenfeed_server_tokens_sent_total", labels) or 0.0

    last = [0, 0]  # the tokens of the last burst, built and not counted
    for data, _, _, _ in burst:
        for batch in pb.StreamBatchesResponse.FromString(data).batches:
            for s in batch.sources:
                last[s] += batch.cols
    assert [sent("a"), sent("b")] == [want[0] - last[0], want[1] - last[1]]
    assert min(want) > 0
    counters.count(held)
    counters.flush()
    assert [sent("a"), sent("b")] == want
    assert (
        registry.get_sample_value(
            "tokenfeed_server_bytes_sent_total", {"dataset": "a", "split": "train"}
        )
        == want[0] * sources[0].store.dtype.itemsize
    )
