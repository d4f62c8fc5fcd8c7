"""Jobs and grants: the tokens file, glob grants, and a real feeder that checks each
call's job (Info, StreamBatches, mixtures, links, listing, max_streams), records
who streams (audit records, /status, /status.json) and never shows a token.

Attacks against a feeder process: test_tenants_attacks.py; reloads: test_credentials.py
and tests/e2e/test_tenants_e2e.py."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.server.config import ServerConfig
from tokenfeed.server.logs import JsonFormatter
from tokenfeed.server.tenants import (
    Job,
    check_pattern,
    load_tokens_file,
    parse_tenants,
    token_digest,
)
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import free_port, wait_until
from support.feeders import feeder_params, running_feeder
from support.stores import make_positional_store
from support.tenants import (
    JOBS,
    TOKENS,
    Canary,
    bearer,
    make_big,
    make_tenant_root,
    write_tokens_file,
)

# ------------------------------------------------------------------- tokens file


def test_yaml_and_json_files_say_the_same(tmp_path: Path) -> None:
    yaml_file = write_tokens_file(tmp_path / "t.yaml", JOBS)
    json_file = tmp_path / "t.json"
    json_file.write_text(json.dumps({"jobs": JOBS}))
    a, b = load_tokens_file(yaml_file), load_tokens_file(json_file)
    assert a == b
    pretrain = a.by_name()["pretrain"]
    assert (pretrain.weight, pretrain.max_streams) == (2.0, 3)
    assert a.by_name()["eval"].weight == 1.0  # the default
    assert a.job_for(TOKENS["pretrain"]) == pretrain
    assert a.job_for("not a token") is None
    assert a.job_for(None) is None


GOOD = {"token_sha256": "a" * 64, "datasets": ["web/*"]}


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ([], "one key, 'jobs'"),
        ({"jobs": {}, "extra": 1}, "one key, 'jobs'"),
        ({"jobs": {}}, "map job names"),
        ({"jobs": {"bad name!": GOOD}}, "a job name is"),
        ({"jobs": {"a": "x"}}, "must be a mapping"),
        ({"jobs": {"a": {**GOOD, "token": "plain"}}}, "unknown keys ['token']"),
        ({"jobs": {"a": {**GOOD, "token_sha256": "abc"}}}, "64 hex digits"),
        ({"jobs": {"a": GOOD, "b": GOOD}}, "the same token_sha256 as job 'a'"),
        ({"jobs": {"a": {**GOOD, "datasets": []}}}, "non-empty list"),
        ({"jobs": {"a": {**GOOD, "datasets": ["../x"]}}}, "'..' segment"),
        ({"jobs": {"a": {**GOOD, "datasets": ["/abs/*"]}}}, "relative to the data root"),
        ({"jobs": {"a": {**GOOD, "datasets": ["web/a**"]}}}, "whole segment"),
        ({"jobs": {"a": {**GOOD, "datasets": ["web//x"]}}}, "empty"),
        ({"jobs": {"a": {**GOOD, "weight": 0}}}, "weight must be in"),
        ({"jobs": {"a": {**GOOD, "weight": "2"}}}, "weight must be a number"),
        ({"jobs": {"a": {**GOOD, "max_streams": 0}}}, "max_streams must be a positive"),
        ({"jobs": {"a": {**GOOD, "max_streams": 2.5}}}, "max_streams must be a positive"),
    ],
)
def test_a_bad_tokens_file_names_the_entry_at_fault(doc: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        parse_tenants(doc)


def test_unreadable_and_malformed_files(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="cannot read it"):
        load_tokens_file(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("jobs:\n  a: [unclosed\n")
    with pytest.raises(InvalidArgument, match="not valid YAML or JSON at line"):
        load_tokens_file(bad)


# -------------------------------------------------------------------------- globs

SEGMENT = st.text("abx.-_", min_size=1, max_size=3).filter(lambda s: s not in (".", ".."))
NAME = st.lists(SEGMENT, min_size=1, max_size=4).map("/".join)


def _reference(pattern: str, name: str) -> bool:
    """The grant's meaning as one regex over `name/`: `**/` any run of segments, `*`
    and `?` within one."""
    rx = ""
    for seg in pattern.split("/"):
        if seg == "**":
            rx += "(?:[^/]+/)*"
        else:
            rx += "".join(
                "[^/]*" if c == "*" else "[^/]" if c == "?" else re.escape(c) for c in seg
            )
            rx += "/"
    return re.fullmatch(rx, name + "/") is not None


@given(name=NAME, data=st.data())
def test_globs_match_segments_as_documented(name: str, data: st.DataObject) -> None:
    # a pattern made from the name: each segment kept, or replaced by a glob
    segments = name.split("/")
    pattern = "/".join(
        data.draw(st.sampled_from([s, "*", "**", "?" * len(s), s[:1] + "*"])) for s in segments
    )
    other = data.draw(NAME)
    job = Job("j", "0" * 64, (pattern,))
    assert job.allows(name) == _reference(pattern, name) is True
    assert job.allows(other) == _reference(pattern, other)
    assert Job("j", "0" * 64, ("**",)).allows(other)
    assert Job("j", "0" * 64, (other,)).allows(name) == (name == other)


def test_patterns_cannot_leave_the_root() -> None:
    for bad in ("..", "a/../b", "/etc", "a/./b", "a\\b", "", "x/**y"):
        with pytest.raises(InvalidArgument):
            check_pattern(bad)
    assert not Job("j", "0" * 64, ("web/*",)).allows("web/en/deeper")
    assert Job("j", "0" * 64, ("web/**",)).allows("web/en/deeper")


# ------------------------------------------------------------------ configuration


def test_tokens_file_and_auth_token_file_are_exclusive(tmp_path: Path) -> None:
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    token = tmp_path / "token"
    token.write_text("t\n")
    flags = {"data_root": tmp_path, "tokens_file": tokens, "auth_token_file": token}
    with pytest.raises(InvalidArgument, match="exclusive"):
        ServerConfig.from_sources(flags, {})
    argv = [sys.executable, "-m", "tokenfeed", "serve", "--data-root", str(tmp_path)]
    argv += ["--tokens-file", str(tokens), "--auth-token-file", str(token)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "--tokens-file and --auth-token-file are exclusive" in proc.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"jobs": {"a": {**GOOD, "weight": -1}}}))
    proc = subprocess.run(
        [*argv[:6], "--tokens-file", str(bad)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "weight must be in" in proc.stderr


# ------------------------------------------------------------------ a real feeder


@pytest.fixture
def tenant_root(tmp_path: Path) -> Path:
    return make_tenant_root(tmp_path / "root")


@pytest.fixture
def tenant_feeder(tenant_root: Path, tmp_path: Path):
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    with running_feeder(tenant_root, tokens_file=tokens, metrics_port=free_port()) as f:
        yield f


def _code(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def _no_token_in(text: str) -> None:
    for token in TOKENS.values():
        assert token not in text


def _info(stub, dataset: str, job: str) -> tuple[grpc.StatusCode, str]:
    return _code(lambda: stub.Info(pb.InfoRequest(dataset=dataset), metadata=bearer(job)))


def test_each_job_sees_and_reads_only_its_grant(tenant_feeder) -> None:
    with grpc.insecure_channel(tenant_feeder.address) as ch:
        s = pb_grpc.FeederStub(ch)

        def names(job: str) -> list[str]:
            return [d.name for d in s.Info(pb.InfoRequest(), metadata=bearer(job)).datasets]

        assert names("pretrain") == ["code", "web/en", "web/fr"]
        assert names("eval") == ["code", "secret/eval-set", "web/en", "web/fr"]
        assert names("ablation") == ["web/en"]
        for metadata in (None, [("authorization", "Bearer nope")], [("authorization", "x")]):
            code, details = _code(lambda m=metadata: s.Info(pb.InfoRequest(), metadata=m))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in details
        # Info and StreamBatches outside the grant: PERMISSION_DENIED naming both
        code, details = _info(s, "secret/eval-set", "pretrain")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "job 'pretrain' may not read dataset 'secret/eval-set'" in details
        _no_token_in(details)
        request = pb.StreamBatchesRequest(params=feeder_params(dataset="web/fr"))
        code, details = _code(lambda: list(s.StreamBatches(request, metadata=bearer("ablation"))))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "'web/fr'" in details
        # within the grant, a dataset that does not exist: NOT_FOUND listing only the grant
        assert _info(s, "web/de", "pretrain") == (
            grpc.StatusCode.NOT_FOUND,
            "no dataset 'web/de' under the data root; job 'pretrain' may read: code, web/en, "
            "web/fr",
        )
        # outside it, whether it exists or not: PERMISSION_DENIED (no probing the root)
        assert _info(s, "web/de", "ablation")[0] == grpc.StatusCode.PERMISSION_DENIED
        batches = [
            b for m in s.StreamBatches(request, metadata=bearer("pretrain")) for b in m.batches
        ]
        assert len(batches) == 46


def test_a_mixture_is_checked_source_by_source(tenant_feeder) -> None:
    params = feeder_params(dataset="")
    params.sources.add(name="web/en", weight=0.9)
    params.sources.add(name="secret/eval-set", weight=0.1)
    with grpc.insecure_channel(tenant_feeder.address) as ch:
        s = pb_grpc.FeederStub(ch)
        code, details = _code(
            lambda: next(
                iter(
                    s.StreamBatches(
                        pb.StreamBatchesRequest(params=params), metadata=bearer("pretrain")
                    )
                )
            )
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details.startswith("sources['secret/eval-set']: job 'pretrain'")
        code, details = _code(
            lambda: s.Info(pb.InfoRequest(params=params), metadata=bearer("pretrain"))
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED
        msg = next(
            iter(s.StreamBatches(pb.StreamBatchesRequest(params=params), metadata=bearer("eval")))
        )
        assert msg.batches


def test_a_link_is_judged_as_the_store_it_points_to(tenant_root: Path, tmp_path: Path) -> None:
    # web/alias -> secret/eval-set: not pretrain's, although "web/*" matches the name;
    # shortcut -> web/en: ablation's, although its grant does not name "shortcut"
    os.symlink(tenant_root / "secret" / "eval-set", tenant_root / "web" / "alias")
    os.symlink(tenant_root / "web" / "en", tenant_root / "shortcut")
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    with (
        running_feeder(tenant_root, tokens_file=tokens) as f,
        grpc.insecure_channel(f.address) as ch,
    ):
        s = pb_grpc.FeederStub(ch)
        code, details = _info(s, "web/alias", "pretrain")
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "a link to a store outside" in details
        assert "eval-set" not in details  # what it links to is not told
        info = s.Info(pb.InfoRequest(dataset="shortcut"), metadata=bearer("ablation"))
        assert info.datasets[0].name == "shortcut"


def test_a_job_over_its_max_streams_is_refused(tenant_feeder) -> None:
    request = pb.StreamBatchesRequest(params=feeder_params(dataset="web/en", batch_size=1))
    with grpc.insecure_channel(tenant_feeder.address) as ch:
        s = pb_grpc.FeederStub(ch)
        held = [s.StreamBatches(request, metadata=bearer("pretrain")) for _ in range(3)]
        for call in held:  # open and sending, the rest waiting on flow control
            next(call)
        code, details = _code(lambda: next(s.StreamBatches(request, metadata=bearer("pretrain"))))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "job 'pretrain' already has 3 streams open, its max_streams" in details
        assert next(s.StreamBatches(request, metadata=bearer("eval"))).batches  # others go on
        held[0].cancel()
        wait_until(
            lambda: tenant_feeder.server.service.streams.per_job["pretrain"] < 3, 30, "a slot"
        )
        assert next(s.StreamBatches(request, metadata=bearer("pretrain"))).batches
        for call in held:
            call.cancel()


def test_streams_take_turns_only_while_jobs_compete(tenant_root: Path, tmp_path: Path) -> None:
    """One job alone sends without turns (nothing to divide: the scheduler costs it
    nothing); once two jobs stream, both take turns, and every batch still arrives."""
    make_big(tenant_root)
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    with (
        running_feeder(tenant_root, tokens_file=tokens) as f,
        grpc.insecure_channel(f.address) as ch,
    ):
        shares = f.server.service.shares
        alone = Canary(ch, "eval")
        assert alone.finish() > 100
        assert shares.accounts == {}
        both = [Canary(ch, "eval"), Canary(ch, "pretrain")]
        assert all(c.finish() > 100 for c in both)
        assert set(shares.accounts) == {"eval", "pretrain"}
        assert shares.busy == 0  # every turn given back


def test_reflection_needs_a_known_token(tenant_feeder) -> None:
    request = reflection_pb2.ServerReflectionRequest(list_services="")
    with grpc.insecure_channel(tenant_feeder.address) as ch:
        stub = reflection_pb2_grpc.ServerReflectionStub(ch)
        code, _ = _code(lambda: list(stub.ServerReflectionInfo(iter([request]))))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        answers = list(stub.ServerReflectionInfo(iter([request]), metadata=bearer("eval")))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "tokenfeed.v1.Feeder" in names


def test_audit_records_one_per_stream(tenant_feeder, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="tokenfeed.server.streams")
    request = pb.StreamBatchesRequest(params=feeder_params(dataset="web/en"), rank=0)
    with grpc.insecure_channel(tenant_feeder.address) as ch:
        s = pb_grpc.FeederStub(ch)
        batches = sum(len(m.batches) for m in s.StreamBatches(request, metadata=bearer("eval")))
        other = pb.StreamBatchesRequest(params=feeder_params(dataset="web/fr"), rank=0)
        _code(lambda: list(s.StreamBatches(other, metadata=bearer("ablation"))))
        _code(lambda: list(s.StreamBatches(request, metadata=[("authorization", "Bearer x")])))
    wait_until(lambda: len(_audit(caplog)) >= 4, 30, "the audit records")
    records = _audit(caplog)
    events = [(r["event"], r["job"], r.get("outcome")) for r in records]
    assert events == [
        ("stream_open", "eval", None),
        ("stream_close", "eval", "ok"),
        ("stream_refused", "ablation", "PERMISSION_DENIED"),
        ("stream_refused", None, "UNAUTHENTICATED"),
    ]
    assert records[2]["dataset"] == "web/fr"
    close = records[1]
    assert close["dataset"] == "web/en"
    assert close["rank"] == 0
    assert close["world_size"] == 1
    assert close["batches"] == batches == 46
    assert close["tokens"] == 46 * 4 * 65
    assert close["peer"].startswith("ipv4:127.0.0.1:")
    # as JSON lines: the fields at the top level, no token anywhere
    for r in caplog.records:
        if r.name == "tokenfeed.server.streams":
            line = json.loads(JsonFormatter().format(r))
            assert {"event", "job", "peer", "rank", "world_size"} <= set(line)
            _no_token_in(JsonFormatter().format(r) + r.getMessage())


def _audit(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.audit for r in caplog.records if r.name == "tokenfeed.server.streams"]


def test_status_page_shows_each_live_stream(tenant_feeder) -> None:
    base = f"http://127.0.0.1:{tenant_feeder.server.metrics_port}"
    request = pb.StreamBatchesRequest(params=feeder_params(dataset="code", batch_size=1), rank=0)
    with grpc.insecure_channel(tenant_feeder.address) as ch:
        s = pb_grpc.FeederStub(ch)
        live = s.StreamBatches(request, metadata=bearer("eval"))
        next(live)

        def status_json() -> dict:
            return json.loads(urllib.request.urlopen(base + "/status.json", timeout=10).read())

        # a row's step moves once a burst of messages is written (the first is in)
        wait_until(lambda: status_json()["streams"][0]["step"] >= 1, 30, "the row's progress")
        status = status_json()
        assert set(status) == {"datasets", "cache", "streams"}
        assert status["datasets"] == [{"name": "code", "tokens": 10_000, "format": "tokenfeed"}]
        assert set(status["cache"]) == {"bytes", "capacity_bytes", "hit_ratio"}
        (row,) = status["streams"]
        assert set(row) == {
            "job", "peer", "dataset", "rank", "world_size", "epoch", "step", "tokens_per_s",
            "idle_s",
        }  # fmt: skip
        assert (row["job"], row["dataset"], row["rank"], row["epoch"]) == ("eval", "code", 0, 0)
        assert row["step"] >= 1
        assert row["idle_s"] >= 0
        page = urllib.request.urlopen(base + "/status", timeout=10).read().decode()
        assert '<meta http-equiv="refresh"' in page
        assert "<td>eval</td>" in page
        metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
        assert "tokenfeed_server_streams_active 1.0" in metrics
        for text in (page, metrics, json.dumps(status)):
            _no_token_in(text)
            for token in TOKENS.values():
                assert token_digest(token) not in text
        live.cancel()


def test_grants_on_an_object_storage_root(s3_root: str, tmp_path: Path) -> None:
    for name in ("web/en", "secret/eval-set"):
        make_positional_store(f"{s3_root}/{name}", 2_000, 1_000)  # type: ignore[arg-type]
    tokens = write_tokens_file(tmp_path / "tokens.yaml", JOBS)
    with (
        running_feeder(s3_root, tokens_file=tokens) as f,  # type: ignore[arg-type]
        grpc.insecure_channel(f.address) as ch,
    ):
        s = pb_grpc.FeederStub(ch)
        assert [d.name for d in s.Info(pb.InfoRequest(), metadata=bearer("pretrain")).datasets] == [
            "web/en"
        ]
        assert _info(s, "secret/eval-set", "pretrain")[0] == grpc.StatusCode.PERMISSION_DENIED
        code, details = _info(s, "web/de", "pretrain")
        assert code == grpc.StatusCode.NOT_FOUND
        assert details.endswith("job 'pretrain' may read: web/en")  # nothing else listed
        info = s.Info(pb.InfoRequest(dataset="secret/eval-set"), metadata=bearer("eval"))
        assert info.datasets[0].total_tokens == 2_000
