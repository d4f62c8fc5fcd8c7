"""The client's Prometheus metrics: the one home of their names.

Every series is labelled `rank`, so one Prometheus scraping every trainer shows them
side by side (the deploy dashboards and alert rules are built on these names; what
they mean for users: docs/client.md, "Metrics"):

    tokenfeed_client_tokens_received_total       counter   tokens of input_ids received
    tokenfeed_client_batches_received_total      counter   batches received
    tokenfeed_client_bytes_received_total        counter   token payload bytes received
    tokenfeed_client_reconnects_total{reason}    counter   stream re-openings, by cause
    tokenfeed_client_wait_seconds                histogram time the training loop blocked in
                                                           next(), steady state (see below)
    tokenfeed_client_stall_fraction              gauge     steady-state waited / wall time
                                                           over the last window (see below)
    tokenfeed_client_first_batch_seconds         histogram time the loop blocked in next()
                                                           for each stream's first batch
    tokenfeed_client_buffer_occupancy            gauge     batches ready in the buffer
    tokenfeed_client_mixture_weight_ratio{source} gauge    a mixture's normalized weight of
                                                           each source at the loop's position
    tokenfeed_client_mixer_loss_nats{source}     gauge     an OnlineMixer's mean loss per row
                                                           of each source over its last update
                                                           interval, all ranks (nats for a
                                                           cross-entropy loss)

Time to first batch is reported apart. The first `next()` of each iteration (each
`iter(loader)`: a new epoch, a resume, or a stream opened ahead and adopted) waits for
the stream's first batch: connecting and the feeder reading its first chunk. That wait
goes into `first_batch_seconds` only; `wait_seconds` holds every other `next()` (the
final StopIteration included), and `stall_fraction` is their waited time over the
window's wall time minus the first-batch waits in it. A wait still in progress counts
up to now, so a loop stuck mid-stream shows as stalled while it is stuck (a loop still
waiting for a first batch does not: see `first_batch_seconds` and reconnects).

Cheap for the training loop. The loop's `next()` touches no Prometheus object and no
lock: it appends its wait to a deque. The reader thread, once per message, folds those
waits into plain-Python histogram counts and stall bins and counts what it received,
under a lock of its own; a collector (one per registry) folds too and turns the
counts into the series at scrape time. (Uncontended locks cost ten times their warm
price right after a training step's sleep: benchmarks/trainer_loop.py shows it.)

The registry is passed in (or a fresh `CollectorRegistry` is made), never the global
one, so tests and several clients in one process do not fight over it. Clients that
share a registry share its metric families: the counters and histograms of a train and
a validation loader of the same rank add up, and `stall_fraction` shows the larger of
their stalls (a closed client no longer counts there). Registering the names twice
would raise.
"""

from __future__ import annotations

import threading
import time
import weakref
from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from time import perf_counter
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

