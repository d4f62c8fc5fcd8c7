"""A feeder shared by jobs, as `tokenfeed serve` processes: SIGHUP and file changes
rotate the certificate and the tokens with streams in flight (the kept ones finish
whole, the revoked ones end UNAUTHENTICATED), the JSON log's audit records, and under
`--workers 2` the supervisor forwarding SIGHUP and serving the node's status page,
read by a real headless Chromium."""

from __future__ import annotations

import datetime
import json
import shutil
import signal
import time
import urllib.request
from pathlib import Path

import grpc
import pytest

from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import free_port, wait_until
from support.browser import dump_dom, table_rows
from support.feeders import FeederProcess
from support.pki import make_pki
from support.tenants import JOBS, TOKENS, Canary, bearer, make_tenant_root, write_tokens_file

pytestmark = pytest.mark.slow
WITHOUT_PRETRAIN = {k: v for k, v in JOBS.items() if k != "pretrain"}


def _root(tmp_path: Path) -> Path:
    return make_tenant_root(tmp_path / "root", big=True)


def _info(address: str, job: str, ca: bytes | None = None) -> grpc.StatusCode:
    creds = grpc.ssl_channel_credentials(ca) if ca is not None else None
    with grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address) as ch:
        try:
            pb_grpc.FeederStub(ch).Info(pb.InfoRequest(), metadata=bearer(job), timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def _revoked(canary: Canary) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        canary.finish()
    return info.value


def test_sighup_rotates_certificate_and_tokens_with_streams_in_flight(tmp_path: Path) -> None:
    root = _root(tmp_path)
    for d in ("old", "new"):
        (tmp_path / d).mkdir()
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(old["server_cert_path"], cert)
    shutil.copy(old["server_key_path"], key)
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    flags = {"tokens_file": tokens, "tls_cert": cert, "tls_key": key, "log_format": "json"}
    with FeederProcess(root, **flags) as proc:
        with grpc.secure_channel(proc.address, grpc.ssl_channel_credentials(old["ca"])) as ch:
            kept, revoked = Canary(ch, "eval"), Canary(ch, "pretrain")
            # everything at once: a new certificate and key, pretrain's token withdrawn
            shutil.copy(new["server_cert_path"], cert)
            shutil.copy(new["server_key_path"], key)
            write_tokens_file(tokens, WITHOUT_PRETRAIN)
            signalled = time.time()
            proc.proc.send_signal(signal.SIGHUP)
            error = _revoked(revoked)
            assert error.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "token of job 'pretrain' was withdrawn" in error.details()
            steps = kept.finish()  # the whole epoch, every row exact, on the old connection
        assert _info(proc.address, "eval", new["ca"]) == grpc.StatusCode.OK
        assert _info(proc.address, "eval", old["ca"]) == grpc.StatusCode.UNAVAILABLE
        assert _info(proc.address, "pretrain", new["ca"]) == grpc.StatusCode.UNAUTHENTICATED
        # a changed file, no signal: pretrain is back
        write_tokens_file(tokens, JOBS)
        wait_until(lambda: "reloaded (a file changed)" in proc.log(), 60, "the file change")
        assert _info(proc.address, "pretrain", new["ca"]) == grpc.StatusCode.OK
        log = proc.log()
    records = [json.loads(line) for line in log.splitlines() if line.strip()]  # JSON only
    streams = [r for r in records if r.get("logger") == "tokenfeed.server.streams"]
    closes = {r["job"]: r for r in streams if r["event"] == "stream_close"}
    assert closes["eval"]["outcome"] == "ok"
    assert closes["eval"]["batches"] == steps
    assert closes["eval"]["dataset"] == "web/big"
    assert closes["pretrain"]["outcome"] == "UNAUTHENTICATED"
    opens = [r for r in streams if r["event"] == "stream_open"]
    assert {r["job"] for r in opens} == {"eval", "pretrain"}
    assert not {"outcome", "batches", "tokens"} & set(opens[0])
    ended = datetime.datetime.fromisoformat(closes["pretrain"]["time"].replace("Z", "+00:00"))
    print(f"revoked stream ended {ended.timestamp() - signalled:.3f} s after the SIGHUP")
    for token in TOKENS.values():
        assert token not in log
    assert "BEGIN" not in log


def test_workers_forward_sighup_and_serve_the_nodes_status_page(tmp_path: Path) -> None:
    root = _root(tmp_path)
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    port = free_port()
    with FeederProcess(root, workers=2, tokens_file=tokens, metrics_port=port) as proc:
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection each
        with (
            grpc.insecure_channel(proc.address, options=options) as a,
            grpc.insecure_channel(proc.address, options=options) as b,
        ):
            kept, revoked = Canary(a, "eval"), Canary(b, "pretrain")
            url = f"http://127.0.0.1:{port}/status"

            def status() -> dict:
                return json.loads(urllib.request.urlopen(url + ".json", timeout=10).read())

            # each worker writes its status every second; the supervisor merges them
            wait_until(lambda: len(status()["streams"]) == 2, 60, "both streams' rows")
            page = dump_dom(url)
            rows = table_rows(page, "streams")
            assert sorted((r[0], r[2], r[3], r[4]) for r in rows) == [
                ("eval", "web/big", "0", "1"),
                ("pretrain", "web/big", "0", "1"),
            ]
            assert all(r[1].startswith("ipv4:127.0.0.1:") for r in rows)
            assert ["web/big", "4000000", "tokenfeed"] in table_rows(page, "datasets")
            write_tokens_file(tokens, WITHOUT_PRETRAIN)
            proc.proc.send_signal(signal.SIGHUP)
            assert _revoked(revoked).code() == grpc.StatusCode.UNAUTHENTICATED
            assert kept.finish() > 100
        wait_until(lambda: status()["streams"] == [], 60, "the rows of ended streams to go")
        assert status()["datasets"][0]["name"] == "web/big"
        log = proc.log()
    assert "SIGHUP: forwarded to 2 workers" in log
    assert log.count("reloaded (SIGHUP)") == 2  # each worker
