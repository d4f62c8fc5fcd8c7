"""`tokenfeed plan`: how much feeder a training job needs, before it starts.

    tokenfeed plan --gpus 512 --tokens-per-gpu-s 12000 --seq-len 4096 --batch-size 8
    tokenfeed plan ... --per-core-tokens-s 3e8          # a per-core figure you measured
    tokenfeed plan ... --measure feeder:50051 --dataset web   # measure it now
    tokenfeed plan ... --json                           # JSON only, on stdout
    tokenfeed plan ... --mixture web=0.7,code=0.3 [--schedule FILE]  # per source too

The trainers consume GPUs x tokens-per-GPU-per-second input tokens; the feeder sends
each row's shift tokens too (seq_len + shift per row), in the store's dtype. The
worker processes (cores) it takes are that wire rate times the headroom over the
per-core figure, and the replicas (nodes) are the cores over the cores per node, or
more when one node's NIC cannot carry its share. Every rank holds one stream: a worker
takes at most STREAMS_PER_WORKER of them (`serve --max-streams`' default), so a job of
many ranks needs at least gpus x headroom / STREAMS_PER_WORKER workers whatever its
token rate, and each replica's streams size its memory and open files
(docs/serving.md, "Limits").

The per-core figure is, in order: `--per-core-tokens-s`; `--measure ADDRESS`, the
rate one stream gets from a running feeder (point it at a feeder with one worker on an
otherwise idle node; a client slower than the feeder gives a low, safe figure); else
this build's own figure, from benchmarks/serve_throughput.py (BUILD_PER_CORE_TOKENS_S).
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from tokenfeed.core.dtypes import DTYPES, itemsize

# Wire tokens per server CPU-second (16 x 1024 uint16 rows, shuffled) on the benchmark
# machine: benchmarks/serve_throughput.py --workers-rows measured 1.61-1.63 CPU-s per
# 1e9 tokens per worker (benchmarks/README.md); 1e9 / 1.73 keeps ~6 % in hand. Its
# --cpu form reads more on a busy machine: `--measure` on the real node is the better
# figure. Re-measure when the hot path changes.
BUILD_PER_CORE_TOKENS_S = 5.8e8
# What a stream costs a feeder (docs/serving.md, "Limits"; benchmarks/scale.py measures
# them): `serve --max-streams`' default per worker, descriptors and memory per stream,
# and per worker process beside its chunks.
STREAMS_PER_WORKER = 2048
FILES_PER_STREAM, FILES_PER_WORKER = 9, 256
POOL_FILES = 1024  # a worker's open chunk files: 8 per stream, at least this many
STREAM_BYTES, WORKER_BYTES = 1 << 20, 100 << 20


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n\n", 1)[1]
    a = p.add_argument
    a("--gpus", type=int, required=True, help="trainer GPUs (ranks)")
    a(
        "--tokens-per-gpu-s",
        type=float,
        required=True,
        help="input tokens one GPU trains on per second",
    )
    a("--seq-len", type=int, required=True)
    a("--batch-size", type=int, required=True, help="windows per rank per step")
    a("--shift", type=int, default=1, help="label shift (auto: its largest divisor)")
    a("--dtype", choices=sorted(DTYPES), default="uint16", help="store token dtype")
    a("--cores-per-node", type=int, default=16, help="feeder cores per data node")
    a("--nic-gbit", type=float, default=25.0, help="a data node's NIC, Gbit/s")
    a("--headroom", type=float, default=2.0, help="capacity over the need (default 2x)")
    src = p.add_mutually_exclusive_group()
    src.add_argument(
        "--per-core-tokens-s", type=float, default=None, help="wire tokens/s one feeder core serves"
    )
    src.add_argument(
        "--measure",
        metavar="ADDRESS",
        default=None,
        help="measure the per-core figure against this running feeder",
    )
    a(
        "--mixture",
        default=None,
        help="a mixture (web=0.7,code=0.3 or the client's YAML/JSON file): also print what "
        "each source must deliver in each schedule segment",
    )
    a("--schedule", default=None, help="a schedule file (with --mixture)")
    a("--dataset", default="demo", help="dataset to stream when measuring")
    a("--seconds", type=float, default=5.0, help="how long to measure")
    a("--json", action="store_true", help="print only JSON on stdout")


def _measure(args: argparse.Namespace) -> float:
    """Wire tokens/s one stream gets from a running feeder (tokenfeed bench's loop)."""
    from tokenfeed.cli.bench import measure
    from tokenfeed.client import FeederClient

    with FeederClient(
        args.measure,
        dataset=args.dataset,
        seq_len=args.seq_len,
        batch_size=args.batch_size,
        shift=args.shift,
        shuffle=True,
        rank=0,
        world_size=1,
    ) as client:
        result = measure(lambda: client, args.seconds)
    return float(result["tokens_per_s"]) * (args.seq_len + args.shift) / args.seq_len


def plan(args: argparse.Namespace, per_core: float, source: str) -> dict[str, Any]:
    """The numbers (see the module docstring); inputs are the keys with "per" or the
    flag's own name."""
    from tokenfeed.core.errors import InvalidArgument

    for name in (
        "gpus",
        "tokens_per_gpu_s",
        "seq_len",
        "batch_size",
        "shift",
        "cores_per_node",
        "nic_gbit",
        "headroom",
    ):
        if not getattr(args, name) > 0:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be positive")
    if not per_core > 0:
        raise InvalidArgument(f"the per-core figure must be positive, got {per_core}")
    tokens = args.gpus * args.tokens_per_gpu_s
    wire = tokens * (args.seq_len + args.shift) / args.seq_len
    nbytes = wire * itemsize(args.dtype)
    gbit = nbytes * 8 / 1e9
    by_rate = math.ceil(wire * args.headroom / per_core)
    by_streams = math.ceil(args.gpus * args.headroom / STREAMS_PER_WORKER)
    cores = max(1, by_rate, by_streams)
    replicas = max(
        math.ceil(cores / args.cores_per_node), math.ceil(gbit * args.headroom / args.nic_gbit)
    )
    workers = math.ceil(cores / replicas)
    streams = math.ceil(args.gpus / replicas)  # per replica, before a failover
    return {
        "tokens_per_s": tokens,
        "wire_tokens_per_s": wire,
        "bytes_per_s": nbytes,
        "gbit_per_s": gbit,
        "steps_per_s": args.tokens_per_gpu_s / (args.batch_size * args.seq_len),
        "cores": cores,
        "replicas": replicas,
        "workers_per_replica": workers,
        "cores_by_streams": by_streams,
        "streams_per_replica": streams,
        "open_files_per_replica": streams * FILES_PER_STREAM
        + workers * FILES_PER_WORKER
        + max(0, workers * POOL_FILES - streams * (FILES_PER_STREAM - 1)),
        "memory_beside_cache_bytes": streams * STREAM_BYTES + workers * WORKER_BYTES,
        "gpus": args.gpus,
        "tokens_per_gpu_s": args.tokens_per_gpu_s,
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "shift": args.shift,
        "dtype": args.dtype,
        "cores_per_node": args.cores_per_node,
        "nic_gbit_per_node": args.nic_gbit,
        "per_core_tokens_s": per_core,
        "per_core_source": source,
        "headroom": args.headroom,
    }


def by_source(args: argparse.Namespace, tokens_per_s: float) -> list[dict[str, Any]]:
    """Per schedule segment, the tokens/s each source of `--mixture` must deliver."""
    from tokenfeed.core.mixture import Mixture
    from tokenfeed.core.mixture.files import load_mixture

    sources, schedule = load_mixture(args.mixture, args.schedule)
    mix = Mixture(sources, schedule, seq_len=args.seq_len)
    return [
        {
            "from_tokens": start,
            "tokens_per_s": {
                n: float(w) * tokens_per_s for n, w in zip(mix.names, w_, strict=True)
            },
        }
        for start, w_ in mix.segments
    ]


def run(args: argparse.Namespace) -> int:
    if args.per_core_tokens_s is not None:
        per_core, source = args.per_core_tokens_s, "given"
    elif args.measure is not None:
        per_core, source = _measure(args), f"measured at {args.measure}"
    else:
        per_core, source = BUILD_PER_CORE_TOKENS_S, "this build's benchmark"
    doc = plan(args, per_core, source)
    if args.mixture is not None:
        doc["segments"] = by_source(args, doc["tokens_per_s"])
    if args.json:
        print(json.dumps(doc, indent=2))
        return 0
    print(
        f"trainers consume   {doc['tokens_per_s']:,.0f} tokens/s "
        f"({args.gpus} GPUs x {args.tokens_per_gpu_s:,.0f}; {doc['steps_per_s']:.2f} steps/s)"
    )
    print(
        f"feeder sends       {doc['wire_tokens_per_s']:,.0f} tokens/s with the shift, "
        f"{doc['bytes_per_s'] / 1e9:,.2f} GB/s, {doc['gbit_per_s']:,.2f} Gbit/s ({args.dtype})"
    )
    print(f"per core           {per_core:,.0f} wire tokens/s ({source})")
    print(
        f"it takes           {doc['cores']} cores and {doc['replicas']} replicas "
        f"({doc['workers_per_replica']} workers each: `tokenfeed serve --workers "
        f"{doc['workers_per_replica']}`), at {args.headroom:g}x headroom, "
        f"{args.cores_per_node} cores and {args.nic_gbit:g} Gbit/s per node"
    )
    print(
        f"per replica        {doc['streams_per_replica']:,} streams: "
        f"--cache-bytes + {doc['memory_beside_cache_bytes'] / (1 << 30):,.1f} GiB of memory, "
        f'`ulimit -n` >= {doc["open_files_per_replica"]:,} (docs/serving.md, "Limits")'
    )
    for seg in doc.get("segments", []):
        shares = ", ".join(f"{n} {t:,.0f}" for n, t in seg["tokens_per_s"].items())
        print(f"from token {seg['from_tokens']:,}: tokens/s by source: {shares}")
    return 0
