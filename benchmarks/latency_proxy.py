"""A TCP proxy that adds a fixed latency to every request and copies nothing in Python.

    python benchmarks/latency_proxy.py UPSTREAM_PORT [--latency 0.020]
    # prints its own endpoint (http://127.0.0.1:PORT) on stdout, then serves until killed

For benchmarks against an S3 server on this machine (SeaweedFS): a far-away object
store answers every request some tens of milliseconds late, and the feeder's read-ahead
has to hide that. The proxy models exactly that and nothing else:

* each request is held for `latency` seconds before it goes upstream: the first bytes
  a client sends after the last response bytes it was given (or on a new connection)
  start a request; HTTP/1.1 keep-alive clients (obstore, boto3) send one request at a
  time per connection, so this is once per request;
* every byte, both ways, moves with `os.splice` through a pipe: socket -> pipe ->
  socket inside the kernel, so the proxy costs a few system calls per MiB, not a
  Python copy of every byte (the fault proxy in tests/support/s3faultproxy.py parses HTTP and
  copies in Python; it is for correctness tests, and on a 2-core machine it measured
  itself rather than the feeder: 0.41x with no latency at all).

Why not the kernel (`tc qdisc ... netem delay` on a veth pair into a network namespace
of our own): the benchmark machine's kernel has no netem (nor fq); `tc` there knows
only tbf, htb and pfifo, which shape rate, not delay. What this proxy does not model:
a real link's bandwidth (bytes after the first flow at loopback speed) and the extra
round trip of opening a TCP connection (the client keeps connections open, so it is
rare).

Two threads per connection, one per direction; stdlib only.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import socket
import sys
import threading
import time

PIPE_BYTES = 1 << 20
F_SETPIPE_SZ = getattr(fcntl, "F_SETPIPE_SZ", 1031)


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket, latency: float) -> None:
        self.client, self.upstream, self.latency = client, upstream, latency
        self.fresh = True  # the next bytes from the client start a new request
        self.requests = 0

    def pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        r, w = os.pipe()
        try:
            with contextlib.suppress(OSError):  # a smaller pipe only costs more system calls
                fcntl.fcntl(w, F_SETPIPE_SZ, PIPE_BYTES)
            s, d = src.fileno(), dst.fileno()
            while True:
                n = os.splice(s, w, PIPE_BYTES)  # blocks until bytes arrive
                if n == 0:
                    break
                if requests:
                    if self.fresh:
                        self.fresh = False
                        self.requests += 1
                        time.sleep(self.latency)
                else:
                    # before the bytes reach the client, so its next request is "fresh"
                    self.fresh = True
                while n:
                    n -= os.splice(r, d, n)
        except OSError:
            pass  # a reset on either side: end this direction
        finally:
            os.close(r)
            os.close(w)
            for sock, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
                with contextlib.suppress(OSError):
                    sock.shutdown(how)


def serve(upstream_port: int, latency: float, host: str = "127.0.0.1") -> None:
    listener = socket.create_server((host, 0), backlog=128)
    print(f"http://{host}:{listener.getsockname()[1]}", flush=True)
    while True:
        client, _ = listener.accept()
        try:
            upstream = socket.create_connection((host, upstream_port))
        except OSError:
            client.close()
            continue
        for s in (client, upstream):
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = _Conn(client, upstream, latency)
        threads = [
            threading.Thread(target=conn.pump, args=(client, upstream, True), daemon=True),
            threading.Thread(target=conn.pump, args=(upstream, client, False), daemon=True),
        ]
        for t in threads:
            t.start()
        threading.Thread(target=_close_after, args=(threads, conn), daemon=True).start()


def _close_after(threads: list[threading.Thread], conn: _Conn) -> None:
    for t in threads:
        t.join()
    conn.client.close()
    conn.upstream.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("upstream_port", type=int)
    ap.add_argument("--latency", type=float, default=0.020, help="seconds per request")
    args = ap.parse_args()
    serve(args.upstream_port, args.latency)
    return 0


if __name__ == "__main__":
    sys.exit(main())
