"""Properties of the mixture math (core/mixture/), checked against a slow sequential
reference.

The reference below is written from docs/mixtures.md's definition alone (walk
positions one by one, queue items as they fall due), not from the closed form in
mixture/apportionment.py.
"""

from __future__ import annotations

import math
from collections import Counter, deque
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.keyed import Permutation, permute, stage_keys
from tokenfeed.core.limits import MAX_TOKENS
from tokenfeed.core.mixture import (
    Mixture,
    PassOrders,
    parse_weight,
    source_seed,
    split_passes,
    step_key,
    step_keys,
)
from tokenfeed.core.mixture.passes import divmod_items
from tokenfeed.core.mixture.spec import normalize, normalize_given
from tokenfeed.core.mixture.steps import rank_steps, rounds
from tokenfeed.core.shuffle import EpochOrder

from support import fewer_examples

# ------------------------------------------------------------------ the reference


def _shares(weights):
    ws = [Fraction(repr(float(w))) for w in weights]
    total = sum(ws)
    return [w / total for w in ws]


class Reference:
    """The definition, walked: position by position, items queued as they fall due."""

    def __init__(self, base, schedule, seq_len):
        self.names = [n for n, _ in base]
        self.k = len(self.names)
        self.seq_len = seq_len
        self.segs = [(0, _shares([w for _, w in base]))]
        for tok, ws in schedule:
            self.segs.append((tok, _shares([ws[n] for n in self.names])))

    def weight(self, x):
        """Weights of position x: the last segment with from_tokens <= x * seq_len."""
        current = self.segs[0][1]
        for tok, shares in self.segs:
            if tok <= x * self.seq_len:
                current = shares
        return current

    def walk(self, n):
        """(sequence of (source, item) for positions 0..n-1, targets t(0..n))."""
        k = self.k
        t = [Fraction(0)] * k
        targets = [tuple(t)]
        nxt = [0] * k
        queue: deque = deque()
        out: list[tuple[int, int]] = []
        x = 0
        while len(out) < n or len(targets) <= n:
            w = self.weight(x)
            for i in range(k):
                while True:
                    due = w[i] > 0 if nxt[i] == 0 else t[i] >= nxt[i]
                    if not due:
                        break
                    queue.append((i, nxt[i]))
                    nxt[i] += 1
            t = [a + b for a, b in zip(t, w, strict=True)]
            targets.append(tuple(t))
            x += 1
            while queue and len(out) < n:
                out.append(queue.popleft())
        return out, targets[: n + 1]


def prefix_counts(seq, k):
    c = [0] * k
    out = [tuple(c)]
    for i, _ in seq:
        c[i] += 1
        out.append(tuple(c))
    return out


# ------------------------------------------------------------------- strategies

WEIGHTS = [0, 0, 0, 1, 2, 3, 5, 0.5, 0.1, 0.7, 0.25, 0.2, 1 / 3, 0.14285714285714285, 0.001]


@st.composite
def mixtures(draw, max_k=4, max_segments=4, max_gap=80):
    k = draw(st.integers(1, max_k))
    seq_len = draw(st.integers(1, 4))
    names = [f"s{i}" for i in range(k)]

    def weight_set():
        ws = draw(st.lists(st.sampled_from(WEIGHTS), min_size=k, max_size=k))
        if not any(ws):
            ws[draw(st.integers(0, k - 1))] = draw(st.sampled_from([1, 0.3]))
        return ws

    base = list(zip(names, weight_set(), strict=True))
    n_seg = draw(st.integers(0, max_segments - 1))
    gaps = draw(st.lists(st.integers(1, max_gap), min_size=n_seg, max_size=n_seg))
    schedule = [
        (tok, dict(zip(names, weight_set(), strict=True))) for tok in np.cumsum(gaps).tolist()
    ]
    return base, schedule, seq_len


def build(spec):
    base, schedule, seq_len = spec
    return Mixture(base, schedule, seq_len=seq_len), Reference(base, schedule, seq_len)


# --------------------------------------------------------- closed form == definition


@given(mixtures(), st.integers(1, 250))
def test_counts_equal_the_walk(spec, n):
    mix, ref = build(spec)
    seq, _ = ref.walk(n)
    expected = prefix_counts(seq, mix.k)
    assert [mix.counts(p) for p in range(n + 1)] == expected
    assert mix.counts_at(np.arange(n + 1)).tolist() == [list(c) for c in expected]


@given(mixtures(), st.integers(0, 200), st.integers(0, 60))
def test_a_jump_to_any_range_equals_walking_there(spec, a, length):
    mix, ref = build(spec)
    seq, _ = ref.walk(a + length)
    src, item = mix.items(a, a + length)
    assert list(zip(src.tolist(), item.tolist(), strict=True)) == seq[a:]


