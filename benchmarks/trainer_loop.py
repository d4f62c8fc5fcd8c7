"""The trainer's side of data loading, side by side on the same windows.

    python benchmarks/trainer_loop.py      # ~2 minutes; see --help

One uint16 store, batches of 16 x 1024 in the feeder's shuffled (block-shuffle) epoch
order, and five ways to feed a training loop:

  feeder/numpy     FeederClient from a local feeder (a `tokenfeed serve` subprocess),
                   device=None: uint16 numpy views, no torch
  feeder/torch     the same with device="cpu": int64 torch tensors (widened in the
                   client's reader thread)
  dataloader/w0    torch DataLoader over a map-style sliding-window Dataset reading the
                   same chunks with np.memmap, in the training process (num_workers=0)
  dataloader/w2    the same with num_workers=2 worker processes
  lru-chunks/w2    the original loader's style: each of 2 workers keeps an LRU of whole
                   chunks (read with np.fromfile) and slices windows out of them

For each, in a fresh process: tokens/s into a loop that does no work; CPU seconds of
the trainer process(es) (workers included, the feeder not) per 10^9 tokens; p50/p99 of
the time next() blocks; peak RSS of the trainer side (sum over its processes, sampled).
Then loops that sleep --step-ms (1, 5 and 20 ms) per batch like a training step: the
data-stall fraction (time blocked in next() / wall time), the p99 and the longest
next(). The feeder's own CPU is shown apart. Each stepped loop crosses epoch ends (the
next epoch streams ahead), and its stall counts every wait, first batches included.
At 1-5 ms steps the ring almost always holds a batch, so p99 is the cost of next()
itself right after a sleep (a bare generator's next() is ~8 us p50 / ~25 us p99 after
a 5 ms sleep on this VM); the stall is that plus the rare empty ring (a reader or
feeder descheduled on a busy machine: see the max column). 20 ms stands for an
ordinary training step. The numbers are from one run on a shared machine: read the
ratios, not the digits (benchmarks/README.md has the latest).

`--baseline-client DIR` also runs each feeder variant with the client package of
another revision (DIR is its `client/` source root, e.g. from `git archive main client
| tar -x -C /tmp/base`, with the built `client/tokenfeed/client/*.so` copied in: without
it that client decodes with protobuf, ~2x its CPU), named `<variant>@base`, in the same
rounds.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np
from procs import stat

from tokenfeed.cli.bench import measure
from tokenfeed.cli.process import serve_argv, wait_for_port
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.sampling import DEFAULT_BLOCK_TOKENS, DatasetSampler
from tokenfeed.core.store import TokenStore, write_store

SEQ_LEN, BATCH, DATASET = 1024, 16, "bench"
VARIANTS = ("feeder/numpy", "feeder/torch", "dataloader/w0", "dataloader/w2", "lru-chunks/w2")
# Document variants, e.g. --variants feeder/numpy+docs,feeder/torch+docs,dataloader/w0:
# +documents documents=True (every document output); +docs that and masked labels;
# +varlen what FlashAttention's varlen functions take (cu_seqlens, max_seqlen,
# position_ids); +mask masked labels only.
DOC_OPTIONS: dict[str, dict[str, Any]] = {
    "documents": {"documents": True},
    "docs": {"documents": True, "mask_cross_document_labels": True},
    "varlen": {"documents": ("cu_seqlens", "max_seqlen", "position_ids")},
    "mask": {"mask_cross_document_labels": True},
}
EOS = 50256


# ------------------------------------------------------------------ the baselines


def epoch_starts(store: TokenStore) -> np.ndarray:
    """The window starts of epoch 0 in the feeder's order (world size 1)."""
    spec = SamplingSpec(dataset=DATASET, seq_len=SEQ_LEN, batch_size=BATCH, shuffle=True)
    sampler = DatasetSampler(
        spec, store.total_tokens, store.meta.tokens_per_chunk or DEFAULT_BLOCK_TOKENS
    )
    return np.concatenate([bp.starts for bp in sampler.batches(0, 0)])


