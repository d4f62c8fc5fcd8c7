"""A small TCP fault proxy for tests: resets, delays and black holes on loopback.

    proxy = FaultProxy(("127.0.0.1", server_port)).start()
    client = FeederClient(proxy.address, ...)
    proxy.reset_after(200_000)   # RST the connection carrying the next 200 kB, mid-read
    proxy.blackhole()            # keep connections open, forward nothing
    proxy.reset_all()            # RST every open connection now
    proxy.heal()                 # back to a clean pass-through
    proxy.stop()

Threads, not asyncio, so it runs beside any event loop in the test process. Resets
are real RSTs (SO_LINGER 0), which is what a crashed peer or a middlebox looks like.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time


class FaultProxy:
    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self._listener = socket.create_server((host, 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._conns: list[tuple[socket.socket, socket.socket]] = []
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._mode = "pass"
        self._delay = 0.0
        self._reset_budget: int | None = None
        self.connections = 0  # accepted so far
        self.resets = 0  # connections reset by an injected fault

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> FaultProxy:
        self._spawn(self._accept_loop)  # _threads[0]; then one thread per connection
        return self

    # ---------------------------------------------------------------- faults
    def heal(self) -> None:
        with self._lock:
            self._mode, self._delay, self._reset_budget = "pass", 0.0, None

    def blackhole(self) -> None:
        """Accept and hold connections but forward nothing, in either direction."""
        with self._lock:
            self._mode = "blackhole"

    def delay(self, seconds: float) -> None:
        """Sleep this long before forwarding each downstream read."""
        with self._lock:
            self._delay = seconds

    def reset_after(self, nbytes: int) -> None:
        """RST the connection that carries the next `nbytes` downstream, mid-read (once)."""
        with self._lock:
            self._reset_budget = nbytes

    def reset_all(self) -> None:
        with self._lock:
            conns, self._conns = self._conns, []
        for pair in conns:
            self._reset(pair)

    def quiet(self) -> bool:
        """Every connection closed and its thread ended (the accept loop runs on)."""
        with self._lock:
            return not self._conns and not any(t.is_alive() for t in self._threads[1:])

    def stop(self) -> None:
        self._stop.set()
        self.reset_all()
        self._listener.close()
        for t in self._threads:
            t.join(timeout=5)

    # ------------------------------------------------------------- plumbing
    def _spawn(self, target, *args) -> None:
        t = threading.Thread(target=target, args=args, daemon=True, name="faultproxy")
        t.start()
        self._threads.append(t)

    def _reset(self, pair: tuple[socket.socket, socket.socket], injected: bool = True) -> None:
        self.resets += injected
        for s in pair:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.close()
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self._listener], [], [], 0.1)
            if not ready:
                continue
            try:
                down, _ = self._listener.accept()
                up = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                with contextlib.suppress(OSError, UnboundLocalError):
                    down.close()
                continue
            up.settimeout(None)
            pair = (down, up)
            with self._lock:
                self._conns.append(pair)
                self.connections += 1
            self._spawn(self._pump, pair)

    def _pump(self, pair: tuple[socket.socket, socket.socket]) -> None:
        down, up = pair
        try:
            while not self._stop.is_set():
                ready, _, _ = select.select([down, up], [], [], 0.1)
                with self._lock:
                    mode, delay = self._mode, self._delay
                if mode == "blackhole":  # forward nothing, without spinning on readable sockets
                    time.sleep(0.05)
                    continue
                for src in ready:
                    data = src.recv(65536)
                    if not data:
                        raise ConnectionError("closed")
                    dst = up if src is down else down
                    if src is up:
                        if delay:
                            time.sleep(delay)
                        if self._spend(len(data)):
                            dst.sendall(data[: len(data) // 2])  # die mid-message
                            raise ConnectionResetError("injected")
                    dst.sendall(data)
            injected = False
        except ConnectionResetError as e:
            injected = str(e) == "injected"
        except (OSError, ValueError, ConnectionError):
            injected = False
        with self._lock:
            if pair in self._conns:
                self._conns.remove(pair)
        self._reset(pair, injected)

    def _spend(self, nbytes: int) -> bool:
        with self._lock:
            if self._reset_budget is None:
                return False
            self._reset_budget -= nbytes
            if self._reset_budget > 0:
                return False
            self._reset_budget = None
            return True