@given(mixtures(), st.lists(st.integers(0, 200), min_size=1, max_size=6), st.integers(1, 20))
def test_runs_equal_the_walk(spec, starts, length):
    mix, ref = build(spec)
    seq, _ = ref.walk(max(starts) + length)
    src, item = mix.runs(np.array(starts), length)
    for row, s in enumerate(starts):
        assert list(zip(src[row].tolist(), item[row].tolist(), strict=True)) == seq[s : s + length]


@given(mixtures(max_k=12), st.integers(0, 200), st.integers(1, 40), st.integers(0, 30))
def test_counts_every_step_equal_the_walk(spec, start, step, n):
    """A round's step boundaries, from the items in due order where steps are short
    against the sources (or searched one by one), are the walk's counts."""
    mix, ref = build(spec)
    seq, _ = ref.walk(start + step * n)
    walked = prefix_counts(seq, mix.k)
    got = mix.apportionment.counts_every(start, step, n)
    assert got.tolist() == [list(walked[start + step * s]) for s in range(n + 1)]


@given(mixtures(), st.integers(1, 250))
def test_bound_monotone_adds_up(spec, n):
    mix, ref = build(spec)
    _, targets = ref.walk(n)
    k = mix.k
    prev = (0,) * k
    for p in range(n + 1):
        c = mix.counts(p)
        t = mix.target(p)
        assert t == targets[p]
        assert sum(c) == p
        assert all(x >= y for x, y in zip(c, prev, strict=True))
        for ci, ti in zip(c, t, strict=True):
            assert -k <= ci - ti <= 1
            assert abs(ci - ti) <= k
        prev = c


@given(mixtures(max_k=5), st.integers(0, 300))
def test_a_source_with_weight_zero_since_the_start_is_never_drawn(spec, n):
    mix, _ = build(spec)
    never = [i for i in range(mix.k) if all(seg[1][i] == 0 for seg in mix.segments)]
    c = mix.counts(n)
    assert all(c[i] == 0 for i in never)


