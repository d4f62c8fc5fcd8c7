"""Run-time segments (core/mixture/runtime.py; docs/mixtures.md, "Run-time weights").

A segment added while a run streams is a schedule segment: the properties below hold
a run that adds one at step s against a run constructed with it, at every step and
across elastic resumes, and the mixture extended segment by segment against one built
from scratch.
"""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.mixture import Mixture, RuntimeSegments, merge, step_position
from tokenfeed.core.mixture.sampler import MixtureSampler
from tokenfeed.core.mixture.spec import parse
from tokenfeed.core.request import SamplingSpec
from tokenfeed.v1 import feeder_pb2 as pb

from support import fewer_examples

WEIGHTS = [0.0, 0.0, 1.0, 2.0, 0.5, 0.1, 0.7, 0.25, 1 / 3, 0.1234, 0.001]
TOTALS = (3_000, 1_100, 700, 400)  # tokens of up to four sources' stores
BLOCKS = (500, 300, 200, 100)


def weight_set(draw, k: int) -> list[float]:
    ws = draw(st.lists(st.sampled_from(WEIGHTS), min_size=k, max_size=k))
    if not any(ws):
        ws[draw(st.integers(0, k - 1))] = 1.0
    return ws


@st.composite
def mixtures(draw, max_k: int = 4):
    """(names, base weights, declared schedule as (from_tokens, weights in order), seq_len)."""
    k = draw(st.integers(1, max_k))
    names = [f"s{i}" for i in range(k)]
    seq_len = draw(st.integers(1, 4))
    gaps = draw(st.lists(st.integers(1, 60), max_size=3))
    schedule = [(int(t), weight_set(draw, k)) for t in np.cumsum(gaps).tolist()]
    return names, weight_set(draw, k), schedule, seq_len


def declared(names, base, schedule):
    return list(zip(names, base, strict=True)), [
        (t, dict(zip(names, ws, strict=True))) for t, ws in schedule
    ]


def spec_of(names, base, schedule, seq_len, *, B, W, seed, shuffle, runtime=b""):
    sources, sched = declared(names, base, schedule)
    return SamplingSpec(
        dataset="",
        sources=sources,
        schedule=sched,
        runtime=runtime,
        seq_len=seq_len,
        batch_size=B,
        world_size=W,
        seed=seed,
        shuffle=shuffle,
    )


def rank_batches(spec: SamplingSpec, offset: int, step: int, steps: int) -> list[list[tuple]]:
    """Per step, every rank's batch as (step, offset, shift, sources, starts)."""
    k = len(spec.sources)
    sampler = MixtureSampler(spec, TOTALS[:k], BLOCKS[:k])
    per_rank = []
    for rank in range(spec.world_size):
        it = sampler.batches(rank, offset, step)
        rows = []
        for _ in range(steps):
            b = next(it)
            rows.append((b.step, b.offset, b.shift, b.sources.tolist(), b.starts.tolist()))
        per_rank.append(rows)
    return [list(x) for x in zip(*per_rank, strict=True)]


# ------------------------------------------------------------------- merge rule


@given(mixtures(), st.lists(st.integers(1, 200), min_size=1, max_size=4), st.data())
def test_in_force_is_the_merge_and_a_runtime_segment_wins_at_an_equal_from_tokens(
    mixture, runtime_tokens, data
):
    names, base, schedule, seq_len = mixture
    k = len(names)
    # run-time from_tokens drawn among and around the declared ones, strictly increasing
    pool = sorted({*runtime_tokens, *(t for t, _ in schedule)})
    tokens = sorted(set(data.draw(st.lists(st.sampled_from(pool), min_size=1, max_size=4))))
    rt = RuntimeSegments(k)
    added = []
    for t in tokens:
        ws = weight_set(data.draw, k)
        rt = rt.with_segment(t, ws)
        added.append((t, ws))
    mix = Mixture(*declared(names, base, schedule), seq_len=seq_len, runtime=rt)
    by_tokens = dict(schedule) | dict(added)  # the run-time segment wins
    want = [(0, base), *sorted(by_tokens.items())]
    got = [(s.from_tokens, [float(w) for w in s.weights]) for s in mix.in_force]
    assert got == want
    # and it is exactly the mixture constructed with that schedule
    ref = Mixture(*declared(names, base, want[1:]), seq_len=seq_len)
    ps = np.arange(0, 300)
    assert mix.counts_at(ps).tolist() == ref.counts_at(ps).tolist()
    assert mix.schedule() == [
        (t, {n: repr(float(w)) for n, w in zip(names, ws, strict=True)}) for t, ws in want
    ]


