"""Property tests of one dataset's sampling (docs/sampling.md)."""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import fields
from fractions import Fraction

import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from tokenfeed.core import keyed, native
from tokenfeed.core.errors import FailedPrecondition, InvalidArgument
from tokenfeed.core.keyed import Permutation as _Permutation
from tokenfeed.core.request import SamplingSpec, proper_divisors
from tokenfeed.core.sampling import (
    DatasetSampler,
    split_bounds,
    steps_per_epoch,
    window_count,
)
from tokenfeed.core.shuffle import EpochOrder

from support.stores import make_sampler

compiled = pytest.mark.skipif(
    not (native.enabled() and native.built("tokenfeed.core._keyed")),
    reason="the compiled loops are off or not built (TOKENFEED_PURE_PYTHON=1)",
)


def epoch_starts(
    sampler: DatasetSampler, epoch: int = 0, offset: int = 0, step: int = 0
) -> list[list]:
    """Per rank, the list of (step, offset, shift, starts tuple) of one epoch."""
    return [
        [
            (b.step, b.offset, b.shift, tuple(b.starts.tolist()))
            for b in sampler.batches(epoch, rank, offset, step)
        ]
        for rank in range(sampler.world_size)
    ]


def all_windows(sampler: DatasetSampler) -> list[int]:
    return [sampler.split_begin + k * sampler.stride for k in range(sampler.num_windows)]


@st.composite
def samplers(draw, auto=False):
    seq_len = draw(st.sampled_from([4, 6, 8, 12, 16] if auto else [1, 2, 4, 6, 8, 12, 16]))
    divisors = [1, *proper_divisors(seq_len)] + ([seq_len] if seq_len > 1 else [])
    shift = draw(st.sampled_from(divisors + (["auto"] if proper_divisors(seq_len) else [])))
    shift = "auto" if auto else shift
    kwargs = dict(
        total_tokens=draw(st.integers(20, 3000)),
        split=draw(st.sampled_from(["train", "validation"])),
        split_rate=draw(st.sampled_from([0.5, 0.8, 0.9, 1.0, 0.0, 0.33])),
        seq_len=seq_len,
        stride=draw(st.integers(1, 20)),
        batch_size=draw(st.integers(1, 7)),
        world_size=draw(st.integers(1, 5)),
        shift=shift,
        seed=draw(st.integers(0, 2**64 - 1)),
        shuffle=draw(st.booleans()),
        shuffle_blocks=draw(st.integers(1, 6)),
        block_tokens=draw(st.integers(1, 400)),
    )
    try:
        return make_sampler(**kwargs)
    except FailedPrecondition:
        assume(False)


