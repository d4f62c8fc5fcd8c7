"""Connection and its parts (Security, Timeouts, Backoff, addresses) on their own, then
FeederClient(connection=...) against a real feeder on loopback."""

from __future__ import annotations

import dataclasses
import random
import socket
from pathlib import Path

import pytest

from tokenfeed.client import Backoff, Connection, FeederClient, Security, Timeouts
from tokenfeed.client.connection import alone, split_addresses, with_connect_timeout

from support.feeders import FEEDER_DATASET, running_feeder

KW = {"dataset": FEEDER_DATASET, "seq_len": 16, "batch_size": 4, "rank": 0, "world_size": 1}

# ----------------------------------------------------------------------------- backoff


def test_backoff_grows_is_capped_and_jittered() -> None:
    b = Backoff(initial=0.1, maximum=1.0, multiplier=2.0, jitter=0.5, deadline=10)
    rng = random.Random(0)
    for attempt, top in enumerate([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]):
        delays = [b.delay(attempt, rng) for _ in range(200)]
        assert all(top / 2 <= d <= top for d in delays)
        assert max(delays) - min(delays) > top / 4  # really spread out
    assert Backoff(jitter=0.0, initial=0.3, maximum=0.3, deadline=1).delay(5) == 0.3


def test_backoff_is_bounded() -> None:
    b = Backoff(max_retries=3, deadline=None)
    assert not b.exhausted(3, 1e9)
    assert b.exhausted(4, 0)
    d = Backoff(max_retries=None, deadline=5.0)
    assert not d.exhausted(10**6, 4.9)
    assert d.exhausted(1, 5.1)
    with pytest.raises(ValueError, match="bounded"):
        Backoff(max_retries=None, deadline=None)
    with pytest.raises(ValueError, match="initial <= maximum"):
        Backoff(initial=2.0, maximum=1.0)


# --------------------------------------------------------------------------- addresses


def test_addresses_from_string_list_and_commas() -> None:
    assert split_addresses("a:1") == ["a:1"]
    assert split_addresses(" a:1, b:2 ,") == ["a:1", "b:2"]
    assert split_addresses(["a:1", "[::1]:3"]) == ["a:1", "[::1]:3"]
    for bad in ("", "nohost", "a:b", [","]):
        with pytest.raises(ValueError, match=r"no feeder address|is not host:port"):
            split_addresses(bad)
    for wrong in (None, 50051, ["a:1", 2]):
        with pytest.raises(TypeError, match="address"):
            split_addresses(wrong)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- security


def test_security_reads_pem_paths_once_and_certificates_turn_tls_on(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"CA PEM")
    s = Security(root_certificates=str(ca))
    assert s.tls
    assert s.root_certificates == b"CA PEM"
    ca.write_bytes(b"changed")  # read when made, not when dialled
    assert s.root_certificates == b"CA PEM"
    assert Security(root_certificates=ca) != s
    mutual = Security(certificate_chain=b"chain", private_key=b"key")
    assert mutual.tls
    assert mutual.root_certificates is None
    assert not Security().tls
    assert Security(tls=True).tls
    assert Security(root_certificates=b"x") == Security(tls=True, root_certificates=b"x")


@pytest.mark.parametrize(
    ("kw", "error", "names"),
    [
        ({"tls": "yes"}, TypeError, "tls"),
        ({"root_certificates": 3}, TypeError, "root_certificates"),
        ({"root_certificates": "/nonexistent/ca.pem"}, ValueError, "root_certificates"),
        ({"certificate_chain": b"pem"}, ValueError, "private_key"),
        ({"private_key": b"pem"}, ValueError, "certificate_chain"),
    ],
)
def test_security_refuses_what_cannot_be_tls(kw: dict, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        Security(**kw)


# -------------------------------------------------------------------------- connection


def test_a_connection_is_one_frozen_value_with_the_defaults() -> None:
    c = Connection(" a:1, b:2 ", token=" s3cret\n")
    assert c.addresses == ("a:1", "b:2")
    assert c.token == "s3cret"
    assert c.metadata == (("authorization", "Bearer s3cret"),)
    assert (c.security, c.timeouts, c.backoff) == (Security(), Timeouts(), Backoff())
    assert Connection(["a:1", "b:2"], token="s3cret") == c  # one value, however spelled
    assert hash(Connection("a:1")) == hash(Connection(["a:1"]))
    assert Connection("a:1").metadata == ()
    later = dataclasses.replace(c, timeouts=Timeouts(connect_timeout=5))
    assert later.timeouts.connect_timeout == 5
    assert later.addresses == c.addresses
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.token = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kw", "error", "names"),
    [
        ({"addresses": ""}, ValueError, "address"),
        ({"addresses": ["a:1", 2]}, TypeError, "address"),
        ({"token": ""}, TypeError, "token"),
        ({"token": 5}, TypeError, "token"),
        ({"security": {"tls": True}}, TypeError, "security"),
        ({"timeouts": 5}, TypeError, "timeouts"),
        ({"backoff": {"initial": 1}}, TypeError, "backoff"),
    ],
)
def test_a_connection_checks_every_setting(kw: dict, error: type, names: str) -> None:
    with pytest.raises(error, match=names):
        Connection(**{"addresses": "a:1", **kw})


