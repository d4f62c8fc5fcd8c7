"""The loop's position on its own: epochs, state dicts, ends, steps left.

No feeder here: `Loop` drives a Position the way FeederClient does (an iteration opens
a stream at the position, each batch the loop takes stores the position after it, the
stream's end ends the epoch) over `rank_batches`, a plain reference of which batches
a rank receives (docs/sampling.md, "Steps and ranks")."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.client.position import STATE_KEYS, Position, checked_state
from tokenfeed.core.request import SamplingSpec

Batch = tuple[int, int, int]  # (epoch, offset, step)


def _spec(batch_size: int = 3, world_size: int = 2, split: str = "train", **kw) -> SamplingSpec:
    return SamplingSpec(
        dataset="d", seq_len=8, batch_size=batch_size, world_size=world_size, split=split, **kw
    )


MIXTURE = SamplingSpec(dataset="", sources=(("a", 0.7), ("b", 0.3)), seq_len=8, batch_size=2)


def rank_batches(spec: SamplingSpec, rank: int, windows: int, offset: int) -> Iterator[int]:
    """Offsets of the steps `rank` receives from `offset` to the epoch's end: train
    drops a last step of fewer than B * W windows; validation keeps it, for the ranks
    with a window in it."""
    size, mine = spec.batch_size * spec.world_size, rank * spec.batch_size
    o = offset
    while o + size <= windows or (spec.split == "validation" and o + mine < windows):
        yield o
        o += size


class Loop:
    """A training loop over a Position, as FeederClient moves it."""

    def __init__(self, spec: SamplingSpec, rank: int, windows: int) -> None:
        self.position = Position(spec, rank)
        self.spec, self.rank, self.windows = spec, rank, windows
        self.stream: Iterator[Batch] | None = None

    def iterate(self) -> None:
        """iter(loader): a new stream from the position."""
        p = self.position
        p.start()
        epoch, step = p.epoch, p.step
        offsets = rank_batches(self.spec, self.rank, self.windows, p.offset)
        self.stream = ((epoch, o, step + i) for i, o in enumerate(offsets))

    def take(self, n: int) -> list[Batch]:
        """Up to n next() calls; the stream's end ends the epoch."""
        assert self.stream is not None
        out: list[Batch] = []
        for _ in range(n):
            batch = next(self.stream, None)
            if batch is None:
                self.position.end()
                self.stream = None
                break
            _, offset, step = batch
            # what the reader thread computes and the loop stores (FeederClient._next)
            size = self.spec.batch_size * self.spec.world_size
            self.position.offset, self.position.step = min(offset + size, self.windows), step + 1
            out.append(batch)
        return out

    def epoch(self) -> list[Batch]:
        self.iterate()
        return self.take(1 << 30)


def _full(spec: SamplingSpec, rank: int, windows: int, epoch: int) -> list[Batch]:
    return [(epoch, o, s) for s, o in enumerate(rank_batches(spec, rank, windows, 0))]


# ----------------------------------------------------------------------------- rules


def test_a_fresh_position_is_epoch_zeros_start() -> None:
    p = Position(_spec(), 1)
    assert (p.epoch, p.offset, p.step, p.loaded, p.ended) == (0, 0, 0, False, False)
    assert p.state_dict() == {
        "epoch": 0,
        "offset": 0,
        "step": 0,
        "fingerprint": _spec().fingerprint(),
        "world_size": 2,
    }


def test_set_epoch_keeps_a_loaded_position_for_the_same_epoch_only() -> None:
    p = Position(_spec())
    state = {**p.state_dict(), "epoch": 2, "offset": 12, "step": 2}
    p.load_state_dict(state)
    assert not p.set_epoch(2)  # the resume loop: kept
    assert p.state_dict() == state
    assert p.set_epoch(3)
    assert (p.epoch, p.offset, p.step) == (3, 0, 0)
    assert p.set_epoch(3)  # nothing loaded: a set_epoch always starts over
    p.load_state_dict(state)
    assert p.set_epoch(1)
    assert (p.epoch, p.offset, p.step) == (1, 0, 0)
    with pytest.raises(ValueError, match="non-negative"):
        p.set_epoch(-1)


