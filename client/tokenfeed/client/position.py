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

Run-time weights (docs/mixtures.md, "Run-time weights"): `set_weights` adds a run-time
segment to the spec from a step on, at that step's global position (the next offset
plus the steps in between times B * W, also after an elastic resume), and the state
dict carries every run-time segment, which `load_state_dict` adopts. The spec is the
position's: the run-time segments are the trajectory the position has come along.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.core.limits import MAX_REQUEST_BYTES, MAX_TOKENS, REQUEST_FIELDS_BYTES
from tokenfeed.core.mixture import RuntimeSegments, step_position
from tokenfeed.core.mixture.spec import segment_weights
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import steps_per_epoch

STATE_KEYS = ("epoch", "offset", "step", "fingerprint", "world_size")


class Position:
    """The loop's position in rank `rank`'s stream of `spec`; starts at epoch 0's start.

    `loaded`: a position `load_state_dict` gave, not streamed yet; `ended`: the
    epoch ran to its end in the loop.
    """

    __slots__ = ("_fixed_bytes", "ended", "epoch", "loaded", "offset", "rank", "spec", "step")

    def __init__(self, spec: SamplingSpec, rank: int = 0) -> None:
        self.spec, self.rank = spec, rank
        self.epoch, self.offset, self.step = 0, 0, 0
        self.loaded = self.ended = False
        self._fixed_bytes: int | None = None

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
        what differs, and then nothing changes. A mixture's run-time segments are the
        saved ones from then on."""
        spec, epoch, offset, step = checked_state(state, self.spec)
        self.spec = spec
        self.epoch, self.offset, self.step = epoch, offset, step
        self.loaded, self.ended = True, False

    # ---------------------------------------------------------- run-time weights
    def set_weights(self, weights: Any, at_step: int | None = None) -> int:
        """From global step `at_step` (None: the next step, the first the loop has not
        received) on, the mixture follows `weights`: a run-time segment from that
        step's position. Returns the step. InvalidArgument (changing nothing) for
        weights a schedule segment would refuse, a step in the past or at position 0,
        a step before the last run-time change, or a request grown past the feeder's
        limit."""
        spec = self.spec
        if not spec.is_mixture:
            raise TypeError(
                f"set_weights changes a mixture's weights; this loader streams dataset "
                f"{spec.dataset!r}"
            )
        step = self.step if at_step is None else at_step
        position = step_position(step, self.offset, self.step, spec.global_batch)
        tokens = position * spec.seq_len
        if tokens > MAX_TOKENS:
            raise InvalidArgument.at(
                "at_step", f"step {step} starts at {tokens} tokens, past the stream's 2**62"
            )
        exact = segment_weights(spec.source_names, weights, "weights")
        runtime = spec.mixture.runtime
        last = runtime.last_from_tokens
        if last is not None and tokens < last:
            raise InvalidArgument.at(
                "at_step",
                f"step {step} starts at {tokens} tokens, before the run-time change already "
                f"made from {last} tokens; changes are made in step order",
            )
        grown = runtime.with_segment(tokens, [float(w) for w in exact])
        size = self._request_bytes(len(grown.data))
        if size > MAX_REQUEST_BYTES:
            raise InvalidArgument.at(
                "weights",
                f"{len(runtime) + 1} run-time segments would make a stream request of "
                f"{size} bytes, over the feeder's limit of {MAX_REQUEST_BYTES}; change the "
                "weights less often",
            )
        self.spec = spec.with_(runtime=grown.data)
        return int(step)

    def _request_bytes(self, runtime_bytes: int) -> int:
        """The size of a stream request whose run-time segments take `runtime_bytes`."""
        if self._fixed_bytes is None:  # everything else: the same for every change
            plain = self.spec.with_(runtime=b"").to_proto().ByteSize()
            self._fixed_bytes = plain + REQUEST_FIELDS_BYTES
        return self._fixed_bytes + runtime_bytes + 16  # the field's tag and length

    def weights_in_force(self) -> dict[str, float]:
        """A mixture's normalized weights at the position ({} for one dataset)."""
        spec = self.spec
        if not spec.is_mixture:
            return {}
        shares = spec.mixture.shares_at(min(self.offset, spec.mixture.max_position))
        return {n: float(w) for n, w in zip(spec.source_names, shares, strict=True)}


def checked_state(state: dict[str, Any], spec: SamplingSpec) -> tuple[SamplingSpec, int, int, int]:
    """(spec, epoch, offset, step) of a state dict, if `spec` can continue it: a
    mixture's spec with the state's run-time segments."""
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
        rows = state["mixture"].get("runtime", [])
        runtime = RuntimeSegments.from_state(len(spec.sources), rows, "mixture.runtime")
        spec = spec.with_(runtime=runtime.data)
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
    return spec, epoch, offset, step


def no_epochs() -> TypeError:
    return TypeError(
        "a mixture stream is endless and has no len() or steps_left; stop at your own "
        "step or token budget"
    )


def _endless(offset: int) -> int:
    """Steps a mixture stream has left: always some (it is endless)."""
    return 1
