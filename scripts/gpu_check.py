#!/usr/bin/env python3
"""Checks of the client's CUDA path on a machine with NVIDIA GPUs, run by hand (CI has
no GPU; docs/client.md, "Checking the CUDA path", says what each check proves).

    python scripts/gpu_check.py               # on cuda:0, and cuda:1 when there are two
    python scripts/gpu_check.py --dry-run     # the same checks on the CPU (its test runs this)
    python scripts/gpu_check.py --only ids,stream

It writes a store of documents with ids over the whole uint16 range, starts a feeder
(`tokenfeed serve`) on 127.0.0.1, and runs:

  ceiling    pinned host-to-device copies of one batch's bytes, against the stager
             staging whole batches (figures)
  ids        uint16 and uint32 ids over their full range come out right on the
             device while the compute stream is busy, and while the copy is late
  readers    two reader threads staging through one stager at once: every batch
             right, documents and masked labels included
  loop       batches used as a training loop does (labels masked in place, the
             batch before kept, older ones dropped), every value checked
  stream     the device stream against the numpy stream over 3 epochs (the next
             epoch's reader opened ahead), documents, masked labels, auto shift
  latency    p50 / p99 next() and the stall under a ~10 ms fake step (fails on a
             GPU above a 1 % stall)
  memory     device memory allocated flat over the steps of `latency` (CUDA only)
  contexts   with two GPUs, a process on cuda:1 (and one with CUDA_VISIBLE_DEVICES=1,
             LOCAL_RANK=1, device="cuda") has no CUDA context on GPU 0
  sanitizer  ids, loop and stream again under TORCH_CUDA_SANITIZER=1, in a child

One line per check (PASS, FAIL or SKIP, with figures), then a summary; exit 1 if a
check failed. --dry-run runs them with device "cpu": that proves the script and its
checks work, through the client's CPU path (the CUDA path's staging code is tested on
the CPU by tests/client/test_device.py); a timing never fails there, and the
CUDA-only checks skip.
"""

from __future__ import annotations

import argparse
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch

from tokenfeed.cli.process import serve_argv, stop, wait_for_port
from tokenfeed.client import FeederClient
from tokenfeed.client.buffers import NumpyStager, batch_array
from tokenfeed.client.device import make_stager
from tokenfeed.core import documents
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import write_store
from tokenfeed.v1 import feeder_pb2, feeder_pb2_grpc

SEQ_LEN, BATCH = 256, 8
OUTPUTS = documents.OUTPUTS


class Rig:
    """What every check uses: the device, the feeder, how long to run."""

    def __init__(self, device: str, address: str, dry_run: bool) -> None:
        self.device, self.address, self.dry_run = device, address, dry_run
        self.cuda = device.startswith("cuda")
        self.scale = 0.2 if dry_run else 1.0  # fewer batches on the CPU
        self.latency_run: dict[str, Any] = {}

    def n(self, count: int) -> int:
        return max(4, int(count * self.scale))

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def busy(self, ms: float, stream: Any = None) -> None:
        """Keep a stream of the device (the current one by default) busy for ~`ms`."""
        if self.cuda:
            with torch.cuda.stream(stream or torch.cuda.current_stream(self.device)):
                torch.cuda._sleep(int(ms * _cycles_per_ms()))

    def loader(self, **kw: Any) -> FeederClient:
        args: dict[str, Any] = dict(
            dataset="docs",
            seq_len=SEQ_LEN,
            batch_size=BATCH,
            shift="auto",
            shuffle=True,
            seed=1,
            rank=0,
            world_size=1,
        )
        args.update(kw)
        return FeederClient(self.address, **args)


_CYCLES: list[float] = []


def _cycles_per_ms() -> float:
    if not _CYCLES:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        end.synchronize()
        _CYCLES.append(10_000_000 / start.elapsed_time(end))
    return _CYCLES[0]


def expected(msg: feeder_pb2.Batch, layout: str = "flat") -> dict[str, Any]:
    """The batch as the numpy path makes it (ids widened): what a staged one must equal."""
    numpy = NumpyStager(SEQ_LEN, layout, OUTPUTS, True)
    inputs, labels, docs, _ = numpy.stage(msg, batch_array(msg))
    return {"input_ids": inputs.astype(np.int64), "labels": labels, **(docs or {})}


