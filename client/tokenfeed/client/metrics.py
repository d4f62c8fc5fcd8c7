"""The client's Prometheus metrics: the one home of their names.

Every series is labelled `rank`, so one Prometheus scraping every trainer shows them
side by side (the deploy dashboards and alert rules are built on these names):

    tokenfeed_client_tokens_received_total       counter   tokens of input_ids received
    tokenfeed_client_batches_received_total      counter   batches received
    tokenfeed_client_bytes_received_total        counter   token payload bytes received
    tokenfeed_client_reconnects_total{reason}    counter   stream re-openings, by cause
    tokenfeed_client_wait_seconds                histogram time the training loop blocked in next()
    tokenfeed_client_stall_fraction              gauge     waited / wall time over the last window
    tokenfeed_client_buffer_occupancy            gauge     batches ready in the buffer

The registry is passed in (or a fresh `CollectorRegistry` is made), never the global
one, so tests and several clients in one process do not fight over it. Clients that
share a registry share its metric families (a train and a validation loader of the
same rank add up); registering the names twice would raise.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

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
STALL_WINDOW_SECONDS = 30.0


class _Families:
    """The metric families of one registry (made once per registry)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.tokens = Counter(
            PREFIX + "tokens_received", "Tokens of input_ids received.", ["rank"], registry=r
        )
        self.batches = Counter(
            PREFIX + "batches_received", "Batches received.", ["rank"], registry=r
        )
        self.bytes = Counter(
            PREFIX + "bytes_received", "Token payload bytes received.", ["rank"], registry=r
        )
        self.reconnects = Counter(
            PREFIX + "reconnects",
            "Stream re-openings after a failure.",
            ["rank", "reason"],
            registry=r,
        )
        self.wait = Histogram(
            PREFIX + "wait_seconds",
            "Time the training loop blocked in next().",
            ["rank"],
            buckets=WAIT_BUCKETS,
            registry=r,
        )
        self.stall = Gauge(
            PREFIX + "stall_fraction",
            f"Fraction of wall time the loop waited for data over the last "
            f"{STALL_WINDOW_SECONDS:g} s.",
            ["rank"],
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


class StallWindow:
    """Waited time / wall time over the last `window` seconds, in one-second bins.

    A wait still in progress counts up to now, so a loop stuck in next() shows as
    stalled while it is stuck, not only once the batch finally arrives.
    """

    def __init__(
        self, window: float = STALL_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self._clock = clock
        self._born = clock()
        self._bins: deque[list[float]] = deque()  # [second, waited seconds]
        self._waiting_since: float | None = None
        self._lock = threading.Lock()

    def begin_wait(self) -> None:
        self._waiting_since = self._clock()

    def end_wait(self) -> None:
        since, self._waiting_since = self._waiting_since, None
        if since is not None:
            self.add(self._clock() - since)

    def add(self, waited: float) -> None:
        now = self._clock()
        second = float(int(now))
        with self._lock:
            if self._bins and self._bins[-1][0] == second:
                self._bins[-1][1] += waited
            else:
                self._bins.append([second, waited])
            self._prune(now)

    def _prune(self, now: float) -> None:
        while self._bins and self._bins[0][0] < now - self.window - 1:
            self._bins.popleft()

    def value(self) -> float:
        now = self._clock()
        with self._lock:
            self._prune(now)
            start = max(now - self.window, self._born)
            waited = sum(w for s, w in self._bins if s + 1 > start)
        since = self._waiting_since
        if since is not None:
            waited += now - max(since, start)
        wall = now - start
        return 0.0 if wall <= 0 else min(1.0, waited / wall)


class ClientMetrics:
    """The series of one client (one rank); cheap enough to update for every batch."""

    def __init__(self, rank: int, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        fam = _families_of(self.registry)
        label = str(rank)
        self._fam, self._rank = fam, label
        self.tokens = fam.tokens.labels(rank=label)
        self.batches = fam.batches.labels(rank=label)
        self.bytes = fam.bytes.labels(rank=label)
        self.wait = fam.wait.labels(rank=label)
        self.stall = StallWindow()
        fam.stall.labels(rank=label).set_function(self.stall.value)
        self._occupancy: Callable[[], float] = lambda: 0.0
        fam.occupancy.labels(rank=label).set_function(lambda: self._occupancy())
        self._http: tuple[object, threading.Thread] | None = None
        self.port: int | None = None

    def received(self, tokens: int, nbytes: int) -> None:
        self.tokens.inc(tokens)
        self.batches.inc()
        self.bytes.inc(nbytes)

    def reconnect(self, reason: str) -> None:
        self._fam.reconnects.labels(rank=self._rank, reason=reason).inc()

    def waited(self, seconds: float) -> None:
        self.wait.observe(seconds)

    def track_occupancy(self, fn: Callable[[], float]) -> None:
        self._occupancy = fn

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Export the registry over HTTP (port 0 picks a free one); returns the port."""
        from prometheus_client import start_http_server

        server, thread = start_http_server(port, addr=addr, registry=self.registry)
        self._http = (server, thread)
        self.port = int(server.server_address[1])
        return self.port

    def close(self) -> None:
        self._occupancy = lambda: 0.0
        if self._http is not None:
            server, thread = self._http
            self._http = None
            server.shutdown()  # type: ignore[attr-defined]
            server.server_close()  # type: ignore[attr-defined]
            thread.join(timeout=5)