def test_an_epoch_run_to_its_end_starts_over_unless_a_position_was_loaded() -> None:
    loop = Loop(_spec(), 0, windows=20)
    assert loop.epoch() == _full(_spec(), 0, 20, 0)
    assert loop.position.ended
    assert (loop.position.offset, loop.position.step) == (18, 3)
    assert loop.epoch() == _full(_spec(), 0, 20, 0)  # the same epoch again
    state = loop.position.state_dict()
    loop.position.load_state_dict(state)  # the end of the epoch, loaded: nothing left
    assert loop.epoch() == []
    loop.iterate()
    assert loop.take(1) == [(0, 0, 0)]


def test_a_new_iteration_continues_where_the_loop_stopped() -> None:
    loop = Loop(_spec(), 1, windows=40)
    loop.iterate()
    first = loop.take(2)
    loop.iterate()  # the batches the old stream held were never received
    assert first + loop.take(1 << 30) == _full(_spec(), 1, 40, 0)


def test_steps_left_and_remaining_count_from_an_offset() -> None:
    # B=3, W=2: steps at offsets 0, 6, 12 and a short last one at 18 (windows 18, 19)
    first, second = Position(_spec(split="validation"), 0), Position(_spec(split="validation"), 1)
    assert (first.steps_left(20), second.steps_left(20)) == (4, 3)  # 18, 19 are rank 0's
    assert Position(_spec(), 0).steps_left(20) == 3  # train drops the short last step
    first.offset = 18
    assert first.steps_left(20) == 1
    assert first.remaining(20)(20) == 0
    assert second.remaining(22)(18) == 1  # windows 21: rank 1's


def test_a_mixture_is_one_endless_stream() -> None:
    p = Position(MIXTURE)
    assert p.endless
    assert p.set_epoch(0)
    with pytest.raises(ValueError, match="endless"):
        p.set_epoch(1)
    with pytest.raises(TypeError, match="endless"):
        p.steps_left(10)
    assert p.remaining(10)(10**9) == 1  # never ends
    state = p.state_dict()
    assert state["mixture"] == MIXTURE.mixture_state()
    extended = MIXTURE.with_(schedule=((1000, (("a", 0.5), ("b", 0.5))),))
    Position(extended).load_state_dict(state)  # a segment added after the position
    with pytest.raises(ValueError, match="epoch 0"):
        Position(MIXTURE).load_state_dict({**state, "epoch": 1})
    reordered = SamplingSpec(dataset="", sources=(("b", 0.3), ("a", 0.7)), seq_len=8, batch_size=2)
    with pytest.raises(ValueError, match="sources differ"):
        Position(reordered).load_state_dict(state)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"epoch": None}, "missing"),
        ({"fingerprint": "0" * 16}, "different sampling parameters"),
        ({"offset": -6}, "negative"),
        ({"mixture": MIXTURE.mixture_state()}, "saved by a mixture loader"),
    ],
)
def test_a_state_for_another_order_is_refused_and_changes_nothing(
    change: dict, message: str
) -> None:
    p = Position(_spec())
    p.load_state_dict({**p.state_dict(), "epoch": 1, "offset": 6, "step": 1})
    state = {**p.state_dict(), **change}
    state = {k: v for k, v in state.items() if v is not None}
    with pytest.raises(ValueError, match=message):
        p.load_state_dict(state)
    assert (p.epoch, p.offset, p.step, p.loaded) == (1, 6, 1, True)
    with pytest.raises(ValueError, match="single-dataset loader"):
        checked_state(Position(_spec()).state_dict(), MIXTURE)
    assert set(STATE_KEYS) <= set(Position(MIXTURE).state_dict())


# ------------------------------------------------------------------------ properties

OPS = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(0, 6)),
        st.tuples(st.just("iterate"), st.just(0)),
        st.tuples(st.just("save"), st.just(0)),
        st.tuples(st.just("load"), st.booleans()),  # True: into a fresh loop (a restart)
        st.tuples(st.just("set_epoch"), st.integers(0, 3)),
    ),
    max_size=40,
)