def same(batch: dict[str, Any], want: dict[str, Any]) -> str | None:
    """None if every output of a staged (or received) batch equals `want`, else which
    differs."""
    for key, value in want.items():
        got = batch[key]
        if key == "max_seqlen":
            if got != value:
                return f"{key}: {got} != {value}"
            continue
        host = got.cpu().numpy() if hasattr(got, "cpu") else np.asarray(got)
        if host.shape != np.shape(value) or not np.array_equal(host, value):
            return f"{key} differs"
        if hasattr(got, "is_contiguous") and not got.is_contiguous():
            return f"{key} is not contiguous"
    return None


def messages(
    rig: Rig,
    dataset: str,
    shift: int,
    count: int,
    rows: int = BATCH,
    seq_len: int = SEQ_LEN,
    seed: int | None = None,
) -> list[feeder_pb2.Batch]:
    """Up to `count` Batch messages of `dataset` as the feeder sends them, document ends
    included: from the epoch's first step (its first window holds the store's edge
    ids), or shuffled by `seed`."""
    spec = SamplingSpec(
        dataset=dataset,
        seq_len=seq_len,
        batch_size=rows,
        shift=shift,
        shuffle=seed is not None,
        seed=seed or 0,
    )
    request = feeder_pb2.StreamBatchesRequest(
        params=spec.to_proto(), batches_per_message=1, document_ends=True
    )
    out: list[feeder_pb2.Batch] = []
    with grpc.insecure_channel(rig.address) as channel:
        for response in feeder_pb2_grpc.FeederStub(channel).StreamBatches(request):
            out.extend(response.batches)
            if len(out) >= count:
                break
    return out[:count]


def staged(stager: Any, msg: feeder_pb2.Batch) -> dict[str, Any]:
    """Stage one batch and take it as next() does (the loop's stream waits for it)."""
    inputs, labels, docs, pending = stager.stage(msg, batch_array(msg))
    if pending is not None:
        stager.ready(*pending)
    return {"input_ids": inputs, "labels": labels, **(docs or {})}


# -------------------------------------------------------------------------- the checks


def check_ceiling(rig: Rig) -> tuple[str, str]:
    # A batch as large as a training step's: 16 x 2048 tokens.
    rows, seq_len = 16, 2048
    msgs = messages(rig, "docs", 1, 8, rows, seq_len)
    nbytes = len(msgs[0].tokens)
    count = rig.n(2000)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=rig.cuda)
    dest = torch.empty(nbytes, dtype=torch.uint8, device=rig.device)
    # On the CPU a memcpy: torch's CPU copy_ wakes its thread pool for each call.
    copy = (
        partial(dest.copy_, host, non_blocking=True)
        if rig.cuda
        else partial(np.copyto, dest.numpy(), host.numpy())
    )
    rig.sync()
    t0 = time.perf_counter()
    for _ in range(count):
        copy()
    rig.sync()
    copies = count / (time.perf_counter() - t0)
    stager = make_stager(rig.device, seq_len, "flat", (), False)
    t0 = time.perf_counter()
    for i in range(count):
        staged(stager, msgs[i % len(msgs)])
    rig.sync()
    batches = count / (time.perf_counter() - t0)
    tokens = batches * rows * seq_len
    return "PASS", (
        f"copies of a {nbytes:,}-byte batch: {copies:,.0f}/s ({copies * nbytes / 1e9:.2f} GB/s); "
        f"stager {batches:,.0f} batches/s ({tokens / 1e6:.1f} M tokens/s), "
        f"{batches / copies:.2f} of the copy ceiling"
    )


def check_ids(rig: Rig) -> tuple[str, str]:
    n = 0
    for dataset in ("docs", "wide"):  # uint16, uint32
        for shift in (1, 4):
            first, *more = messages(rig, dataset, shift, 2)
            for layout in ("flat", "grouped"):
                stager = make_stager(rig.device, SEQ_LEN, layout, OUTPUTS, True)
                side = getattr(stager.device, "stream", None)
                for late, msg in ((False, first), (True, more[0])):
                    # Late: the side stream is busy, so the copy lands after ready();
                    # else the compute stream is: the copy runs beside it.
                    rig.busy(20, side if late else None)
                    bad = same(staged(stager, msg), expected(msg, layout))
                    if bad:
                        return "FAIL", f"{dataset} shift {shift} {layout} late={late}: {bad}"
                    n += 1
    rig.sync()
    return "PASS", f"{n} batches, uint16 and uint32 over their full range, both layouts"


