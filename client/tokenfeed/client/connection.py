"""How to reach the feeder, as one value: addresses, TLS, a bearer token, timeouts, backoff.

Related settings are grouped in small frozen values, each checked when it is made, so
a bad one fails before any feeder is contacted:

    from tokenfeed.client import Backoff, Connection, FeederClient, Security, Timeouts

    feeders = Connection(
        "feeder-a:50051,feeder-b:50051",
        security=Security(root_certificates="ca.pem"),
        token=os.environ["FEEDER_TOKEN"],
        timeouts=Timeouts(connect_timeout=10),
        backoff=Backoff(deadline=600),
    )
    loader = FeederClient(connection=feeders, dataset="web", seq_len=2048, batch_size=8)

FeederClient's flat keywords (`tls=`, `root_certificates=`, `certificate_chain=`,
`private_key=`, `token=`, `timeouts=`, `backoff=`, and `connect_timeout=`, a
shorthand: `with_connect_timeout`) build the same value. An address is "host:port", a
comma-separated list of them, or a list; a name with several records stands for all
of them (`transport.expand`). What the settings mean on the wire: docs/serving.md,
"Auth and TLS" and "Several replicas"; how the client reconnects and when it gives
up: docs/client.md, "Reconnects and giving up".
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeAlias

from tokenfeed.client.checks import check_seconds, check_type, instance_or_default

# Timeouts.connect_timeout's default; `connect_timeout=` fills in a Timeouts left at it.
CONNECT_TIMEOUT = 30.0


# --------------------------------------------------------------------- addresses


def host_port(address: str) -> tuple[str, str]:
    """ "host:port" or "[v6]:port" -> (host, port), both as text."""
    host, _, port = address.rpartition(":")
    return host.strip("[]"), port


def split_addresses(address: str | Sequence[str]) -> list[str]:
    """ "a:1,b:2" or ["a:1", "b:2"] -> ["a:1", "b:2"] (order kept, blanks dropped)."""
    if not isinstance(address, str) and (
        not isinstance(address, Sequence) or not all(isinstance(a, str) for a in address)
    ):
        raise TypeError(
            "the feeder address must be 'host:port', a comma-separated string or a list of "
            f"them, got {address!r}"
        )
    parts = address.split(",") if isinstance(address, str) else list(address)
    out = [p.strip() for p in parts if p and p.strip()]
    if not out:
        raise ValueError(f"no feeder address in {address!r}")
    for a in out:
        host, port = host_port(a)
        if not host or not port.isdigit():
            raise ValueError(f"feeder address {a!r} is not host:port")
    return out


# ---------------------------------------------------------------------- settings


Pem: TypeAlias = bytes | str | os.PathLike[str]


def _pem(name: str, value: Any) -> bytes | None:
    """PEM given as bytes, or as the path of a file holding it (read now, once)."""
    if value is None or isinstance(value, bytes):
        return value
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"{name} must be PEM bytes or a path to a PEM file, got {value!r}")
    if not os.path.isfile(value):
        raise ValueError(f"{name}: no such file: {os.fspath(value)!r}")
    return Path(value).read_bytes()


@dataclass(frozen=True)
class Security:
    """TLS to the feeder, optionally mutual, matching `tokenfeed serve`'s --tls-cert,
    --tls-key and --tls-client-ca.

    PEM is given as bytes or as the path of a file holding it; a path is read when the
    value is made, so the fields hold bytes. `root_certificates` None trusts the
    system's roots; `certificate_chain` and `private_key` (the client's, for mutual
    TLS) go together. Giving any certificate turns `tls` on.
    """

    tls: bool = False
    root_certificates: Pem | None = None
    certificate_chain: Pem | None = None  # the client's certificate (mutual TLS)
    private_key: Pem | None = None

    def __post_init__(self) -> None:
        check_type("tls", self.tls, bool, "True or False")
        for name in ("root_certificates", "certificate_chain", "private_key"):
            object.__setattr__(self, name, _pem(name, getattr(self, name)))
        if (self.certificate_chain is None) != (self.private_key is None):
            raise ValueError("certificate_chain and private_key go together (mutual TLS)")
        if self.root_certificates or self.certificate_chain:
            object.__setattr__(self, "tls", True)


@dataclass(frozen=True)
class Timeouts:
    """Seconds. `connect_timeout` bounds how long a client that has never reached a
    feeder keeps trying (every address, with backoff) before it raises
    FeederUnavailable: a wrong address or a TLS mismatch fails fast. Once a feeder
    answered, reconnects follow `Backoff` (minutes). `attempt_timeout` bounds one
    attempt to reach an address that does not answer at all (gRPC's own is 20 s).
    Keepalive pings detect a black-holed connection while a stream waits for data: no
    ack within `keepalive_timeout` after a ping closes the transport, the stream fails
    with UNAVAILABLE and the client reconnects elsewhere. `rpc_timeout` bounds a unary
    call (Info)."""

    keepalive_time: float = 20.0
    keepalive_timeout: float = 10.0
    connect_timeout: float = CONNECT_TIMEOUT
    attempt_timeout: float = 10.0
    rpc_timeout: float = 30.0

    def __post_init__(self) -> None:
        for name in (
            "keepalive_time",
            "keepalive_timeout",
            "connect_timeout",
            "attempt_timeout",
            "rpc_timeout",
        ):
            check_seconds(f"Timeouts.{name}", getattr(self, name))


@dataclass(frozen=True)
class Backoff:
    """Bounded exponential backoff with jitter between reconnect attempts.

    Attempt n (0-based) waits a random time in [(1 - jitter) * d, d] with
    d = min(maximum, initial * multiplier**n): spread out so a restarted feeder is not
    hit by every trainer in the same millisecond. The client gives up, raising
    `FeederUnavailable`, after `max_retries` consecutive failed attempts (None: no
    count limit) or `deadline` seconds since the first failure of an outage (None: no
    time limit); a batch received ends the outage and resets both.
    """

    initial: float = 0.1
    maximum: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5
    max_retries: int | None = None
    deadline: float | None = 120.0

    def __post_init__(self) -> None:
        if not (0 <= self.initial <= self.maximum and self.multiplier >= 1):
            raise ValueError(f"bad backoff: need 0 <= initial <= maximum, multiplier >= 1: {self}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"backoff jitter must be in [0, 1], got {self.jitter}")
        if self.max_retries is None and self.deadline is None:
            raise ValueError("backoff needs max_retries or deadline: retries must be bounded")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        d = min(self.maximum, self.initial * self.multiplier ** min(attempt, 64))
        u = (rng or random).random()
        return d * (1 - self.jitter * u)

    def exhausted(self, failures: int, outage_seconds: float) -> bool:
        return (self.max_retries is not None and failures > self.max_retries) or (
            self.deadline is not None and outage_seconds > self.deadline
        )


@dataclass(frozen=True, init=False)
class Connection:
    """Where the feeders are and how to reach them: the addresses (in order), TLS,
    the bearer token (sent as `authorization: Bearer <token>`), the timeouts and the
    reconnect backoff. `addresses` takes "host:port", a comma-separated string or a
    list, and holds the split tuple."""

    addresses: tuple[str, ...]
    security: Security
    token: str | None
    timeouts: Timeouts
    backoff: Backoff

    def __init__(
        self,
        addresses: str | Sequence[str],
        *,
        security: Security | None = None,
        token: str | None = None,
        timeouts: Timeouts | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        set_ = object.__setattr__
        set_(self, "addresses", tuple(split_addresses(addresses)))
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise TypeError(f"token must be a non-empty string or None, got {token!r}")
        set_(self, "security", instance_or_default("security", security, Security))
        set_(self, "token", token.strip() if token else None)
        set_(self, "timeouts", instance_or_default("timeouts", timeouts, Timeouts))
        set_(self, "backoff", instance_or_default("backoff", backoff, Backoff))

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call sends: the bearer token, if any."""
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()


def with_connect_timeout(timeouts: Timeouts | None, connect_timeout: float | None) -> Timeouts:
    """`timeouts` with FeederClient's `connect_timeout=`, a shorthand for
    `Timeouts.connect_timeout`: it fills in a `timeouts` that is None or leaves
    connect_timeout at its default (30 s), and must agree with one that sets another."""
    timeouts = instance_or_default("timeouts", timeouts, Timeouts)
    if connect_timeout is None:
        return timeouts
    check_seconds("connect_timeout", connect_timeout)
    if timeouts.connect_timeout not in (CONNECT_TIMEOUT, connect_timeout):
        raise ValueError(
            f"connect_timeout={connect_timeout!r} disagrees with timeouts="
            f"Timeouts(connect_timeout={timeouts.connect_timeout!r}): give it once "
            "(connect_timeout= is a shorthand for Timeouts.connect_timeout)"
        )
    return replace(timeouts, connect_timeout=float(connect_timeout))


def alone(connection: Connection, **keywords: Any) -> Connection:
    """`connection=`, checked, when FeederClient's address and flat connection
    `keywords` were left unset (they describe a Connection too: giving both is an
    error)."""
    check_type("connection", connection, Connection, "a Connection")
    given = [name for name, value in keywords.items() if value is not None and value is not False]
    if given:
        raise TypeError(
            f"FeederClient takes connection= or the address and the connection keywords "
            f"({', '.join(given)}), not both: set them on the Connection"
        )
    return connection
