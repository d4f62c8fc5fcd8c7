"""One worker process of `tokenfeed serve --workers N` (started by supervisor.py only).

    python -m tokenfeed.server.worker --index I --ready-fd R --parent-fd P \\
        --state-dir D --log-level L --config JSON

A FeederServer like the single-process one, with three differences: SO_REUSEPORT on
(the N workers listen on one port and the kernel spreads connections over them), its
stores are `chunks.MappedStore`s (chunk bytes shared through the page cache, each
checked once per node), and its metrics go to files the supervisor sums
(PROMETHEUS_MULTIPROC_DIR, set by the supervisor). `--config` is the node's
ServerConfig with this worker's share already applied (cache bytes / N, no metrics
port, no port file). Once serving it writes "<pid> <port>" to the ready pipe, and its
status (status.py) to `STATE/status/<index>.json` every STATUS_SECONDS for the
supervisor's status page; it reloads its credentials on SIGHUP (forwarded by the
supervisor), and drains on SIGTERM, and also when the parent pipe closes (the
supervisor is gone).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import threading
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from tokenfeed.core.atomic import write_atomic
from tokenfeed.server import logs
from tokenfeed.server.app import FeederServer, create_server, run_until_stopped, serve
from tokenfeed.server.chunks import MappedStore, VerifiedChunks, raise_open_files_limit
from tokenfeed.server.config import ServerConfig

log = logging.getLogger("tokenfeed.server.worker")

STATUS_DIR = "status"  # under the state directory: one <index>.json per worker
STATUS_SECONDS = 1.0


def encode_config(config: ServerConfig) -> str:
    """`config` as JSON (paths as strings) for a worker's command line."""
    values: dict[str, Any] = {}
    for f in fields(config):
        v = getattr(config, f.name)
        values[f.name] = str(v) if isinstance(v, Path) else v
    return json.dumps(values)


def decode_config(text: str) -> ServerConfig:
    values: dict[str, Any] = {}
    for f in fields(ServerConfig):
        if f.name in (doc := json.loads(text)):
            v = doc[f.name]
            values[f.name] = Path(v) if v is not None and str(f.type).startswith("Path") else v
    return ServerConfig(**values)


def _watch_parent(fd: int) -> None:
    """Drain (as on SIGTERM) when the supervisor's end of pipe `fd` closes."""

    def watch() -> None:
        while True:
            try:
                if not os.read(fd, 1):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        log.warning("the supervisor is gone: draining")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="tokenfeed-parent-watch", daemon=True).start()


def _write_status(server: FeederServer, path: Path) -> None:
    """Write the server's status to `path` every STATUS_SECONDS (a daemon thread)."""

    def write() -> None:
        while True:
            doc = server.service.status() | {"pid": os.getpid(), "written": time.time()}
            try:
                write_atomic(path, json.dumps(doc).encode())
            except OSError as e:  # the supervisor's directory is gone: it is stopping
                log.debug("status not written: %s", e)
            time.sleep(STATUS_SECONDS)

    threading.Thread(target=write, name="tokenfeed-status", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tokenfeed.server.worker")
    ap.add_argument("--index", type=int, required=True)
    ap.add_argument("--ready-fd", type=int, required=True)
    ap.add_argument("--parent-fd", type=int, required=True)
    ap.add_argument("--state-dir", type=Path, required=True)
    ap.add_argument("--log-level", default="INFO")
    ap.add_argument("--config", required=True)
    args = ap.parse_args(argv)
    config = decode_config(args.config)
    logs.configure(args.log_level, config.log_format, worker=args.index)
    if not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        log.error("PROMETHEUS_MULTIPROC_DIR is not set: workers are started by the supervisor")
        return 2

    raise_open_files_limit()
    verified = VerifiedChunks(args.state_dir / "verified")
    server = create_server(config, open_store=MappedStore.opener(verified), reuse_port=True)
    ready = os.fdopen(args.ready_fd, "wb", buffering=0)

    def on_serving(s: FeederServer) -> None:
        _write_status(s, args.state_dir / STATUS_DIR / f"{args.index}.json")
        ready.write(f"{os.getpid()} {s.port}\n".encode())
        ready.close()

    _watch_parent(args.parent_fd)
    return run_until_stopped(serve(config, server, on_serving))


if __name__ == "__main__":
    raise SystemExit(main())