def check_readers(rig: Rig) -> tuple[str, str]:
    stager = make_stager(rig.device, SEQ_LEN, "flat", OUTPUTS, True)
    out: queue.Queue[Any] = queue.Queue(maxsize=4)
    count = rig.n(300)

    def reader(k: int) -> None:
        try:
            # Each thread its own order of the epoch, two shifts taking turns.
            batches = [messages(rig, "docs", shift, count, seed=k) for shift in (1, 4)]
            for i in range(count):
                msg = batches[i % 2][i % len(batches[i % 2])]
                inputs, labels, docs, pending = stager.stage(msg, batch_array(msg))
                out.put((msg, {"input_ids": inputs, "labels": labels, **(docs or {})}, pending))
        except Exception as e:
            out.put(e)
        out.put(None)

    threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(2)]
    for t in threads:
        t.start()
    ended = checked = 0
    while ended < 2:
        item = out.get(timeout=120)
        if item is None:
            ended += 1
            continue
        if isinstance(item, Exception):
            return "FAIL", f"a reader raised {item!r}"
        msg, batch, pending = item
        if pending is not None:
            stager.ready(*pending)
        bad = same(batch, expected(msg))
        if bad:
            return "FAIL", f"batch {checked}: {bad}"
        checked += 1
    ring = getattr(stager, "ring", None)
    slots = f", {len(ring)} pinned slots" if ring is not None else ""
    return "PASS", f"{checked} batches from 2 threads{slots}"