@given(mixtures(max_segments=3), st.integers(1, 120), st.data())
def test_appending_a_future_segment_changes_nothing_before_it(spec, gap, data):
    base, schedule, seq_len = spec
    last = schedule[-1][0] if schedule else 0
    names = [n for n, _ in base]
    ws = data.draw(st.lists(st.sampled_from(WEIGHTS), min_size=len(names), max_size=len(names)))
    assume(any(ws))
    extended = [*schedule, (last + gap, dict(zip(names, ws, strict=True)))]
    old = Mixture(base, schedule, seq_len=seq_len)
    new = Mixture(base, extended, seq_len=seq_len)
    cut = -(-(last + gap) // seq_len)  # first position of the new segment
    for p in range(cut + 1):
        assert old.counts(p) == new.counts(p)
    a, b = old.items(0, cut), new.items(0, cut)
    assert np.array_equal(a[0], b[0])
    assert np.array_equal(a[1], b[1])


# --------------------------------------------------------- far offsets, big numbers


@given(
    st.lists(st.sampled_from(WEIGHTS[3:]), min_size=1, max_size=16),
    st.lists(st.integers(1, 1 << 40), min_size=0, max_size=5),
    st.integers(1, 4096),
    st.integers(0, (1 << 50)),
    st.integers(1, 40),
)
def test_far_offsets_are_consistent(weights, gaps, seq_len, p, length):
    """At offsets no walk reaches: the vector kernels equal the scalar exact ints, the
    bound holds, and the range function agrees with c(q+1) - c(q) at every q."""
    names = [f"s{i}" for i in range(len(weights))]
    rng = np.random.default_rng(len(gaps) + seq_len)
    schedule, tok = [], 0
    for g in gaps:
        tok += g * seq_len + int(rng.integers(0, seq_len))
        schedule.append((tok, dict(zip(names, rng.permutation(weights).tolist(), strict=True))))
    mix = Mixture(list(zip(names, weights, strict=True)), schedule, seq_len=seq_len)
    check_far(mix, min(p, mix.max_position - length), length)


def check_far(mix, p, length):
    qs = np.arange(p, p + length + 1)
    c = mix.counts_at(qs)
    exact = [mix.counts(int(q)) for q in qs]
    assert c.tolist() == [list(x) for x in exact]
    k = mix.k
    for q, cq in zip(qs.tolist(), exact, strict=True):
        assert sum(cq) == q
        assert all(-k <= ci - ti <= 1 for ci, ti in zip(cq, mix.target(q), strict=True))
    src, item = mix.items(p, p + length)
    for n in range(length):
        step = [b - a for a, b in zip(exact[n], exact[n + 1], strict=True)]
        assert step[src[n]] == 1
        assert sum(step) == 1
        assert item[n] == exact[n][src[n]]


@pytest.mark.parametrize("p", [0, 12345, 1 << 40, (1 << 61) + 3])
def test_int64_kernels_reduce_products_that_would_overflow(p):
    """D near 2**31 and far offsets: a*d exceeds int64 unless d is reduced mod D."""
    mix = Mixture(
        {"a": 0.123456789, "b": 0.876543211, "c": 0.5},
        [(1000, {"a": 0.5, "b": 0.123456789, "c": 0.876543211})],
        seq_len=1,
    )
    app = mix.apportionment
    assert app._fast.all()
    assert max(s.D for s in app._segs) > 1 << 30
    check_far(mix, p, 30)


def test_large_denominators_take_the_exact_path():
    weights = [0.14285714285714285, 0.3, 0.123456789, 1 / 3]
    base = [(f"s{i}", w) for i, w in enumerate(weights)]
    schedule = [
        (37, {"s0": 0.1, "s1": 0.0, "s2": 2.5e-7, "s3": 0.9}),
        (90, {"s0": 0.1, "s1": 1 / 7, "s2": 0.0, "s3": 0.3}),
    ]
    mix, ref = Mixture(base, schedule, seq_len=1), Reference(base, schedule, 1)
    assert mix.apportionment._fast.tolist() == [False, True, False]  # large D: exact kernels
    seq, _ = ref.walk(300)
    assert mix.counts_at(np.arange(301)).tolist() == [list(c) for c in prefix_counts(seq, 4)]
    src, item = mix.items(20, 300)
    assert list(zip(src.tolist(), item.tolist(), strict=True)) == seq[20:]
    far = 1 << 55
    assert mix.counts_at(np.array([far])).tolist()[0] == list(mix.counts(far))
    # points too far apart for the anchored floats: the Python-int kernels
    ps = np.array([40, 1 << 40, far, far + 7])
    assert mix.counts_at(ps).tolist() == [list(mix.counts(int(p))) for p in ps]
    src, item = mix.runs(np.array([far, 300, 1 << 45]), 9)
    for row, s in enumerate([far, 300, 1 << 45]):
        for n in range(9):
            c0, c1 = mix.counts(s + n), mix.counts(s + n + 1)
            i = int(src[row, n])
            assert c1[i] == c0[i] + 1
            assert item[row, n] == c0[i]


def test_position_range_is_checked():
    mix = Mixture({"a": 1}, seq_len=8)
    assert mix.max_position == MAX_TOKENS // 8
    mix.counts(mix.max_position)
    with pytest.raises(InvalidArgument, match="position"):
        mix.counts(mix.max_position + 1)
    with pytest.raises(InvalidArgument, match="position"):
        mix.counts(-1)


# --------------------------------------------------------------- steps and ranks


def all_rank_items(mix, offset, steps, B, W, seed, shuffle):
    """Per step, per rank (source, item) rows."""
    return [
        rank_steps(mix, r, offset, steps, batch_size=B, world_size=W, seed=seed, shuffle=shuffle)
        for r in range(W)
    ]


def test_the_ranks_of_a_job_share_the_step_boundaries_of_their_round(monkeypatch) -> None:
    """Every rank of a job opens its stream at the same step, and each asks for the
    same boundaries: computed once (an epoch-start storm of 1,024 ranks on 1,000
    sources computed them per rank), kept read-only, and as a fresh mixture's."""
    base, schedule = {"a": 0.5, "b": 0.3, "c": 0.2}, [(5_000, {"a": 0.1, "b": 0.1, "c": 0.8})]
    mix = Mixture(base, schedule, seq_len=8)
    app = mix.apportionment
    calls = []
    compute = app._counts_every
    monkeypatch.setattr(app, "_counts_every", lambda *a: calls.append(a) or compute(*a))
    kw = {"batch_size": 4, "world_size": 16, "seed": 3, "shuffle": True}
    rows = [rank_steps(mix, r, 640, 5, **kw) for r in range(16)]
    assert calls == [(640, 64, 5)]
    fresh = Mixture(base, schedule, seq_len=8)
    for r, (src, item) in enumerate(rows):
        want_src, want_item = rank_steps(fresh, r, 640, 5, **kw)
        assert np.array_equal(src, want_src)
        assert np.array_equal(item, want_item)
    assert not app.counts_every(640, 64, 5).flags.writeable
    rank_steps(mix, 0, 640 + 64 * 5, 5, **kw)  # the next round: its own boundaries
    assert calls[-1] == (960, 64, 5)


def delivered(rows):
    out = Counter()
    for src, item in rows:
        out.update(zip(src.ravel().tolist(), item.ravel().tolist(), strict=True))
    return out


@given(
    mixtures(),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 12),
    st.integers(0, 2**64 - 1),
    st.booleans(),
    st.integers(0, 50),
)
def test_every_item_exactly_once_across_ranks(spec, B, W, steps, seed, shuffle, offset):
    mix, _ = build(spec)
    got = delivered(all_rank_items(mix, offset, steps, B, W, seed, shuffle))
    c0, c1 = mix.counts(offset), mix.counts(offset + steps * B * W)
    want = Counter((i, n) for i in range(mix.k) for n in range(c0[i], c1[i]))
    assert got == want


