"""Real feeders for tests: in process (its own event loop thread) or as a
`tokenfeed serve` subprocess.

    def test_x(feeder):                        # in-process server on 127.0.0.1:<free port>
        FeederClient(feeder.address, dataset="positions", ...)   # feeder.data_root holds it
        pb.StreamBatchesRequest(params=feeder_params(seq_len=16))  # raw requests for it

    with running_feeder(data_root, cache_bytes=1 << 20) as f:   # your own data / config
        ...f.address, f.port, f.server (the FeederServer), f.registry (its metrics)

    proc = FeederProcess(data_root, cache_bytes="1M")  # `tokenfeed serve` subprocess
    proc.address; proc.kill() (SIGKILL); proc.terminate() (SIGTERM drain, returns the
    exit code); proc.restart() (same port); proc.stop() (kill if running, always safe)

The in-process server runs on its own event loop in a daemon thread, so synchronous
test code (and the client's reader thread) can call it directly.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

FEEDER_DATASET = "positions"  # 10,000 tokens in chunks of 1,000 (uint32, token == position)


def feeder_params(**changes: object):  # -> pb.SamplingParams
    """SamplingParams over FEEDER_DATASET: train split of 0.9, 64-token windows at
    stride 48, batches of 4, one rank; `changes` set other fields."""
    from tokenfeed.v1 import feeder_pb2 as pb

    base = dict(
        dataset=FEEDER_DATASET,
        split="train",
        split_rate=0.9,
        seq_len=64,
        stride=48,
        batch_size=4,
        world_size=1,
    )
    return pb.SamplingParams(**(base | changes))


class InProcessFeeder:
    """A FeederServer on its own event loop thread; `.address` is "127.0.0.1:<port>"."""

    def __init__(self, data_root: Path, registry=None, open_store=None, **config) -> None:
        import asyncio
        import threading

        from prometheus_client import CollectorRegistry

        from tokenfeed.core.store import TokenStore
        from tokenfeed.server.app import create_server, new_event_loop
        from tokenfeed.server.config import ServerConfig

        # an s3:// root stays a string (Path() would fold "s3://b/p" into "s3:/b/p")
        self.data_root = data_root if str(data_root).startswith("s3://") else Path(data_root)
        self.registry = registry if registry is not None else CollectorRegistry()
        cfg = ServerConfig(data_root=self.data_root, **{"port": 0, "grace_seconds": 1.0, **config})
        self.server = create_server(cfg, self.registry, open_store=open_store or TokenStore.open)
        self.loop = new_event_loop()
        started = threading.Event()
        self._error: BaseException | None = None

        def main() -> None:
            asyncio.set_event_loop(self.loop)
            try:
                self.loop.run_until_complete(self.server.start())
            except BaseException as e:  # re-raised in the test thread
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


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A feeder's /metrics on `port`: every sample by (name, sorted labels)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


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
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
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
