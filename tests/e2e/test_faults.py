"""Faults end to end: trainers killed and resumed (once with another world size), a
chunk corrupted under a running feeder, malformed stores, and what /metrics reveals.

Everything is real: `tokenfeed serve` processes or in-process feeders on loopback,
trainer subprocesses killed with SIGKILL, files damaged on disk while served. Stores
are positional (token i == i), so every delivered token is checkable, and
exactly-once is checked by window `starts` against the epoch order the sampling
engine computes (`service.sampler_for`, the server's own request -> DatasetSampler mapping).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.client import Backoff, FeederClient
from tokenfeed.core.errors import DataLoss
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import META_NAME
from tokenfeed.server.datasets import Catalog
from tokenfeed.server.service import sampler_for
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import free_port, wait_until
from support.feeders import FeederProcess, running_feeder
from support.stores import assert_positional_batch, make_positional_store

pytestmark = pytest.mark.slow

WAIT_SECONDS = 60.0  # a bound on every poll below, so a hang fails with a message

# ------------------------------------------------------------------ killed trainers

# A minimal trainer: one FeederClient rank, the starts it trained on appended to a
# log, and after every step a checkpoint of the data position together with the
# log's length (the "model" state), written atomically. On start it loads the
# checkpoint, forgets what was logged after it and continues; a killed step is
# therefore trained again, exactly as a real job redoes the steps after its last
# checkpoint. It checks every token (positional store) and can hang after a step
# (a job stopped at a barrier) so the test kills it at a known position.
TRAINER = r"""
import json, os, sys, time
from pathlib import Path

import numpy as np

from tokenfeed.client import Backoff, FeederClient

cfg = json.loads(sys.argv[1])
work = Path(cfg["work"])
log_path, ckpt_path = work / "starts.log", work / "ckpt.json"
loader = FeederClient(cfg["address"], rank=cfg["rank"], world_size=cfg["world_size"],
                      backoff=Backoff(initial=0.05, maximum=0.5, deadline=60),
                      **cfg["sampling"])
logged = 0
if ckpt_path.exists():
    ckpt = json.loads(ckpt_path.read_text())
    loader.load_state_dict(ckpt["data"])
    logged = ckpt["log_len"]
lines = log_path.read_text().splitlines(keepends=True) if log_path.exists() else []
if len(lines) < logged or not all(line.endswith("\n") for line in lines[:logged]):
    sys.exit(f"log shorter than its checkpoint: {len(lines)} < {logged}")
log_path.write_text("".join(lines[:logged]))
loader.set_epoch(0)  # keeps the loaded position
seq_len = cfg["sampling"]["seq_len"]
with open(log_path, "a") as log:
    for batch in loader:
        starts = batch["starts"]
        want = starts[:, None] + np.arange(seq_len)
        if not (np.array_equal(batch["input_ids"], want)
                and np.array_equal(batch["labels"], want + batch["shift"])):
            sys.exit(f"wrong tokens at step {batch['step']}")
        log.write("".join(f"{s}\n" for s in starts.tolist()))
        log.flush()  # in the kernel: survives SIGKILL
        logged += len(starts)
        tmp = ckpt_path.with_name("ckpt.json.tmp")
        tmp.write_text(json.dumps({"data": loader.state_dict(), "log_len": logged}))
        os.replace(tmp, ckpt_path)
        if batch["step"] + 1 == cfg.get("hang_after"):
            (work / "hanging").touch()
            while True:  # a hung rank: the behaviour under test
                time.sleep(1)
        time.sleep(cfg["step_seconds"])  # the training step's time
