"""`SourceCounters`: a mixture stream's tokens and bytes sent, counted by source."""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tokenfeed.server.assembly import MessageBuilder
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.mixtures import MixtureSpace


class SourceCounters:
    """A mixture stream's tokens_sent / bytes_sent, by source: the builder records each
    message's spans as it builds it (MessageBuilder.by_source); once a burst is
    written, its spans join the pending runs (consecutive batches of a round make one
    run), and every FLUSH_SECONDS, and when the stream ends, the runs' tokens by source
    (LocatedRound.source_tokens: one count of its rows a run) go to the counters. Counting
    each message as built and each burst as written (numpy rows per message, two
    counter increments per source per burst) cost ~7 of a mixture's ~50 us per batch
    at one batch per message (in process, chunks cached)."""

    # A flush increments two counters per source sent since the last: for 1,000 sources,
    # about all of them every time; Prometheus scrapes every few seconds at most.
    FLUSH_SECONDS = 1.0

    def __init__(
        self,
        metrics: ServerMetrics,
        pipe: MessageBuilder,
        children: dict[str, tuple[Any, Any]] | None = None,
    ) -> None:
        assert isinstance(pipe.ds, MixtureSpace)
        assert pipe.by_source is not None
        self.pipe = pipe
        self.itemsize = pipe.ds.store.dtype.itemsize
        self.metrics = metrics
        self.names = [d.name for d in pipe.ds.sources]
        # each source's two counters by its name, looked up at its first count: a stream
        # of 1,000 sources would look up 2,000 at its start, most of them for nothing
        # yet; `children` is the feeder's, shared by its later streams
        self._children = children if children is not None else {}
        self._runs: list[list[Any]] = []  # [round, first batch, end batch], written, not counted
        self._due = time.monotonic() + self.FLUSH_SECONDS

    @classmethod
    def of(
        cls,
        metrics: ServerMetrics,
        pipe: MessageBuilder,
        children: dict[str, tuple[Any, Any]] | None = None,
    ) -> SourceCounters | None:
        return cls(metrics, pipe, children) if pipe.by_source is not None else None

    def count(self, messages: int) -> None:
        """The next `messages` messages built are written: count them (soon)."""
        queue, runs = self.pipe.by_source, self._runs
        assert queue is not None
        for _ in range(messages):
            for lr, i, j in queue.popleft():
                last = runs[-1] if runs else None
                if last is not None and last[0] is lr and last[2] == i:
                    last[2] = j
                else:
                    runs.append([lr, i, j])
        if time.monotonic() >= self._due:
            self.flush()

    def flush(self) -> None:
        """Count every run written so far."""
        self._due = time.monotonic() + self.FLUSH_SECONDS
        if not self._runs:
            return
        k = len(self.names)
        total = sum(lr.source_tokens(i, j, k) for lr, i, j in self._runs)
        self._runs.clear()
        sent = np.flatnonzero(total)
        for i, n in zip(sent.tolist(), total[sent].tolist(), strict=True):
            name = self.names[i]
            tokens, nbytes = self._children.get(name) or self._lookup(name)
            tokens.inc(n)
            nbytes.inc(n * self.itemsize)

    def _lookup(self, name: str) -> tuple[Any, Any]:
        self._children[name] = found = (
            self.metrics.tokens_sent.labels(dataset=name, split="train", source=name),
            self.metrics.bytes_sent.labels(dataset=name, split="train"),
        )
        return found