def test_merge_keeps_each_list_in_order():
    _, (base, s100, s300) = parse(
        {"a": 1, "b": 1}, [(100, {"a": 1, "b": 0}), (300, [("a", 0), ("b", 1)])]
    )
    _, (_, r100, r200) = parse({"a": 1, "b": 1}, [(100, {"a": 2, "b": 1}), (200, {"a": 1, "b": 2})])
    assert merge([base, s100, s300], [r100, r200]) == [base, r100, r200, s300]
    assert merge([base, s100, s300], []) == [base, s100, s300]


# ------------------------------------------------ a change at step s == constructed


SIZES, SEEDS = st.integers(1, 3), st.integers(0, 2**64 - 1)


def changed_and_constructed(mixture, position, draw, **kw):
    """A spec with a run-time segment from `position` (weights drawn) and the spec
    constructed with that segment in its schedule, and that schedule."""
    names, base, schedule, seq_len = mixture
    ws = weight_set(draw, len(names))
    tokens = position * seq_len
    assume(all(t != tokens for t, _ in schedule))
    rt = RuntimeSegments(len(names)).with_segment(tokens, ws)
    changed = spec_of(names, base, schedule, seq_len, runtime=rt.data, **kw)
    with_it = sorted([*schedule, (tokens, ws)])
    return changed, spec_of(names, base, with_it, seq_len, **kw), with_it


@fewer_examples(2)  # every rank's batches of three samplers each
@given(mixtures(), SIZES, SIZES, st.integers(1, 6), st.integers(0, 4), st.integers(1, 6), SEEDS,
       st.booleans(), st.data())  # fmt: skip
def test_a_change_at_step_s_streams_the_batches_of_the_constructed_run(
    mixture, B, W, s, ahead, after, seed, shuffle, data
):
    """set_weights(w, at_step=s + ahead) while the loop is at step s: from step s on
    (what the loader streams again after the call), every rank's batch is the one of a
    run constructed with that segment; before step s + ahead nothing changes at all."""
    names, base, schedule, seq_len = mixture
    G = B * W
    position = step_position(s + ahead, s * G, s, G)
    kw = dict(B=B, W=W, seed=seed, shuffle=shuffle)
    changed, constructed, _ = changed_and_constructed(mixture, position, data.draw, **kw)
    unchanged = spec_of(names, base, schedule, seq_len, **kw)
    steps = ahead + after
    got = rank_batches(changed, s * G, s, steps)
    assert got == rank_batches(constructed, s * G, s, steps)
    assert got[:ahead] == rank_batches(unchanged, s * G, s, ahead)
    # and from the start of the run too: a segment added at s changes nothing before it
    assert rank_batches(changed, 0, 0, s + steps) == rank_batches(constructed, 0, 0, s + steps)


@fewer_examples(2)
@given(mixtures(), SIZES, SIZES, st.integers(1, 5), SIZES, SIZES, st.integers(0, 4),
       st.integers(1, 5), SEEDS, st.booleans(), st.data())  # fmt: skip
def test_a_change_after_an_elastic_resume_starts_at_the_steps_global_position(
    mixture, B1, W1, s1, B2, W2, ahead, after, seed, shuffle, data
):
    """A run at (B1, W1) saves at step s1 and resumes at (B2, W2); a change at step
    s1 + ahead then starts at the next offset plus ahead * B2 * W2 positions (never at
    (s1 + ahead) * B2 * W2), and the resumed run streams the constructed run's batches."""
    names, base, _, seq_len = mixture
    k = len(names)
    offset = s1 * B1 * W1
    position = step_position(s1 + ahead, offset, s1, B2 * W2)
    assert position == offset + ahead * B2 * W2
    kw = dict(B=B2, W=W2, seed=seed, shuffle=shuffle)
    changed, constructed, with_it = changed_and_constructed(mixture, position, data.draw, **kw)
    got = rank_batches(changed, offset, s1, ahead + after)
    assert got == rank_batches(constructed, offset, s1, ahead + after)
    assert [step[0][:2] for step in got] == [
        (s1 + n, offset + n * B2 * W2) for n in range(ahead + after)
    ]
    # the first changed step's windows are the ones the constructed mixture has there
    first = got[ahead]
    mix = Mixture(*declared(names, base, with_it), seq_len=seq_len)
    c0, c1 = mix.counts(position), mix.counts(position + B2 * W2)
    drawn = [src for rank in first for src in rank[3]]
    assert [drawn.count(i) for i in range(k)] == [b - a for a, b in zip(c0, c1, strict=True)]