def test_readme_example_literally() -> None:
    # seq_len 8, stride 4, shift 2 over T = 0, 1, 2, ...
    T = np.arange(1000)
    sampler = make_sampler(
        total_tokens=1000,
        split="train",
        split_rate=1.0,
        seq_len=8,
        stride=4,
        batch_size=2,
        world_size=1,
        shift=2,
    )
    batch = next(sampler.batches(epoch=0, rank=0))
    rows = [T[s : s + 8 + 2] for s in batch.starts]
    assert rows[0][:8].tolist() == list(range(0, 8))
    assert rows[0][2:].tolist() == list(range(2, 10))
    assert rows[1][:8].tolist() == list(range(4, 12))
    assert rows[1][2:].tolist() == list(range(6, 14))
    # the original loader's grouped layout is a reshape of the same buffer
    assert rows[0][:8].reshape(8 // 2, 2).tolist() == [[0, 1], [2, 3], [4, 5], [6, 7]]


@given(samplers())
def test_every_window_exactly_once_per_epoch(sampler: DatasetSampler) -> None:
    delivered = Counter(s for rank in epoch_starts(sampler) for b in rank for s in b[3])
    assert all(c == 1 for c in delivered.values())
    windows = set(all_windows(sampler))
    assert set(delivered) <= windows
    global_batch = sampler.batch_size * sampler.world_size
    if sampler.split == "train":
        assert len(delivered) == sampler.num_windows // global_batch * global_batch
    else:
        assert set(delivered) == windows


@given(samplers())
def test_windows_stay_inside_the_split(sampler: DatasetSampler) -> None:
    for rank in epoch_starts(sampler):
        for _, _, shift, starts in rank:
            for s in starts:
                assert sampler.split_begin <= s
                assert s + sampler.seq_len + shift <= sampler.split_end
                assert (s - sampler.split_begin) % sampler.stride == 0


@given(samplers())
def test_step_layout_and_len(sampler: DatasetSampler) -> None:
    """Step s covers [o_s, o_s + B*W); len() matches what is delivered."""
    global_batch = sampler.batch_size * sampler.world_size
    for rank, batches in enumerate(epoch_starts(sampler)):
        assert len(batches) == sampler.steps(rank)
        assert len(batches) == steps_per_epoch(
            sampler.num_windows, sampler.batch_size, sampler.world_size, rank, sampler.split
        )
        for i, (step, offset, _, starts) in enumerate(batches):
            assert step == i
            assert offset == i * global_batch
            assert 1 <= len(starts) <= sampler.batch_size


@given(samplers(), st.integers(0, 2**32))
def test_deterministic_and_resumable_at_any_step(sampler: DatasetSampler, pick: int) -> None:
    full = epoch_starts(sampler, epoch=3)
    assert full == epoch_starts(sampler, epoch=3)
    global_batch = sampler.batch_size * sampler.world_size
    steps = max(len(r) for r in full)
    k = pick % (steps + 1)
    # after the last (maybe short) step the position is the end of the epoch
    resumed = epoch_starts(
        sampler, epoch=3, offset=min(k * global_batch, sampler.num_windows), step=k
    )
    assert resumed == [r[k:] for r in full]


@given(samplers(), st.integers(1, 6), st.integers(0, 2**32))
def test_elastic_resume_is_exactly_once(sampler: DatasetSampler, new_world: int, pick: int) -> None:
    """W ranks up to a step boundary, then another world size from that offset."""
    global_batch = sampler.batch_size * sampler.world_size
    steps_before = pick % (sampler.num_windows // global_batch + 1)
    offset = steps_before * global_batch
    before = [s for r in epoch_starts(sampler, 1) for b in r[:steps_before] for s in b[3]]
    try:
        after_plan = _with(sampler, world_size=new_world)
    except FailedPrecondition:
        assume(False)
    after = [s for r in epoch_starts(after_plan, 1, offset, steps_before) for b in r for s in b[3]]
    delivered = Counter(before + after)
    assert all(c == 1 for c in delivered.values())
    if sampler.split == "validation":
        assert set(delivered) == set(all_windows(sampler))
    else:
        rest = sampler.num_windows - offset
        assert len(delivered) == offset + rest // (sampler.batch_size * new_world) * (
            sampler.batch_size * new_world
        )


def _with(sampler: DatasetSampler, **changes) -> DatasetSampler:
    spec = {f.name: getattr(sampler.spec, f.name) for f in fields(sampler.spec) if f.init}
    sizes = {"total_tokens": sampler.total_tokens, "block_tokens": sampler.block_tokens}
    return make_sampler(**(spec | sizes | changes))


@given(samplers(auto=True))
def test_auto_shift_is_one_proper_divisor_per_step_shared_by_ranks(sampler: DatasetSampler) -> None:
    by_offset: dict[int, set[int]] = {}
    for rank in epoch_starts(sampler):
        for _, offset, shift, _ in rank:
            by_offset.setdefault(offset, set()).add(shift)
    for shifts in by_offset.values():
        assert len(shifts) == 1
        assert shifts <= set(proper_divisors(sampler.seq_len))


def test_auto_shift_draws_every_divisor() -> None:
    sampler = make_sampler(
        total_tokens=100_000,
        split="train",
        split_rate=1.0,
        seq_len=12,
        stride=1,
        batch_size=1,
        world_size=1,
        shift="auto",
        seed=7,
    )
    seen = Counter(b.shift for b, _ in zip(sampler.batches(0, 0), range(2000), strict=False))
    assert set(seen) == {2, 3, 4, 6}
    assert min(seen.values()) > 350  # about 500 each if uniform


def test_epochs_and_seeds_give_different_orders() -> None:
    sampler = make_sampler(
        total_tokens=50_000,
        split="train",
        split_rate=1.0,
        seq_len=16,
        stride=16,
        batch_size=4,
        world_size=2,
        shuffle=True,
        shuffle_blocks=4,
        block_tokens=2000,
    )
    e0, e1 = epoch_starts(sampler, 0), epoch_starts(sampler, 1)
    assert e0 != e1
    assert epoch_starts(_with(sampler, seed=1), 0) != e0
    flat = [s for b in e0[0] for s in b[3]]
    assert flat != sorted(flat)


@given(st.integers(1, 5000), st.integers(0, 2**64 - 1))
def test_permutation_is_a_bijection_with_an_inverse(n: int, key: int) -> None:
    perm = _Permutation(n, key)
    x = np.arange(n)
    y = perm(x)
    assert np.array_equal(np.sort(y), x)
    assert np.array_equal(perm.inverse(y), x)


@compiled
@given(
    st.lists(st.integers(1, 2**62), min_size=1, max_size=40),
    st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=40),
    st.booleans(),
    st.booleans(),
    st.randoms(use_true_random=False),
)
def test_the_c_permutation_is_the_numpy_one(
    sizes: list[int], seeds: list[int], per_element: bool, inverse: bool, rnd
) -> None:
    """keyed.permute in C (_keyed.c) against its numpy reference (the compiled loops
    off), with one bijection for every element or one each (keys, sizes and widths per
    element), either way."""
    m = len(sizes)
    if per_element:
        n = np.array(sizes, dtype=np.int64)
        sk = keyed.stage_keys(np.array((seeds * m)[:m], dtype=np.uint64))  # a strided view
    else:
        n, sk = sizes[0], keyed.stage_keys(seeds[0])
    x = np.array([rnd.randrange(int(v)) for v in np.broadcast_to(n, (m,))], dtype=np.int64)
    got = keyed.permute(x, n, sk, inverse=inverse)
    with native.disabled():
        assert np.array_equal(got, keyed.permute(x, n, sk, inverse=inverse))
    assert np.array_equal(keyed.permute(got, n, sk, inverse=not inverse), x)


