"""What every peer adapter shares: the command line, the measurements, the JSON it prints.

An adapter (`run_<peer>.py` beside this file) is a small program run by
benchmarks/peers.py in the peer's own virtual environment. It defines a `Peer`
subclass (how its loader is built, what a batch's rows are, how its state is saved and
loaded) and a `write` function (the flat token files -> the peer's own format), and
calls `main`. Every mode prints one JSON object on its last line of stdout:

  write    the time to write the format from the flat file(s)
  run      time to the first batch (cold, then warm), an empty loop, a loop that sleeps
           --step-ms per batch; for a mixture also the sources of the first batches
  resume   stop at --fraction of an epoch, save the state (through pickle, as a
           checkpoint would), build a new loader from it: the time to its next batch,
           and whether the following batches are those of the run that did not stop

Only the standard library and numpy here (each peer's venv has numpy): the timing is
`tokenfeed.cli.bench.measure` and the process tree's CPU `procs` (from benchmarks/),
the same code the project's own benchmarks use, imported by path.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO / "benchmarks"), str(REPO / "cli")]

from procs import cpu_seconds, tree  # noqa: E402

from tokenfeed.cli.bench import measure  # noqa: E402

SEQ_LEN, BATCH = 1024, 16
WINDOW = SEQ_LEN + 1  # the last token is the last label
# Mixture sources hold token ids in disjoint ranges, so a row's first token names its
# source (benchmarks/peers.py writes them so).
SOURCE_SPAN = 20_000
# A row is told apart from every other by its first tokens (random uint16: 64 bits).
KEY_TOKENS = 4


class Peer:
    """One loader over one dataset (`data`, a list of one path) or a mixture (`data`
    and `weights`), for `rank` of `world_size`, built by `variant` ("w0", "w2", ...).

    Subclasses set `epoch()` (an iterable of one epoch's batches, or an endless one),
    `rows(batch)` (its token rows as a numpy array, at least KEY_TOKENS columns),
    `epoch_batches()`,
    `state_dict()` / `load_state_dict()` and `close()`."""

    elastic = False  # a state saved at one world size resumes at another

    def __init__(
        self,
        data: list[Path],
        variant: str,
        weights: list[float] | None = None,
        world_size: int = 1,
        rank: int = 0,
        seed: int = 0,
    ) -> None:
        self.data, self.variant, self.weights = data, variant, weights
        self.world_size, self.rank, self.seed = world_size, rank, seed
        self.workers = int(variant[1:]) if variant.startswith("w") else 0

    def epoch(self) -> Iterable[Any]:
        raise NotImplementedError

    def rows(self, batch: Any) -> np.ndarray:
        raise NotImplementedError

    def epoch_batches(self) -> int:
        """Batches in one whole epoch of this rank (not what is left of it)."""
        raise NotImplementedError

    def state_dict(self) -> Any:
        raise NotImplementedError

    def load_state_dict(self, state: Any) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Stop workers and threads (the default: nothing to stop)."""


class LoaderPeer(Peer):
    """A peer whose `loader` is a DataLoader-like object with its own state: iterating
    it is an epoch, `len()` its batches, `state_dict()` / `load_state_dict()` its state
    (MosaicML Streaming's and LitData's StreamingDataLoader)."""

    loader: Any

    def epoch(self) -> Iterable[Any]:
        return self.loader

    def epoch_batches(self) -> int:
        return len(self.loader)

    def state_dict(self) -> Any:
        return self.loader.state_dict()

    def load_state_dict(self, state: Any) -> None:
        self.loader.load_state_dict(state)

    def close(self) -> None:
        it = getattr(self.loader, "_iterator", None)  # torch's DataLoader: its workers
        if it is not None and hasattr(it, "_shutdown_workers"):
            it._shutdown_workers()


class FlatWindows:
    """Window i = T[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] of a flat uint16 file, read
    with np.memmap (opened in the process that reads: workers too)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.n = (path.stat().st_size // 2 - WINDOW) // SEQ_LEN + 1
        self._map: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def window(self, i: int) -> np.ndarray:
        if self._map is None:
            self._map = np.memmap(self.path, dtype=np.uint16, mode="r")
        s = int(i) * SEQ_LEN
        return self._map[s : s + WINDOW]

    def __getstate__(self) -> dict[str, Any]:  # sent to workers without the map
        return {**self.__dict__, "_map": None}


def keys(rows: np.ndarray) -> list[bytes]:
    """Each row's identity: its first KEY_TOKENS tokens."""
    return [bytes(r) for r in np.ascontiguousarray(rows[:, :KEY_TOKENS], dtype=np.uint16)]


def deviation(sources: np.ndarray, weights: list[float], per_batch: int) -> dict[str, Any]:
    """How far each source's row count strays from its weighted share, over every
    prefix of whole batches: the largest |count - weight x rows| (in rows) and the same
    at the last batch. `sources` is each row's source index, in stream order."""
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    onehot = np.eye(len(w), dtype=np.int64)[sources]
    counts = np.cumsum(onehot, axis=0)[per_batch - 1 :: per_batch]  # after each batch
    rows = np.arange(1, len(counts) + 1, dtype=np.float64)[:, None] * per_batch
    gap = np.abs(counts - rows * w)
    return {
        "max_rows": float(gap.max()),
        "final_rows": [float(g) for g in gap[-1]],
        "batches": len(counts),
    }


def first_batch(make: Callable[[], Peer]) -> tuple[Peer, float, Any]:
    """A new loader and its first batch: the seconds from building it to holding it."""
    t0 = time.perf_counter()
    peer = make()
    batch = next(iter(peer.epoch()))
    return peer, time.perf_counter() - t0, batch


def endless(peer: Peer) -> Iterator[Any]:
    """The loader's batches across epochs."""
    while True:
        for batch in peer.epoch():  # noqa: UP028 (`yield from` would close the loader with this)
            yield batch


# ------------------------------------------------------------------------- modes


def run(make: Callable[[], Peer], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    peer, out["first_batch_cold_s"], _ = first_batch(make)
    peer.close()
    peer, out["first_batch_warm_s"], _ = first_batch(make)
    if peer.weights:
        per_batch, n = None, args.mixture_batches
        sources = []
        for batch in endless(peer):
            rows = peer.rows(batch)
            per_batch = len(rows)
            sources.append(rows[:, 0].astype(np.int64) // SOURCE_SPAN)
            if len(sources) == n:
                break
        out["deviation"] = deviation(np.concatenate(sources), peer.weights, per_batch or 1)
    me, feeder = os.getpid(), [int(p) for p in args.feeder_pid]

    def others() -> float:  # workers (descendants) and the feeder, over the window
        return cpu_seconds([p for p in tree(me) if p != me] + feeder)

    def tokens(batch: Any) -> int:
        return len(peer.rows(batch)) * SEQ_LEN

    out["empty"] = measure(peer.epoch, args.seconds, 0.0, tokens, others)
    out["step"] = measure(peer.epoch, args.seconds, args.step_ms / 1e3, tokens, others)
    peer.close()
    return out


def resume(make: Callable[..., Peer], args: argparse.Namespace) -> dict[str, Any]:
    """Epoch 0 to --fraction, state saved; then the next --check batches of the same
    loader (the uninterrupted run) against those of a new loader from the state."""
    peer = make()
    it = iter(peer.epoch())
    batches = peer.epoch_batches()
    stop = int(batches * args.fraction)
    for _ in range(stop):
        next(it)
    t0 = time.perf_counter()
    state = pickle.dumps(peer.state_dict())
    save_s = time.perf_counter() - t0
    left = batches - stop  # the uninterrupted run, to the epoch's end
    rest = [keys(peer.rows(batch)) for batch in itertools.islice(it, left)]
    del it
    peer.close()
    reference = rest[: args.check]

    t0 = time.perf_counter()
    again = make()
    again.load_state_dict(pickle.loads(state))
    it = iter(again.epoch())
    resumed = [keys(again.rows(next(it)))]
    resume_s = time.perf_counter() - t0
    resumed += [keys(again.rows(next(it))) for _ in range(args.check - 1)]
    del it
    again.close()
    out: dict[str, Any] = {
        "at_batch": stop,
        "save_s": save_s,
        "state_bytes": len(state),
        "resume_s": resume_s,
        "exact": resumed == reference,
    }
    if args.elastic_world_size and peer.elastic:
        out["elastic"] = elastic(make, state, rest, args)
    return out


def elastic(
    make: Callable[..., Peer], state: bytes, rest: list[list[bytes]], args: argparse.Namespace
) -> dict[str, Any]:
    """The state loaded at another world size, every rank in turn in this process: the
    rows all ranks receive to the end of the epoch must be the rows the uninterrupted
    run had left, none lost, none repeated, but for the epoch's last rows that no longer
    fill a whole step of world_size x BATCH (a training epoch drops a short last step)."""
    w = args.elastic_world_size
    got: list[bytes] = []
    seconds = []
    for rank in range(w):
        t0 = time.perf_counter()
        peer = make(world_size=w, rank=rank)
        peer.load_state_dict(pickle.loads(state))
        for i, batch in enumerate(peer.epoch()):
            if i == 0:
                seconds.append(time.perf_counter() - t0)
            got += keys(peer.rows(batch))
        peer.close()
    left = [k for batch in rest for k in batch]  # in the order of the epoch
    whole = len(left) // (w * BATCH) * (w * BATCH)
    want = set(left[:whole])
    have = set(got)
    return {
        "world_size": w,
        "resume_s": max(seconds),
        "rows": len(got),
        "rows_left": len(want),
        "short_last_step": len(left) - whole,
        "lost": len(want - have),
        "repeated": len(got) - len(have),
        "foreign": len(have - want),
    }


def main(peer_class: type[Peer], write: Callable[[list[Path], Path], None]) -> None:
    p = argparse.ArgumentParser(description=f"peer adapter: {peer_class.__name__}")
    p.add_argument("mode", choices=("write", "run", "resume"))
    p.add_argument("--data", nargs="+", type=Path, required=True, help="format dir(s) or flats")
    p.add_argument("--out", type=Path, help="write: the output directory")
    p.add_argument("--variant", default="w0")
    p.add_argument("--weights", type=float, nargs="*", help="a mixture: one per --data")
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--step-ms", type=float, default=5.0)
    p.add_argument("--mixture-batches", type=int, default=1000)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--check", type=int, default=32)
    p.add_argument("--elastic-world-size", type=int, default=0)
    p.add_argument("--feeder-pid", nargs="*", default=[])
    args = p.parse_args()

    if args.mode == "write":
        t0 = time.perf_counter()
        write(args.data, args.out)
        result: dict[str, Any] = {"write_s": time.perf_counter() - t0}
    else:

        def make(world_size: int = 1, rank: int = 0) -> Peer:
            return peer_class(args.data, args.variant, args.weights, world_size, rank)

        result = run(make, args) if args.mode == "run" else resume(make, args)
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # worker pools and their threads end with the process, not after it
