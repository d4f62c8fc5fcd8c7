"""benchmarks/scale.py, item 2: a Megatron index of 10^8 documents used in place."""

from __future__ import annotations

import contextlib
import os
import time
from functools import partial
from pathlib import Path

import grpc
import numpy as np
from scale_parts import (
    B,
    MiB,
    cpu_seconds,
    feeder,
    interleaved,
    load,
    params,
    process_tree,
    quiet,
    row,
    run,
    status_kib,
)

from tokenfeed.core.store.megatron import HEADER, MAGIC, VERSION
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc

# The small Megatron store's documents (1.4 GB of tokens): larger than what a case reads
# (4,000 batches, 65M tokens) and than the cache, as the big one is. One of 10^5
# documents (71M tokens) was nearly all read by a case, so its 64 MiB cache already held
# some of the chunks a case measured: a store-size effect, not the index's.
MG_SMALL = 1_000_000
MG_CACHE = "64M"  # both feeders' chunk cache: full on either store, so memory compares
MG_BLOCK = 1 << 22  # documents written at a time


def doc_tokens(a: int, b: int) -> np.ndarray:
    """The tokens of documents [a, b) of the benchmark's Megatron stores: 200 to 1,223."""
    return 200 + np.arange(a, b, dtype=np.int64) * 7919 % 1024


def megatron_store(prefix: Path, documents: int) -> None:
    """A Megatron uint16 dataset of `documents` one-sentence documents: a real .idx
    written a block of documents at a time (no Python object per document; 20 bytes a
    document), the .bin a hole as long as the tokens it indexes."""
    prefix.parent.mkdir(parents=True, exist_ok=True)
    blocks = [(a, min(a + MG_BLOCK, documents)) for a in range(0, documents, MG_BLOCK)]
    total = 0
    with open(prefix.with_name(prefix.name + ".idx"), "wb") as f:
        f.write(HEADER.pack(MAGIC, VERSION, 8, documents, documents + 1))  # 8: uint16
        for a, b in blocks:
            doc_tokens(a, b).astype("<i4").tofile(f)
        for a, b in blocks:  # each sentence's byte offset in the .bin
            n = doc_tokens(a, b)
            ((total + np.cumsum(n) - n) * 2).astype("<i8").tofile(f)
            total += int(n.sum())
        for a, b in blocks:  # document d is sentence d
            np.arange(a, b, dtype="<i8").tofile(f)
        np.array([documents], dtype="<i8").tofile(f)
    with open(prefix.with_name(prefix.name + ".bin"), "wb") as f:
        f.truncate(2 * total)


async def document_batches(address: str, req: pb.StreamBatchesRequest, batches: int) -> int:
    """Read `batches` batches of one request: how many carried document ends."""
    with_ends = n = 0
    async with grpc.aio.insecure_channel(address) as ch:
        call = feeder_pb2_grpc.FeederStub(ch).StreamBatches(req)
        async for msg in call:
            n += len(msg.batches)
            with_ends += sum(bool(b.document_ends) for b in msg.batches)
            if n >= batches:
                call.cancel()
                break
    return with_ends


def memory(pid: int) -> tuple[int, int]:
    """(RssAnon, RssFile) bytes of a process tree: its own memory, and the pages of
    files it maps (libraries, a Megatron index), which are the page cache's."""
    pids = process_tree(pid)
    anon, mapped = (sum(status_kib(p, k) for p in pids) * 1024 for k in ("RssAnon", "RssFile"))
    return anon, mapped