@compiled
def test_the_c_permutation_refuses_what_it_cannot_map() -> None:
    sk = keyed.stage_keys(7)
    with pytest.raises(ValueError, match=r"in \[0, n\)"):
        keyed.permute(np.array([5]), 3, sk)  # x not below n
    with pytest.raises(TypeError, match="sk"):
        keyed.permute(np.array([1, 2]), 3, sk[:4])


@given(
    st.integers(1, 3000),
    st.integers(1, 200),
    st.integers(1, 10),
    st.integers(0, 99),
    st.randoms(use_true_random=False),
)
def test_positions_in_any_order_map_alike(n, wpb, shuffle_blocks, seed, rnd) -> None:
    """Ascending positions take the run-by-run path, others are sorted first: same map."""
    order = EpochOrder(n, wpb, shuffle_blocks, seed, epoch=1, shuffle=True)
    ascending = order.windows(np.arange(n))
    positions = [rnd.randrange(n) for _ in range(rnd.randrange(1, 200))]
    np.testing.assert_array_equal(order.windows(np.array(positions)), ascending[positions])


# an epoch order's windows, windows per block, blocks per group and seed
order_args = st.tuples(
    st.integers(1, 3000), st.integers(1, 200), st.integers(1, 10), st.integers(0, 99)
)


@given(order_args, st.randoms(use_true_random=False))
def test_an_order_kept_maps_as_a_fresh_one(args, rnd) -> None:
    """A sampler keeps its epoch orders, shared by the ranks of a job, and an order keeps
    its groups' permutations: asked in any order, over more groups than it keeps and
    after other epochs, it maps every position as a fresh order does."""
    n, wpb, blocks, seed = args
    spec = dict(seq_len=4, stride=1, batch_size=1, shuffle=True, split_rate=1.0)
    sampler = make_sampler(n + 4, wpb, shuffle_blocks=blocks, seed=seed, **spec)
    kept = sampler.order(1)
    assert sampler.order(1) is kept
    for epoch in (0, 2):  # more epochs than it keeps: epoch 1's order is made again
        sampler.order(epoch)
    fresh = EpochOrder(sampler.num_windows, sampler.windows_per_block, blocks, seed, 1, True)
    for _ in range(rnd.randrange(1, 6)):
        lo = rnd.randrange(sampler.num_windows)
        positions = np.arange(lo, min(sampler.num_windows, lo + rnd.randrange(1, 400)))
        for order in (kept, sampler.order(1)):
            np.testing.assert_array_equal(order.windows(positions), fresh.windows(positions))