@given(
    mixtures(),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 8),
    st.integers(0, 2**64 - 1),
    st.booleans(),
    st.lists(st.integers(1, 7), min_size=3, max_size=3),
)
def test_each_sources_passes_are_delivered_exactly_once(spec, B, W, steps, seed, shuffle, windows):
    mix, _ = build(spec)
    got = delivered(all_rank_items(mix, 0, steps, B, W, seed, shuffle))
    for i in range(mix.k):
        w = windows[i % 3]
        seen = Counter(split_passes(n, w) for (src, n) in got if src == i)
        total = sum(seen.values())
        assert all(v == 1 for v in seen.values())
        full, rest = divmod(total, w)
        assert set(seen) == {(e, q) for e in range(full) for q in range(w)} | {
            (full, q) for q in range(rest)
        }


@given(
    mixtures(),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 6),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 2**64 - 1),
    st.booleans(),
)
def test_elastic_resume_continues_every_source(spec, B1, W1, s1, B2, W2, s2, seed, shuffle):
    """Another batch size or world size from the same offset: nothing lost or repeated."""
    mix, _ = build(spec)
    first = delivered(all_rank_items(mix, 0, s1, B1, W1, seed, shuffle))
    offset = s1 * B1 * W1
    second = delivered(all_rank_items(mix, offset, s2, B2, W2, seed, shuffle))
    assert not (set(first) & set(second))
    end = mix.counts(offset + s2 * B2 * W2)
    assert first + second == Counter((i, n) for i in range(mix.k) for n in range(end[i]))


@fewer_examples(2)  # every rank's steps of two mixtures walked each
@given(
    mixtures(max_segments=3),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 6),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 6),
    st.integers(0, 2**64 - 1),
    st.booleans(),
    st.integers(0, 50),
    st.data(),
)
def test_elastic_resume_across_an_extended_schedule(
    spec, B1, W1, s1, B2, W2, s2, seed, shuffle, later, data
):
    """A checkpoint at offset o, resumed with a schedule extended by a segment that starts
    at or after o (in tokens) and another B and W: every source continues exactly."""
    base, schedule, seq_len = spec
    offset = s1 * B1 * W1
    start = max(offset * seq_len, (schedule[-1][0] if schedule else 0) + 1) + later
    names = [n for n, _ in base]
    ws = data.draw(st.lists(st.sampled_from(WEIGHTS), min_size=len(names), max_size=len(names)))
    assume(any(ws))
    old = Mixture(base, schedule, seq_len=seq_len)
    new = Mixture(base, [*schedule, (start, dict(zip(names, ws, strict=True)))], seq_len=seq_len)
    first = delivered(all_rank_items(old, 0, s1, B1, W1, seed, shuffle))
    second = delivered(all_rank_items(new, offset, s2, B2, W2, seed, shuffle))
    assert old.counts(offset) == new.counts(offset)
    end = new.counts(offset + s2 * B2 * W2)
    assert first + second == Counter((i, n) for i in range(new.k) for n in range(end[i]))


@given(mixtures(), st.integers(1, 4), st.integers(1, 4), st.integers(1, 6), st.integers(0, 100))
def test_shuffle_off_is_due_order_without_any_permutation(spec, B, W, steps, offset):
    mix, ref = build(spec)
    seq, _ = ref.walk(offset + steps * B * W)
    for r in range(W):
        src, item = rank_steps(mix, r, offset, steps, batch_size=B, world_size=W, shuffle=False)
        for s in range(steps):
            lo = offset + s * B * W + r * B
            assert list(zip(src[s].tolist(), item[s].tolist(), strict=True)) == seq[lo : lo + B]