def test_the_flat_keywords_build_the_same_connection(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"CA PEM")
    backoff = Backoff(deadline=600)
    with FeederClient(
        "a:1,b:2", root_certificates=ca, token="t", backoff=backoff, connect_timeout=5, **KW
    ) as flat:
        assert flat.connection == Connection(
            ["a:1", "b:2"],
            security=Security(tls=True, root_certificates=b"CA PEM"),
            token="t",
            timeouts=Timeouts(connect_timeout=5.0),
            backoff=backoff,
        )
    with FeederClient("a:1", **KW) as plain:
        assert plain.connection == Connection("a:1")


def test_connect_timeout_is_a_shorthand_that_must_agree_with_timeouts() -> None:
    quick = Timeouts(keepalive_time=1.0)
    # fills in a Timeouts that leaves connect_timeout at its default
    assert with_connect_timeout(quick, 5) == Timeouts(keepalive_time=1.0, connect_timeout=5.0)
    assert with_connect_timeout(None, 5) == Timeouts(connect_timeout=5.0)
    assert with_connect_timeout(quick, None) is quick
    assert with_connect_timeout(None, None) == Timeouts()
    same = Timeouts(connect_timeout=5.0)
    assert with_connect_timeout(same, 5) == same
    with pytest.raises(ValueError, match=r"connect_timeout=5 disagrees with .*connect_timeout=2"):
        with_connect_timeout(Timeouts(connect_timeout=2), 5)
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(ValueError, match="connect_timeout"):
            with_connect_timeout(None, bad)
    with pytest.raises(TypeError, match="timeouts"):
        with_connect_timeout(5, None)  # type: ignore[arg-type]


def test_a_client_takes_a_connection_or_the_flat_keywords_not_both() -> None:
    c = Connection("a:1")
    assert alone(c, address=None, token=None, tls=False) is c
    with pytest.raises(TypeError, match=r"\(address\), not both"):
        alone(c, address="a:1")
    with pytest.raises(TypeError, match=r"\(tls, token\), not both"):
        alone(c, tls=True, token="t", backoff=None)
    with pytest.raises(TypeError, match="a Connection"):
        alone("a:1")  # type: ignore[arg-type]


# ------------------------------------------------------------- against a real feeder


def test_a_connection_reaches_the_feeder_like_the_flat_keywords(feeder_root: Path) -> None:
    secret = feeder_root / "token"
    secret.write_text("s3cret\n")
    with running_feeder(feeder_root, auth_token_file=secret) as f:
        backoff = Backoff(initial=0.01, deadline=30)
        conn = Connection(f.address, token="s3cret", backoff=backoff)
        with FeederClient(connection=conn, **KW) as a:
            assert a.connection is conn
            assert a.backoff is backoff
            starts = [s for b in a for s in b["starts"].tolist()]
        with FeederClient(f.address, token="s3cret", backoff=backoff, **KW) as b:
            assert b.connection == conn
            assert [s for batch in b for s in batch["starts"].tolist()] == starts
    assert len(starts) == len(set(starts)) > 0


def test_connection_conflicts_are_refused_before_any_contact() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.setblocking(False)
        address = f"127.0.0.1:{listener.getsockname()[1]}"
        conn = Connection(address)
        for kw in ({"token": "t"}, {"connect_timeout": 5}, {"timeouts": Timeouts()}):
            with pytest.raises(TypeError, match="not both"):
                FeederClient(connection=conn, **kw, **KW)
        with pytest.raises(TypeError, match="not both"):
            FeederClient(address, connection=conn, **KW)
        with pytest.raises(TypeError, match="address"):
            FeederClient(**KW)
        with pytest.raises(TypeError, match="a Connection"):
            FeederClient(connection=address, **KW)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="disagrees"):
            FeederClient(address, timeouts=Timeouts(connect_timeout=1), connect_timeout=2, **KW)
        with pytest.raises(BlockingIOError):
            listener.accept()  # nothing connected