PREFIX = "tokenfeed_client_"
# 10 us .. 10 s: a healthy loop waits microseconds, a starved one milliseconds to seconds.
WAIT_BUCKETS = (
    1e-5,
    2.5e-5,
    5e-5,
    1e-4,
    2.5e-4,
    5e-4,
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
# 1 ms .. 2 min: an adopted stream's first batch is already there; a new one connects
# and waits for its first chunk; a feeder being restarted takes seconds to minutes.
FIRST_BATCH_BUCKETS = (
    1e-3,
    2.5e-3,
    5e-3,
    1e-2,
    2.5e-2,
    5e-2,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)
STALL_WINDOW_SECONDS = 30.0

_DOC = {
    "tokens": "Tokens of input_ids received.",
    "batches": "Batches received.",
    "bytes": "Token payload bytes received.",
    "wait": "Time the training loop blocked in next(), except for a stream's first batch.",
    "first": "Time the training loop blocked in next() for a stream's first batch "
    "(connect, first chunk).",
    "stall": f"Fraction of wall time the loop waited for data over the last "
    f"{STALL_WINDOW_SECONDS:g} s, first-batch waits left out.",
    "weight": "A mixture's normalized weight of each source at the training loop's position.",
    "loss": "An online mixer's mean loss per row of each source over its last update "
    "interval, summed over ranks (nats for a cross-entropy loss).",
}


class Histogram:
    """Plain-Python histogram counts: `observe` is a bisect and two adds.

    Written under the owner's lock; read without it (a reader may see an observation's
    count without its sum for an instant; the exposition derives `_count` from the
    buckets, so buckets and count always agree).
    """

    __slots__ = ("bounds", "counts", "sum")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1  # bucket i: value <= bounds[i]
        self.sum += value

    @property
    def count(self) -> int:
        return sum(self.counts)


class StallWindow:
    """Waited time / wall time over the last `window` seconds, in one-second bins.

    `add(waited)` needs no lock of its own (ONE writer at a time): it adds to the
    current bin, a `[second, waited, excluded]` list, and once a second moves it into
    a bounded deque. `value()` (scrape time, any thread) reads the current bin
    first, then the deque, and counts a bin found in both once. `exclude(seconds)`
    takes time out of the wall time (a first-batch wait). A wait still in progress
    (`begin_wait` .. `end_wait`/`clear_wait`) counts up to now.
    """

    def __init__(
        self, window: float = STALL_WINDOW_SECONDS, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.window = window
        self._clock = clock
        self._born = clock()
        self._current: list[float] = [float(int(self._born)), 0.0, 0.0]
        # Bins of distinct seconds, oldest dropped: enough to cover the window.
        self._bins: deque[list[float]] = deque(maxlen=int(window) + 2)
        self._waiting_since: float | None = None

    def begin_wait(self, since: float | None = None) -> None:
        self._waiting_since = self._clock() if since is None else since

    def clear_wait(self) -> None:
        self._waiting_since = None

    def end_wait(self) -> None:
        since, self._waiting_since = self._waiting_since, None
        if since is not None:
            self.add(self._clock() - since)

    def add(self, waited: float, now: float | None = None) -> None:
        """Count `waited` seconds at `now` (default: the clock)."""
        if now is None:
            now = self._clock()
        current = self._current
        if current[0] == int(now):
            current[1] += waited
        else:
            self._roll(now)[1] += waited

    def exclude(self, seconds: float, now: float | None = None) -> None:
        """Leave `seconds` ending at `now` out of the wall time."""
        if now is None:
            now = self._clock()
        current = self._current
        if current[0] != int(now):
            current = self._roll(now)
        current[2] += seconds

    def _roll(self, now: float) -> list[float]:
        old, new = self._current, [float(int(now)), 0.0, 0.0]
        self._bins.append(old)  # before the swap: value() then sees `old` at least once
        self._current = new
        return new

    def value(self) -> float:
        now = self._clock()
        current = self._current  # first: a roll in between leaves it at the deque's end
        bins = list(self._bins)  # one C call: atomic under the GIL
        if not bins or bins[-1] is not current:
            bins.append(current)
        start = max(now - self.window, self._born)
        waited = excluded = 0.0
        for second, w, x in bins:
            if second + 1 > start:
                waited += w
                excluded += x
        since = self._waiting_since
        if since is not None:
            waited += now - max(since, start)
        wall = now - start - excluded
        return 0.0 if wall <= 0 else max(0.0, min(1.0, waited / wall))


class ClientMetrics:
    """The series of one client (one rank).

    The training loop records each `next()`'s wait with `waited(seconds)`: one append
    to a deque (atomic, no lock). The reader thread, once per message in `received`,
    and the collector at scrape time fold those waits into the histogram and the stall
    window under a lock the loop never takes (`fold`). The first-batch waits are rare
    and recorded by `first_batch_waited` the same way.

    The totals are also plain attributes for programs that print a summary (the demo,
    benchmarks); call `fold()` first, or use `summary()`: `wait.sum`/`wait.count`
    (steady-state waits), `first_batch_seconds` (the latest stream's first-batch
    wait, None before one), `first_batch.sum`/`first_batch.count`.
    """

    def __init__(self, rank: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.rank = str(rank)
        self.created = time.time()
        self.wait = Histogram(WAIT_BUCKETS)
        self.first_batch = Histogram(FIRST_BATCH_BUCKETS)
        self.first_batch_seconds: float | None = None
        self.stall = StallWindow()
        self.tokens = self.batches = self.bytes = 0
        self.closed = False
        # Written by the loop only; a bound keeps memory flat if nothing folds them
        # (the reader folds every message, so it is never reached in practice).
        self.waits: deque[float] = deque(maxlen=1 << 16)
        self._first_waits: deque[tuple[float, float]] = deque(maxlen=1 << 10)
        self._lock = threading.Lock()  # the readers and the collector, never the loop
        fam = _families_of(self.registry)
        self._fam = fam
        fam.collector.add(self)
        self._occupancy: Callable[[], float] = lambda: 0.0
        fam.occupancy.labels(rank=self.rank).set_function(lambda: self._occupancy())
        self._weights: Callable[[], Mapping[str, float]] = dict
        self.mixer_losses: dict[str, float] = {}
        self._http: tuple[object, threading.Thread] | None = None
        self.port: int | None = None

    # The training loop, per next(): an append, no lock.
    def waited(self, seconds: float) -> None:
        """A steady-state wait in next() of `seconds` (folded in later)."""
        self.waits.append(seconds)

    def first_batch_waited(self, seconds: float, now: float | None = None) -> None:
        """The wait in next() for a stream's first batch, ended at `now`
        (`time.perf_counter`): not a steady-state stall."""
        self.first_batch_seconds = seconds
        self._first_waits.append((seconds, perf_counter() if now is None else now))

    # The reader thread, per message.
    def received(self, tokens: int, nbytes: int, batches: int = 1) -> None:
        with self._lock:
            self.tokens += tokens
            self.batches += batches
            self.bytes += nbytes
            self._fold()

    def reconnect(self, reason: str) -> None:
        self._fam.reconnects.labels(rank=self.rank, reason=reason).inc()

    def fold(self) -> None:
        """Move the loop's recorded waits into the histograms and the stall window."""
        with self._lock:
            self._fold()

    def _fold(self) -> None:
        waits, stall = self.waits, self.stall
        if waits:
            now = perf_counter()  # within a batch or a scrape of when they ended
            observe = self.wait.observe
            while waits:
                w = waits.popleft()
                observe(w)
                stall.add(w, now)
        firsts = self._first_waits
        while firsts:
            w, end = firsts.popleft()
            self.first_batch.observe(w)
            stall.exclude(w, end)

    def summary(self) -> dict[str, Any]:
        """Totals for a printed summary: steady-state waits apart from first batches."""
        self.fold()
        return {
            "first_batch_seconds": self.first_batch_seconds,
            "first_batches": self.first_batch.count,
            "first_batch_seconds_total": self.first_batch.sum,
            "waits": self.wait.count,
            "wait_seconds_total": self.wait.sum,
            "stall_fraction": self.stall.value(),
        }

    def track_occupancy(self, fn: Callable[[], float]) -> None:
        self._occupancy = fn

    def track_weights(self, fn: Callable[[], Mapping[str, float]]) -> None:
        """`fn()` gives a mixture's weights at the loop's position (read at scrape time)."""
        self._weights = fn

    def weights(self) -> Mapping[str, float]:
        return {} if self.closed else self._weights()

    def mixer_loss(self, losses: Mapping[str, float]) -> None:
        """An online mixer's latest per-source mean losses (NaN: no row of it)."""
        self.mixer_losses = dict(losses)

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Export the registry over HTTP (port 0 picks a free one); returns the port."""
        from prometheus_client import start_http_server

        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = (server, thread)
        self.port = int(server.server_address[1])
        return self.port

    def close(self) -> None:
        self._occupancy = lambda: 0.0
        self.closed = True
        if self._http is not None:
            server, thread = self._http
            self._http = None
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            thread.join(timeout=5)


class _Collector:
    """The loop-written series of every client of one registry, summed by rank."""

    def __init__(self) -> None:
        self._clients: list[ClientMetrics] = []
        self._lock = threading.Lock()

    def add(self, client: ClientMetrics) -> None:
        with self._lock:
            self._clients.append(client)

    def describe(self) -> Iterator[Metric]:
        """The names, so the registry refuses a second owner of any of them."""
        yield CounterMetricFamily(PREFIX + "tokens_received", _DOC["tokens"], labels=["rank"])
        yield CounterMetricFamily(PREFIX + "batches_received", _DOC["batches"], labels=["rank"])
        yield CounterMetricFamily(PREFIX + "bytes_received", _DOC["bytes"], labels=["rank"])
        yield HistogramMetricFamily(PREFIX + "wait_seconds", _DOC["wait"], labels=["rank"])
        yield HistogramMetricFamily(PREFIX + "first_batch_seconds", _DOC["first"], labels=["rank"])
        yield GaugeMetricFamily(PREFIX + "stall_fraction", _DOC["stall"], labels=["rank"])
        yield from _by_source()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            clients = list(self._clients)
        for c in clients:
            c.fold()
        ranks: dict[str, list[ClientMetrics]] = {}
        for c in clients:
            ranks.setdefault(c.rank, []).append(c)
        counters = {
            k: CounterMetricFamily(PREFIX + name, _DOC[k], labels=["rank"])
            for k, name in (
                ("tokens", "tokens_received"),
                ("batches", "batches_received"),
                ("bytes", "bytes_received"),
            )
        }
        wait = HistogramMetricFamily(PREFIX + "wait_seconds", _DOC["wait"], labels=["rank"])
        first = HistogramMetricFamily(
            PREFIX + "first_batch_seconds", _DOC["first"], labels=["rank"]
        )
        stall = GaugeMetricFamily(PREFIX + "stall_fraction", _DOC["stall"], labels=["rank"])
        for rank, cs in ranks.items():
            created = min(c.created for c in cs)
            for key, family in counters.items():
                family.add_metric([rank], float(sum(getattr(c, key) for c in cs)), created=created)
            for family, attr in ((wait, "wait"), (first, "first_batch")):
                hists = [getattr(c, attr) for c in cs]
                family.add_metric([rank], _buckets(hists), sum(h.sum for h in hists))
                # As prometheus_client's own Histogram exports it.
                family.samples.append(Sample(family.name + "_created", {"rank": rank}, created))
            open_ = [c.stall.value() for c in cs if not c.closed]
            stall.add_metric([rank], max(open_, default=0.0))
        yield from counters.values()
        yield wait
        yield first
        yield stall
        weight, loss = _by_source()
        for rank, cs in ranks.items():
            for family, values in (
                (weight, [c.weights() for c in cs]),
                (loss, [c.mixer_losses for c in cs if not c.closed]),
            ):
                merged: dict[str, float] = {}
                for v in values:  # a rank's clients: one of them is its mixture
                    merged.update(v)
                for source, value in merged.items():
                    family.add_metric([rank, source], value)
        yield weight
        yield loss


def _by_source() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
    return (
        GaugeMetricFamily(
            PREFIX + "mixture_weight_ratio", _DOC["weight"], labels=["rank", "source"]
        ),
        GaugeMetricFamily(PREFIX + "mixer_loss_nats", _DOC["loss"], labels=["rank", "source"]),
    )


def _buckets(hists: list[Histogram]) -> list[tuple[str, float]]:
    """Cumulative `le` buckets of the sum of `hists` (same bounds), +Inf last."""
    bounds = hists[0].bounds
    counts = [0] * (len(bounds) + 1)
    for h in hists:
        for i, n in enumerate(list(h.counts)):
            counts[i] += n
    out, total = [], 0
    for bound, n in zip((*bounds, float("inf")), counts, strict=True):
        total += n
        out.append((floatToGoString(bound), float(total)))
    return out


class _Families:
    """The metric families of one registry (made once per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.collector = _Collector()
        r.register(self.collector)
        self.reconnects = Counter(
            PREFIX + "reconnects",
            "Stream re-openings after a failure.",
            ["rank", "reason"],
            registry=r,
        )
        self.occupancy = Gauge(
            PREFIX + "buffer_occupancy", "Batches ready in the buffer.", ["rank"], registry=r
        )


_families: weakref.WeakKeyDictionary[CollectorRegistry, _Families] = weakref.WeakKeyDictionary()
_families_lock = threading.Lock()


def _families_of(registry: CollectorRegistry) -> _Families:
    with _families_lock:
        fam = _families.get(registry)
        if fam is None:
            fam = _families[registry] = _Families(registry)
        return fam