@given(
    mixtures(),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(2, 8),
    st.integers(0, 2**64 - 1),
    st.booleans(),
    st.integers(0, 40),
)
def test_steps_jump_equals_walk_and_rounds_agree(spec, B, W, steps, seed, shuffle, offset):
    mix, _ = build(spec)
    r = W - 1
    kw = {"batch_size": B, "world_size": W, "seed": seed, "shuffle": shuffle}
    src, item = rank_steps(mix, r, offset, steps, **kw)
    tail = rank_steps(mix, r, offset + B * W, steps - 1, **kw)  # resume one step later
    assert np.array_equal(tail[0], src[1:])
    assert np.array_equal(tail[1], item[1:])
    got = list(rounds(mix, r, offset, 7, max_steps=steps, **kw))
    assert got[0].step == 7
    assert np.array_equal(np.concatenate([g.sources for g in got]), src)
    assert np.array_equal(np.concatenate([g.items for g in got]), item)
    assert sum(len(g) for g in got) == steps


def test_shuffle_mixes_ranks_and_depends_on_seed_and_offset():
    mix = Mixture({"web": 0.7, "code": 0.2, "math": 0.1}, seq_len=16)
    kw = {"batch_size": 8, "world_size": 8}
    plain = rank_steps(mix, 0, 0, 4, shuffle=False, **kw)
    a = rank_steps(mix, 0, 0, 4, seed=1, shuffle=True, **kw)
    b = rank_steps(mix, 0, 0, 4, seed=2, shuffle=True, **kw)
    assert not np.array_equal(a[1], plain[1])
    assert not np.array_equal(a[1], b[1])
    assert np.array_equal(a[1], rank_steps(mix, 0, 0, 4, seed=1, shuffle=True, **kw)[1])
    # different steps use different orders
    assert len({tuple(np.argsort(row)) for row in a[1]}) > 1


@pytest.mark.parametrize("n", [2, 3, 5, 8, 100, 1000, 1024, 4095])
def test_step_permutation_is_a_bijection(n):
    sk = stage_keys(step_keys(5, np.array([0, n, 7 * n])))
    for row in range(3):
        y = permute(np.arange(n), n, np.repeat(sk[row : row + 1], n, axis=0))
        assert sorted(y.tolist()) == list(range(n))
        # per-element keys equal the one-key form
        assert np.array_equal(y, permute(np.arange(n), n, sk[row]))


@given(
    st.lists(st.sampled_from([0, 1, 2, 0.5, 0.3, 0.001]), min_size=1, max_size=40),
    st.integers(1, 8),
    st.sampled_from([1, 2, 3, 4, 5, 8, 16]),
    st.integers(1, 6),
    st.integers(0, 2**64 - 1),
    st.integers(0, 10**6),
)
def test_step_order_is_the_keyed_bijection_of_the_source_major_layout(
    weights, B, W, steps, seed, offset
):
    """rank_steps against its definition, one step at a time with scalar keys: the
    step's items source-major, slot v of rank r = that layout at the bijection of
    [0, B*W) keyed by step_key(seed, o_s) of slot r*B + v (a few sources and many, B*W
    a power of two and not)."""
    if not any(weights):
        weights[0] = 1
    mix = Mixture([(f"s{i}", w) for i, w in enumerate(weights)], seq_len=3)
    gb = B * W
    offset = offset // gb * gb
    for rank in {0, W - 1}:
        src, item = rank_steps(
            mix, rank, offset, steps, batch_size=B, world_size=W, seed=seed, shuffle=True
        )
        for s in range(steps):
            o = offset + s * gb
            c0, c1 = mix.counts(o), mix.counts(o + gb)
            layout = [(i, n) for i in range(mix.k) for n in range(c0[i], c1[i])]
            slots = np.arange(rank * B, (rank + 1) * B)
            v = Permutation(gb, step_key(seed, o))(slots)
            assert list(zip(src[s].tolist(), item[s].tolist(), strict=True)) == [
                layout[x] for x in v.tolist()
            ]