def check_loop(rig: Rig) -> tuple[str, str]:
    stager = make_stager(rig.device, SEQ_LEN, "flat", OUTPUTS, True)
    batches = [messages(rig, "docs", shift, 64, seed=7) for shift in (1, 2, 4)]
    kept: list[dict[str, Any]] = []
    count = rig.n(400)
    for step in range(count):
        msg = batches[step % 3][step // 3 % 64]
        batch = staged(stager, msg)
        want = expected(msg)
        inputs = batch["input_ids"]
        total = int((inputs * 2).sum())  # the loop's stream reads the batch
        batch["labels"][:, 0] = -100  # and writes to it in place
        want["labels"][:, 0] = -100
        bad = same(batch, want)
        if bad or total != int(want["input_ids"].sum()) * 2:
            return "FAIL", f"step {step}: {bad or 'a sum over input_ids differs'}"
        kept = [*kept[-1:], batch]  # the batch before stays alive, older ones go
    return "PASS", f"{count} steps with in-place label masks"


def check_stream(rig: Rig) -> tuple[str, str]:
    opts = dict(documents=True, mask_cross_document_labels=True)
    n = 0
    with rig.loader(device=rig.device, **opts) as dev, rig.loader(**opts) as ref:
        epochs = 3
        for epoch in range(epochs):
            dev.set_epoch(epoch)
            ref.set_epoch(epoch)
            for got, want in zip(dev, ref, strict=True):
                want = {**want, "input_ids": want["input_ids"].astype(np.int64)}
                unmasked = got["input_ids"].clone()
                bad = same(got, {k: want[k] for k in ("input_ids", "labels", *OUTPUTS)})
                if bad:
                    return "FAIL", f"epoch {epoch} step {got['step']}: {bad}"
                got["labels"].fill_(-100)
                if not torch.equal(got["input_ids"], unmasked):
                    return "FAIL", f"epoch {epoch} step {got['step']}: masking changed input_ids"
                n += 1
    return "PASS", f"{n} batches over {epochs} epochs equal the numpy stream's"


def check_latency(rig: Rig) -> tuple[str, str]:
    waits: list[float] = []
    memory: list[int] = []
    steps = rig.n(600)
    with rig.loader(device=rig.device, documents=True, mask_cross_document_labels=True) as c:

        def batches() -> Iterator[dict[str, Any]]:
            epoch = 0
            while True:
                c.set_epoch(epoch)
                yield from c
                epoch += 1

        it = batches()
        next(it)
        start = time.perf_counter()
        for _ in range(steps):
            t0 = time.perf_counter()
            batch = next(it)
            waits.append(time.perf_counter() - t0)
            rig.busy(10)  # the fake step: ~10 ms of the GPU, then the loss read back
            loss = batch["input_ids"].float().mean()
            if rig.cuda:
                loss.item()
                memory.append(torch.cuda.memory_allocated(rig.device))
            else:
                time.sleep(0.01)
        wall = time.perf_counter() - start
    waits.sort()
    stall = sum(waits) / wall * 100
    p50, p99 = waits[len(waits) // 2] * 1e3, waits[int(len(waits) * 0.99)] * 1e3
    rig.latency_run = {"memory": memory, "steps": steps}
    figures = f"{steps} steps: stall {stall:.2f} %, next() p50 {p50:.3f} ms, p99 {p99:.3f} ms"
    if stall >= 1.0 and not rig.dry_run:
        return "FAIL", figures + " (the goal: a stall under 1 %)"
    return "PASS", figures


def check_memory(rig: Rig) -> tuple[str, str]:
    memory = rig.latency_run.get("memory")
    if not rig.cuda:
        return "SKIP", "CUDA only"
    if not memory or len(memory) < 30:
        return "SKIP", "the latency check did not run"
    # How many batches are alive varies with the buffer's fill: compare the peaks of
    # the first and the last third (after a warm-up), allowing two batches (three int64
    # planes, document ids, the uploaded bytes).
    n = len(memory)
    early, late = max(memory[n // 10 : n // 3]), max(memory[-(n // 3) :])
    batch_bytes = BATCH * SEQ_LEN * (3 * 8 + 4 + 2)
    figures = (
        f"peak allocated {early / 2**20:.2f} MiB early, {late / 2**20:.2f} MiB late over {n} steps"
    )
    if late - early > 2 * batch_bytes:
        return "FAIL", figures + f": grew {late - early:,} bytes"
    return "PASS", figures


def check_contexts(rig: Rig) -> tuple[str, str]:
    if not rig.cuda or torch.cuda.device_count() < 2:
        return "SKIP", "needs two GPUs"
    alone = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "1"}
    cases = (
        ("device='cuda:1'", {}, "cuda:1"),
        ("LOCAL_RANK=1 on GPU 1 alone", alone, "cuda"),
    )
    for label, env, device in cases:
        gpus = _gpus_of_child(rig, env, device)
        if gpus is None:
            return "SKIP", "nvidia-smi lists no process with the child's pid (a PID namespace?)"
        if gpus != {1}:
            return "FAIL", f"{label}: contexts on GPU(s) {sorted(gpus)}, expected only GPU 1"
    return "PASS", "contexts only on GPU 1: " + "; ".join(label for label, _, _ in cases)


def _gpus_of_child(rig: Rig, env: dict[str, str], device: str) -> set[int] | None:
    """The GPUs (nvidia-smi indices) holding a context of a child process that trains a
    few steps on `device` (no torch.cuda.set_device) and waits; None if nvidia-smi does
    not list the child at all."""
    child_env = {**os.environ, "CUDA_DEVICE_ORDER": "PCI_BUS_ID", **env}
    argv = [sys.executable, __file__, "--context-child", device, "--address", rig.address]
    with subprocess.Popen(
        argv, env=child_env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as child:
        assert child.stdout is not None
        assert child.stdin is not None
        line = child.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"the child did not start: {line!r}")
        apps = _smi("--query-compute-apps=pid,gpu_bus_id")
        bus = {b.strip(): int(i) for i, b in _smi("--query-gpu=index,pci.bus_id")}
        child.stdin.close()
        child.wait(60)
    gpus = {bus[b.strip()] for pid, b in apps if int(pid) == child.pid}
    return gpus or None


def _smi(query: str) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", query, "--format=csv,noheader"], check=True, capture_output=True, text=True
    ).stdout
    return [line.split(",") for line in out.splitlines() if line.strip()]


def context_child(device: str, address: str) -> None:
    rig = Rig(device, address, dry_run=False)
    model = torch.nn.Embedding(65_536, 16)
    with rig.loader(device=device) as loader:
        model = model.to(loader.device)
        for step, batch in enumerate(loader):
            model(batch["input_ids"]).float().mean().backward()
            if step == 30:
                break
        torch.cuda.synchronize(loader.device)
        print("ready", flush=True)
        sys.stdin.read()  # the parent looks at the contexts, then closes stdin


def check_sanitizer(rig: Rig) -> tuple[str, str]:
    """The sanitizer's dispatch mode is per thread: it sees the kernels of the thread
    that enabled it, so ids and loop stage in this (the loop's) thread. It needs CUDA:
    a dry run runs the same child without it."""
    argv = [sys.executable, __file__, "--only", "ids,loop,stream", "--address", rig.address]
    env = dict(os.environ)
    if rig.dry_run:
        argv.append("--dry-run")
    else:
        env["TORCH_CUDA_SANITIZER"] = "1"
    child = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    lines = child.stdout.strip().splitlines()
    if child.returncode != 0:
        tail = (child.stderr.strip().splitlines() or lines or ["no output"])[-1]
        return "FAIL", f"exit {child.returncode}: {tail}"
    how = "without the sanitizer (CUDA only)" if rig.dry_run else "TORCH_CUDA_SANITIZER=1"
    return "PASS", f"{how}: {lines[-1] if lines else 'no output'}"


CHECKS: dict[str, Callable[[Rig], tuple[str, str]]] = {
    "ceiling": check_ceiling,
    "ids": check_ids,
    "readers": check_readers,
    "loop": check_loop,
    "stream": check_stream,
    "latency": check_latency,
    "memory": check_memory,
    "contexts": check_contexts,
    "sanitizer": check_sanitizer,
}


# ------------------------------------------------------------------------------ running


def write_documents(path: Path, dtype: str, total: int) -> None:
    """A store of documents of ~300 tokens, ids over the dtype's whole range, the top
    one the EOS; the first window starts with the ids a signed reading would get wrong."""
    top = int(np.iinfo(np.dtype(dtype)).max)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, top, size=total, endpoint=True, dtype=np.int64)
    tokens[tokens == top] = 0
    tokens[np.cumsum(rng.geometric(1 / 300, size=total // 100)) % total] = top
    edges = [e for e in (0, 1, 2**15 - 1, 2**15, 2**16 - 1, 2**31 - 1, 2**31, top) if e <= top]
    tokens[: len(edges)] = edges
    write_store(
        path,
        tokens.astype(dtype),
        dtype=dtype,
        tokens_per_chunk=1 << 16,
        eos_token_id=top,
        vocab_size=top + 1,
        tokenizer="synthetic",
        source={"kind": "gpu_check"},
    )


@contextmanager
def feeder(address: str | None) -> Iterator[str]:
    """`address`, or a feeder of its own on a fresh store of documents."""
    if address:
        yield address
        return
    with tempfile.TemporaryDirectory(prefix="tokenfeed-gpu-check-") as tmp:
        root = Path(tmp)
        write_documents(root / "docs", "uint16", 400_000)
        write_documents(root / "wide", "uint32", 100_000)
        port_file = root / "port"
        proc = subprocess.Popen(
            serve_argv(root, port_file), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            yield f"127.0.0.1:{wait_for_port(proc, port_file)}"
        finally:
            stop(proc, signal.SIGTERM)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="on the CPU, no GPU needed")
    p.add_argument("--device", default="cuda:0", help="the GPU to check (default cuda:0)")
    p.add_argument("--only", help="comma-separated checks (default: all)")
    p.add_argument("--address", help="a running feeder serving 'docs' (default: start one)")
    p.add_argument("--context-child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.context_child:
        context_child(args.context_child, args.address)
        return 0
    names = args.only.split(",") if args.only else list(CHECKS)
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        print(f"unknown checks {unknown}; known: {', '.join(CHECKS)}", file=sys.stderr)
        return 2
    device = "cpu" if args.dry_run else args.device
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run on a GPU machine, or --dry-run on the CPU", file=sys.stderr)
        return 2
    if not args.dry_run:
        torch.cuda.set_device(device)  # as a training script does
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    with feeder(args.address) as address:
        rig = Rig(device, address, args.dry_run)
        for name in names:
            t0 = time.perf_counter()
            try:
                status, detail = CHECKS[name](rig)
            except Exception as e:
                status, detail = "FAIL", f"{type(e).__name__}: {e}"
            counts[status] += 1
            took = time.perf_counter() - t0
            print(f"{status} {name:<10} {detail} ({took:.1f} s)", flush=True)
    where = "dry run on the CPU" if args.dry_run else device
    summary = f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped"
    print(f"gpu_check ({where}, torch {torch.__version__}): {summary}")
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