class MemmapWindows:
    """Map-style dataset: window i = T[s : s + seq_len + 1] via np.memmap of the chunks."""

    def __init__(self, root: Path, starts: np.ndarray) -> None:
        self.root, self.starts = root, starts
        self._maps: list[np.ndarray] | None = None
        store = TokenStore.open(root)
        self.bounds = np.cumsum([0] + [c.tokens for c in store.meta.chunks])
        self.paths = [store.chunk_path(i) for i in range(store.num_chunks)]

    def __len__(self) -> int:
        return len(self.starts)

    def chunk(self, i: int) -> np.ndarray:
        if self._maps is None:  # opened in the process that reads (workers too)
            self._maps = [np.memmap(p, dtype=np.uint16, mode="r") for p in self.paths]
        return self._maps[i]

    def window(self, s: int) -> np.ndarray:
        end = s + SEQ_LEN + 1
        c = int(np.searchsorted(self.bounds, s, side="right")) - 1
        parts = []
        while s < end:
            lo, hi = int(self.bounds[c]), int(self.bounds[c + 1])
            take = min(end, hi)
            parts.append(self.chunk(c)[s - lo : take - lo])
            s, c = take, c + 1
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def __getitem__(self, i: int) -> dict[str, Any]:
        import torch

        w = torch.from_numpy(self.window(int(self.starts[i])).astype(np.int64))
        return {"input_ids": w[:-1], "labels": w[1:]}


class LruChunkWindows(MemmapWindows):
    """The original loader's style: an LRU of whole chunks per worker process."""

    capacity = 8

    def __init__(self, root: Path, starts: np.ndarray) -> None:
        super().__init__(root, starts)
        self._lru: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()

    def chunk(self, i: int) -> np.ndarray:
        if i in self._lru:
            self._lru.move_to_end(i)
            return self._lru[i]
        data = np.fromfile(self.paths[i], dtype=np.uint16)
        self._lru[i] = data
        if len(self._lru) > self.capacity:
            self._lru.popitem(last=False)
        return data


# ------------------------------------------------------------- measuring a process