loader.close()
(work / "done").touch()
"""

SAMPLING = {
    "dataset": "positions",
    "seq_len": 32,
    "stride": 32,
    "batch_size": 8,
    "shuffle": True,
    "seed": 11,
}


@pytest.fixture
def trainer_root(tmp_path: Path) -> Path:
    """60,000 tokens in chunks of 6,000: 1,874 windows, ~117 steps per rank of 2."""
    root = tmp_path / "data"
    make_positional_store(root / "positions", 60_000, 6_000)
    return root


class Trainer:
    """One trainer rank as a subprocess, with its own work directory."""

    def __init__(
        self,
        script: Path,
        work: Path,
        address: str,
        rank: int,
        world_size: int,
        step_seconds: float = 0.0,
        hang_after: int | None = None,
    ) -> None:
        self.script, self.work = script, work
        work.mkdir(parents=True, exist_ok=True)
        self.cfg = {
            "work": str(work),
            "address": address,
            "rank": rank,
            "world_size": world_size,
            "sampling": SAMPLING,
            "step_seconds": step_seconds,
            "hang_after": hang_after,
        }
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        with open(self.work / "stderr", "ab") as err:
            self.proc = subprocess.Popen(
                [sys.executable, str(self.script), json.dumps(self.cfg)], stderr=err
            )

    def ckpt(self) -> dict | None:
        try:
            return json.loads((self.work / "ckpt.json").read_text())
        except FileNotFoundError:
            return None

    def stderr(self) -> str:
        return (self.work / "stderr").read_text(errors="replace")

    def wait_for(self, done, what: str) -> None:
        def ready() -> bool:
            assert self.proc is not None
            assert self.proc.poll() is None, (
                f"rank {self.cfg['rank']} exited ({self.proc.returncode}) before {what}:\n"
                f"{self.stderr()}"
            )
            return bool(done())

        wait_until(ready, WAIT_SECONDS, what, poll=0.01)

    def wait_step(self, step: int) -> None:
        self.wait_for(
            lambda: (self.ckpt() or {"data": {"step": -1}})["data"]["step"] >= step, f"step {step}"
        )

    def kill(self) -> None:
        """SIGKILL; the trainer must still have been running (killed mid-epoch)."""
        assert self.proc is not None
        self.proc.kill()
        assert self.proc.wait(30) == -signal.SIGKILL, self.stderr()
        assert not (self.work / "done").exists()

    def finish(self) -> None:
        assert self.proc is not None
        assert self.proc.wait(WAIT_SECONDS) == 0, self.stderr()
        assert (self.work / "done").exists()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)

    def starts(self) -> list[int]:
        """What this rank trained on: its log up to its last checkpoint."""
        ckpt = self.ckpt()
        lines = (self.work / "starts.log").read_text().splitlines()
        return [int(x) for x in lines[: ckpt["log_len"] if ckpt else 0]]


def plan_starts(
    root: Path, world_size: int, rank: int, offset: int = 0, until: int | None = None
) -> list[int]:
    """The starts the sampling engine gives `rank` from `offset` (to offset `until`)."""
    p = pb.SamplingParams(split="train", split_rate=1.0, world_size=world_size, **SAMPLING)
    sampler = sampler_for(SamplingSpec.from_proto(p), Catalog(root).get(SAMPLING["dataset"]))
    return [
        s
        for bp in sampler.batches(0, rank, offset)
        if until is None or bp.offset < until
        for s in bp.starts.tolist()
    ]


def assert_exactly_once(got: list[int], expected: list[int]) -> None:
    assert len(set(expected)) == len(expected)  # the sampler itself repeats nothing
    assert len(set(got)) == len(got), "a window was trained twice"
    assert sorted(got) == sorted(expected), "windows lost or foreign windows delivered"


@pytest.fixture
def trainers(tmp_path: Path):
    """A factory of Trainer ranks; every one still running at the end is killed."""
    script = tmp_path / "trainer.py"
    script.write_text(TRAINER)
    started: list[Trainer] = []

    def make(work: Path, *args, **kw) -> Trainer:
        t = Trainer(script, work, *args, **kw)
        started.append(t)
        return t

    yield make
    for t in started:
        t.stop()


def test_trainers_killed_mid_epoch_resume_exactly_once(
    trainer_root: Path, tmp_path: Path, trainers
) -> None:
    with FeederProcess(trainer_root) as feeder:
        ranks = [
            trainers(tmp_path / f"rank{r}", feeder.address, r, 2, step_seconds=0.02)
            for r in range(2)
        ]
        ranks[1].wait_step(10)
        ranks[1].kill()  # one rank dies alone...
        ranks[1].start()
        ranks[0].wait_step(40)
        ranks[1].wait_step(ranks[1].ckpt()["data"]["step"] + 5)  # the restarted one moved on
        for t in ranks:  # ...then both at once
            t.kill()
        for t in ranks:
            t.start()
        for t in ranks:
            t.finish()
    per_rank = [plan_starts(trainer_root, 2, r) for r in range(2)]
    for r, t in enumerate(ranks):
        assert t.starts() == per_rank[r]  # in order, too
    assert_exactly_once(ranks[0].starts() + ranks[1].starts(), per_rank[0] + per_rank[1])


def test_resume_with_a_different_world_size_exactly_once(
    trainer_root: Path, tmp_path: Path, trainers
) -> None:
    k = 20  # both ranks checkpoint step k, then the job is killed (e.g. a node lost)
    with FeederProcess(trainer_root) as feeder:
        old = [trainers(tmp_path / f"old{r}", feeder.address, r, 2, hang_after=k) for r in range(2)]
        for t in old:
            t.wait_for(lambda t=t: (t.work / "hanging").exists(), f"step {k}")
        for t in old:
            t.kill()
        ckpts = [t.ckpt() for t in old]
        assert [c["data"]["step"] for c in ckpts] == [k, k]
        offset = ckpts[0]["data"]["offset"]
        assert ckpts[1]["data"] == ckpts[0]["data"]
        assert offset == k * 2 * SAMPLING["batch_size"]

        # Three ranks resume from the job's data state; one of them is killed once more.
        new = []
        for r in range(3):
            work = tmp_path / f"new{r}"
            work.mkdir()
            (work / "ckpt.json").write_text(json.dumps({"data": ckpts[0]["data"], "log_len": 0}))
            new.append(trainers(work, feeder.address, r, 3, step_seconds=0.01))
        new[2].wait_step(k + 10)
        new[2].kill()
        new[2].start()
        for t in new:
            t.finish()
    for r, t in enumerate(old):
        assert t.starts() == plan_starts(trainer_root, 2, r, until=offset)
    for r, t in enumerate(new):
        assert t.starts() == plan_starts(trainer_root, 3, r, offset=offset)
        assert t.ckpt()["data"]["step"] > k
    got = [s for t in old + new for s in t.starts()]
    expected = [s for r in range(2) for s in plan_starts(trainer_root, 2, r, until=offset)]
    expected += [s for r in range(3) for s in plan_starts(trainer_root, 3, r, offset=offset)]
    assert_exactly_once(got, expected)
    # Everything but the train split's short last global batch of 3 x 8 was trained.
    windows = (60_000 - SAMPLING["seq_len"] - 1) // SAMPLING["stride"] + 1
    assert windows - 3 * SAMPLING["batch_size"] < len(got) <= windows


# ------------------------------------------------------------ a chunk corrupted live


def test_chunk_corrupted_while_serving_is_data_loss_for_its_streams_only(tmp_path: Path) -> None:
    # 200,000 tokens in 10 chunks; split_rate 0.5: train is chunks 0-4, validation 5-9.
    root = tmp_path / "data"
    store = make_positional_store(root / "victim", 200_000, 20_000)
    bad = store.chunk_path(4)  # the last train chunk
    bad_start = int(store.chunk_starts[4])
    # The train stream moves 16 tokens per 8 KiB batch: the server (which runs a few MiB
    # ahead of a client, within HTTP/2 flow control) reaches chunk 4 only after ~40 MiB,
    # long after the byte below is flipped.
    train = dict(dataset="victim", split_rate=0.5, seq_len=256, stride=2, batch_size=8)
    valid = dict(
        dataset="victim", split="validation", split_rate=0.5, seq_len=256, stride=16, batch_size=8
    )
    with (
        FeederProcess(root, cache_bytes="256K") as feeder,
        FeederClient(feeder.address, **train) as a,
        FeederClient(feeder.address, **valid) as b,
    ):
        a_it, b_it = iter(a), iter(b)
        a_got = b_got = 0
        for _ in range(3):  # both streams are running
            assert_positional_batch(next(a_it), 256)
            assert_positional_batch(next(b_it), 256)
        with open(bad, "r+b") as f:  # flip one byte in place, as bit rot would
            f.seek(40_000)
            byte = f.read(1)
            f.seek(40_000)
            f.write(bytes([byte[0] ^ 0xFF]))
        with pytest.raises(DataLoss) as info:  # noqa: PT012 - read until the error
            for a_got, batch in enumerate(a_it, start=4):
                assert_positional_batch(batch, 256)  # every batch delivered is still right
                assert int(batch["starts"].max()) + 256 + batch["shift"] <= bad_start
                if a_got % 8 == 0:  # the other stream keeps going alongside
                    assert_positional_batch(next(b_it), 256)
                    b_got += 1
        assert a_got > 1000  # the fault came mid-stream, not at the start
        assert "chunk_000004.bin" in str(info.value)
        assert "corrupt" in str(info.value)
        assert str(root) not in str(info.value)  # the data root stays private
        assert 0 < b_got + 3 < len(b)  # b was mid-epoch when a failed...
        for batch in b_it:  # ...and finishes its epoch, every token right
            assert_positional_batch(batch, 256)
            b_got += 1
        assert b_got + 3 == len(b)
        # The feeder still serves: Info, and a fresh stream over healthy chunks.
        with grpc.insecure_channel(feeder.address) as ch:
            names = [d.name for d in pb_grpc.FeederStub(ch).Info(pb.InfoRequest()).datasets]
        assert names == ["victim"]  # opening checks sizes only; the flip is inside
        with FeederClient(feeder.address, **valid) as again:
            assert sum(1 for _ in again) == len(b)
    result = subprocess.run(
        [sys.executable, "-m", "tokenfeed", "verify", str(root / "victim")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result
    assert "chunk_000004.bin" in result.stderr
    assert "1 problem(s)" in result.stdout
    assert "chunk_000003.bin" not in result.stderr


# ------------------------------------------------------------------ malformed stores


def _edit_meta(store: Path, edit) -> None:
    doc = json.loads((store / META_NAME).read_text())
    edit(doc)
    (store / META_NAME).write_text(json.dumps(doc))


def _lie_about_a_chunk(doc: dict) -> None:
    doc["chunks"][1]["tokens"] = 900  # and a consistent total: only the file disagrees
    doc["total_tokens"] = sum(c["tokens"] for c in doc["chunks"])


# name -> (damage, what the error must say); every store is 4,000 tokens in 4 chunks.
# Found when the store opens (its meta.json alone, docs/stores.md): never listed.
BROKEN_AT_OPEN = {
    "lies-total": (
        lambda p: _edit_meta(p, lambda d: d.update(total_tokens=5000)),
        "total_tokens=5000 but its chunks hold 4000",
    ),
    "unknown-dtype": (
        lambda p: _edit_meta(p, lambda d: d.update(dtype="float32")),
        "unknown token dtype 'float32'",
    ),
    "duplicate-chunk": (
        lambda p: _edit_meta(p, lambda d: d["chunks"].append(d["chunks"][0])),
        "chunk(s) ['chunk_000000.bin'] more than once",
    ),
}
# Found at a chunk's first read: listed, and every stream that needs the chunk fails.
BROKEN_AT_READ = {
    "truncated": (
        lambda p: os.truncate(p / "chunk_000002.bin", 1000),
        "chunk_000002.bin has 1000 bytes, expected 1000 tokens x 4",
    ),
    "lies-chunk": (
        lambda p: _edit_meta(p, _lie_about_a_chunk),
        "chunk_000001.bin has 4000 bytes, expected 900 tokens",
    ),
    "wrong-dtype": (
        lambda p: _edit_meta(p, lambda d: d.update(dtype="uint16")),
        "chunk_000000.bin has 4000 bytes, expected 1000 tokens x 2",
    ),
    "missing-chunk": (lambda p: (p / "chunk_000003.bin").unlink(), "chunk_000003.bin is missing"),
}
BROKEN = {**BROKEN_AT_OPEN, **BROKEN_AT_READ}


def _params(dataset: str, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(
        **{
            "dataset": dataset,
            "split": "train",
            "split_rate": 1.0,
            "seq_len": 64,
            "stride": 64,
            "batch_size": 4,
            "world_size": 1,
            **kw,
        }
    )


def _stream_error(stub: pb_grpc.FeederStub, dataset: str, served: bool) -> grpc.RpcError:
    """The status of a StreamBatches call that must fail: before any batch arrives, or
    (`served`) once its batches reach a damaged chunk, every token before it right."""
    batches = []
    with pytest.raises(grpc.RpcError) as info:  # noqa: PT012 - read until the error
        for response in stub.StreamBatches(pb.StreamBatchesRequest(params=_params(dataset))):
            batches += response.batches
    if not served:
        assert batches == []
    for b in batches:  # never a wrong token: each is its position in the store
        rows = np.frombuffer(b.tokens, dtype=b.dtype).reshape(b.rows, b.cols)
        assert (rows == np.add.outer(np.asarray(b.starts), np.arange(b.cols))).all()
    return info.value


def test_malformed_stores_are_skipped_and_refused_never_served(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "data"
    make_positional_store(root / "healthy", 10_000, 1_000)
    for name, (damage, _) in BROKEN.items():
        make_positional_store(root / name, 4_000, 1_000)
        damage(root / name)
    make_positional_store(root / "shrinks", 4_000, 1_000)  # damaged after it was served
    caplog.set_level(logging.WARNING, logger="tokenfeed.server.datasets")
    with running_feeder(root, cache_bytes=4096) as f, grpc.insecure_channel(f.address) as ch:
        stub = pb_grpc.FeederStub(ch)
        names = [d.name for d in stub.Info(pb.InfoRequest()).datasets]
        assert names == sorted(["healthy", "shrinks", *BROKEN_AT_READ])
        logged = caplog.text
        for name in BROKEN_AT_OPEN:
            assert f"skipping dataset {name!r}" in logged
        assert str(root) not in logged

        for name, (_, message) in BROKEN.items():
            errors = [_stream_error(stub, name, served=name in BROKEN_AT_READ)]
            if name in BROKEN_AT_OPEN:
                errors.append(
                    _call_error(lambda name=name: stub.Info(pb.InfoRequest(dataset=name)))
                )
            for err in errors:
                assert err.code() == grpc.StatusCode.DATA_LOSS, (name, err.details())
                assert err.details().startswith(f"{name}: "), err.details()
                assert message in err.details(), err.details()
                assert str(root) not in err.details()

        # Served once (the store stays open, its chunks cycle through the 4 KiB cache),
        # then a chunk is cut short on disk: the next read of it is DATA_LOSS.
        first = [
            b
            for r in stub.StreamBatches(pb.StreamBatchesRequest(params=_params("shrinks")))
            for b in r.batches
        ]
        assert len(first) == ((4_000 - 65) // 64 + 1) // 4
        os.truncate(root / "shrinks" / "chunk_000001.bin", 2000)
        got = []
        with pytest.raises(grpc.RpcError) as info:  # noqa: PT012 - read until the error
            for r in stub.StreamBatches(pb.StreamBatchesRequest(params=_params("shrinks"))):
                got += r.batches
        err = info.value
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert "chunk_000001.bin has 2000 bytes, expected 1000 tokens x 4" in err.details()
        assert all(max(b.starts) + b.cols <= 1000 for b in got)  # only chunk 0's windows

        # The healthy store streams a whole epoch, token == position.
        with FeederClient(f.address, dataset="healthy", seq_len=64, batch_size=4) as c:
            n = 0
            for batch in c:
                assert_positional_batch(batch, 64)
                n += 1
            assert n == len(c) == ((10_000 - 65) // 64 + 1) // 4


def _call_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


# ------------------------------------------------------------------ metrics privacy


def test_metrics_expose_no_paths_or_secrets(tmp_path: Path) -> None:
    root = tmp_path / "data-root-private"
    make_positional_store(root / "positions", 10_000, 1_000)
    make_positional_store(root / "broken", 2_000, 1_000)
    (root / "broken" / "chunk_000001.bin").unlink()
    token = "tf-secret-" + secrets.token_hex(16)
    token_file = tmp_path / "secret-dir" / "token"
    token_file.parent.mkdir()
    token_file.write_text(token + "\n")
    metrics_port = free_port()
    with FeederProcess(root, metrics_port=metrics_port, auth_token_file=token_file) as feeder:
        with FeederClient(
            feeder.address,
            token=token,
            dataset="positions",
            seq_len=64,
            batch_size=4,
            backoff=Backoff(max_retries=2, deadline=None),
        ) as c:
            assert sum(1 for _ in c) == len(c)
        auth = (("authorization", f"Bearer {token}"),)
        wrong = (("authorization", "Bearer not-" + token),)
        codes = []
        with grpc.insecure_channel(feeder.address) as ch:
            stub = pb_grpc.FeederStub(ch)
            calls = [
                lambda: stub.Info(pb.InfoRequest()),  # no token
                lambda: stub.Info(pb.InfoRequest(), metadata=wrong),
                lambda: stub.Info(pb.InfoRequest(dataset="../../etc/passwd"), metadata=auth),
                lambda: stub.Info(pb.InfoRequest(dataset="etc/passwd"), metadata=auth),
                lambda: list(
                    stub.StreamBatches(
                        pb.StreamBatchesRequest(params=_params("etc/passwd")), metadata=auth
                    )
                ),
                lambda: list(
                    stub.StreamBatches(
                        pb.StreamBatchesRequest(params=_params(str(root / "positions"))),
                        metadata=auth,
                    )
                ),
                lambda: list(
                    stub.StreamBatches(
                        pb.StreamBatchesRequest(params=_params("broken")), metadata=auth
                    )
                ),
            ]
            for call in calls:
                codes.append(_call_error(call).code().name)
        assert codes == [
            "UNAUTHENTICATED",
            "UNAUTHENTICATED",
            "INVALID_ARGUMENT",
            "NOT_FOUND",
            "NOT_FOUND",
            "INVALID_ARGUMENT",
            "DATA_LOSS",
        ]
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10)
            .read()
            .decode()
        )
    # The calls above were counted...
    assert 'tokenfeed_server_errors_total{code="UNAUTHENTICATED"} 2.0' in text
    assert 'tokenfeed_server_errors_total{code="NOT_FOUND"} 2.0' in text
    assert 'tokenfeed_server_batches_sent_total{dataset="positions",split="train"}' in text
    # ...and nothing in the scrape says where the data lives or what the secrets are.
    for secret in (
        str(root),
        str(tmp_path),
        "data-root-private",
        "secret-dir",
        str(token_file),
        token,
        token[len("tf-secret-") :],
        "passwd",
        "etc/",
        "chunk_000001",
    ):
        assert secret not in text, secret
