"""An HTTP/1.1 fault proxy for S3 tests: latency, 503 SlowDown, resets and cut bodies.

    proxy = S3FaultProxy(("127.0.0.1", s3_port), seed=1).start()
    endpoint = proxy.endpoint              # point the S3 client here
    proxy.configure(latency=0.02, slowdown=0.2, reset=0.2)   # shares of requests
    proxy.fail_next(3, "reset")            # the next 3 matching requests fail, then pass
    proxy.stop()

It parses just enough HTTP/1.1 to know where each request and response ends
(Content-Length, chunked, HEAD/204/304 without a body, read-until-close), so
keep-alive connections carry many requests and every fault hits one request:

* latency: sleep before forwarding each request (a far-away object store);
* slowdown: answer 503 with an S3 `SlowDown` XML body without asking upstream (the
  request body is read first so the connection stays in sync);
* reset: forward the request, send the response head and part of its body, then RST
  the client connection (SO_LINGER 0): a connection reset mid-body (a response with no
  body, HEAD's, is cut inside its head instead);
* truncate: like reset but a clean FIN: a body cut short of its Content-Length;
* stall: send the response head and part of the body, then nothing for `stall_seconds`
  (a read timeout), then close.

Faults apply only to requests whose method is in `methods` (default GET, HEAD, the
reads; PUTs pass clean unless asked). Random faults use `random.Random(seed)`: the
sequence of decisions is fixed, which requests get them depends on request order.
Counters (`requests`, `methods_seen[method]`, `faults[kind]`) let tests check the faults
really happened, and count a client's requests.

asyncio on its own thread, so it runs beside any client (sync or async) in a test.
The signature is computed by the client over the Host header it sends; the proxy
forwards bytes unchanged, so SigV4 still verifies upstream.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import random
import socket
import struct
import termios
import threading
import time
from collections import Counter
from collections.abc import Iterable

log = logging.getLogger(__name__)

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>faultproxy</RequestId></Error>"
)
KINDS = ("slowdown", "reset", "truncate", "stall")
_MAX_HEAD = 64 * 1024


class _Head:
    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        lines = raw.decode("latin-1").split("\r\n")
        self.start = lines[0]
        self.headers: dict[str, str] = {}
        for line in lines[1:]:
            if ":" in line:
                k, v = line.split(":", 1)
                self.headers[k.strip().lower()] = v.strip()

    def content_length(self) -> int | None:
        v = self.headers.get("content-length")
        return None if v is None else int(v)

    def chunked(self) -> bool:
        return "chunked" in self.headers.get("transfer-encoding", "").lower()

    def wants_close(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


class S3FaultProxy:
    def __init__(
        self,
        upstream: tuple[str, int],
        *,
        host: str = "127.0.0.1",
        seed: int = 0,
        methods: Iterable[str] = ("GET", "HEAD"),
    ) -> None:
        self.upstream = upstream
        self.host = host
        self.port = 0
        self.methods = {m.upper() for m in methods}
        self.latency = 0.0
        self.shares = dict.fromkeys(KINDS, 0.0)
        self.stall_seconds = 30.0
        self.cut_fraction = 0.5  # how much of a body passes before a reset/truncate/stall
        self._rng = random.Random(seed)
        self._queued: list[str] = []
        self._lock = threading.Lock()
        self.requests = 0
        self.methods_seen: Counter[str] = Counter()
        self.faults: Counter[str] = Counter()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.base_events.Server | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    # --------------------------------------------------------------- control
    def configure(self, *, latency: float | None = None, **shares: float) -> None:
        """Set the latency (seconds per request) and/or the share of each fault kind."""
        with self._lock:
            if latency is not None:
                self.latency = latency
            for kind, share in shares.items():
                if kind not in self.shares:
                    raise ValueError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
                self.shares[kind] = share
            if sum(self.shares.values()) > 1:
                raise ValueError(f"fault shares add up to more than 1: {self.shares}")

    def fail_next(self, n: int, kind: str) -> None:
        """The next `n` matching requests get fault `kind`, whatever the shares say."""
        if kind not in KINDS:
            raise ValueError(f"unknown fault {kind!r}; known: {', '.join(KINDS)}")
        with self._lock:
            self._queued.extend([kind] * n)

    def heal(self) -> None:
        with self._lock:
            self.latency = 0.0
            self.shares = dict.fromkeys(KINDS, 0.0)
            self._queued.clear()

    def _decide(self, method: str) -> tuple[str | None, float]:
        with self._lock:
            self.requests += 1
            self.methods_seen[method] += 1
            if method not in self.methods:
                return None, self.latency
            if self._queued:
                kind: str | None = self._queued.pop(0)
            else:
                kind = None
                x = self._rng.random()
                for k in KINDS:
                    if x < self.shares[k]:
                        kind = k
                        break
                    x -= self.shares[k]
            if kind is not None:
                self.faults[kind] += 1
            return kind, self.latency

    # ------------------------------------------------------------- lifecycle
    def start(self) -> S3FaultProxy:
        self._thread = threading.Thread(target=self._run, name="s3faultproxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("fault proxy did not start")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)

        async def boot() -> None:
            self._server = await asyncio.start_server(self._serve, self.host, 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        loop.run_until_complete(boot())
        loop.run_forever()
        loop.close()

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return

        async def shutdown() -> None:
            assert self._server is not None
            self._server.close()
            for w in list(self._writers):
                w.transport.abort()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(shutdown(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        assert self._thread is not None
        self._thread.join(10)
        self._loop = None

    def __enter__(self) -> S3FaultProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------- plumbing
    async def _serve(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self._writers.add(down_w)
        up_w: asyncio.StreamWriter | None = None
        try:
            up_r, up_w = await asyncio.open_connection(*self.upstream)
            self._writers.add(up_w)
            while True:
                try:
                    raw = await down_r.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                    return  # client closed between requests
                if b"100-continue" in raw.lower():  # answer it here; upstream sees a plain PUT
                    raw = b"".join(
                        line
                        for line in raw.splitlines(keepends=True)
                        if not line.lower().startswith(b"expect:")
                    )
                    down_w.write(b"HTTP/1.1 100 Continue\r\n\r\n")
                req = _Head(raw)
                method = req.start.split(" ", 1)[0].upper()
                kind, latency = self._decide(method)
                if latency:
                    await asyncio.sleep(latency)
                if kind == "slowdown":
                    await _drain_body(down_r, req, None)
                    down_w.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\nRetry-After: 0\r\n\r\n"
                        % len(SLOWDOWN_BODY)
                        + (b"" if method == "HEAD" else SLOWDOWN_BODY)
                    )
                    await down_w.drain()
                    continue
                up_w.write(raw)
                await _copy_body(down_r, up_w, req)
                await up_w.drain()
                resp_raw = await up_r.readuntil(b"\r\n\r\n")
                resp = _Head(resp_raw)
                status = int(resp.start.split(" ", 2)[1])
                if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
                    if kind in ("reset", "truncate", "stall"):  # no body: cut the head
                        down_w.write(resp_raw[: len(resp_raw) // 2])
                        await down_w.drain()
                        await self._break(down_w, kind)
                        return
                    down_w.write(resp_raw)
                    await down_w.drain()
                    continue
                down_w.write(resp_raw)
                if kind in ("reset", "truncate", "stall"):
                    n = resp.content_length()
                    budget = max(1, int((n if n is not None else 1 << 16) * self.cut_fraction))
                    await _copy_body(up_r, down_w, resp, limit=budget)
                    await down_w.drain()
                    await self._break(down_w, kind)
                    return
                closed = await _copy_body(up_r, down_w, resp)
                await down_w.drain()
                if closed or resp.wants_close() or req.wants_close():
                    return
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            log.debug("fault proxy connection ended: %r", e)
        except asyncio.CancelledError:  # stop(): end quietly (the server callback
            pass  # reports a cancelled handler task as an error)
        finally:
            for w in (down_w, up_w):
                if w is not None:
                    self._writers.discard(w)
                    w.close()

    async def _break(self, w: asyncio.StreamWriter, kind: str) -> None:
        if kind == "stall":
            await asyncio.sleep(self.stall_seconds)
            w.close()
        elif kind == "truncate":
            w.close()
        else:  # reset: RST, not FIN
            sock = w.get_extra_info("socket")
            await _delivered(w)  # an RST drops what the peer has not acknowledged
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            w.transport.abort()


async def _delivered(w: asyncio.StreamWriter) -> None:
    """Until the peer has acknowledged every byte written to `w` (5 s at most: a peer
    that stopped reading gets its reset anyway)."""
    sock = w.get_extra_info("socket")

    def unacknowledged() -> int:  # in asyncio's buffer, then in the kernel's send queue
        queued = w.transport.get_write_buffer_size()
        if sock is not None:
            raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4)
            queued += struct.unpack("i", raw)[0]
        return queued

    deadline = time.monotonic() + 5.0
    while unacknowledged() and time.monotonic() < deadline:
        await asyncio.sleep(0.001)


async def _drain_body(r: asyncio.StreamReader, head: _Head, w: asyncio.StreamWriter | None) -> None:
    await _copy_body(r, w, head)


async def _copy_body(
    r: asyncio.StreamReader, w: asyncio.StreamWriter | None, head: _Head, limit: int | None = None
) -> bool:
    """Copy one message body from r to w (or discard it); True if it ran to EOF.

    `limit` stops after that many body bytes (a fault); framing is then left broken.
    """
    left = limit

    def emit(data: bytes) -> bool:
        nonlocal left
        if left is not None:
            data = data[:left]
            left -= len(data)
        if w is not None and data:
            w.write(data)
        return left is not None and left <= 0

    async def copy(n: int) -> bool:
        """Copy the next `n` bytes; True if the limit ran out first."""
        while n:
            data = await r.read(min(n, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", n)
            n -= len(data)
            if emit(data):
                return True
            if w is not None:
                await w.drain()
        return False

    if head.chunked():
        while True:
            line = await r.readuntil(b"\r\n")
            if emit(line):
                return False
            size = int(line.split(b";", 1)[0].strip(), 16)
            if size == 0:  # trailers, then an empty line
                while True:
                    t = await r.readuntil(b"\r\n")
                    if emit(t) or t == b"\r\n":
                        return False
            if await copy(size + 2):  # data + CRLF
                return False
    n = head.content_length()
    if n is None:
        if head.start.startswith("HTTP/"):  # a response with no length: until close
            while data := await r.read(1 << 16):
                if emit(data):
                    return False
                if w is not None:
                    await w.drain()
            return True
        return False  # a request with no body
    await copy(n)
    return False
