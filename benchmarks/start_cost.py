"""What a stream's start costs the feeder in process, without gRPC: scale.py item 6's
storm taken apart.

    python benchmarks/start_cost.py [--quick]

A FeederService (not bound) over a sparse 10^12-token store (--quick: 2,000 chunks)
takes the requests of 1,024 ranks of world size 1,024 (8 x 2,048-token batches), each
as the servicer does: the request prepared (`_prepare_stream`: the spec, the grant,
the sampler shared by the ranks, the message builder), its first burst (one batch),
its second (up to four messages: rows read in place from the chunk files at this world
size, the files of the next bursts opened). Every stream is kept open until all have
started, as in a storm. Prints the CPU seconds of this process per start for each
step, the median of interleaved repeats; scale.py item 6 measures the same starts
through gRPC, and gRPC's own floor beside them.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from scale_parts import CHUNK, params, sparse_store

from tokenfeed.server import wire
from tokenfeed.server.app import create_server
from tokenfeed.server.assembly import MessageBuilder
from tokenfeed.server.config import ServerConfig
from tokenfeed.server.service import FeederService, Received
from tokenfeed.server.streams import StreamEntry
from tokenfeed.v1 import feeder_pb2 as pb

RANKS = 1_024
REPEATS = 3


def requests(epoch: int) -> list[Received]:
    """Every rank's request of `epoch`, as the servicer receives it."""
    p = params("ds", world=RANKS)
    out = []
    for rank in range(RANKS):
        data = pb.StreamBatchesRequest(params=p, rank=rank, epoch=epoch).SerializeToString()
        out.append(Received(pb.StreamBatchesRequest.FromString(data), wire.field_bytes(data, 1)))
    return out


def burst(pipe: MessageBuilder) -> None:
    """The next burst, built as the servicer builds it: on the loop if it can, else on a
    worker thread (here: the same thread)."""
    if not pipe.next_burst(inline=True):
        pipe.next_burst()


def starts(service: FeederService, epoch: int, bursts: int) -> float:
    """CPU seconds per start of every rank's stream of `epoch` with `bursts` bursts."""
    received = requests(epoch)
    job = service.access.job(())
    pipes = []
    t = time.process_time()
    for r in received:
        entry = StreamEntry.of(r.message, "ipv4:127.0.0.1:1")
        entry.job = job
        pipe, _ = service._prepare_stream(r, entry)
        for _ in range(bursts):
            burst(pipe)
        pipes.append(pipe)
    spent = time.process_time() - t
    for pipe in pipes:
        pipe.close()
    return spent / len(received)


def main() -> int:
    quick = "--quick" in sys.argv
    with tempfile.TemporaryDirectory(prefix="tokenfeed-starts-") as d:
        root = Path(d)
        sparse_store(root / "ds", (2_000 if quick else 59_605) * CHUNK)
        cfg = ServerConfig(data_root=root, port=0, cache_bytes=64 << 20)
        server = create_server(cfg, CollectorRegistry())
        service = server.service
        starts(service, 0, 0)  # the store opened, the ranks' sampler made once
        got: dict[int, list[float]] = {0: [], 1: [], 2: []}
        epoch = 0
        for _ in range(REPEATS):
            for bursts in got:  # in turns; each its own epoch, as a storm's
                epoch += 1
                got[bursts].append(starts(service, epoch, bursts))
        server.close()
    med = {k: statistics.median(v) for k, v in got.items()}
    print(f"{RANKS:,} starts of world size {RANKS:,}, CPU per start (median of {REPEATS}):")
    print(f"  the request prepared         {med[0] * 1e3:.3f} ms")
    print(f"  + the first burst (1 batch)  {med[1] * 1e3:.3f} ms")
    print(f"  + the second burst           {med[2] * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