@fewer_examples(2)  # an EpochOrder built per element drawn
@given(
    st.lists(
        st.tuples(st.integers(1, 300), st.integers(1, 40), st.integers(0, 2**64 - 1)),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 5),
    st.data(),
)
def test_pass_orders_equal_each_sources_epoch_order(sources, shuffle_blocks, data):
    """PassOrders (many sources' passes in one call, group tables cached between calls)
    element by element against EpochOrder, the single-dataset definition: on both of
    its paths (vectorized over passes, and one EpochOrder per pass for a few passes)."""
    windows, wpb, seeds = (list(x) for x in zip(*sources, strict=True))
    orders = PassOrders(windows, wpb, shuffle_blocks, seeds, shuffle=True)
    vectorized = PassOrders(windows, wpb, shuffle_blocks, seeds, shuffle=True)
    vectorized.few_passes = 0
    for _ in range(3):  # later calls reuse (and add to) the cached groups and passes
        m = data.draw(st.integers(1, 60))
        src = np.array(
            data.draw(st.lists(st.integers(0, len(windows) - 1), min_size=m, max_size=m))
        )
        epoch = np.array(
            data.draw(st.lists(st.integers(0, 3) | st.integers(0, 2**40), min_size=m, max_size=m))
        )
        pos = np.array([data.draw(st.integers(0, windows[i] - 1)) for i in src.tolist()])
        got = orders.windows(src, epoch, pos)
        assert np.array_equal(got, vectorized.windows(src, epoch, pos))
        for n in range(m):
            i, e = int(src[n]), int(epoch[n])
            want = EpochOrder(windows[i], wpb[i], shuffle_blocks, seeds[i], e, True)
            assert got[n] == want.windows(np.array([pos[n]]))[0]


# ------------------------------------------------------------------- passes, keys


def test_source_seed_depends_on_seed_and_name_only():
    assert source_seed(1, "web") == source_seed(1, "web")
    assert source_seed(1, "web") != source_seed(2, "web")
    assert source_seed(1, "web") != source_seed(1, "code")
    assert source_seed(1, "a") != source_seed(1, "a\0")  # the length is part of the key
    assert 0 <= source_seed(2**64 - 1, "ünïcode/名前") < 2**64
    # pinned: other languages must derive the same keys
    assert source_seed(0, "web") == 0x25865A436AE1931A


def test_split_passes():
    assert split_passes(10, 4) == (2, 2)
    p, q = split_passes(np.arange(9), 3)
    assert p.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert q.tolist() == [0, 1, 2] * 3
    with pytest.raises(FailedPrecondition, match="window"):
        split_passes(3, 0)


# ------------------------------------------------------------------------ budget


def test_budget_reports_draws_passes_and_shares():
    mix = Mixture(
        {"web": 0.7, "code": 0.2, "math": 0.1},
        [{"from_tokens": 1000, "weights": {"web": 0.5, "code": 0.2, "math": 0.3}}],
        seq_len=10,
    )
    budget = mix.budget(2000, {"web": 1000, "code": 7, "math": 3})
    assert budget.positions == 200
    drawn = [s.windows_drawn for s in budget.sources]
    assert sum(drawn) == 200
    assert tuple(drawn) == mix.counts(200)
    assert drawn == [70 + 50, 20 + 20, 10 + 30]
    assert [s.tokens_drawn for s in budget.sources] == [1200, 400, 400]
    assert budget.sources[1].passes == Fraction(40, 7)
    assert budget.sources[0].shares == (Fraction(7, 10), Fraction(1, 2))
    assert budget.segments == ((0, 1000), (1000, None))
    for s in budget.sources:  # Info's floats, made without the Fractions: the same values
        assert s.share_floats == [float(x) for x in s.shares]
    with pytest.raises(FailedPrecondition, match="math"):
        mix.budget(2000, {"web": 1, "code": 1, "math": 0})
    assert mix.budget(1e12, [1, 1, 1]).positions == 10**11


# -------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    ("value", "exact"),
    [
        (0.7, Fraction(7, 10)),
        (1, Fraction(1)),
        ("0.1", Fraction(1, 10)),
        (0.0, Fraction(0)),
        (1 / 3, Fraction("0.3333333333333333")),
    ],
)
def test_weights_are_the_shortest_decimal(value, exact):
    assert parse_weight(value, "w") == exact


def test_normalization_is_exact():
    mix = Mixture([("a", 0.1), ("b", 0.2)], seq_len=1)
    assert mix.segments[0][1] == (Fraction(1, 3), Fraction(2, 3))


@given(st.lists(st.floats(min_value=0, allow_nan=False, allow_infinity=False), min_size=1))
def test_floats_normalize_as_their_shortest_decimals(weights):
    assume(any(weights))
    assert normalize_given(weights) == normalize([Fraction(repr(w)) for w in weights])


@given(
    st.lists(st.sampled_from([*WEIGHTS, -0.0, 1e300, 5e-324, 0.1 + 0.2]), min_size=1, max_size=8)
)
def test_a_segment_is_the_same_whichever_way_it_is_spelled(weights):
    """Every source in order as floats is checked at once; any other spelling (names in
    another order, decimal strings) one pair at a time: the same segment."""
    assume(any(weights))
    pairs = [(f"s{i}", float(w)) for i, w in enumerate(weights)]
    at_once = Mixture(pairs, [(10, dict(pairs))], seq_len=3)
    one_by_one = Mixture(pairs, [(10, {n: repr(w) for n, w in reversed(pairs)})], seq_len=3)
    assert at_once.declared[1] == one_by_one.declared[1]
    assert at_once.declared[1].weights == tuple(Fraction(repr(w)) for _, w in pairs)
    assert all(math.copysign(1, w) > 0 for w in at_once.declared[1].given)  # -0.0 is 0


