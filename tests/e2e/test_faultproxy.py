"""The fault proxy itself does what the fault tests rely on (echo server on loopback)."""

from __future__ import annotations

import socket
import threading

import pytest

from support.faultproxy import FaultProxy


@pytest.fixture
def echo():
    server = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except OSError:
                continue
            threading.Thread(target=_echo, args=(conn,), daemon=True).start()

    def _echo(conn: socket.socket) -> None:
        with conn:
            try:
                while data := conn.recv(65536):
                    conn.sendall(data)
            except OSError:  # the proxy resets us: that is the point
                pass

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield server.getsockname()[:2]
    stop.set()
    t.join()
    server.close()


def test_pass_reset_and_blackhole(echo) -> None:
    proxy = FaultProxy(echo).start()
    try:
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as s:
            s.sendall(b"hello")
            assert s.recv(100) == b"hello"
            proxy.reset_after(10)
            s.sendall(b"x" * 100)
            with pytest.raises((ConnectionResetError, TimeoutError, OSError)):  # noqa: PT012 - read until the error
                got = b""
                while len(got) < 100:
                    chunk = s.recv(100)
                    if not chunk:
                        raise ConnectionResetError("closed")
                    got += chunk
        assert proxy.resets == 1
        proxy.blackhole()
        with socket.create_connection((proxy.host, proxy.port), timeout=0.5) as s:
            s.sendall(b"anyone?")
            with pytest.raises(TimeoutError):
                s.recv(100)
        proxy.heal()
        with socket.create_connection((proxy.host, proxy.port), timeout=5) as s:
            s.sendall(b"back")
            assert s.recv(100) == b"back"
    finally:
        proxy.stop()
