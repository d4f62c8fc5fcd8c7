"""Helpers shared by the tests, one home each (fixtures live in tests/conftest.py):

- here: free ports, waits with deadlines (`wait_until`, `until` in a coroutine), the
  metric series our classes register, fewer Hypothesis examples for an expensive test
  (the profiles: tests/conftest.py);
- `stores`: positional, document and Megatron stores, a DatasetSampler;
- `feeders`: a real feeder in process or as a `tokenfeed serve` subprocess;
- `load`: many streams on one event loop, clients that vanish (test_load, benchmarks);
- `readahead`: a stream's bursts against a real cache, read-aheads let land;
- `pki`, `seaweed` (a real S3 server), `faultproxy` / `s3faultproxy` (faults on the
  wire), `prepare` (offline corpora and tokenizers), `documents_reference` (loop
  references of the document outputs).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from pathlib import Path

from hypothesis import settings
from prometheus_client import CollectorRegistry

from tokenfeed.client.metrics import ClientMetrics
from tokenfeed.server.metrics import ServerMetrics, SupervisorMetrics

TESTS = Path(__file__).resolve().parents[1]  # tests/
ROOT = TESTS.parent  # the repository


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(ready: Callable[[], object], timeout: float, what: str, poll: float = 0.02) -> None:
    """Poll `ready()` until it is truthy; AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(poll)


async def until(
    ready: Callable[[], object], timeout: float, what: str, poll: float = 0.005
) -> None:
    """wait_until inside a coroutine: the event loop runs on between two looks."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        await asyncio.sleep(poll)


def fewer_examples(by: int) -> settings:
    """Settings for a test whose every example is expensive: the loaded profile's
    max_examples divided by `by` (at least one), so a profile scales it too."""
    return settings(max_examples=max(1, settings.default.max_examples // by))


_SUFFIXES = {"counter": ["_total"], "gauge": [""], "histogram": ["_bucket", "_sum", "_count"]}


def registered_series(
    server: bool = True, client: bool = True, supervisor: bool = False
) -> set[str]:
    """Every sample name the feeder's, the client's and/or the `--workers` supervisor's
    metrics classes register."""
    reg = CollectorRegistry()
    if server:
        ServerMetrics(reg)
    if supervisor:
        SupervisorMetrics(reg)
    if client:
        ClientMetrics(rank=0, registry=reg)
    return {f.name + s for f in reg.collect() for s in _SUFFIXES[f.type]}