@pytest.mark.parametrize(
    ("sources", "schedule", "field"),
    [
        ({"a": -1, "b": 1}, (), "sources['a']"),
        ({"a": float("nan"), "b": 1}, (), "sources['a']"),
        ({"a": float("inf"), "b": 1}, (), "sources['a']"),
        ({"a": True, "b": 1}, (), "sources['a']"),
        ({"a": "x", "b": 1}, (), "sources['a']"),
        ({"a": 0, "b": 0}, (), "sources"),
        ({}, (), "sources"),
        ([("a", 1), ("a", 2)], (), "sources[1].name"),
        ([("", 1)], (), "sources[0].name"),
        ({"a": 1, "b": 1}, [(10, {"a": 1})], "schedule[0].weights"),
        ({"a": 1, "b": 1}, [(10, {"a": 1, "b": 1, "c": 1})], "schedule[0].weights['c']"),
        ({"a": 1, "b": 1}, [(10, {"a": 0, "b": 0})], "schedule[0].weights"),
        ({"a": 1, "b": 1}, [(10, {"a": 1, "b": -0.5})], "schedule[0].weights['b']"),
        ({"a": 1, "b": 1}, [(10, [("a", 1), ("a", 1)])], "schedule[0].weights['a']"),
        (
            {"a": 1, "b": 1},
            [(10, {"a": 1, "b": 1}), (10, {"a": 1, "b": 1})],
            "schedule[1].from_tokens",
        ),
        (
            {"a": 1, "b": 1},
            [(20, {"a": 1, "b": 1}), (10, {"a": 1, "b": 1})],
            "schedule[1].from_tokens",
        ),
        ({"a": 1, "b": 1}, [(0, {"a": 1, "b": 1})], "schedule[0].from_tokens"),
        ({"a": 1, "b": 1}, [(-5, {"a": 1, "b": 1})], "schedule[0].from_tokens"),
        ({"a": 1, "b": 1}, [(1.5, {"a": 1, "b": 1})], "schedule[0].from_tokens"),
        ({"a": 1, "b": 1}, [{"from": 1, "weights": {"a": 1, "b": 1}}], "schedule[0]"),
        ({"a": 1, "b": 1}, "oops", "schedule"),
    ],
)
def test_invalid_mixtures_name_the_field(sources, schedule, field):
    with pytest.raises(InvalidArgument) as err:
        Mixture(sources, schedule, seq_len=4)
    assert err.value.field == field
    assert str(err.value).startswith(field)
    assert isinstance(err.value, ValueError)


def test_seq_len_and_layout_are_checked():
    with pytest.raises(InvalidArgument, match="seq_len"):
        Mixture({"a": 1}, seq_len=0)
    mix = Mixture({"a": 1}, seq_len=4)
    with pytest.raises(InvalidArgument, match="rank"):
        rank_steps(mix, 2, 0, 1, batch_size=1, world_size=2)
    with pytest.raises(InvalidArgument, match="batch_size"):
        rank_steps(mix, 0, 0, 1, batch_size=0, world_size=2)
    with pytest.raises(InvalidArgument, match="stop"):
        mix.items(5, 4)


