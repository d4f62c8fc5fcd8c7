"""`tokenfeed serve`'s entry point: one server process, or the supervisor of N workers.

The server's modules form layers (an import contract in pyproject.toml): process
management (this module, supervisor.py, worker.py) over the app (app.py: one
FeederServer assembled from its config and served until SIGTERM) over the service
(service.py) over assembly and read-ahead over the cache, splice and wire. Workers
and replicas: docs/serving.md.
"""

from __future__ import annotations

import logging

from tokenfeed.core import native
from tokenfeed.server.app import run_until_stopped, serve
from tokenfeed.server.chunks import raise_open_files_limit
from tokenfeed.server.config import ServerConfig
from tokenfeed.server.inplace import FILES_PER_STREAM, KEEP_FILES, POOL_FILES
from tokenfeed.server.supervisor import Supervisor

log = logging.getLogger("tokenfeed.server")


def run(config: ServerConfig) -> int:
    """`tokenfeed serve`: one server process, or the supervisor of `config.workers`;
    the exit code (0 after a clean drain)."""
    warning = config.insecure_warning()
    if warning:
        log.warning("\n%s\n%s\n%s", "!" * 78, warning, "!" * 78)  # hard to miss
    if not (native.enabled() and native.built("tokenfeed.server._native")):
        log.warning(
            "without the C extensions (TOKENFEED_PURE_PYTHON=1): messages are spliced "
            "in Python and windows sampled in numpy, which costs about 30 % more server CPU "
            "per token"
        )
    check_open_files(config)
    if config.workers > 1:
        return Supervisor(config).run()
    return run_until_stopped(serve(config))


# descriptors beside the streams': gRPC's, the logs, the metrics endpoint, chunk loads
OTHER_FILES = 256


def check_open_files(config: ServerConfig) -> int:
    """Raise the soft limit of open files to the hard one, and warn when it is below
    what `--max-streams` streams may hold; the limit in force."""
    limit = raise_open_files_limit()
    # a connection per stream; the pool of chunk files read in place, KEEP_FILES per
    # stream and at least POOL_FILES (inplace.FilePool); the rest
    need = config.max_streams + max(config.max_streams * KEEP_FILES, POOL_FILES) + OTHER_FILES
    if limit < need:
        log.warning(
            "the limit of open files is %d, below the %d that --max-streams %d streams may "
            "need (%d each: a connection and the chunk files it reads in place); raise "
            '`ulimit -n` or lower --max-streams (deploy/README.md, "How to size it")',
            limit,
            need,
            config.max_streams,
            FILES_PER_STREAM,
        )
    return limit
