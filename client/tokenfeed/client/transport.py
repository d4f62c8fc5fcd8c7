"""Talking to the feeder: endpoints, channels, TLS diagnosis, status codes -> errors.

What to reach and how is a `connection.Connection`. A host name with several A
records (a Kubernetes headless Service) stands for all of them: replicas are
interchangeable because the sample order is a pure function of the request
(docs/serving.md, "Several replicas"). A name with one record stays a name, so TLS
checks the certificate against it.

`Channels` holds a client's channel to the current address, shared with the other
clients of the process that reach it the same way (`channel_pool`). After a failure
the caller `rotate()`s: the channel is retired from the pool and released, and the next
attempt takes the pool's channel to the next address, a fresh one if nobody holds it.
A fresh channel connects at once, so the client's own backoff (`connection.Backoff`)
is the only retry policy in play, not gRPC's internal reconnect backoff (which grows to
minutes).

gRPC status codes are turned into the project's error hierarchy
(`tokenfeed.core.errors`) here, in one place, with the server's message. A failed
connection whose cause is TLS (a plaintext client and a TLS feeder, a missing client
certificate, an untrusted certificate) looks to gRPC like any unreachable address;
`tls_problem` says which it is, from gRPC's message or, when that only says the
socket closed, from one TLS handshake of its own.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from tokenfeed.client.channel_pool import POOL, SharedChannel
from tokenfeed.client.connection import Connection, Security, Timeouts, host_port
from tokenfeed.core.errors import FeederError, error_for
from tokenfeed.v1 import feeder_pb2_grpc

log = logging.getLogger("tokenfeed.client")

# Worth another attempt (possibly at another address): the request itself is fine.
RETRYABLE = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.ABORTED,
        grpc.StatusCode.INTERNAL,  # a stream reset by a dying peer (a few in a row: Outage)
        grpc.StatusCode.RESOURCE_EXHAUSTED,  # the server's stream limit; frees up
        grpc.StatusCode.CANCELLED,  # cancelled by the server (ours are never retried)
    }
)


def retryable(error: grpc.RpcError) -> bool:
    """Whether another attempt may succeed: a RETRYABLE status, but not a message over
    a size limit (grpc's RESOURCE_EXHAUSTED "... message larger than max ..."), which
    fails the same way every time."""
    code = status_of(error)
    return code in RETRYABLE and not (
        code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details_of(error)
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


# --------------------------------------------------------------------- endpoints


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
    host, port = host_port(address)
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


# ------------------------------------------------------------ channel options

# The largest message this client accepts, sent with every stream request (the
# server packs fewer batches per message to stay below it): gRPC's hard limit.
MAX_RECEIVE_BYTES = (1 << 31) - 1
# What a stream may receive ahead of its reader: a fixed HTTP/2 window, ~4 messages of
# the ~1 MiB the feeder packs, instead of gRPC's BDP-probed one. The probe sizes every
# stream's window from what the whole connection receives, and the clients of a process
# share one: with 64 streams whose readers waited (full buffers) the windows grew with
# what came in and the process buffered GiBs a second; 1 or 2 streams stay bounded.
STREAM_WINDOW_BYTES = 4 << 20


def channel_options(
    timeouts: Timeouts, endpoint: Endpoint, security: Security
) -> list[tuple[str, int | str]]:
    """gRPC channel arguments for `timeouts` (keepalive, one dial's bound) and TLS."""
    dial = min(timeouts.attempt_timeout, timeouts.connect_timeout)
    opts: list[tuple[str, int | str]] = [
        ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
        ("grpc.http2.bdp_probe", 0),
        ("grpc.http2.lookahead_bytes", STREAM_WINDOW_BYTES),
        ("grpc.keepalive_time_ms", _ms(timeouts.keepalive_time)),
        ("grpc.keepalive_timeout_ms", _ms(timeouts.keepalive_timeout)),
        ("grpc.http2.max_pings_without_data", 0),
        # Any unanswered ping (keepalive or flow-control probe) ends the transport.
        ("grpc.http2.ping_timeout_ms", _ms(timeouts.keepalive_timeout)),
        ("grpc.http2.min_time_between_pings_ms", _ms(timeouts.keepalive_time)),
        ("grpc.keepalive_permit_without_calls", 0),
        ("grpc.enable_retries", 0),
        # gRPC's minimum connect timeout (its default is 20 s).
        ("grpc.min_reconnect_backoff_ms", _ms(dial)),
    ]
    if security.tls and endpoint.authority:
        opts.append(("grpc.ssl_target_name_override", endpoint.authority))
    return opts


def _ms(seconds: float) -> int:
    return max(1, min(int(seconds * 1000), (1 << 31) - 1))


# ------------------------------------------------------------------------ TLS


def tls_problem(details: str, target: str, security: Security, probe: bool = True) -> str | None:
    """What is wrong with TLS, if gRPC's message of a failed connection to `target`
    shows it is TLS, or (`probe`) a handshake of our own does when the message only
    says the peer hung up; None when TLS is not the cause."""
    low = details.lower()
    if "certificate_verify_failed" in low or "certificate verify failed" in low:
        return (
            "TLS: this client does not trust the feeder's certificate: pass root_certificates= "
            "the CA that signed it (and use the name or IP the certificate was issued for)"
        )
    if security.tls and "wrong_version_number" in low:
        return (
            "TLS: the feeder does not speak TLS (a plaintext feeder?): drop tls/"
            "root_certificates, or start the feeder with --tls-cert and --tls-key"
        )
    if "handshake failed" in low or "ssl_error" in low:
        return f"TLS: the handshake with the feeder failed ({details})"
    hung_up = ("socket closed", "connection reset", "end of tcp stream")
    if not probe or not any(m in low for m in hung_up):
        return None
    answer = probe_tls(target)  # the peer hung up: find out whether it speaks TLS
    if answer is None:
        return None
    if not security.tls:
        return (
            "TLS: the feeder speaks TLS but this client connects in plaintext: pass tls=True "
            "(and root_certificates= if its certificate is not from a public CA)"
        )
    if answer == "client-certificate" and security.certificate_chain is None:
        return (
            "TLS: the feeder requires a client certificate (mutual TLS): pass "
            "certificate_chain= and private_key="
        )
    if answer == "client-certificate":
        return (
            "TLS: the feeder requires a client certificate and did not accept this one "
            "(is it signed by the CA the feeder's --tls-client-ca names?)"
        )
    return None


def probe_tls(target: str, timeout: float = 2.0) -> str | None:
    """One TLS handshake with `target` (certificates not checked, none sent):
    "client-certificate" if the server demands one, "tls" if it speaks TLS, None if it
    does not (or cannot be reached)."""
    host, port = host_port(target)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    try:
        with (
            socket.create_connection((host, int(port)), timeout=timeout) as raw,
            ctx.wrap_socket(raw) as tls,
        ):
            # TLS 1.3 refuses a missing client certificate after the handshake: the
            # server hangs up (or alerts) instead of sending HTTP/2 settings.
            try:
                data = tls.recv(1)
            except TimeoutError:
                return "tls"
            except ssl.SSLError as e:
                return _alert(e) and "client-certificate"
            except OSError:
                data = b""
            return "tls" if data else "client-certificate"
    except ssl.SSLError as e:
        return _alert(e)
    except OSError:
        return None


def _alert(error: ssl.SSLError) -> str | None:
    """A TLS alert from the server means it speaks TLS; anything else, it does not."""
    text = str(error).upper()
    if "CERTIFICATE_REQUIRED" in text or "HANDSHAKE_FAILURE" in text:
        return "client-certificate"
    return "tls" if "ALERT" in text else None


class Channels:
    """A channel to the current endpoint, rotating through the endpoints on failure.

    The endpoint list is the addresses in the order given, each name replaced by its
    records sorted by IP (`expand`), so every rank sees the same list whatever order
    the resolver returns. A client starts on endpoint `start mod n` (the rank: ranks
    spread over replicas) and on failure moves to the next, wrapping around; after a
    whole turn the names are resolved again, so replicas that moved are found.

    The channel itself is the process's pooled one (`channel_pool.POOL`): clients of
    one process on the same endpoint share it, and `close()` only releases it.
    """

    def __init__(self, connection: Connection, start: int = 0) -> None:
        self.connection = connection
        self.addresses = connection.addresses
        self.security = connection.security
        self.start = start
        self._endpoints: list[Endpoint] = []
        self._turn = 0  # endpoints tried since the last resolve
        self._shared: SharedChannel | None = None
        self._lock = threading.Lock()
        self._closed = False
        # Whether any feeder ever answered: until then, a failure is a connect failure
        # (bounded by Timeouts.connect_timeout), after, an outage (bounded by Backoff).
        self.reached = False

    @property
    def current(self) -> str:
        if not self._endpoints:
            return self.addresses[self.start % len(self.addresses)]
        return self._endpoint().target

    def _endpoint(self) -> Endpoint:
        return self._endpoints[(self.start + self._turn) % len(self._endpoints)]

    @property
    def following(self) -> str:
        """Where the attempt after a `rotate()` goes (after a whole turn names are
        resolved again, so this is a guess then)."""
        if not self._endpoints:
            return self.addresses[(self.start + 1) % len(self.addresses)]
        return self._endpoints[(self.start + self._turn + 1) % len(self._endpoints)].target

    def stub(self) -> feeder_pb2_grpc.FeederStub:
        """The stub of the current endpoint's channel, acquiring it if needed."""
        return self._acquired().stub

    def stream_batches(self) -> grpc.UnaryStreamMultiCallable:
        """StreamBatches on the current endpoint's channel, its responses decoded by
        `responses.decode` (acquiring the channel if needed)."""
        return self._acquired().stream_batches

    def _acquired(self) -> SharedChannel:
        with self._lock:
            if self._closed:
                raise RuntimeError("the client is closed")
            if self._shared is None:
                if not self._endpoints:
                    self._resolve()
                ep = self._endpoint()
                opts = tuple(channel_options(self.connection.timeouts, ep, self.security))
                self._shared = POOL.acquire(ep.target, opts, self.security)
            return self._shared

    def _resolve(self) -> None:
        """(Re)resolve every address; names are looked up again each round, so
        replicas that moved are found."""
        endpoints: list[Endpoint] = []
        failed: list[str] = []
        for a in self.addresses:
            try:
                endpoints.extend(expand(a))
            except OSError as e:  # a name that does not resolve: try the others
                failed.append(f"{a} ({e})")
        if not endpoints:
            raise OSError(f"no address resolves: {', '.join(failed)}")
        if failed:
            log.warning("skipping feeder address(es) that do not resolve: %s", ", ".join(failed))
        self._endpoints = endpoints
        self._turn = 0

    def rotate(self) -> None:
        """Leave the current channel, retiring it from the pool (a failure was seen on
        it: clients whose streams on it are fine keep it); the next `stub()` takes the
        next endpoint's. After a whole turn, names are resolved again."""
        with self._lock:
            self._release(retire=True)
            if self._endpoints:
                self._turn += 1
                if self._turn >= len(self._endpoints):
                    # re-resolve on the next stub() and go on where the turn left off
                    self.start += self._turn
                    self._endpoints = []

    def _release(self, retire: bool = False) -> None:
        if self._shared is not None:
            POOL.release(self._shared, retire)
        self._shared = None

    def close(self) -> None:
        """Release the channel (closed if no other client holds it)."""
        with self._lock:
            self._closed = True
            self._release()