@given(st.integers(0, 50), st.integers(0, 10), st.integers(1, 64), st.integers(0, 40))
def test_step_position_arithmetic(step, ahead, G, offset):
    if offset == 0 and ahead == 0:
        with pytest.raises(InvalidArgument, match=r"at_step: .*construct the loader"):
            step_position(step, offset, step, G)
        return
    assert step_position(step + ahead, offset, step, G) == offset + ahead * G
    if step:
        with pytest.raises(InvalidArgument, match=r"at_step: step \d+ is in the past"):
            step_position(step - 1, offset, step, G)
    with pytest.raises(InvalidArgument, match="at_step: must be an integer"):
        step_position(True, offset, step, G)


# ------------------------------------------------- extended == built from scratch


@fewer_examples(6)  # a fresh build beside every extension
@given(mixtures(max_k=3), st.integers(1, 8), st.data())
def test_a_mixture_extended_segment_by_segment_equals_one_built_at_once(mixture, n, data):
    """The server extends the mixture of the request before (one more run-time segment,
    or the last one replaced): the same integers and counts as a fresh build."""
    names, base, schedule, seq_len = mixture
    k = len(names)
    sources, sched = declared(names, base, schedule)
    mix = Mixture(sources, sched, seq_len=seq_len)
    rt = RuntimeSegments(k)
    tok = 0
    for _ in range(n):
        tok += data.draw(st.integers(0, 40))  # 0: replaces the last run-time segment
        if tok == 0:
            continue
        rt = rt.with_segment(tok, weight_set(data.draw, k))
        mix = mix.with_runtime(rt)
        fresh = Mixture(sources, sched, seq_len=seq_len, runtime=rt)
        assert mix.in_force == fresh.in_force
        assert mix.apportionment._segs == fresh.apportionment._segs
        ps = np.arange(0, tok // seq_len + 40)
        assert mix.counts_at(ps).tolist() == fresh.counts_at(ps).tolist()
        a, b = mix.runs(ps[::7], 9), fresh.runs(ps[::7], 9)
        assert a[0].tolist() == b[0].tolist()
        assert a[1].tolist() == b[1].tolist()
    # back to a prefix, or to another branch: still the same as a fresh build
    cut = data.draw(st.integers(0, len(rt)))
    other = RuntimeSegments(k, rt.data[: cut * rt.record_bytes])
    if cut:
        other = other.with_segment(other.last_from_tokens + 1, weight_set(data.draw, k))
    fresh = Mixture(sources, sched, seq_len=seq_len, runtime=other)
    assert mix.with_runtime(other).apportionment._segs == fresh.apportionment._segs
    # and the branch left the version it grew from as it was (they share their lists)
    again = Mixture(sources, sched, seq_len=seq_len, runtime=rt)
    assert mix.in_force == again.in_force
    assert mix.apportionment._segs == again.apportionment._segs
    ps = np.arange(0, tok // seq_len + 40)
    assert mix.counts_at(ps).tolist() == again.counts_at(ps).tolist()


def test_a_spec_with_one_more_segment_extends_the_cached_mixture():
    names, k = ["a", "b", "c"], 3
    rt = RuntimeSegments(k)
    for j in range(1, 200):
        rt = rt.with_segment(j * 64, [j % 7 + 1, 1, 0.5])
    kw = dict(B=2, W=2, seed=1, shuffle=True)
    one = spec_of(names, [1, 1, 1], [], 4, runtime=rt.data, **kw)
    rt2 = rt.with_segment(200 * 64, [0.1, 0.2, 0.7])
    two = one.with_(runtime=rt2.data)  # as the client and the server make it: plain tuples
    # the second shares the first's segment objects: built by extension, not again
    assert two.mixture.in_force[:-1] == one.mixture.in_force
    assert all(x is y for x, y in zip(two.mixture.in_force, one.mixture.in_force, strict=False))
    assert two.mixture.apportionment._segs[5] is one.mixture.apportionment._segs[5]


# ---------------------------------------------------------- the bytes and the state


def test_the_wire_form_is_int64_then_k_float64_little_endian():
    rt = RuntimeSegments(2).with_segment(4096, [0.25, 0.75]).with_segment(8192, [1.0, 0.0])
    assert rt.data == struct.pack("<qdd", 4096, 0.25, 0.75) + struct.pack("<qdd", 8192, 1.0, 0.0)
    assert len(rt) == 2
    assert rt.last_from_tokens == 8192
    # a change at the same from_tokens replaces the last one
    again = rt.with_segment(8192, [0.5, 0.5])
    assert len(again) == 2
    assert again.to_state() == [[4096, [0.25, 0.75]], [8192, [0.5, 0.5]]]
    with pytest.raises(InvalidArgument, match="from_tokens: must be at least"):
        rt.with_segment(4096, [0.5, 0.5])
    assert RuntimeSegments.from_state(2, rt.to_state()) == rt
    assert rt.common_prefix(again) == 1
    assert again.common_prefix(again) == 2
    assert repr(rt) == "RuntimeSegments(k=2, 2 segments)"


@given(
    st.lists(
        st.tuples(
            st.integers(1, 10**6), st.lists(st.sampled_from(WEIGHTS), min_size=3, max_size=3)
        ),
        max_size=6,
    )
)
def test_state_round_trips_exactly(rows):
    rt = RuntimeSegments(3)
    tok = 0
    for gap, ws in rows:
        tok += gap
        rt = rt.with_segment(tok, ws)
    state = rt.to_state()
    assert RuntimeSegments.from_state(3, state) == rt
    assert all(type(w) is float for _, ws in state for w in ws)


def raw(k, *rows):
    return b"".join(struct.pack(f"<q{k}d", t, *ws) for t, ws in rows)


@pytest.mark.parametrize(
    ("data", "field"),
    [
        (raw(2, (10, [1, 1]))[:-3], "runtime_segments"),
        (raw(2, (0, [1, 1])), "runtime_segments[0].from_tokens"),
        (raw(2, ((1 << 62) + 1, [1, 1])), "runtime_segments[0].from_tokens"),
        (raw(2, (10, [1, 1]), (10, [1, 2])), "runtime_segments[1].from_tokens"),
        (raw(2, (10, [1, 1]), (20, [-1, 2])), "runtime_segments[1].weights['a']"),
        (raw(2, (10, [1, math.nan])), "runtime_segments[0].weights['b']"),
        (raw(2, (10, [1, math.inf])), "runtime_segments[0].weights['b']"),
        (raw(2, (10, [0, 0])), "runtime_segments[0].weights"),
    ],
    ids=["partial", "zero", "too-far", "not-increasing", "negative", "nan", "inf", "all-zero"],
)
def test_bad_runtime_segments_name_the_field(data, field):
    with pytest.raises(InvalidArgument) as e:
        SamplingSpec(dataset="", sources={"a": 1, "b": 1}, runtime=data, seq_len=4, batch_size=1)
    assert e.value.field == field
    assert str(e.value).startswith(field + ":")


def test_runtime_segments_need_a_mixture_and_travel_on_the_wire():
    with pytest.raises(InvalidArgument, match="runtime_segments: a runtime_segments needs"):
        SamplingSpec(dataset="d", runtime=raw(1, (8, [1])), seq_len=4, batch_size=1)
    with pytest.raises(InvalidArgument, match="runtime_segments: must be bytes"):
        SamplingSpec(dataset="", sources={"a": 1}, runtime="x", seq_len=4, batch_size=1)  # type: ignore[arg-type]
    spec = SamplingSpec(
        dataset="",
        sources={"a": 0.5, "b": 0.5},
        schedule=[(400, {"a": 1, "b": 0})],
        runtime=raw(2, (100, [0.1234, 0.8766]), (400, [0.3, 0.7])),
        seq_len=4,
        batch_size=2,
    )
    wire = pb.SamplingParams.FromString(spec.to_proto().SerializeToString())
    assert SamplingSpec.from_proto(wire) == spec
    # the fingerprint leaves run-time segments out (as the schedule): a resume adopts them
    plain = spec.with_(runtime=b"")
    assert plain.fingerprint() == spec.fingerprint()
    assert spec.mixture_state()["runtime"] == [[100, [0.1234, 0.8766]], [400, [0.3, 0.7]]]
    assert spec.mixture.schedule() == [
        (0, {"a": "0.5", "b": "0.5"}),
        (100, {"a": "0.1234", "b": "0.8766"}),
        (400, {"a": "0.3", "b": "0.7"}),  # the run-time segment replaced the declared one
    ]
