"""`tokenfeed serve`: flags here, defaults and validation in config.py.

Every flag defaults to None so that `TOKENFEED_<NAME>` environment variables apply
when it is not given (flags > environment > defaults). grpc is imported in `run` only.
"""

from __future__ import annotations

import argparse
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a(
        "--data-root",
        help="directory whose token stores are served, named by relative path "
        "[TOKENFEED_DATA_ROOT]",
    )
    a("--host", help="address to bind (default 127.0.0.1) [TOKENFEED_HOST]")
    a("--port", type=int, help="gRPC port (default 50051; 0 = any free port) [TOKENFEED_PORT]")
    a("--port-file", help="write the bound port to this file once serving [TOKENFEED_PORT_FILE]")
    a(
        "--metrics-port",
        type=int,
        help="Prometheus /metrics port (default 0 = off) [TOKENFEED_METRICS_PORT]",
    )
    a(
        "--cache-bytes",
        help="chunk cache bound for the whole node, e.g. 2G (default 2 GiB; with --workers "
        "N each worker maps at most 1/N of it) [TOKENFEED_CACHE_BYTES]",
    )
    a(
        "--readahead-bytes",
        help="room for chunks read ahead and not used yet, outside --cache-bytes, e.g. "
        "256M: the feeder's memory bound is the sum of both. Object storage needs about "
        "(shuffle_blocks + 1) chunks to hide its first-byte latency (default: a quarter "
        "of --cache-bytes for s3://, 0 for a local root, where read-ahead shares the "
        "cache) [TOKENFEED_READAHEAD_BYTES]",
    )
    a("--max-streams", type=int, help="concurrent streams (default 2048) [TOKENFEED_MAX_STREAMS]")
    a(
        "--max-batch-bytes",
        help="largest response message, e.g. 64M (default 64 MiB) [TOKENFEED_MAX_BATCH_BYTES]",
    )
    a(
        "--workers",
        type=int,
        help="server processes sharing the port, one per core to use: a supervisor "
        "starts them, sums their metrics and replaces any that dies (default 1: one "
        "process, no supervisor) [TOKENFEED_WORKERS]",
    )
    a(
        "--assembly-threads",
        type=int,
        help="batch-assembly threads per server process (default min(8, cpus / workers), "
        "at least 2 with several workers) [TOKENFEED_ASSEMBLY_THREADS]",
    )
    a("--tls-cert", help="PEM server certificate (with --tls-key) [TOKENFEED_TLS_CERT]")
    a("--tls-key", help="PEM server private key [TOKENFEED_TLS_KEY]")
    a(
        "--tls-client-ca",
        help="PEM CA: require client certificates it signed [TOKENFEED_TLS_CLIENT_CA]",
    )
    a(
        "--auth-token-file",
        help="file holding a bearer token every call must send [TOKENFEED_AUTH_TOKEN_FILE]",
    )
    a(
        "--tokens-file",
        help="YAML or JSON file of jobs: each job's token SHA-256, the datasets it may read, "
        "its weight and max_streams; reloaded on SIGHUP and when it changes (not with "
        "--auth-token-file) [TOKENFEED_TOKENS_FILE]",
    )
    a(
        "--grace-seconds",
        type=float,
        help="on SIGTERM, time open streams get to finish (default 10) [TOKENFEED_GRACE_SECONDS]",
    )
    a(
        "--log-format",
        choices=("text", "json"),
        help="log lines as text (default) or one JSON object each, with a record per "
        "stream opened, closed or refused [TOKENFEED_LOG_FORMAT]",
    )
    a(
        "--log-level",
        default=os.environ.get("TOKENFEED_LOG_LEVEL", "INFO"),
        help="logging level (default INFO) [TOKENFEED_LOG_LEVEL]",
    )


def run(args: argparse.Namespace) -> int:
    from tokenfeed.server import logs
    from tokenfeed.server.config import ServerConfig
    from tokenfeed.server.main import run as run_server

    config = ServerConfig.from_sources(vars(args))
    logs.configure(str(args.log_level), config.log_format)
    return run_server(config)
