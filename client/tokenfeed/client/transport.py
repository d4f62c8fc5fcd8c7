"""Where the feeder is and how to talk to it: addresses, credentials, channels, statuses.

An address is "host:port", a comma-separated list of them, or a list. A host name with
several A records (a Kubernetes headless Service) stands for all of them: replicas are
interchangeable because the sample order is a pure function of the request. A name
with one record stays a name, so TLS checks the certificate against it.

`Channels` holds one gRPC channel to the current address. After a failure the caller
`rotate()`s: the channel is closed and the next attempt opens a fresh one to the next
address. A fresh channel connects at once, so the client's own backoff
(`stream.Backoff`) is the only retry policy in play, not gRPC's internal reconnect
backoff (which grows to minutes).

gRPC status codes are turned into the project's error hierarchy
(`tokenfeed.core.errors`) here, in one place, with the server's message.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from tokenfeed.core.errors import FeederError, error_for
from tokenfeed.v1 import feeder_pb2_grpc

# Worth another attempt (possibly at another address): the request itself is fine.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,  # e.g. a stream reset mid-message by a dying peer
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # the server's stream limit; frees up
        grpc.StatusCode.CANCELLED,  # cancelled by the server (ours are never retried)
    }
)


def status_of(error: grpc.RpcError) -> grpc.StatusCode:
    code = error.code() if isinstance(error, grpc.Call) else None
    return code if code is not None else grpc.StatusCode.UNKNOWN


def details_of(error: grpc.RpcError) -> str:
    details = error.details() if isinstance(error, grpc.Call) else None
    return details or str(error)


def to_feeder_error(error: grpc.RpcError, address: str) -> FeederError:
    """The domain error for a gRPC status, carrying the server's message."""
    code = status_of(error)
    return error_for(code.name, f"{details_of(error)} (feeder {address}: {code.name})")


# --------------------------------------------------------------------- addresses


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """ "a:1,b:2" or ["a:1", "b:2"] -> ["a:1", "b:2"] (order kept, blanks dropped)."""
    parts = address.split(",") if isinstance(address, str) else list(address)
    out = [p.strip() for p in parts if p and p.strip()]
    if not out:
        raise ValueError(f"no feeder address in {address!r}")
    for a in out:
        host, port = _host_port(a)
        if not host or not port.isdigit():
            raise ValueError(f"feeder address {a!r} is not host:port")
    return out


def _host_port(address: str) -> tuple[str, str]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


@dataclass(frozen=True)
class Endpoint:
    target: str  # what the channel dials
    authority: str | None = None  # the name TLS checks when `target` is a resolved IP