def test_yaml_style_schedule_and_float_from_tokens():
    mix = Mixture(
        {"web": 0.5, "code": 0.5},
        [{"from_tokens": 2e9, "weights": {"code": 1, "web": 0}}],
        seq_len=2048,
    )
    assert mix.segments[1][0] == 2_000_000_000
    p = -(-2_000_000_000 // 2048)
    assert mix.segment_of(p - 1) == 0
    assert mix.segment_of(p) == 1
    before = mix.counts(p)
    after = mix.counts(p + 100)
    assert after[0] == before[0]
    assert after[1] == before[1] + 100


def test_segments_that_own_no_position_are_skipped():
    # seq_len 10: from_tokens 1 and 5 both start at position 1; the later one wins
    mix = Mixture({"a": 1, "b": 0}, [(1, {"a": 0, "b": 1}), (5, {"a": 1, "b": 1})], seq_len=10)
    assert mix.segment_of(1) == 2
    ref = Reference([("a", 1), ("b", 0)], [(1, {"a": 0, "b": 1}), (5, {"a": 1, "b": 1})], 10)
    seq, _ = ref.walk(50)
    src, item = mix.items(0, 50)
    assert list(zip(src.tolist(), item.tolist(), strict=True)) == seq


def test_weights_do_not_depend_on_scale_or_spelling():
    a = Mixture({"x": 7, "y": 3}, seq_len=1)
    b = Mixture({"x": 0.7, "y": "0.3"}, seq_len=1)
    assert a.counts(12345) == b.counts(12345)
    assert math.isclose(float(a.segments[0][1][0]), 0.7)


def test_anchored_floats_are_fixed_up_where_they_are_ambiguous():
    """Large D: floor((g + a*d) / D) lands exactly on an integer at chosen d, where a
    float alone can round either way; the kernels must still be exact."""
    ws = {"x": 1 / 3, "y": 0.14285714285714285, "z": 0.3, "w": 0.123456789}
    mix = Mixture(
        ws, [(12345, {"x": 0.3, "y": 1 / 3, "z": 0.123456789, "w": 0.14285714285714285})], seq_len=1
    )
    app = mix.apportionment
    assert not app._fast.any()
    checked = wrong_floats = wrong_dues = 0
    for j, seg in enumerate(app._segs):
        prm, mode = app._params(j)
        assert mode == "anchored"
        for i, (a, g) in enumerate(zip(seg.a, seg.g, strict=True)):
            if math.gcd(a, seg.D) != 1:
                continue
            d_star = (-g * pow(a, -1, seg.D)) % seg.D + seg.D  # D divides g + a*d_star
            for delta in (1, 3, 1000, 10**6, 123456789, 10**9 + 7, 2**31, 2**32):
                lo = d_star - delta
                d = np.array([lo, lo + 1, d_star - 1, d_star, d_star + 1], dtype=np.int64)
                floors = app._floors(prm, mode, lo, d_star + 1)(d)
                exact = [
                    [(gg + aa * int(x)) // seg.D for aa, gg in zip(seg.a, seg.g, strict=True)]
                    for x in d
                ]
                assert floors.tolist() == exact
                _, r0 = divmod(g + a * lo, seg.D)
                y = np.float64(r0 / seg.D) + np.float64(a / seg.D) * np.float64(delta)
                wrong_floats += math.floor(y) != (r0 + a * delta) // seg.D
                checked += 1
            # due points exactly on an integer: (D*u - g) / a, with u far from the anchor
            u_star = (g * pow(seg.D, -1, a)) % a + a
            for gap in (1, 40, 1000, 10**6, 10**7):
                u = np.array([u_star - gap, u_star - 1, u_star, u_star + 1], dtype=np.int64)
                got = app._due(prm, mode, np.full(4, i, dtype=np.int64), u)
                assert got.tolist() == [-((g - seg.D * int(x)) // a) for x in u]
                e, f = divmod(seg.D * (u_star - gap) - g, a)
                z = np.float64(f / a) + np.float64(gap) * np.float64(seg.D / a)
                wrong_dues += math.ceil(z) != -((g - seg.D * u_star) // a) - e
    assert checked >= 16
    # the floats alone are wrong somewhere, so the exact fix-ups are what is tested
    assert wrong_floats > 0
    assert wrong_dues > 0


@given(
    st.lists(
        st.tuples(
            st.integers(0, 2**62) | st.integers(0, 2**53 + 5) | st.integers(0, 10**6),
            st.integers(1, 2**40) | st.integers(1, 100),
        ),
        min_size=1,
        max_size=50,
    )
)
def test_pass_divmod_is_numpys(pairs):
    """MixtureSampler.starts' split of items into (pass, position) equals np.divmod,
    near powers of two, multiples of the divisor and 2**53 alike."""
    n = np.array([a for a, _ in pairs], dtype=np.int64)
    d = np.array([b for _, b in pairs], dtype=np.int64)
    for values in (n, np.maximum(n // d * d - 1, 0), n // d * d):  # around multiples too
        q, r = divmod_items(values, d)
        want_q, want_r = np.divmod(values, d)
        assert np.array_equal(q, want_q)
        assert np.array_equal(r, want_r)


def test_pass_divmod_just_below_two_to_the_53():
    top = (1 << 53) - 1
    n = np.array([top, top - 1, top - 2, 1 << 52, (1 << 52) + 1, 0], dtype=np.int64)
    for d in (1, 2, 3, 7, 65_532, 40_956, 24_572, (1 << 26) + 1, top):
        q, r = divmod_items(n, np.full(len(n), d, dtype=np.int64))
        want_q, want_r = np.divmod(n, d)
        assert np.array_equal(q, want_q)
        assert np.array_equal(r, want_r)
