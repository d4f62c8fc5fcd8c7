"""What a reload swaps, all or nothing: the TLS certificate and key, the client CA
bundle and the jobs (tokens file, or the one token of --auth-token-file); and the
watcher that reloads them on SIGHUP and when their files change.

`load_credentials(config)` reads every file and checks all of it (the key matches the
certificate, the CA bundle holds certificates, the tokens file parses and every entry
is valid) before anything is used, so a reload that fails anywhere changes nothing:
the watcher logs why at ERROR and the feeder keeps every old setting. The feeder
starts with the same function, so what would fail a reload fails the start (exit 2).

The watcher polls the files' identities (device, inode, size, mtime: `stat` follows
symlinks, so a Kubernetes Secret's swapped `..data` link counts) every POLL_SECONDS,
and reloads at once on SIGHUP. gRPC asks for the certificate on every new connection
(`grpc.dynamic_ssl_server_credentials`): connections made after a reload get the new
one; streams on older connections go on undisturbed. No key, certificate or token
appears in a message: only paths and reasons. The operator's view: docs/tenants.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.server.config import ServerConfig
from tokenfeed.server.tenants import Tenants, load_tokens_file, single_job

log = logging.getLogger("tokenfeed.server.credentials")

POLL_SECONDS = 2.0  # a changed file is picked up within this (the promise: 10 s)


@dataclass(frozen=True)
class TlsMaterial:
    """A checked certificate chain and key (PEM), and the client CA bundle if any."""

    cert_chain: bytes
    key: bytes
    client_ca: bytes | None

    def configuration(self) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(self.key, self.cert_chain)], root_certificates=self.client_ca
        )


@dataclass(frozen=True)
class Credentials:
    tls: TlsMaterial | None
    tenants: Tenants | None  # None: the feeder checks no token


def _read(flag: str, path: Path) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise InvalidArgument(f"{flag} {path}: cannot read it: {e.strerror or e}") from None


def _no_password() -> bytes:
    raise InvalidArgument("the key is encrypted; gRPC needs an unencrypted PEM key")


@contextlib.contextmanager
def _as_files(*blobs: bytes) -> Iterator[list[str]]:
    """Paths ssl can read `blobs` from: anonymous memory files on Linux (no copy of the
    key on disk), else a private temporary directory."""
    if hasattr(os, "memfd_create"):
        fds = [os.memfd_create("tokenfeed-tls", 0) for _ in blobs]
        try:
            for fd, blob in zip(fds, blobs, strict=True):
                os.write(fd, blob)
            yield [f"/proc/self/fd/{fd}" for fd in fds]
        finally:
            for fd in fds:
                os.close(fd)
        return
    with tempfile.TemporaryDirectory(prefix="tokenfeed-tls-") as d:
        paths = [os.path.join(d, str(i)) for i in range(len(blobs))]
        for path, blob in zip(paths, blobs, strict=True):
            with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "wb") as f:
                f.write(blob)
        yield paths


def load_tls(cert: Path, key: Path, client_ca: Path | None) -> TlsMaterial:
    """Read and check the TLS files: the key must match the certificate."""
    cert_chain, key_pem = _read("--tls-cert", cert), _read("--tls-key", key)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        with _as_files(cert_chain, key_pem) as (cert_file, key_file):
            ctx.load_cert_chain(cert_file, key_file, password=_no_password)
    except InvalidArgument as e:  # from _no_password
        raise InvalidArgument(f"--tls-key {key}: {e.message}") from None
    except ssl.SSLError as e:
        raise InvalidArgument(
            f"--tls-cert {cert} and --tls-key {key}: not a PEM certificate and the "
            f"unencrypted key that matches it ({e.reason or e.strerror or 'unreadable'})"
        ) from None
    ca = None
    if client_ca is not None:
        ca = _read("--tls-client-ca", client_ca)
        try:
            ctx.load_verify_locations(cadata=ca.decode("ascii"))
        except (ssl.SSLError, UnicodeDecodeError, ValueError) as e:
            reason = getattr(e, "reason", None) or "not PEM"
            raise InvalidArgument(
                f"--tls-client-ca {client_ca}: not a bundle of PEM certificates ({reason})"
            ) from None
    return TlsMaterial(cert_chain, key_pem, ca)


def load_credentials(config: ServerConfig) -> Credentials:
    """Every reloadable setting, read and checked; InvalidArgument naming the file."""
    tls = None
    if config.tls_cert is not None and config.tls_key is not None:
        tls = load_tls(config.tls_cert, config.tls_key, config.tls_client_ca)
    tenants = None
    if config.tokens_file is not None:
        tenants = load_tokens_file(config.tokens_file)
    elif config.auth_token_file is not None:
        token = _read("--auth-token-file", config.auth_token_file).decode(errors="replace")
        if not token.strip():
            raise InvalidArgument(f"--auth-token-file {config.auth_token_file} is empty")
        tenants = single_job(token.strip())
    return Credentials(tls, tenants)


def watched_files(config: ServerConfig) -> list[Path]:
    paths = (
        config.tls_cert,
        config.tls_key,
        config.tls_client_ca,
        config.tokens_file,
        config.auth_token_file,
    )
    return [Path(p) for p in paths if p is not None]


def _identity(path: Path) -> tuple[int, ...]:
    try:
        st = path.stat()
    except OSError as e:
        return (-1, e.errno or 0)
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class CredentialWatcher:
    """Reload on SIGHUP (`trigger`) and when a watched file changes; `apply` gets the
    new credentials only when all of them loaded and checked."""

    def __init__(
        self,
        config: ServerConfig,
        apply: Callable[[Credentials], None],
        poll_seconds: float = POLL_SECONDS,
    ) -> None:
        self.config = config
        self.apply = apply
        self.poll_seconds = poll_seconds
        self.files = watched_files(config)
        self.seen = self._identities()  # what the current credentials were loaded from
        self.reloads = 0  # successful reloads (tests wait on it)
        self.failures = 0
        self._wake = asyncio.Event()

    def _identities(self) -> list[tuple[int, ...]]:
        return [_identity(p) for p in self.files]

    def trigger(self) -> None:
        """SIGHUP: reload now (on the event loop's thread)."""
        self._wake.set()

    async def run(self) -> None:
        """Watch until cancelled."""
        while True:
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_seconds)
            signalled = self._wake.is_set()
            self._wake.clear()
            now = self._identities()
            if signalled or now != self.seen:
                await self.reload("SIGHUP" if signalled else "a file changed", now)

    async def reload(self, why: str, identities: list[tuple[int, ...]]) -> bool:
        self.seen = identities  # a failed load is not retried until a file changes again
        try:
            creds = await asyncio.to_thread(load_credentials, self.config)
        except InvalidArgument as e:
            self.failures += 1
            log.error("reload (%s) failed, keeping every previous setting: %s", why, e.message)
            return False
        self.apply(creds)
        self.reloads += 1
        log.info(
            "reloaded (%s): %s",
            why,
            ", ".join(str(p) for p in self.files) or "nothing to reload",
        )
        return True
