"""gRPC's own floor for a stream's start: a feeder with nothing of ours in it.

    python benchmarks/servers/grpc_floor.py --workers 2 --port-file F   # until SIGTERM

N processes on one port (SO_REUSEPORT), each a grpc.aio server on the event loop
`tokenfeed serve` uses, with the same server options, whose StreamBatches answers any
request with one pre-built message of one batch of 8 x 2,049 uint16 tokens (the one
batch of benchmarks/scale.py's item 6; `--messages 5`: five, as many as a feeder's
first two bursts), then waits for the client to cancel. The load
generator drives it as it drives a feeder: its CPU per stream start is what gRPC costs
before any sampling, request checks, logging or metrics (scale.py, item 6).
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc

from tokenfeed.core.atomic import write_atomic
from tokenfeed.server.app import new_event_loop, server_options
from tokenfeed.server.config import ServerConfig
from tokenfeed.server.service import SERVICE_NAME
from tokenfeed.server.supervisor import reserve_port
from tokenfeed.v1 import feeder_pb2 as pb

ROWS, COLS = 8, 2049  # one batch of 8 x 2,048-token windows and their shifted targets


def one_batch() -> bytes:
    batch = pb.Batch(rows=ROWS, cols=COLS, shift=1, dtype="uint16", tokens=bytes(ROWS * COLS * 2))
    batch.starts.extend(range(ROWS))
    return pb.StreamBatchesResponse(batches=[batch]).SerializeToString()


async def serve_one(port: int, messages: int) -> None:
    message = one_batch()

    async def stream_batches(request: bytes, context: grpc.aio.ServicerContext) -> None:
        for _ in range(messages):
            await context.write(message)
        await asyncio.get_running_loop().create_future()  # until the client cancels

    server = grpc.aio.server(options=server_options(ServerConfig.max_batch_bytes, True))
    handler: Any = grpc.unary_stream_rpc_method_handler(stream_batches)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, {"StreamBatches": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("ready", flush=True)
    await stop.wait()
    await server.stop(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--port-file", type=Path)
    ap.add_argument("--messages", type=int, default=1, help="messages a stream writes")
    ap.add_argument("--worker-port", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker_port:
        loop = new_event_loop()
        loop.run_until_complete(serve_one(args.worker_port, args.messages))
        return 0
    held, port = reserve_port("127.0.0.1", 0)  # as a `--workers N` feeder holds its port
    workers = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker-port",
                str(port),
                "--messages",
                str(args.messages),
            ],
            stdout=subprocess.PIPE,
        )
        for _ in range(args.workers)
    ]
    for w in workers:
        if w.stdout is None or w.stdout.readline() != b"ready\n":
            for k in workers:
                k.kill()
            raise SystemExit("a worker did not start")
    if args.port_file:
        write_atomic(args.port_file, f"{port}\n".encode())
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.run_until_complete(stop.wait())
    for w in workers:
        w.send_signal(signal.SIGTERM)
    for w in workers:
        w.wait()
    held.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