def page_cache_out(path: Path) -> None:
    """Drop `path`'s pages from the OS page cache. The small store's tokens (142 MB) would
    stay there from one round to the next, the big one's (142 GB) never: each chunk the
    big feeder loads a page cache miss (for a sparse file, pages of zeros made), each of
    the small one's a copy. Out of the page cache, both read as a store larger than
    memory does."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def megatron(tmp: Path, documents: int, batches: int, repeats: int) -> None:
    print(f"2. a Megatron index of {documents:,} documents against {MG_SMALL:,} ({load()})")
    t = time.monotonic()
    roots = {"big": tmp / "mg_big", "small": tmp / "mg_small"}
    megatron_store(roots["big"] / "mg", documents)
    megatron_store(roots["small"] / "mg", MG_SMALL)
    index = (roots["big"] / "mg.idx").stat().st_size
    print(f"  wrote a {index / 1e9:.2f} GB index in {time.monotonic() - t:.1f} s", flush=True)
    p = params("mg")

    def request(epoch: int, step: int, ends: bool = True) -> pb.StreamBatchesRequest:
        return pb.StreamBatchesRequest(
            params=p, epoch=epoch, step=step, offset=step * B, document_ends=ends
        )

    first: dict[str, tuple[float, float]] = {}  # (wall s, feeder CPU s) from serve's start
    opened: dict[str, float] = {}  # feeder CPU s of the open and the first batch alone
    mem: dict[str, tuple[int, int]] = {}  # after the first batch
    with contextlib.ExitStack() as stack:
        procs = {}
        for k, root in roots.items():
            t = time.monotonic()
            procs[k] = proc = stack.enter_context(feeder(root, cache_bytes=MG_CACHE))
            c = cpu_seconds(proc.proc.pid)
            run(document_batches(proc.address, request(0, 0), 1))
            first[k] = (time.monotonic() - t, cpu_seconds(proc.proc.pid))
            opened[k] = cpu_seconds(proc.proc.pid) - c
            quiet(proc.proc.pid, every=1.0)  # the loads the first batch began are done
            mem[k] = memory(proc.proc.pid)

        carried = [0, 0]  # batches with document ends, batches asked for them

        def case(k: str, ends: bool, r: int) -> float:
            """CPU per batch of a new epoch's stream, after as many that load its chunks;
            an epoch of its own (another case's would have loaded its chunks), its
            tokens out of the page cache on either store (`page_cache_out`)."""
            proc, epoch = procs[k], 2 * r + 1 + (not ends)
            got = run(document_batches(proc.address, request(epoch, 0, ends), batches))
            page_cache_out(roots[k] / "mg.bin")
            before = cpu_seconds(proc.proc.pid)
            got += run(document_batches(proc.address, request(epoch, batches, ends), batches))
            cpu = (cpu_seconds(proc.proc.pid) - before) / batches
            if ends:
                carried[0] += got
                carried[1] += 2 * batches
            return cpu

        # the same streams without document ends: the token path's own cost by store size
        cases = {
            f"{k} {what}": partial(case, k, what == "ends")
            for k in procs
            for what in ("ends", "tokens")
        }
        cpu = interleaved(cases, repeats)
        after = {k: memory(procs[k].proc.pid) for k in procs}
    (wall, c), (small_wall, small_c) = first["big"], first["small"]
    row(
        "2 Megatron",
        "open + first document batch from serve's start <= 2 s (CPU)",
        f"{c:.2f} s CPU, {wall:.2f} s wall (open and batch alone {opened['big']:.3f} s; "
        f"{MG_SMALL:,} documents: {small_c:.2f} s, {small_wall:.2f} s, {opened['small']:.3f} s)",
        c <= 2,
    )
    anon = [(m["big"][0] - m["small"][0]) / MiB for m in (mem, after)]
    mapped = [(m["big"][1] - m["small"][1]) / MiB for m in (mem, after)]
    row(
        "2 Megatron",
        "own memory (RssAnon) <= small store's + 16 MiB",
        f"{anon[0]:+.1f} MiB at the first batch, {anon[1]:+.1f} MiB after the runs "
        f"(index pages mapped, RssFile: {mapped[0]:+.0f} / {mapped[1]:+.0f} MiB of "
        f"{index / MiB:,.0f})",
        max(anon) <= 16,
    )
    ratio, tokens = cpu["big ends"] / cpu["small ends"], cpu["big tokens"] / cpu["small tokens"]
    measured = (
        f"{cpu['big ends'] * 1e3:.3f} ms vs {cpu['small ends'] * 1e3:.3f} ms = {ratio:.2f}x "
        f"(without document ends {cpu['big tokens'] * 1e3:.3f} vs "
        f"{cpu['small tokens'] * 1e3:.3f} ms = {tokens:.2f}x)"
    )
    row("2 Megatron", "CPU/document batch <= 1.1x small store's", measured, ratio <= 1.1)
    row(
        "2 Megatron",
        "every batch carries document ends",
        f"{carried[0]:,} of {carried[1]:,} batches",
        carried[0] == carried[1],
        True,
    )