def expand(address: str, getaddrinfo: Callable[..., Any] = socket.getaddrinfo) -> list[Endpoint]:
    """One address -> its endpoints: a name with several records gives one per record.

    IPv4 records are used when there are any (so "localhost" is 127.0.0.1 only, as a
    server bound to 127.0.0.1 expects); IPv6 otherwise. Resolution errors propagate
    (`OSError`): the caller retries them like an unreachable server.
    """
    host, port = _host_port(address)
    try:
        socket.inet_pton(socket.AF_INET6 if ":" in host else socket.AF_INET, host)
        return [Endpoint(address)]  # already an IP literal
    except OSError:
        pass
    infos = getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
    v6 = [i[4][0] for i in infos if i[0] == socket.AF_INET6]
    ips = sorted(set(v4 or v6), key=ipaddress.ip_address)
    if len(ips) <= 1:
        return [Endpoint(address)]
    return [Endpoint(f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}", host) for ip in ips]


# ------------------------------------------------------------------- credentials


def _read(value: bytes | str | os.PathLike[str] | None) -> bytes | None:
    """PEM given as bytes, or as a path to a file holding it."""
    if value is None or isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


@dataclass(frozen=True)
class Security:
    """TLS (optionally mutual) and a bearer token, matching the server's options."""

    tls: bool = False
    root_certificates: bytes | None = None  # None: the system's roots
    certificate_chain: bytes | None = None  # client certificate (mTLS)
    private_key: bytes | None = None
    token: str | None = None

    @classmethod
    def build(
        cls,
        tls: bool = False,
        root_certificates: bytes | str | os.PathLike[str] | None = None,
        certificate_chain: bytes | str | os.PathLike[str] | None = None,
        private_key: bytes | str | os.PathLike[str] | None = None,
        token: str | None = None,
    ) -> Security:
        if (certificate_chain is None) != (private_key is None):
            raise ValueError("certificate_chain and private_key go together (mutual TLS)")
        tls = bool(tls or root_certificates or certificate_chain)
        return cls(
            tls,
            _read(root_certificates),
            _read(certificate_chain),
            _read(private_key),
            token.strip() if token else None,
        )

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


@dataclass(frozen=True)
class Timeouts:
    """Keepalive pings detect a black-holed connection while a stream waits for data:
    no ack within `keepalive_timeout` after a ping closes the transport, the stream
    fails with UNAVAILABLE and the client reconnects elsewhere. `connect_timeout`
    bounds an attempt to reach a server that does not answer at all."""

    keepalive_time: float = 20.0
    keepalive_timeout: float = 10.0
    connect_timeout: float = 10.0
    rpc_timeout: float = 30.0  # unary calls (Info)

    def grpc_options(self, endpoint: Endpoint, security: Security) -> list[tuple[str, int | str]]:
        opts: list[tuple[str, int | str]] = [
            ("grpc.max_receive_message_length", -1),
            ("grpc.keepalive_time_ms", int(self.keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout * 1000)),
            ("grpc.http2.max_pings_without_data", 0),
            # Any unanswered ping (keepalive or flow-control probe) ends the transport.
            ("grpc.http2.ping_timeout_ms", int(self.keepalive_timeout * 1000)),
            ("grpc.http2.min_time_between_pings_ms", int(self.keepalive_time * 1000)),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.enable_retries", 0),
            # gRPC's minimum connect timeout (its default is 20 s).
            ("grpc.min_reconnect_backoff_ms", int(self.connect_timeout * 1000)),
        ]
        if security.tls and endpoint.authority:
            opts.append(("grpc.ssl_target_name_override", endpoint.authority))
        return opts


class Channels:
    """A channel to the current endpoint, rotating through the endpoints on failure.

    The endpoint list is the addresses in the order given, each name replaced by its
    records sorted by IP (`expand`), so every rank sees the same list whatever order
    the resolver returns. A client starts on endpoint `start mod n` (the rank: ranks
    spread over replicas) and on failure moves to the next, wrapping around; after a
    whole turn the names are resolved again, so replicas that moved are found.
    """

    def __init__(
        self, address: str | Sequence[str], security: Security, options: Timeouts, start: int = 0
    ) -> None:
        self.addresses = split_addresses(address)
        self.security, self.options = security, options
        self.start = start
        self._endpoints: list[Endpoint] = []
        self._turn = 0  # endpoints tried since the last resolve
        self._channel: grpc.Channel | None = None
        self._stub: feeder_pb2_grpc.FeederStub | None = None
        self._lock = threading.Lock()
        self._closed = False

    @property
    def current(self) -> str:
        if not self._endpoints:
            return self.addresses[self.start % len(self.addresses)]
        return self._endpoint().target

    def _endpoint(self) -> Endpoint:
        return self._endpoints[(self.start + self._turn) % len(self._endpoints)]

    def stub(self) -> feeder_pb2_grpc.FeederStub:
        """The stub of the current endpoint's channel, opening it if needed."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._stub is None:
                if not self._endpoints:
                    self._resolve()
                ep = self._endpoint()
                opts = self.options.grpc_options(ep, self.security)
                if self.security.tls:
                    creds = grpc.ssl_channel_credentials(
                        self.security.root_certificates,
                        self.security.private_key,
                        self.security.certificate_chain,
                    )
                    self._channel = grpc.secure_channel(ep.target, creds, options=opts)
                else:
                    self._channel = grpc.insecure_channel(ep.target, options=opts)
                self._stub = feeder_pb2_grpc.FeederStub(self._channel)
            return self._stub

    def _resolve(self) -> None:
        """(Re)resolve every address; names are looked up again each round, so
        replicas that moved are found."""
        endpoints: list[Endpoint] = []
        for a in self.addresses:
            endpoints.extend(expand(a))
        self._endpoints = endpoints
        self._turn = 0

    def rotate(self) -> None:
        """Drop the current channel; the next `stub()` dials the next endpoint.
        After a whole turn, names are resolved again."""
        with self._lock:
            self._close_channel()
            if self._endpoints:
                self._turn += 1
                if self._turn >= len(self._endpoints):
                    # re-resolve on the next stub() and go on where the turn left off
                    self.start += self._turn
                    self._endpoints = []

    def _close_channel(self) -> None:
        if self._channel is not None:
            self._channel.close()
        self._channel, self._stub = None, None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._close_channel()