@given(
    OPS,
    st.integers(1, 40),
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from(["train", "validation"]),
    st.data(),
)
def test_any_sequence_keeps_the_next_batch_the_first_not_received(
    ops: list, windows: int, batch_size: int, world: int, split: str, data: st.DataObject
) -> None:
    """receive / save / load / set_epoch / iterate again, in any order: the next batch
    the loop receives is always the first it has not received (docs/client.md,
    "Position and state dict"), checked against those rules written out over the loop's history."""
    spec = _spec(batch_size, world, split)
    rank = data.draw(st.integers(0, world - 1))
    loop = Loop(spec, rank, windows)
    loop.iterate()
    # the history: this epoch's batches received (a prefix of the epoch), whether a
    # loaded position waits for its stream, whether the epoch ran to its end
    epoch, received, loaded, ended = 0, [], False, False
    saved = None
    for op, arg in ops:
        full = _full(spec, rank, windows, epoch)
        if op == "take" and loop.stream is not None:
            got = loop.take(arg)
            assert got == full[len(received) : len(received) + len(got)]
            received += got
            if len(got) < arg:  # next() found the stream's end
                assert received == full
                ended = True
        elif op == "iterate":
            loop.iterate()
            if ended:
                received = []  # the same epoch again, from its start
            loaded = ended = False
        elif op == "save":
            state = loop.position.state_dict()
            saved = (state, epoch, list(received))
            assert state["epoch"] == epoch
            if len(received) < len(full):  # the state names the first batch not received
                assert (state["epoch"], state["offset"], state["step"]) == full[len(received)]
        elif op == "load" and saved is not None:
            if arg:  # a restart: a new process, a new loop
                loop = Loop(spec, rank, windows)
            loop.position.load_state_dict(saved[0])
            loop.stream = None  # load_state_dict stops the stream
            epoch, received, loaded, ended = saved[1], list(saved[2]), True, False
        elif op == "set_epoch":
            kept = not loop.position.set_epoch(arg)
            assert kept == (loaded and arg == epoch)
            if not kept:
                epoch, received, loaded, ended = arg, [], False, False
            loop.stream = None


@given(
    st.integers(1, 60),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(1, 4),
    st.integers(0, 12),
    st.sampled_from(["train", "validation"]),
)
def test_steps_left_after_an_elastic_resume(
    windows: int, batch_size: int, world: int, new_world: int, k: int, split: str
) -> None:
    """`world` ranks take k steps and save; `new_world` ranks load rank 0's state.
    steps_left is what each rank then receives, and the epoch's windows are each
    delivered once (docs/sampling.md, "Resume")."""
    spec = _spec(batch_size, world, split)
    # ranks step together: a checkpoint is taken at a step every rank reached
    k = min(k, len(list(rank_batches(spec, world - 1, windows, 0))))
    delivered: list[int] = []
    states = []
    for rank in range(world):
        loop = Loop(spec, rank, windows)
        loop.iterate()
        for _, offset, _ in loop.take(k):
            lo = offset + rank * batch_size
            delivered += range(lo, min(lo + batch_size, windows))
        states.append(loop.position.state_dict())
    assert all(s == states[0] for s in states)  # every rank saves the same position
    resumed = spec.with_(world_size=new_world)
    for rank in range(new_world):
        loop = Loop(resumed, rank, windows)
        loop.position.load_state_dict(states[0])
        assert not loop.position.set_epoch(0)  # the resume loop keeps it
        left = loop.position.steps_left(windows)
        batches = loop.epoch()
        assert left == len(batches)
        assert loop.position.steps_left(windows) == 0
        step = states[0]["step"]
        assert [s for _, _, s in batches] == list(range(step, step + left))
        for _, offset, _ in batches:
            lo = offset + rank * batch_size
            delivered += range(lo, min(lo + batch_size, windows))
    assert len(delivered) == len(set(delivered))  # nothing twice
    if split == "validation":
        assert sorted(delivered) == list(range(windows))  # nothing lost
    else:  # the resumed stream drops its own last partial global batch, only that
        tail = (windows - states[0]["offset"]) % (batch_size * new_world)
        assert sorted(delivered) == list(range(windows - tail))
