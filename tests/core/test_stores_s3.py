"""Stores in object storage, against a real S3 server (SeaweedFS, one per session).

The default suite keeps these few (one server start, ~4 s, is shared); the fault
tests behind the S3 fault proxy are marked slow (tests/e2e/test_stores_s3_faults.py).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.cli import main
from tokenfeed.core.errors import DataLoss, NotFound, PermissionDenied, StorageUnavailable
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import META_NAME, TokenStore, open_store
from tokenfeed.core.store.objects import ObjectStore, RetryPolicy
from tokenfeed.prepare.output import PROGRESS_NAME
from tokenfeed.prepare.pipeline import PrepareConfig, prepare
from tokenfeed.prepare.sources import IterableSource
from tokenfeed.server.datasets import Catalog
from tokenfeed.server.service import sampler_for
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import wait_until
from support.feeders import running_feeder
from support.prepare import make_documents, write_jsonl
from support.stores import make_positional_store

FAST = RetryPolicy(attempts=5, base_delay=0.005, max_delay=0.05, read_timeout=2.0)
WRONG_SECRET = "WRONG-secret-value-that-must-not-appear-0001"


def params(dataset: str, **kw) -> pb.SamplingParams:  # type: ignore[no-untyped-def]
    base = dict(dataset=dataset, split="train", split_rate=0.9, seq_len=64, stride=48)
    return pb.SamplingParams(**(base | {"batch_size": 4, "world_size": 1} | kw))


def stream(address: str, p: pb.SamplingParams) -> list[pb.Batch]:
    with grpc.insecure_channel(address) as ch:
        req = pb.StreamBatchesRequest(params=p)
        return [b for r in pb_grpc.FeederStub(ch).StreamBatches(req) for b in r.batches]


def check_positional(batches: list[pb.Batch], root: str, p: pb.SamplingParams) -> None:
    """Every batch is what the sampler says, token by token (token i == i)."""
    expected = list(
        sampler_for(SamplingSpec.from_proto(p), Catalog(root).get(p.dataset)).batches(0, 0)
    )
    assert len(batches) == len(expected) > 0
    for b, bp in zip(batches, expected, strict=True):
        assert list(b.starts) == bp.starts.tolist()
        rows = np.frombuffer(b.tokens, dtype=np.dtype(b.dtype)).reshape(b.rows, b.cols)
        np.testing.assert_array_equal(rows, np.array(b.starts)[:, None] + np.arange(b.cols))


def test_object_store_round_trip_and_safe_errors(
    s3, s3_env, s3_root: str, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG)
    store = ObjectStore(s3_root, policy=FAST)
    big = os.urandom(5 << 20)
    store.put("ds/chunk_000000.bin", big)
    store.put("ds/meta.json", b"{}")
    store.put("other/x", b"x")
    assert [o.key for o in store.list("ds/")] == ["ds/chunk_000000.bin", "ds/meta.json"]
    assert store.head("ds/chunk_000000.bin").size == len(big)
    assert store.get("ds/chunk_000000.bin", size=len(big)) == big
    assert store.child("ds").get("meta.json") == b"{}"
    assert store.get_range("ds/chunk_000000.bin", 12345, 1 << 20) == big[12345 : 1 << 20]
    with pytest.raises(DataLoss, match="expected 7"):
        store.get("ds/meta.json", size=7)
    with pytest.raises(NotFound, match=f"{s3_root}/nope"):
        store.get("nope")
    assert store.delete_prefix("ds/") == 2
    assert [o.key for o in store.list()] == ["other/x"]
    assert store.retries == 0
    # wrong secret / no such bucket: PermissionDenied naming the place, never a secret
    bad = ObjectStore(s3_root, policy=FAST, env=s3_env | {"AWS_SECRET_ACCESS_KEY": WRONG_SECRET})
    errors = []
    for call in (bad.check_access, bad.list, lambda: bad.head("k"), lambda: bad.get("k")):
        with pytest.raises(PermissionDenied) as ei:
            call()
        errors.append(ei.value)
    with pytest.raises(PermissionDenied, match="no-such-bucket"):
        ObjectStore("s3://no-such-bucket/x", policy=FAST, env=s3_env).check_access()
    for e in errors:
        assert "credentials" in e.message
        assert e.message.startswith(s3_root)
        assert e.__cause__ is None
        assert e.__suppress_context__
    text = " ".join(e.message for e in errors) + caplog.text + repr(bad) + repr(bad._settings)
    assert WRONG_SECRET not in text
    assert s3.secret_key not in text
    assert bad.retries == 0  # 403 is not retried


def test_a_refused_connection_is_retried_and_named(s3_env) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    store = ObjectStore("s3://b/p", policy=FAST, env=s3_env | {"AWS_ENDPOINT_URL": closed})
    with pytest.raises(StorageUnavailable) as ei:
        store.check_access()
    assert ei.value.message == "s3://b/p/: LIST failed after 5 attempt(s): connection refused"
    assert store.retries == 4


def test_feeder_serves_native_stores_from_s3(s3_root: str) -> None:
    make_positional_store(f"{s3_root}/positions", 10_000, 1_000)  # type: ignore[arg-type]
    with running_feeder(s3_root, cache_bytes=1 << 20) as f:  # type: ignore[arg-type]
        p = params("positions")
        check_positional(stream(f.address, p), s3_root, p)
        with grpc.insecure_channel(f.address) as ch:
            info = pb_grpc.FeederStub(ch).Info(pb.InfoRequest())
        assert [d.name for d in info.datasets] == ["positions"]
        # uploaded after the feeder started: found when first asked for
        make_positional_store(f"{s3_root}/later/x", 5_000, 700)  # type: ignore[arg-type]
        check_positional(stream(f.address, params("later/x")), s3_root, params("later/x"))
        # a corrupt chunk: DATA_LOSS naming the object, the other stores keep serving
        make_positional_store(f"{s3_root}/bad", 5_000, 1_000)  # type: ignore[arg-type]
        objects = ObjectStore(s3_root)
        data = bytearray(objects.get("bad/chunk_000001.bin"))
        data[5] ^= 1
        objects.put("bad/chunk_000001.bin", bytes(data))
        with pytest.raises(grpc.RpcError) as ei:
            stream(f.address, params("bad"))
        assert ei.value.code() == grpc.StatusCode.DATA_LOSS
        assert f"{s3_root}/bad: chunk chunk_000001.bin is corrupt" in ei.value.details()
        check_positional(stream(f.address, p), s3_root, p)
        for name in ("../positions", "nope"):
            with pytest.raises(grpc.RpcError) as ei:
                stream(f.address, params(name))
            assert ei.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND)
    assert TokenStore.open(f"{s3_root}/bad").verify() == [
        f"{s3_root}/bad: chunk chunk_000001.bin is corrupt (checksum "
        + TokenStore.open(f"{s3_root}/bad").verify()[0].split("(checksum ")[1]
    ]


DOCS = make_documents(150, seed=3)


class Interrupted(KeyboardInterrupt):
    pass


def test_streams_opened_together_share_one_head_of_a_remote_store(
    s3, s3_root: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # type: ignore[no-untyped-def]
    """A remote dataset's generation (meta.json's ETag) is probed by one HEAD per
    PROBE_SECONDS, one at a time: ranks opening streams together pay one round trip; a
    store rewritten in object storage is picked up once that time has passed."""
    import threading
    import time

    from tokenfeed.server import datasets

    from support.s3faultproxy import S3FaultProxy

    monkeypatch.setattr(datasets, "PROBE_SECONDS", 2.0)
    make_positional_store(f"{s3_root}/x", 2_000, 500)  # type: ignore[arg-type]
    with S3FaultProxy(("127.0.0.1", s3.ports.s3), seed=1) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        catalog = Catalog(s3_root)
        first = catalog.get("x")
        time.sleep(2.1)  # time passing is under test: the probe is stale, the next get makes one
        proxy.configure(latency=0.1)  # a slow HEAD, so the threads below arrive during it
        heads = proxy.methods_seen.get("HEAD", 0)
        got: list[datasets.Dataset] = []
        threads = [threading.Thread(target=lambda: got.append(catalog.get("x"))) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert got == [first] * 8
        assert proxy.methods_seen["HEAD"] - heads == 1
        proxy.configure(latency=0.0)
        # a probe younger than PROBE_SECONDS is taken as current (an hour: however long
        # the rewrite takes on a busy machine), an older one is made again
        monkeypatch.setattr(datasets, "PROBE_SECONDS", 3600.0)
        make_positional_store(f"{s3_root}/x", 3_000, 500)  # type: ignore[arg-type]
        assert catalog.get("x") is first
        monkeypatch.setattr(datasets, "PROBE_SECONDS", 0.0)
        wait_until(lambda: catalog.get("x") is not first, 10, "the rewritten store")
        assert catalog.get("x").store.total_tokens == 3_000


def test_read_ahead_on_s3_reaches_into_the_next_epoch(s3_root: str) -> None:
    """As a stream over object storage ends, the next epoch's first chunks are read
    ahead (a trainer's next stream would otherwise wait for their GETs)."""
    make_positional_store(f"{s3_root}/epochs", 40_000, 1_000)  # type: ignore[arg-type]
    # 40 chunks of 4 KB; the cache holds 6 of them, the read-ahead budget 12
    with running_feeder(s3_root, cache_bytes=24_000, readahead_bytes=48_000) as f:  # type: ignore[arg-type]
        p = params("epochs", shuffle=True, shuffle_blocks=2, seed=3, split_rate=1.0)
        check_positional(stream(f.address, p), s3_root, p)
        ds = f.server.catalog.get("epochs")
        spec = SamplingSpec.from_proto(p)
        first = next(sampler_for(spec, ds).batches(1, 0)).starts.tolist()
        wanted = {ds.store.chunk_of(s) for s in first}
        cache = f.server.cache
        wait_until(lambda: all(ds.chunk_key(c) in cache for c in wanted), 30, "read-ahead")
        assert cache.stats.readaheads > 0


def test_a_stream_from_s3_never_waits_once_its_read_aheads_land(s3_root: str) -> None:
    """test_readahead.py's policy check over real object storage: every read-ahead of
    a stream is let land (GETs from SeaweedFS) before its next burst; then no burst waits
    for a chunk: each was asked for in time and none needed soon was evicted."""
    from support.readahead import benchmark_shaped, drive

    ds, cache = benchmark_shaped(s3_root, "groups", readahead_threads=8)
    assert ds.store.remote
    try:
        spec = SamplingSpec(dataset="groups", seq_len=64, batch_size=4, shuffle=True, seed=2)
        assert drive(ds, cache, spec, epochs=2) == []
        assert cache.stats.ahead_used > 0
        assert cache.stats.evictions > 0
    finally:
        cache.close()


def _source(stop_after: int | None = None) -> IterableSource:
    def make():  # type: ignore[no-untyped-def]
        for i, doc in enumerate(DOCS):
            if stop_after is not None and i == stop_after:
                raise Interrupted
            yield doc

    return IterableSource(make, {"corpus": "generated", "documents": len(DOCS)})


def test_prepare_to_s3_resumes_and_overwrites(
    s3_root: str, tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def cfg(out: str | Path, stop: int | None, overwrite: bool = False) -> PrepareConfig:
        return PrepareConfig(
            source=_source(stop),
            tokenizer=str(tok_dir),
            output=out,
            tokens_per_chunk=256,
            batch_size=5,
            overwrite=overwrite,
            progress=False,
        )

    monkeypatch.chdir(tmp_path)
    clean = prepare(cfg(tmp_path / "clean", None))
    out = f"{s3_root}/store"
    objects = ObjectStore(out)
    with pytest.raises(Interrupted):
        prepare(cfg(out, 100))
    keys = {o.key for o in objects.list()}
    assert META_NAME not in keys
    assert PROGRESS_NAME in keys
    assert "chunk_000000.bin" in keys
    resumed = prepare(cfg(out, None))
    assert resumed.resumed_chunks > 0
    assert resumed.path == out
    assert [c.checksum for c in resumed.meta.chunks] == [c.checksum for c in clean.meta.chunks]
    assert {o.key for o in objects.list()} == {META_NAME} | {c.file for c in clean.meta.chunks}
    assert not any(p.name.startswith("s3") for p in tmp_path.iterdir())  # no local "s3:" dir
    # --overwrite deletes what is under the prefix first (a stale extra chunk included)
    objects.put("chunk_000099.bin", b"\0\0")
    again = prepare(cfg(out, None, overwrite=True))
    assert {o.key for o in objects.list()} == {META_NAME} | {c.file for c in again.meta.chunks}
    # objects tokenfeed did not write are never deleted
    objects.put("notes.txt", b"mine")
    with pytest.raises(Exception, match=r"notes\.txt"):
        prepare(cfg(out, None, overwrite=True))


def test_cli_prepare_info_verify_on_s3(
    s3_root: str, tok_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.chdir(tmp_path)
    src = write_jsonl(tmp_path / "c.jsonl", DOCS)
    out = f"{s3_root}/cli"
    argv = ["prepare", "--files", str(src), "--tokenizer", str(tok_dir), "--output", out]
    assert main([*argv, "--tokens-per-chunk", "300", "--no-progress"]) == 0
    assert out in capsys.readouterr().out
    assert not (tmp_path / "s3:").exists()
    assert main(["info", out, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["path"] == out
    assert doc["format"] == "tokenfeed v1"
    assert doc["chunks"] > 1
    assert main(["verify", out]) == 0
    assert "OK" in capsys.readouterr().out
    objects = ObjectStore(out)
    data = bytearray(objects.get("chunk_000001.bin"))
    data[0] ^= 1
    objects.put("chunk_000001.bin", bytes(data))
    assert main(["verify", out]) == 1
    assert f"{out}: chunk chunk_000001.bin is corrupt" in capsys.readouterr().err
    assert open_store(out).num_chunks == doc["chunks"]


def test_bad_credentials_exit_2_without_the_secret(
    s3, s3_root: str, monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    make_positional_store(f"{s3_root}/positions", 2_000, 1_000)  # type: ignore[arg-type]
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", WRONG_SECRET)
    for cmd in (["info", f"{s3_root}/positions"], ["verify", f"{s3_root}/positions"]):
        assert main(cmd) == 2
        err = capsys.readouterr().err
        assert "check the bucket name and the AWS credentials" in err
        assert WRONG_SECRET not in err
        assert s3.secret_key not in err
    cases = [
        (s3_root, "HTTP 403"),  # wrong secret
        (f"s3://no-such-bucket-{os.getpid()}/x", "no-such-bucket"),
    ]
    for root, want in cases:
        if "no-such-bucket" in root:
            monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_key)
        proc = subprocess.run(
            [sys.executable, "-m", "tokenfeed", "serve", "--data-root", root, "--port", "0"],
            capture_output=True,
            text=True,
            timeout=60,
            env=os.environ.copy(),
        )
        assert proc.returncode == 2, proc.stderr
        assert want in proc.stderr
        assert "tokenfeed serve: error:" in proc.stderr
        assert WRONG_SECRET not in proc.stderr + proc.stdout
        assert s3.secret_key not in proc.stderr + proc.stdout