class TrainerSide:
    """Samples RSS of this process and its worker children; sums the workers' CPU."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _pids(self) -> list[int]:
        import multiprocessing

        return [os.getpid()] + [p.pid for p in multiprocessing.active_children() if p.pid]

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            total = 0
            for pid in self._pids():
                with contextlib.suppress(OSError):
                    total += stat(pid)[0]
            self.peak = max(self.peak, total)

    def worker_cpu(self) -> float:
        cpu = 0.0
        for pid in self._pids()[1:]:
            with contextlib.suppress(OSError):
                cpu += stat(pid)[1]
        return cpu

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def child(args: argparse.Namespace) -> None:
    """One variant in this (fresh) process; prints a JSON line."""
    side = TrainerSide()
    root = Path(args.root) / DATASET
    starts = np.load(Path(args.root) / "starts.npy")
    client_root = ""
    if args.child.startswith("feeder/"):
        import tokenfeed.client
        from tokenfeed.client import FeederClient

        client_root = str(Path(tokenfeed.client.__file__).parents[2])

        loader: Any = FeederClient(
            args.address,
            dataset=DATASET,
            seq_len=SEQ_LEN,
            batch_size=BATCH,
            shuffle=True,
            rank=0,
            world_size=1,
            device="cpu" if args.child.startswith("feeder/torch") else None,
            **DOC_OPTIONS.get(args.child.partition("+")[2], {}),
        )

        epoch = [0]

        def batches() -> Any:
            # Each epoch is a permutation of the same windows as the baselines' pass;
            # the next epoch streams ahead while this one ends, as in training.
            loader.set_epoch(epoch[0])
            epoch[0] += 1
            return loader
    else:
        import torch
        from torch.utils.data import DataLoader

        torch.set_num_threads(1)
        cls = LruChunkWindows if args.child.startswith("lru") else MemmapWindows
        workers = int(args.child[-1])
        loader = DataLoader(
            cls(root, starts),
            batch_size=BATCH,
            shuffle=False,
            num_workers=workers,
            persistent_workers=workers > 0,
            prefetch_factor=2 if workers else None,
        )

        def batches() -> Any:
            return loader

    empty = measure(batches, args.seconds, 0.0, extra_cpu=side.worker_cpu)
    train = [
        measure(batches, args.seconds, float(ms) / 1e3, extra_cpu=side.worker_cpu)
        for ms in args.step_ms.split(",")
    ]
    if hasattr(loader, "close"):
        loader.close()
    print(
        json.dumps(
            {
                "variant": args.child,
                "client": client_root,
                "empty": empty,
                "train": train,
                "peak_rss_mb": side.stop() / 2**20,
            }
        ),
        flush=True,
    )


# ------------------------------------------------------------------------ parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=float, default=32e6, help="store size (default 32M)")
    p.add_argument("--seconds", type=float, default=5.0, help="per measurement")
    p.add_argument(
        "--step-ms",
        default="1,5,20",
        help="simulated training step(s) in ms, comma-separated (default 1,5,20)",
    )
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--doc-tokens",
        type=float,
        default=400,
        help="median document length of the store, lognormal (default 400: mean ~660)",
    )
    p.add_argument("--repeat", type=int, default=1, help="rounds of every variant, interleaved")
    p.add_argument(
        "--baseline-client",
        type=Path,
        help="client/ source root of another revision: its feeder variants run as <variant>@base",
    )
    p.add_argument("--json", help="also write every result to this file")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--address", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)

    with tempfile.TemporaryDirectory(prefix="tokenfeed-bench-") as tmp:
        root = Path(tmp)
        n = int(args.tokens)
        tokens = (np.arange(n, dtype=np.int64) * 7919 % EOS).astype(np.uint16)
        # Documents of lognormal lengths (median ~--doc-tokens), each ending in EOS.
        rng = np.random.default_rng(0)
        lengths = rng.lognormal(np.log(args.doc_tokens), 1.0, size=n // 64 + 1).astype(np.int64)
        ends = np.cumsum(lengths + 1) - 1
        tokens[ends[ends < n]] = EOS
        write_store(
            root / DATASET,
            tokens,
            dtype="uint16",
            tokens_per_chunk=1 << 21,
            eos_token_id=50256,
            vocab_size=50257,
            tokenizer="synthetic",
            source={"kind": "benchmark"},
        )
        del tokens
        np.save(root / "starts.npy", epoch_starts(TokenStore.open(root / DATASET)))
        port_file = root / "port"
        feeder = subprocess.Popen(
            serve_argv(root, port_file),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            address = f"127.0.0.1:{wait_for_port(feeder, port_file)}"
            print(
                f"store: {n / 1e6:.0f}M uint16 tokens in {n // (1 << 21)} chunks; batches "
                f"{BATCH} x {SEQ_LEN}, shuffled; {args.seconds:g} s per measurement; "
                f"simulated steps {args.step_ms} ms; {os.cpu_count()} CPUs; load average "
                f"{os.getloadavg()[0]:.1f} at the start",
                flush=True,
            )
            results = []
            variants = args.variants.split(",")
            if args.baseline_client:  # each right after its own, under the same load
                variants = [
                    w
                    for v in variants
                    for w in ([v, f"{v}@base"] if v.startswith("feeder/") else [v])
                ]
            rounds = [variants] * args.repeat
            for k, variant in ((k, v) for k, vs in enumerate(rounds) for v in vs):
                feeder_cpu0 = stat(feeder.pid)[1]
                load0 = os.getloadavg()[0]
                env = dict(os.environ)
                if variant.endswith("@base"):  # the other revision's client package first
                    env["PYTHONPATH"] = os.pathsep.join(
                        [str(args.baseline_client.resolve()), env.get("PYTHONPATH", "")]
                    )
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        variant.removesuffix("@base"),
                        "--root",
                        str(root),
                        "--address",
                        address,
                        "--seconds",
                        str(args.seconds),
                        "--step-ms",
                        args.step_ms,
                    ],
                    check=True,
                    capture_output=True,
                    text=True,
                    env=env,
                )
                r = json.loads(out.stdout.strip().splitlines()[-1])
                if variant.endswith("@base"):  # the other client was the one imported
                    assert Path(r["client"]) == args.baseline_client.resolve(), r["client"]
                r["variant"] = variant
                r["load"] = (load0 + os.getloadavg()[0]) / 2
                moved = r["empty"]["tokens"] + sum(t["tokens"] for t in r["train"])
                r["feeder_cpu"] = (
                    (stat(feeder.pid)[1] - feeder_cpu0) / moved * 1e9
                    if variant.startswith("feeder")
                    else None
                )
                r["round"] = k
                results.append(r)
                print(f"  done {variant} (round {k + 1})", file=sys.stderr, flush=True)
        finally:
            feeder.terminate()
            feeder.wait(30)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    for k in range(args.repeat):
        if args.repeat > 1:
            print(f"\n== round {k + 1} of {args.repeat}")
        report([r for r in results if r["round"] == k], args.step_ms)
    if args.repeat > 1:
        ratio_ranges(results, args.step_ms)


def _spread(values: list[float], fmt: str = ".2f") -> str:
    v = sorted(values)
    return f"{v[0]:{fmt}} / {v[len(v) // 2]:{fmt}} / {v[-1]:{fmt}}"


def ratio_ranges(results: list[dict[str, Any]], step_ms: str) -> None:
    """Over the rounds (min / median / max): each feeder variant against the
    DataLoader with 0 workers of the same round, then each one's stall and p99
    next() at every simulated step, with the load average during its runs."""
    base = {r["round"]: r["empty"] for r in results if r["variant"] == "dataloader/w0"}
    names = sorted({r["variant"] for r in results if r["variant"].startswith("feeder/")})
    if base:
        print("\nagainst dataloader/w0 of the same round (min / median / max over rounds):")
    for name in names if base else ():
        rows = [r for r in results if r["variant"] == name and r["round"] in base]
        tps = [r["empty"]["tokens_per_s"] / base[r["round"]]["tokens_per_s"] for r in rows]
        cpu = [
            r["empty"]["cpu_s_per_1e9_tokens"] / base[r["round"]]["cpu_s_per_1e9_tokens"]
            for r in rows
        ]
        print(f"  {name:<24} tokens/s {_spread(tps)}x   CPU per token {_spread(cpu)}x")
    print("\nsimulated steps (min / median / max over rounds):")
    for name in names:
        rows = [r for r in results if r["variant"] == name]
        load = _spread([r["load"] for r in rows], ".1f")
        cpu = _spread([r["empty"]["cpu_s_per_1e9_tokens"] for r in rows], ".1f")
        print(f"  {name:<24} load {load}; trainer CPU s/1e9 tokens {cpu}")
        for i, ms in enumerate(step_ms.split(",")):
            stall = _spread([r["train"][i]["stall_fraction"] * 100 for r in rows])
            p99 = _spread([r["train"][i]["wait_p99_ms"] for r in rows], ".3f")
            print(f"  {'':<24}   {ms:>3} ms: stall {stall} %   p99 next() {p99} ms")


def report(results: list[dict[str, Any]], step_ms: str) -> None:
    steps = step_ms.split(",")
    sim = " | ".join(f"{f'{ms} ms step':^24}" for ms in steps)
    head = (
        f"{'loader':<22} {'Mtok/s':>8} {'CPU s/1e9':>10} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'RSS MB':>7} | "
        + " | ".join(f"{'stall %':>7} {'p99 ms':>8} {'max ms':>7}" for _ in steps)
        + f" | {'feeder CPU s/1e9':>16}"
    )
    print()
    print(f"{'':<22} {'empty loop':^46} | {sim} |")
    print(head)
    print("-" * len(head))
    for r in results:
        e = r["empty"]
        fc = "" if r["feeder_cpu"] is None else f"{r['feeder_cpu']:.1f}"
        sims = " | ".join(
            f"{t['stall_fraction'] * 100:>7.2f} {t['wait_p99_ms']:>8.3f} {t['wait_max_ms']:>7.2f}"
            for t in r["train"]
        )
        print(
            f"{r['variant']:<22} {e['tokens_per_s'] / 1e6:>8.1f} "
            f"{e['cpu_s_per_1e9_tokens']:>10.1f} {e['wait_p50_ms']:>8.3f} "
            f"{e['wait_p99_ms']:>8.3f} {r['peak_rss_mb']:>7.0f} | {sims} | {fc:>16}"
        )
    by = {r["variant"]: r["empty"] for r in results}
    print()
    for name in by:
        if not name.startswith("feeder/"):
            continue
        f = by[name]
        for base in ("dataloader/w0", "dataloader/w2", "lru-chunks/w2"):
            if base in by:
                b = by[base]
                print(
                    f"{name} vs {base}: {f['tokens_per_s'] / b['tokens_per_s']:.2f}x tokens/s, "
                    f"{f['cpu_s_per_1e9_tokens'] / b['cpu_s_per_1e9_tokens']:.2f}x trainer CPU "
                    f"per token"
                )


if __name__ == "__main__":
    main()
