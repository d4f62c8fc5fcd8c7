"""One feeder in this process: a FeederServer assembled from its config, and served.

`create_server(config)` builds everything without binding (tests pass `port=0` and
their own registry): the catalog of stores, the chunk cache, the servicer, health,
reflection, auth and TLS; `FeederServer.start()` binds and serves; `drain()` is the
graceful stop (health NOT_SERVING, no new streams, open ones get `grace_seconds`).
`serve(config)` runs one until SIGTERM/SIGINT, then drains: the single-process
`tokenfeed serve` (main.py) and each worker process of `--workers N` (worker.py).
SIGHUP, or a change to their files, reloads the TLS certificate, key and client CA and
the jobs (credentials.py), all or nothing; SIGUSR1 dumps what every thread and stream
waits for (stacks.py). Auth and TLS, limits: docs/serving.md; jobs, rotation and the
status page: docs/tenants.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIServer

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from tokenfeed.core.atomic import write_atomic
from tokenfeed.core.errors import FeederError
from tokenfeed.core.limits import MAX_REQUEST_BYTES
from tokenfeed.core.store import TokenStore
from tokenfeed.core.store.objects import GET_BUFFER_BYTES, is_url
from tokenfeed.server.access import Access
from tokenfeed.server.cache import ChunkCache
from tokenfeed.server.config import ServerConfig
from tokenfeed.server.credentials import Credentials, CredentialWatcher, load_credentials
from tokenfeed.server.datasets import Catalog
from tokenfeed.server.metrics import ServerMetrics
from tokenfeed.server.service import SERVICE_NAME, FeederService
from tokenfeed.server.stacks import dump_on_signal
from tokenfeed.server.status import serve_http
from tokenfeed.v1 import feeder_pb2

log = logging.getLogger("tokenfeed.server")

HEALTH_SERVICE = "grpc.health.v1.Health"
# Chunk loads in flight at once. From a local disk a load takes milliseconds of CPU
# (reading, checksum): more threads would take cores from assembly. From object storage
# a load mostly waits tens of ms for its GET, the GIL released: 8 keep a shuffle group's
# chunks (8 blocks by default) loading together.
READAHEAD_THREADS_LOCAL = 2
READAHEAD_THREADS_REMOTE = 8
MALLOC_ARENAS_REMOTE = 2
_M_ARENA_MAX = -8  # glibc's mallopt parameter


def _fewer_malloc_arenas() -> None:
    """At most MALLOC_ARENAS_REMOTE malloc arenas (glibc), unless MALLOC_ARENA_MAX is set.

    glibc gives each thread that allocates its own arena (up to 8 per core), and an
    arena keeps the pages of what was freed in it. A feeder on object storage has 8
    read-ahead threads and the S3 client's runtime threads, each allocating a GET's
    buffers, so its heap would grow by an arena's leftovers per thread; with 2 arenas
    they share, and since those threads mostly wait on the network, sharing costs no
    throughput (benchmarks/store_sources.py shows both). Elsewhere (musl, macOS) this
    does nothing.
    """
    if "MALLOC_ARENA_MAX" in os.environ:
        return
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_ARENA_MAX, MALLOC_ARENAS_REMOTE)


class TokenAuth(grpc.aio.ServerInterceptor):  # type: ignore[misc]  # grpc is untyped
    """Calls to services other than the Feeder's must carry a token the feeder knows
    (server reflection): the Feeder's servicer checks its own calls, so it can record
    a refusal and check the job's grant.

    The health service is exempt so orchestrator probes (Kubernetes gRPC probes send
    no metadata) keep working; it reveals nothing but "serving".
    """

    def __init__(self, access: Access, metrics: ServerMetrics) -> None:
        self._access = access
        self._metrics = metrics

    async def intercept_service(self, continuation: Any, details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(
            (f"/{HEALTH_SERVICE}/", f"/{SERVICE_NAME}/")
        ):
            return handler
        try:
            self._access.job(details.invocation_metadata)
            return handler
        except FeederError as e:
            error = e
        metrics = self._metrics

        async def reject(request: Any, context: grpc.aio.ServicerContext) -> None:
            metrics.errors.labels(code=error.code).inc()
            await context.abort(getattr(grpc.StatusCode, error.code), error.message)

        kind = (handler.request_streaming, handler.response_streaming)
        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[kind]
        return make(
            reject,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def server_options(max_batch_bytes: int, reuse_port: bool) -> list[tuple[str, int]]:
    """The gRPC server options of a feeder (benchmarks/servers/grpc_floor.py serves with
    them too, to be gRPC's floor under the same settings)."""
    return [
        ("grpc.max_send_message_length", max_batch_bytes + (1 << 20)),
        ("grpc.max_receive_message_length", MAX_REQUEST_BYTES),
        # a second feeder on a busy port must fail, except the worker processes of one
        # `--workers N` feeder, which share it
        ("grpc.so_reuseport", 1 if reuse_port else 0),
        # Accept the clients' keepalive pings (every 20 s, also while a slow trainer's
        # stream is paused by flow control) instead of a GOAWAY.
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


class FeederServer:
    """One feeder: the gRPC server and everything it owns.

    `open_store` and `reuse_port` are for the worker processes of `--workers N`
    (worker.py): stores whose chunks map the page cache, and SO_REUSEPORT so N servers
    share the port. Otherwise SO_REUSEPORT stays off, so a second feeder started on a
    busy port fails instead of quietly splitting its clients.
    """

    def __init__(
        self,
        config: ServerConfig,
        registry: CollectorRegistry | None = None,
        *,
        open_store: Callable[[Path], TokenStore] = TokenStore.open,
        reuse_port: bool = False,
    ) -> None:
        self.config = config
        self.reuse_port = reuse_port
        self.registry = registry if registry is not None else CollectorRegistry()
        self.metrics = ServerMetrics(self.registry)
        # Read and checked before anything starts: a bad file fails the start (exit 2).
        self.credentials = load_credentials(config)
        self._served_tls = self.credentials.tls
        if is_url(config.data_root):
            _fewer_malloc_arenas()  # before the object storage client's threads start
        # First: an s3:// root is listed here, so bad credentials fail before anything starts.
        self.catalog = Catalog(config.data_root, open_store)
        # Object storage: more chunk loads in flight, each GET's buffers counted with its
        # chunk while it loads.
        remote = self.catalog.remote
        self.cache = ChunkCache(
            config.cache_bytes,
            self.metrics,
            readahead_threads=READAHEAD_THREADS_REMOTE if remote else READAHEAD_THREADS_LOCAL,
            readahead_bytes=config.readahead_budget,
            load_overhead=GET_BUFFER_BYTES if remote else 0,
        )
        self.executor = ThreadPoolExecutor(
            config.num_assembly_threads, thread_name_prefix="tokenfeed-batch"
        )
        self.service = FeederService(
            self.catalog,
            self.cache,
            self.metrics,
            self.executor,
            max_streams=config.max_streams,
            max_batch_bytes=config.max_batch_bytes,
            tenants=self.credentials.tenants,
        )
        self.watcher = CredentialWatcher(config, self.apply)
        self._watching: asyncio.Task[None] | None = None
        self.health = health.aio.HealthServicer()
        self.port: int | None = None
        self.metrics_port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._http: WSGIServer | None = None
        self._stopped = False

    @property
    def address(self) -> str:
        host = self.config.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    async def start(self) -> int:
        """Bind, serve, mark healthy; returns the bound port (useful with port 0)."""
        cfg = self.config
        interceptors = [TokenAuth(self.service.access, self.metrics)] if cfg.authenticates else []
        server = grpc.aio.server(
            interceptors=interceptors,
            options=server_options(cfg.max_batch_bytes, self.reuse_port),
        )
        server.add_generic_rpc_handlers((self.service.handler(),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (
                feeder_pb2.DESCRIPTOR.services_by_name["Feeder"].full_name,
                HEALTH_SERVICE,
                reflection.SERVICE_NAME,
            ),
            server,
        )
        bind = f"[{cfg.host}]:{cfg.port}" if ":" in cfg.host else f"{cfg.host}:{cfg.port}"
        tls = self.credentials.tls
        if tls is not None:
            # gRPC asks for the certificate on every new connection: a reload's reaches
            # the connections made after it
            creds = grpc.dynamic_ssl_server_credentials(
                tls.configuration(),
                self._certificate,
                require_client_authentication=tls.client_ca is not None,
            )
            port = server.add_secure_port(bind, creds)
        else:
            port = server.add_insecure_port(bind)
        if port == 0:
            raise OSError(f"could not bind {bind}")
        start_threads(self.executor, self.config.num_assembly_threads)
        await server.start()
        self._server, self.port = server, port
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if cfg.metrics_port:
            self._http, self.metrics_port = serve_http(
                self.registry, cfg.host, cfg.metrics_port, self.service.status
            )
        if self.watcher.files:
            self._watching = asyncio.get_running_loop().create_task(self.watcher.run())
        if cfg.port_file is not None:
            write_atomic(Path(cfg.port_file), f"{port}\n".encode())
        # the stores, opened while the first calls are on their way, not by them
        threading.Thread(target=self.catalog.open_ahead, name="tokenfeed-open", daemon=True).start()
        return port

    def _certificate(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question before each TLS handshake (from its own threads): the
        certificate to use from now on, or None for the one it has."""
        tls = self.credentials.tls
        if tls is None or tls is self._served_tls:
            return None
        self._served_tls = tls
        return tls.configuration()

    def apply(self, credentials: Credentials) -> None:
        """A reload's credentials, every one checked (credentials.py): the next TLS
        handshake takes the certificate, calls from now on the jobs; open streams
        whose token or grant went end (FeederService.set_tenants)."""
        self.credentials = credentials
        self.service.set_tenants(credentials.tenants)

    def reload(self) -> None:
        """SIGHUP: reload the credentials now (on the event loop's thread)."""
        self.watcher.trigger()
        if self._watching is None:
            log.info("SIGHUP: no TLS or token files to reload")

    async def drain(self, grace: float | None = None) -> None:
        """Graceful stop: NOT_SERVING, refuse new streams, give open ones `grace` seconds."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.grace_seconds if grace is None else grace
        self.service.draining = True
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching
        await self.health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)
        self.close()

    def close(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.service.files.close()
        self.cache.close()

    async def wait_for_termination(self) -> None:
        assert self._server is not None
        await self._server.wait_for_termination()


def start_threads(pool: ThreadPoolExecutor, n: int) -> None:
    """Start `n` threads of `pool` now: it starts them one per task as tasks come, and on
    a busy machine each start makes the event loop wait for the new thread to be
    scheduled, in the way of the first streams' first batches."""
    ready = threading.Barrier(n + 1)
    for _ in range(n):  # each task holds its thread at the barrier, so the next needs a new one
        pool.submit(ready.wait, 10.0)
    ready.wait(10.0)


def create_server(
    config: ServerConfig,
    registry: CollectorRegistry | None = None,
    *,
    open_store: Callable[[Path], TokenStore] = TokenStore.open,
    reuse_port: bool = False,
) -> FeederServer:
    """A feeder for `config`, not yet bound; `await server.start()` serves it."""
    return FeederServer(config, registry, open_store=open_store, reuse_port=reuse_port)


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed (the `server` extra), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


async def serve(
    config: ServerConfig,
    server: FeederServer | None = None,
    on_serving: Callable[[FeederServer], None] | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT, then drain; `on_serving` runs once bound."""
    server = server if server is not None else create_server(config)
    await server.start()
    log.info(
        "tokenfeed feeder serving %s on %s (tls=%s, auth=%s, cache %d bytes, read-ahead %d)%s",
        config.data_root,
        server.address,
        config.tls,
        "tokens file" if config.tokens_file else config.auth_token_file is not None,
        config.cache_bytes,
        config.readahead_budget,
        f", metrics on :{server.metrics_port}" if server.metrics_port else "",
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    undo_dumps = dump_on_signal(loop)  # SIGUSR1: what every thread and stream waits for
    if on_serving is not None:
        on_serving(server)
    await stop.wait()
    log.info("draining: no new streams, %.1f s for open ones", config.grace_seconds)
    await server.drain()
    undo_dumps()
    log.info("stopped")
    return 0


def run_until_stopped(main: Coroutine[Any, Any, int]) -> int:
    """Run `main` (a `serve(...)`) on a new event loop; its exit code."""
    loop = new_event_loop()
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(main)
    finally:
        # Drained: a repeated SIGTERM during the last teardown must not turn exit 0
        # into "killed by signal".
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        asyncio.set_event_loop(None)
        loop.close()
