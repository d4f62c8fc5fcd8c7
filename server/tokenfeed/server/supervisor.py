"""`tokenfeed serve --workers N`: one data node's cores, a supervisor and N workers.

One server process is one core (the event loop); a data node has 16 to 64. The
supervisor (this process) starts N worker processes (worker.py), each a whole
FeederServer, and stays out of the data path:

* **One port.** The workers listen on the same host:port with SO_REUSEPORT and the
  kernel spreads incoming connections over them (by a hash of the connection). The
  option is set only in this mode: the supervisor first checks that nobody listens on
  the port (a plain bind, which fails on a busy port just as the single-process
  server does), then holds a bound, non-listening SO_REUSEPORT socket for its
  lifetime, so `--port 0` means one port for all workers and the port stays reserved
  while a worker is being replaced. A single-process feeder started on that port later
  fails to bind; only processes of the same user that ask for SO_REUSEPORT can join.
* **Chunk memory, once per node.** Each worker maps the chunk files read-only
  (chunks.MappedStore): the bytes live once, in the page cache, whichever workers use
  them, and each chunk's checksum is checked once per node. Each worker's LRU is
  bounded by cache_bytes / N of mapped chunks, so the workers together never map
  more than --cache-bytes (a chunk several workers map is counted once per worker in
  that bound and held once in memory). A worker evicting a chunk unmaps it; mapping it
  again while the page cache still holds it costs a page-table fill, not a read or a
  checksum. Measured against N private copies: benchmarks/workers_memory.py.
  The alternative, a shared-memory arena with one cross-process LRU, would count a
  shared chunk once but needs locks and pins that survive a worker killed while
  holding them; the page cache already is that arena, kept by the kernel.
* **One /metrics.** Workers write their metric values to files in a directory this
  process owns (prometheus_client's multiprocess mode); `--metrics-port` is served
  here and sums them: counters and histograms over every worker that ever ran (a dead
  worker's counts stay, so the sums never go backwards), gauges over the live ones.
  Same metric names as one process, plus tokenfeed_server_workers and
  tokenfeed_server_worker_restarts_total.
* **Replacement.** A worker that dies is logged, its live gauges are dropped, and a
  new one starts on the same port (after a backoff that grows while replacements keep
  dying young). Its clients see their stream break, reconnect to the same address (the
  kernel picks a live worker) and resume at the offset they had reached.
* **Reload.** SIGHUP is forwarded to every worker, which reloads its TLS files and
  jobs (credentials.py; each also watches the files itself). So is SIGUSR1, on which
  each worker dumps its threads' stacks and its streams' tasks (stacks.py).
* **Status.** Each worker writes its status (status.py) to the state directory every
  STATUS_SECONDS; the metrics port's /status and /status.json merge the live workers'.
* **State.** The workers' metric files, status and verified chunks live in a folder
  of the temporary directory ($TMPDIR), removed at the drain. A supervisor killed
  outright (SIGKILL, the OOM killer) cannot remove its own, so it and its workers hold
  a lock on the folder (one open file, inherited), and the next supervisor to start
  removes the folders whose lock nobody holds.
* **Stop.** SIGTERM or SIGINT: every worker gets SIGTERM and drains (--grace-seconds
  for open streams); exit 0 once all have stopped. A worker still running grace + 15
  seconds later is killed and the exit code is 1. If the supervisor itself dies, each
  worker sees its pipe close and drains.

What an operator sees of this mode: docs/serving.md, "Workers".
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

from tokenfeed.core.atomic import write_atomic
from tokenfeed.server.config import ServerConfig
from tokenfeed.server.credentials import load_credentials
from tokenfeed.server.metrics import SupervisorMetrics
from tokenfeed.server.stacks import DUMP_SIGNAL
from tokenfeed.server.status import merge, serve_http
from tokenfeed.server.worker import STATUS_DIR, encode_config

log = logging.getLogger("tokenfeed.server.supervisor")

START_TIMEOUT = 120.0  # seconds for the first workers to serve
STOP_MARGIN = 15.0  # seconds past --grace-seconds before a draining worker is killed
YOUNG = 10.0  # a worker dying sooner than this after its start backs the next one off


def reserve_port(host: str, port: int) -> tuple[socket.socket, int]:
    """Check that `host:port` is free, then hold it with a bound, non-listening
    SO_REUSEPORT socket (the workers join it); returns (socket, port number)."""
    family, _, _, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC does
        try:
            probe.bind(addr)
        except OSError as e:
            raise OSError(
                e.errno, f"cannot bind {host}:{port}: {e.strerror} (another server on it?)"
            ) from None
        port = int(probe.getsockname()[1])
    held = socket.socket(family, socket.SOCK_STREAM)
    held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        held.bind((*addr[:1], port, *addr[2:]))
    except OSError as e:
        if e.errno != errno.EADDRINUSE:
            held.close()
            raise
        # Connections in TIME_WAIT from an earlier server without SO_REUSEPORT: bind as
        # gRPC would (the probe showed that nobody listens).
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind((*addr[:1], port, *addr[2:]))
    return held, port


class NodeCollector(MultiProcessCollector):  # type: ignore[misc]  # prometheus_client is untyped
    """The workers' metric files, summed; a scrape that meets a file a new worker is
    just creating (empty for a moment) reads again instead of failing with a 500."""

    def collect(self) -> list[Any]:  # Metric families
        for attempt in range(10):
            try:
                return list(super().collect())
            except struct.error:
                if attempt == 9:
                    raise
                time.sleep(0.01)
        return []


@dataclass
class _Worker:
    index: int
    proc: subprocess.Popen[bytes]
    ready_fd: int  # our end of its ready pipe (-1 once read)
    parent_fd: int  # our end of its parent pipe: closing it tells the worker we are gone
    started: float
    serving: bool = False

    def close_fds(self) -> None:
        for fd in (self.ready_fd, self.parent_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self.ready_fd = self.parent_fd = -1


STATE_PREFIX = "tokenfeed-workers-"
STATE_LOCK = "lock"


def new_state_dir() -> tuple[Path, int]:
    """A new state folder and the descriptor of its lock (flock: held until every copy
    of the descriptor is closed); the folders of supervisors that died without
    removing theirs, and whose workers are gone too, are removed first."""
    for old in Path(tempfile.gettempdir()).glob(STATE_PREFIX + "*"):
        _remove_if_orphaned(old)
    state = Path(tempfile.mkdtemp(prefix=STATE_PREFIX))
    lock = os.open(state / ".lock", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(state / ".lock", state / STATE_LOCK)  # no other start ever finds it free
    return state, lock


def _remove_if_orphaned(state: Path) -> None:
    """Remove `state` if no process holds its lock. A folder without a lock (one being
    made, or by an older version) or whose lock cannot be opened (another user's) is
    left."""
    try:
        fd = os.open(state / STATE_LOCK, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return  # its supervisor runs
    else:
        log.info("removing %s, left by a supervisor that was killed", state)
        shutil.rmtree(state, ignore_errors=True)
    finally:
        os.close(fd)


class Supervisor:
    """Runs `config.workers` worker processes on one port until SIGTERM/SIGINT."""

    def __init__(self, config: ServerConfig) -> None:
        if config.workers < 2:
            raise ValueError("the supervisor is for --workers 2 or more")
        self.config = config
        self.n = config.workers
        self._stop = threading.Event()
        # signals forwarded to every worker, set by their handlers
        self._forwarded = {sig: threading.Event() for sig in (signal.SIGHUP, DUMP_SIGNAL)}
        self._workers: list[_Worker | None] = [None] * self.n
        self._respawn_at = [0.0] * self.n
        self._young_deaths = [0] * self.n
        self.port = 0

    # ------------------------------------------------------------------ run

    def run(self) -> int:
        """Start, supervise, drain; the exit code (0 after a clean drain)."""
        load_credentials(self.config)  # a bad TLS or tokens file fails here, before any worker
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: self._stop.set())
        for sig, event in self._forwarded.items():
            signal.signal(sig, lambda *_, e=event: e.set())
        state, lock = new_state_dir()
        http = None
        try:
            (state / "metrics").mkdir()
            (state / STATUS_DIR).mkdir()
            self._state, self._lock = state, lock
            registry = CollectorRegistry()
            NodeCollector(registry, path=str(state / "metrics"))
            self.metrics = SupervisorMetrics(registry)
            held, self.port = reserve_port(self.config.host, self.config.port)
            with held:
                self._worker_config = replace(
                    self.config,
                    workers=1,
                    port=self.port,
                    metrics_port=0,
                    port_file=None,
                    cache_bytes=max(1, self.config.cache_bytes // self.n),
                    readahead_bytes=self.config.readahead_budget // self.n,
                    assembly_threads=self.config.num_assembly_threads,
                )
                for i in range(self.n):
                    self._workers[i] = self._spawn(i)
                if not self._wait_serving():
                    return self._drain(failed=True)
                cfg = self.config
                metrics_port = 0
                if cfg.metrics_port:
                    http, metrics_port = serve_http(
                        registry, cfg.host, cfg.metrics_port, self.status
                    )
                if cfg.port_file is not None:
                    write_atomic(Path(cfg.port_file), f"{self.port}\n".encode())
                log.info(
                    "tokenfeed feeder serving %s on %s:%d with %d worker processes "
                    "(cache %d bytes in all, %d per worker)%s",
                    cfg.data_root,
                    cfg.host,
                    self.port,
                    self.n,
                    cfg.cache_bytes,
                    self._worker_config.cache_bytes,
                    f", metrics on :{metrics_port}" if metrics_port else "",
                )
                while not self._stop.wait(0.1):
                    self._supervise()
                    for sig, event in self._forwarded.items():
                        if event.is_set():
                            event.clear()
                            self._forward(sig)
                return self._drain()
        finally:
            if http is not None:
                http.shutdown()
                http.server_close()
            for w in self._workers:
                if w is not None:
                    w.close_fds()
            shutil.rmtree(state, ignore_errors=True)
            os.close(lock)
            # Drained: a repeated SIGTERM during the last teardown must not turn exit 0
            # into "killed by signal".
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def status(self) -> dict[str, Any]:
        """The node's status: the live workers' latest, merged (their idle times aged
        by how old each one's is)."""
        parts = []
        now = time.time()
        for w in list(self._workers):
            if w is None or not w.serving:
                continue
            try:
                doc = json.loads((self._state / STATUS_DIR / f"{w.index}.json").read_bytes())
            except (OSError, ValueError):
                continue  # not written yet
            if doc.get("pid") == w.proc.pid:  # not a replaced worker's last one
                parts.append(doc | {"age_s": max(0.0, now - doc["written"])})
        return merge(parts)

    # ------------------------------------------------------------ internals

    def _forward(self, sig: int) -> None:
        live = [w for w in self._workers if w is not None and w.serving]
        log.info("%s: forwarded to %d workers", signal.Signals(sig).name, len(live))
        for w in live:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(sig)

    def _spawn(self, index: int) -> _Worker:
        ready_r, ready_w = os.pipe()
        parent_r, parent_w = os.pipe()
        argv = [
            sys.executable,
            "-m",
            "tokenfeed.server.worker",
            "--index",
            str(index),
            "--ready-fd",
            str(ready_w),
            "--parent-fd",
            str(parent_r),
            "--state-dir",
            str(self._state),
            "--log-level",
            logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            "--config",
            encode_config(self._worker_config),
        ]
        env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(self._state / "metrics")}
        try:
            # the lock's descriptor too: the folder is in use while a worker drains
            proc = subprocess.Popen(argv, env=env, pass_fds=(ready_w, parent_r, self._lock))
        finally:
            os.close(ready_w)
            os.close(parent_r)
        log.info("worker %d started (pid %d)", index, proc.pid)
        return _Worker(index, proc, ready_r, parent_w, time.monotonic())

    def _read_ready(self, w: _Worker) -> bool | None:
        """Consume the ready line if there: True serving, None not yet, False died."""
        if w.serving:
            return True
        if not select.select([w.ready_fd], [], [], 0)[0]:
            return None
        line = os.read(w.ready_fd, 256)
        os.close(w.ready_fd)
        w.ready_fd = -1
        if not line:
            return False
        w.serving = True
        log.info("worker %d serving (pid %s)", w.index, line.split()[0].decode())
        self.metrics.workers.inc()
        return True

    def _wait_serving(self) -> bool:
        """Wait for every first worker to serve; False when one dies or time runs out."""
        deadline = time.monotonic() + START_TIMEOUT
        while not self._stop.is_set():
            states = [self._read_ready(w) for w in self._workers if w is not None]
            if all(s is True for s in states):
                return True
            if any(s is False for s in states) or time.monotonic() > deadline:
                log.error("a worker did not start (see its log above); stopping")
                return False
            fds = [w.ready_fd for w in self._workers if w is not None and w.ready_fd >= 0]
            select.select(fds, [], [], 0.1)
        return True  # stopped while starting: drain what started

    def _supervise(self) -> None:
        now = time.monotonic()
        for i, w in enumerate(self._workers):
            if w is None:
                if now >= self._respawn_at[i]:
                    self._workers[i] = self._spawn(i)
                continue
            if w.proc.poll() is None:
                if w.ready_fd >= 0:
                    self._read_ready(w)
                continue
            self._buried(w)
            self._workers[i] = None
            lived = now - w.started
            self._young_deaths[i] = self._young_deaths[i] + 1 if lived < YOUNG else 0
            delay = min(10.0, 0.25 * 2 ** self._young_deaths[i]) if self._young_deaths[i] else 0
            self._respawn_at[i] = now + delay
            self.metrics.worker_restarts.inc()
            log.warning(
                "worker %d (pid %d) %s after %.1f s; replacing it%s",
                i,
                w.proc.pid,
                _how(w.proc.returncode),
                lived,
                f" in {delay:.2g} s" if delay else "",
            )

    def _buried(self, w: _Worker) -> None:
        """Forget a worker that exited: its live gauges go, its counters stay summed."""
        if w.serving:
            self.metrics.workers.dec()
        w.close_fds()
        mark_process_dead(w.proc.pid, str(self._state / "metrics"))

    def _drain(self, failed: bool = False) -> int:
        live = [w for w in self._workers if w is not None and w.proc.poll() is None]
        if not failed:
            log.info(
                "draining %d workers: no new streams, %.1f s for open ones",
                len(live),
                self.config.grace_seconds,
            )
        for w in live:
            with contextlib.suppress(ProcessLookupError):
                w.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.grace_seconds + STOP_MARGIN
        code = 1 if failed else 0
        for w in (w for w in self._workers if w is not None):
            try:
                w.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker %d (pid %d) did not stop; killing it", w.index, w.proc.pid)
                w.proc.kill()
                w.proc.wait()
                code = 1
            rc = w.proc.returncode
            if rc != 0 and not (rc == -signal.SIGTERM and not w.serving):
                log.error("worker %d (pid %d) %s", w.index, w.proc.pid, _how(rc))
                code = 1
            self._buried(w)
        log.info("stopped" if code == 0 else "stopped with errors")
        return code


def _how(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"
