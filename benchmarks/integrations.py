"""The per-step cost of each framework integration's data path over the bare client.

    python benchmarks/integrations.py      # ~2 minutes; see --help

One feeder (a `tokenfeed serve` subprocess) and one store; batches of 8 x 2048 as
int64 tensors on the CPU. Five ways to take a batch in a training loop that then
sleeps `--step-ms` (20 ms, an ordinary training step):

  client        `next()` of a bare FeederClient(device="cpu")
  transformers  FeederTrainer: its dataloader's next() (labels made contiguous as
                shift_labels) and the Trainer's own `_prepare_inputs` of the batch
  lightning     FeederDataModule: its train iterable's next() (the position after the
                batch noted) and `on_before_batch_transfer` (the batch marked trained)
  torchtitan    FeederDataLoader from torchtitan's build call: next() of its pairs

Per way, in turns (`--repeat` rounds, the ways interleaved so that a busy machine
weighs on all of them alike): the wall time of that data path per step and the main
thread's CPU time per step (the reader thread's, the same for all, is left out).
Printed: medians over the rounds, and each integration's overhead over the client, by
main-thread CPU time and by wall time, as microseconds and as a share of the step (the
goal: under 5 %). On a busy machine the wall column swings by hundreds of microseconds
between ways that do the same work; the CPU column holds.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.cli.process import serve_argv, wait_for_port
from tokenfeed.core.store import write_store

DATASET, SEQ_LEN, BATCH = "bench", 2048, 8
WAYS = ("client", "transformers", "lightning", "torchtitan")


def client_steps(address: str) -> Iterator[Any]:
    from tokenfeed.client import FeederClient

    with FeederClient(address, **request(), device="cpu") as loader:
        yield from endless(loader)


def transformers_steps(address: str) -> Iterator[Any]:
    import transformers

    from tokenfeed.integrations.transformers import FeederTrainer

    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=512,
            n_positions=64,
            n_embd=8,
            n_layer=1,
            n_head=1,
            bos_token_id=0,
            eos_token_id=0,
        )
    )
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(output_dir=out, report_to=[], use_cpu=True)
        trainer = FeederTrainer(model, args, train_loader={"address": address, **request()})
        batches = trainer.get_train_dataloader()
        with trainer.train_loader:
            while True:
                batches.set_epoch(0)
                for batch in batches:
                    yield trainer._prepare_inputs(batch)


def lightning_steps(address: str) -> Iterator[Any]:
    import lightning as L

    from tokenfeed.integrations.lightning import FeederDataModule

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    trainer.training = True
    data = FeederDataModule(address, train=request())
    data.trainer = trainer
    data.setup("fit")
    try:
        while True:
            for batch in data.train_dataloader():
                yield data.on_before_batch_transfer(batch, 0)
    finally:
        data.teardown("fit")


def torchtitan_steps(address: str) -> Iterator[Any]:
    from tokenfeed.integrations.torchtitan import FeederDataLoader

    config = FeederDataLoader.Config(address=address, dataset=DATASET, shuffle=True, seed=1)
    loader = config.build(dp_rank=0, dp_world_size=1, seq_len=SEQ_LEN, local_batch_size=BATCH)
    try:
        yield from loader
    finally:
        loader.close()


def request() -> dict[str, Any]:
    return {"dataset": DATASET, "seq_len": SEQ_LEN, "batch_size": BATCH, "shuffle": True, "seed": 1}


def endless(loader: Any) -> Iterator[Any]:
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def measure(steps: Iterator[Any], n: int, step_s: float) -> tuple[float, float]:
    """(wall, main-thread CPU) seconds per step of taking a batch, over n steps after a
    warm-up; each step then sleeps step_s."""
    for _ in range(20):
        next(steps)
        time.sleep(step_s)
    wall = cpu = 0.0
    for _ in range(n):
        w0, c0 = time.perf_counter(), time.thread_time()
        next(steps)
        wall, cpu = wall + time.perf_counter() - w0, cpu + time.thread_time() - c0
        time.sleep(step_s)
    return wall / n, cpu / n


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--step-ms", type=float, default=20.0)
    p.add_argument("--steps", type=int, default=150, help="measured steps per way and round")
    p.add_argument("--repeat", type=int, default=3, help="rounds, the ways interleaved")
    p.add_argument("--ways", default=",".join(WAYS))
    args = p.parse_args()
    ways = args.ways.split(",")
    makers: dict[str, Callable[[str], Iterator[Any]]] = {
        "client": client_steps,
        "transformers": transformers_steps,
        "lightning": lightning_steps,
        "torchtitan": torchtitan_steps,
    }
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp) / "data"
        rng = np.random.default_rng(0)
        write_store(
            root / DATASET,
            rng.integers(0, 512, size=8_000_000).astype(np.uint16),
            dtype="uint16",
            tokens_per_chunk=1 << 20,
            vocab_size=512,
            tokenizer="random",
        )
        port_file = Path(tmp) / "port"
        proc = subprocess.Popen(serve_argv(root, port_file), stderr=subprocess.DEVNULL)
        stack.callback(proc.wait, 30)
        stack.callback(proc.terminate)
        address = f"127.0.0.1:{wait_for_port(proc, port_file)}"
        streams = {w: stack.enter_context(contextlib.closing(makers[w](address))) for w in ways}
        results: dict[str, list[tuple[float, float]]] = {w: [] for w in ways}
        for _ in range(args.repeat):
            for w in ways:
                results[w].append(measure(streams[w], args.steps, args.step_ms / 1e3))

    step_us = args.step_ms * 1e3
    medians = {
        w: tuple(statistics.median(r[i] for r in results[w]) * 1e6 for i in (0, 1)) for w in ways
    }
    base_wall, base_cpu = medians["client"]
    print(
        f"batches {BATCH} x {SEQ_LEN}, int64 on the CPU, {args.step_ms:g} ms step, "
        f"{args.repeat} rounds of {args.steps} steps (medians; overheads over the client)"
    )
    print(
        f"{'way':<13} {'wall us/step':>13} {'CPU us/step':>12} {'CPU over us':>12} "
        f"{'of step':>8} {'wall over us':>13} {'of step':>8}"
    )
    for w in ways:
        wall, cpu = medians[w]
        over = ""
        if w != "client":
            over_cpu, over_wall = cpu - base_cpu, wall - base_wall
            over = (
                f" {over_cpu:12.1f} {100 * over_cpu / step_us:7.2f}%"
                f" {over_wall:13.1f} {100 * over_wall / step_us:7.2f}%"
            )
        print(f"{w:<13} {wall:13.1f} {cpu:12.1f}{over}")


if __name__ == "__main__":
    main()
