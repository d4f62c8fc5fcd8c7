"""Server configuration: one frozen dataclass, from `TOKENFEED_*` env overridden by flags.

Every setting has a flag (`--cache-bytes`) and an environment variable
(`TOKENFEED_CACHE_BYTES`); a flag given on the command line wins. Values are checked
once, at start, in `__post_init__`, so a typo fails before the port is bound rather
than at the first request.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tokenfeed.core.errors import InvalidArgument

ENV_PREFIX = "TOKENFEED_"
GiB = 1 << 30
LOG_FORMATS = ("text", "json")
MiB = 1 << 20


@dataclass(frozen=True)
class ServerConfig:
    data_root: Path | str  # a directory, or "s3://bucket/prefix" (kept as a string)
    host: str = "127.0.0.1"
    port: int = 50051
    metrics_port: int = 0  # 0 = no metrics endpoint
    cache_bytes: int = 2 * GiB
    # chunks read ahead and not used yet wait outside the cache, in this many bytes
    # (cache.py); -1 = automatic: none for a local root, cache_bytes / 4 for s3://
    readahead_bytes: int = -1
    # one feeder takes a job of thousands of ranks: each stream costs at most ~1 MiB
    # and FILES_PER_STREAM descriptors (docs/serving.md, "Limits")
    max_streams: int = 2048
    max_batch_bytes: int = 64 * MiB  # bytes of one response message (all its batches)
    assembly_threads: int = 0  # batch-assembly threads per process; 0 = automatic
    workers: int = 1  # server processes on one port (supervisor.py); 1 = one process
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_client_ca: Path | None = None  # require client certificates signed by this CA
    auth_token_file: Path | None = None
    tokens_file: Path | None = None  # jobs, their tokens' digests and grants (tenants.py)
    log_format: str = "text"  # or "json": one object per line (logs.py)
    grace_seconds: float = 10.0
    port_file: Path | None = None  # written with the bound port once serving (tests, scripts)

    def __post_init__(self) -> None:
        root = self.data_root
        if isinstance(root, str) and root.startswith("s3://"):
            pass  # object storage: the feeder lists it at start (Catalog), exit 2 if it cannot
        elif isinstance(root, str) and "://" in root:
            raise InvalidArgument(
                f"--data-root {root}: only local directories and s3://bucket/prefix are supported"
            )
        elif not Path(root).is_dir():
            raise InvalidArgument(f"--data-root {root} is not a directory")
        for name, lo, hi in (
            ("port", 0, 65535),
            ("metrics_port", 0, 65535),
            ("cache_bytes", 1, 1 << 50),
            ("readahead_bytes", -1, 1 << 50),
            ("max_streams", 1, 1 << 20),
            ("max_batch_bytes", 1, 2 * GiB - 1),  # gRPC messages are limited to 2 GiB
            ("assembly_threads", 0, 1024),
            ("workers", 1, 256),
        ):
            value = getattr(self, name)
            if not lo <= value <= hi:
                flag = "--" + name.replace("_", "-")
                raise InvalidArgument(f"{flag} must be in [{lo}, {hi}], got {value}")
        if not 0 <= self.grace_seconds <= 3600:
            raise InvalidArgument(f"--grace-seconds must be in [0, 3600], got {self.grace_seconds}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidArgument("--tls-cert and --tls-key must be given together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise InvalidArgument("--tls-client-ca needs --tls-cert and --tls-key")
        if self.tokens_file is not None and self.auth_token_file is not None:
            raise InvalidArgument(
                "--tokens-file and --auth-token-file are exclusive: the tokens file holds "
                "every job's token (give the one token a job there)"
            )
        if self.log_format not in LOG_FORMATS:
            raise InvalidArgument(
                f"--log-format must be one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}"
            )
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file", "tokens_file"):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise InvalidArgument(f"--{name.replace('_', '-')} {path}: no such file")
        if self.auth_token_file is not None and not self.auth_token():
            raise InvalidArgument(f"--auth-token-file {self.auth_token_file} is empty")

    @property
    def num_assembly_threads(self) -> int:
        """Batch-assembly threads of one server process: the flag, or min(8, cpus) for
        one process and min(8, max(2, cpus // workers)) for each of several."""
        if self.assembly_threads:
            return self.assembly_threads
        cores = max(1, (os.cpu_count() or 1) // self.workers)
        return min(8, cores if self.workers == 1 else max(2, cores))

    @property
    def readahead_budget(self) -> int:
        """Bytes of the read-ahead budget: the flag, or automatic (-1): 0 for a local data
        root (chunks load in milliseconds: read-ahead shares the cache's room), a quarter
        of --cache-bytes for object storage (first bytes come tens of ms late: the next
        shuffle group's chunks load early, into room of their own)."""
        if self.readahead_bytes >= 0:
            return self.readahead_bytes
        remote = isinstance(self.data_root, str) and self.data_root.startswith("s3://")
        return self.cache_bytes // 4 if remote else 0

    @property
    def tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def authenticates(self) -> bool:
        """Whether calls must carry a token (--auth-token-file or --tokens-file)."""
        return self.auth_token_file is not None or self.tokens_file is not None

    def auth_token(self) -> str | None:
        """The bearer token (surrounding whitespace stripped), or None when auth is off."""
        if self.auth_token_file is None:
            return None
        return Path(self.auth_token_file).read_text().strip()

    def is_loopback(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def insecure_warning(self) -> str | None:
        """A loud warning when the feeder is reachable from the network unprotected."""
        if self.is_loopback() or self.tls or self.authenticates:
            return None
        return (
            f"WARNING: serving on {self.host}:{self.port} with neither TLS nor an auth "
            "token: anyone who can reach this address can read every dataset under "
            f"the data root. Use --tls-cert/--tls-key and/or --auth-token-file (or "
            "--tokens-file), or bind "
            "127.0.0.1."
        )

    @classmethod
    def from_sources(
        cls, flags: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> ServerConfig:
        """Defaults < `TOKENFEED_<NAME>` environment < flags (those not None)."""
        environ = os.environ if environ is None else environ
        flags = flags or {}
        values: dict[str, Any] = {}
        for f in fields(cls):
            raw: Any = flags.get(f.name)
            if raw is None:
                raw = environ.get(ENV_PREFIX + f.name.upper())
                if raw is None or raw == "":
                    continue
            values[f.name] = _convert(f.name, str(f.type), raw)
        if "data_root" not in values:
            raise InvalidArgument("no data root: pass --data-root or set TOKENFEED_DATA_ROOT")
        return cls(**values)


def _convert(name: str, type_name: str, raw: Any) -> Any:
    """Parse an env/flag value by the field's annotation (a string under `annotations`)."""
    flag = "--" + name.replace("_", "-")
    try:
        if name == "data_root" and str(raw).startswith("s3://"):
            return str(raw)  # Path() would fold "s3://b/p" into a local "s3:/b/p"
        if type_name.startswith("Path"):
            return Path(raw)
        if type_name == "int":
            return parse_size(raw) if isinstance(raw, str) else int(raw)
        if type_name == "float":
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        env = ENV_PREFIX + name.upper()
        raise InvalidArgument(f"{flag} (or {env}): bad value {raw!r}") from None


_UNITS = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """An integer, optionally with a binary unit: 512M, 2G, 2GiB, 1024 -> bytes/count."""
    s = text.strip().lower().removesuffix("ib").removesuffix("b")
    if s and s[-1] in _UNITS:
        return int(float(s[:-1]) * _UNITS[s[-1]])
    return int(s)