@given(order_args, st.integers(0, 2**32), st.integers(1, 300))
def test_a_run_of_positions_maps_as_the_whole_epoch(args, at, size) -> None:
    """A run of ascending positions (a round: within one group it takes a shorter path)
    maps as the same positions of the whole epoch do."""
    n, wpb, blocks, seed = args
    order = EpochOrder(n, wpb, blocks, seed, epoch=4, shuffle=True)
    whole = order.windows(np.arange(n))
    lo = at % n
    run = np.arange(lo, min(n, lo + size))
    np.testing.assert_array_equal(order.windows(run), whole[run])
    np.testing.assert_array_equal(order.windows(run[::-1]), whole[run[::-1]])


@given(samplers(), st.integers(0, 2**32))
def test_rounds_are_the_batches_in_bulk(sampler: DatasetSampler, pick: int) -> None:
    """Rounds (what the server assembles) are consecutive steps, full but for the
    epoch's last batch, and flatten to exactly `batches()`."""
    rank = pick % sampler.world_size
    steps = sampler.steps(rank)
    offset = min(
        (pick // 7 % (steps + 1)) * sampler.batch_size * sampler.world_size, sampler.num_windows
    )
    rounds = list(sampler.rounds(3, rank, offset, step=5))
    flat = [b for r in rounds for b in r.batches()]
    want = list(sampler.batches(3, rank, offset, step=5))
    assert [(b.step, b.offset, b.shift, b.starts.tolist()) for b in flat] == [
        (b.step, b.offset, b.shift, b.starts.tolist()) for b in want
    ]
    assert [b.step for b in flat] == list(range(5, 5 + len(flat)))
    rows = [n for r in rounds for n in r.rows]
    assert all(n == sampler.batch_size for n in rows[:-1])
    assert all(r.starts.shape == (len(r), sampler.batch_size) for r in rounds)


@given(st.integers(1, 3000), st.integers(1, 200), st.integers(1, 10), st.integers(0, 99))
def test_block_shuffle_touches_only_its_group_blocks(
    n: int, wpb: int, shuffle_blocks: int, seed: int
) -> None:
    """The cache working set claim: positions of one group come from <= shuffle_blocks blocks."""
    order = EpochOrder(n, wpb, shuffle_blocks, seed, epoch=2, shuffle=True)
    windows = order.windows(np.arange(n))
    assert np.array_equal(np.sort(windows), np.arange(n))
    groups = -(-order.num_blocks // order.blocks_per_group)
    bounds = np.minimum(order._group_start(np.arange(groups + 1)), n)
    assert bounds[0] == 0
    assert bounds[-1] == n
    for lo, hi in itertools.pairwise(bounds):
        blocks = set((windows[lo:hi] // order.wpb).tolist())
        assert 1 <= len(blocks) <= order.blocks_per_group


def test_no_shuffle_is_index_order() -> None:
    sampler = make_sampler(
        total_tokens=1000,
        split="validation",
        split_rate=0.5,
        seq_len=4,
        stride=3,
        batch_size=2,
        world_size=2,
    )
    r0, r1 = epoch_starts(sampler)
    assert [b[3] for b in r0][:2] == [(500, 503), (512, 515)]
    assert [b[3] for b in r1][:2] == [(506, 509), (518, 521)]


def test_validation_short_last_step_goes_to_ranks_in_order() -> None:
    # 11 windows, B=2, W=3: steps of 6; the last step has 5 windows: rank0 2, rank1 2, rank2 1
    sampler = make_sampler(
        total_tokens=15,
        split="validation",
        split_rate=0.0,
        seq_len=4,
        stride=1,
        batch_size=2,
        world_size=3,
    )
    assert sampler.num_windows == 11
    sizes = [[len(b[3]) for b in r] for r in epoch_starts(sampler)]
    assert sizes == [[2, 2], [2, 2], [2, 1]]
    sampler = _with(sampler, total_tokens=12)  # 8 windows: last step 2 -> rank 0 only
    sizes = [[len(b[3]) for b in r] for r in epoch_starts(sampler)]
    assert sizes == [[2, 2], [2], [2]]


def test_split_is_token_level_and_exact() -> None:
    assert split_bounds(10, "train", Fraction("0.9")) == (0, 9)
    assert split_bounds(10, "validation", Fraction("0.9")) == (9, 10)
    assert split_bounds(10**12, "train", Fraction("0.9"))[1] == 900_000_000_000
    assert window_count(10, 8, 4, 2) == 1
    assert window_count(9, 8, 4, 2) == 0


@pytest.mark.parametrize("rate", [0.7, 0.99, 0.3, 0.6, 0.85, 0.95, 0.98, 0.1, 1e-05])
def test_split_rate_is_the_decimal_the_user_wrote(rate: float) -> None:
    """0.7 is 7/10 exactly, not the double's binary value (which gave 699,999 of 10^6)."""
    spec = SamplingSpec(dataset="t", seq_len=1, batch_size=1, split_rate=rate)
    d = Fraction(str(rate))
    for total in (10**6, 10**9 + 7, 12_345):
        assert split_bounds(total, "train", spec.split_fraction) == (
            0,
            total * d.numerator // d.denominator,
        )
    sampler = make_sampler(
        total_tokens=10**6, split="train", split_rate=0.7, seq_len=1, batch_size=1
    )
    assert sampler.split_end == 700_000


def test_virtual_store_of_a_trillion_tokens() -> None:
    """Deep offsets in a 10^12-token store: valid windows, no list of starts built."""
    sampler = make_sampler(
        total_tokens=10**12,
        split="train",
        split_rate=0.99,
        seq_len=1024,
        stride=512,
        batch_size=16,
        world_size=64,
        shift="auto",
        shuffle=True,
        seed=3,
    )
    offset = sampler.num_windows // 2 // 1024 * 1024
    batch = next(sampler.batches(epoch=9, rank=63, offset=offset, step=offset // 1024))
    assert len(batch.starts) == 16
    assert len(set(batch.starts.tolist())) == 16
    assert all(s % 512 == 0 and s + 1024 + batch.shift <= sampler.split_end for s in batch.starts)
    assert batch.shift in proper_divisors(1024)


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        (dict(shift=3), InvalidArgument, "must divide seq_len"),
        (dict(shift=0), InvalidArgument, "must divide"),
        (dict(shift="auto", seq_len=13), InvalidArgument, "has none"),
        (dict(shift="sometimes"), InvalidArgument, "positive integer or 'auto'"),
        (dict(seq_len=0), InvalidArgument, "seq_len"),
        (dict(stride=-1), InvalidArgument, "stride"),
        (dict(batch_size=0), InvalidArgument, "batch_size"),
        (dict(world_size=2**41), InvalidArgument, "world_size"),
        (dict(split="test"), InvalidArgument, "split must be one of"),
        (dict(split_rate=1.5), InvalidArgument, "split_rate"),
        (dict(split_rate=float("nan")), InvalidArgument, "split_rate"),
        (dict(seed=-1), InvalidArgument, "seed"),
        (dict(total_tokens=8), FailedPrecondition, "8 tokens, too short for one window"),
        (dict(split="validation", split_rate=1.0), FailedPrecondition, "too short"),
        (dict(batch_size=30), FailedPrecondition, "fewer than one global batch"),
    ],
)
def test_bad_parameters_are_clear_errors(kwargs, error, text) -> None:
    base = dict(
        total_tokens=100,
        split="train",
        split_rate=1.0,
        seq_len=8,
        stride=4,
        batch_size=2,
        world_size=1,
    )
    with pytest.raises(error, match=text):
        make_sampler(**(base | kwargs))


def test_bad_rank_and_offset() -> None:
    sampler = make_sampler(
        total_tokens=100,
        split="train",
        split_rate=1.0,
        seq_len=8,
        stride=4,
        batch_size=2,
        world_size=2,
    )
    with pytest.raises(InvalidArgument, match="rank"):
        next(sampler.batches(0, 2))
    with pytest.raises(InvalidArgument, match="offset"):
        next(sampler.batches(0, 0, offset=sampler.num_windows + 1))
    with pytest.raises(InvalidArgument, match="offset"):
        sampler.steps(0, offset=-1)
    assert list(sampler.batches(0, 0, offset=sampler.num_windows)) == []


def test_shuffle_spreads_windows_evenly_over_positions() -> None:
    """Over many seeds every window is about equally likely at every position."""
    n, seeds = 48, 3000
    counts = np.zeros((n, n))
    for seed in range(seeds):
        order = EpochOrder(
            n, windows_per_block=6, shuffle_blocks=8, seed=seed, epoch=0, shuffle=True
        )
        counts[np.arange(n), order.windows(np.arange(n))] += 1
    expected = seeds / n
    # a biased permutation family (e.g. a weak round function) leaves cells near 0 or 2x
    assert counts.min() > 0.5 * expected
    assert counts.max() < 1.6 * expected
