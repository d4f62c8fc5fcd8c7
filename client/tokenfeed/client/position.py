"""Where the training loop is: the position of the first batch it has not received.

The position is (epoch, offset, step). `offset` is a position in the epoch order,
which is the same for every world size, so a job may resume with more or fewer ranks
(elastic) and still see every window of the epoch exactly once (docs/sampling.md,
"Resume"); `step` counts global batches. This module is the rules of that position
and nothing else: no I/O, no threads, no gRPC. The client moves it as batches reach
the loop; its reader thread keeps a position of its own (the first batch it has not
received) for reconnects, and batches it holds that the loop never took are simply
not counted, so a new stream asks for them again (docs/client.md, "Position and
state dict").

Receiving the batch at (offset, step) moves the position to (min(offset + B * W,
windows), step + 1): the reader thread computes that as it stages the batch and the
loop stores it into `offset` and `step`, the one write on the loop's path.

Epochs (docs/client.md, "Epochs"). `set_epoch(e)` starts epoch e at offset 0, except
right after `load_state_dict` of that same epoch: the usual `for epoch in range(saved,
n): set_epoch(epoch)` resume loop keeps the loaded position. Iterating again after an
epoch ran to its end (`end`) runs the same epoch again from its start (`start`), like
a DataLoader without `set_epoch`.

A mixture is one endless stream (docs/mixtures.md): epoch 0 only, no end, and no
`steps_left`; its state also holds the mixture, and a resume may change the world
size, the batch size, and add schedule segments at or after the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import steps_per_epoch

STATE_KEYS = ("epoch", "offset", "step", "fingerprint", "world_size")


class Position:
    """The loop's position in rank `rank`'s stream of `spec`; starts at epoch 0's start.

    `loaded`: a position `load_state_dict` gave, not streamed yet; `ended`: the
    epoch ran to its end in the loop.
    """

    __slots__ = ("ended", "epoch", "loaded", "offset", "rank", "spec", "step")

    def __init__(self, spec: SamplingSpec, rank: int = 0) -> None:
        self.spec, self.rank = spec, rank
        self.epoch, self.offset, self.step = 0, 0, 0
        self.loaded = self.ended = False

    @property
    def endless(self) -> bool:
        return self.spec.is_mixture

    def set_epoch(self, epoch: int) -> bool:
        """Move to the start of `epoch`. False, leaving everything as it is, right
        after `load_state_dict` of that same epoch."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        if epoch > 0 and self.endless:
            raise ValueError(
                f"a mixture stream is endless and has no epochs: set_epoch({epoch}) is not "
                "allowed (set_epoch(0) is)"
            )
        if self.loaded and epoch == self.epoch:
            return False
        self.epoch, self.offset, self.step = int(epoch), 0, 0
        self.loaded = self.ended = False
        return True

    def start(self) -> None:
        """An iteration starts from here: an epoch that ran to its end starts over (a
        load or a set_epoch since would have cleared `ended`)."""
        if self.ended:
            self.offset, self.step = 0, 0
        self.loaded = self.ended = False

    def end(self) -> None:
        """The epoch ran to its end in the loop."""
        self.ended = True

    # ------------------------------------------------------------------- sizes
    def remaining(self, windows: int) -> Callable[[int], int]:
        """offset -> the steps this rank still has in an epoch of `windows` windows
        from it (docs/sampling.md, "Steps and ranks"); a mixture always has some."""
        if self.endless:
            return _endless
        spec = self.spec
        return partial(
            steps_per_epoch, windows, spec.batch_size, spec.world_size, self.rank, spec.split
        )

    def steps_left(self, windows: int) -> int:
        """Steps this rank still receives in the current epoch from the position,
        counted at this world size (also right after an elastic resume)."""
        if self.endless:
            raise no_epochs()
        return self.remaining(windows)(self.offset)

    # ------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The position (and, for a mixture, the mixture itself: a resume checks its
        sources and schedule)."""
        state: dict[str, Any] = {
            "epoch": self.epoch,
            "offset": self.offset,
            "step": self.step,
            "fingerprint": self.spec.fingerprint(),
            "world_size": self.spec.world_size,
        }
        if self.endless:
            state["mixture"] = self.spec.mixture_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Move to a saved position, after checking it was saved for the same order
        (docs/sampling.md, "Resume"; docs/mixtures.md, "Resume"); ValueError naming
        what differs, and then nothing changes."""
        epoch, offset, step = checked_state(state, self.spec)
        self.epoch, self.offset, self.step = epoch, offset, step
        self.loaded, self.ended = True, False


def checked_state(state: dict[str, Any], spec: SamplingSpec) -> tuple[int, int, int]:
    """(epoch, offset, step) of a state dict, if `spec` can continue it."""
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise ValueError(f"not a FeederClient state: missing {missing}")
    if ("mixture" in state) != spec.is_mixture:
        raise ValueError(
            "the state was saved by a "
            + ("mixture" if "mixture" in state else "single-dataset")
            + " loader and this one streams "
            + ("a mixture" if spec.is_mixture else f"dataset {spec.dataset!r}")
        )
    if spec.is_mixture:
        problem = spec.resume_problem(state["mixture"], int(state["offset"]))
        if problem:
            raise ValueError(f"cannot resume this mixture checkpoint: {problem}")
        if int(state["epoch"]) != 0:
            raise ValueError(f"a mixture state has epoch 0, got {state['epoch']}")
    fingerprint = spec.fingerprint()
    if state["fingerprint"] != fingerprint:
        raise ValueError(
            f"the state was saved with different sampling parameters (fingerprint "
            f"{state['fingerprint']} != {fingerprint}): dataset, split, split_rate, "
            f"seq_len, stride, shift, seed, shuffle and shuffle_blocks must match to "
            f"resume the same epoch order"
        )
    epoch, offset, step = (int(state[k]) for k in ("epoch", "offset", "step"))
    if min(epoch, offset, step) < 0:
        raise ValueError(f"negative epoch/offset/step in state {state}")
    return epoch, offset, step


def no_epochs() -> TypeError:
    return TypeError(
        "a mixture stream is endless and has no len() or steps_left; stop at your own "
        "step or token budget"
    )


def _endless(offset: int) -> int:
    """Steps a mixture stream has left: always some (it is endless)."""
    return 1
