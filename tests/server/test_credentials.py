"""Reloading the TLS files and the jobs, all or nothing, on a real feeder in process:
the certificate new connections get, a bad reload that changes nothing, a file change
picked up without a signal, and streams whose token or grant went away.

The same with `tokenfeed serve` processes and SIGHUP: tests/e2e/test_tenants_e2e.py."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.server.credentials import load_tls
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import wait_until
from support.feeders import feeder_params, running_feeder
from support.pki import make_pki
from support.stores import positional_rows
from support.tenants import JOBS, bearer, make_tenant_root, write_tokens_file

# an epoch of feeder_params(batch_size=1): windows k with 48 k + 65 <= 9,000 train tokens
STEPS = (9_000 - 65) // 48 + 1


@pytest.fixture(scope="module")
def pkis(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    """Two unrelated PKIs: the certificate before and after a rotation."""
    return make_pki(tmp_path_factory.mktemp("old")), make_pki(tmp_path_factory.mktemp("new"))


def _install(pki: dict, d: Path) -> dict[str, Path]:
    """The server's certificate and key at fixed paths in `d` (replaced whole)."""
    d.mkdir(exist_ok=True)
    out = {}
    for name, src in (("tls_cert", "server_cert"), ("tls_key", "server_key")):
        tmp = d / f"{name}.tmp"
        shutil.copy(pki[f"{src}_path"], tmp)
        tmp.replace(d / f"{name}.pem")
        out[name] = d / f"{name}.pem"
    return out


def _info(address: str, pki: dict, job: str = "eval") -> pb.InfoResponse:
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(pki["ca"])) as ch:
        return pb_grpc.FeederStub(ch).Info(pb.InfoRequest(), metadata=bearer(job), timeout=10)


def test_tls_files_are_checked(pkis: tuple[dict, dict], tmp_path: Path) -> None:
    old, new = pkis
    tls = load_tls(old["server_cert_path"], old["server_key_path"], old["ca_path"])
    assert (tls.cert_chain, tls.client_ca) == (old["server_cert"], old["ca"])
    with pytest.raises(InvalidArgument, match="the unencrypted key that matches it") as info:
        load_tls(new["server_cert_path"], old["server_key_path"], None)
    assert "BEGIN" not in info.value.message  # no PEM in the message
    garbage = tmp_path / "ca.pem"
    garbage.write_text("not a certificate\n")
    with pytest.raises(InvalidArgument, match=r"--tls-client-ca .* not a bundle of PEM"):
        load_tls(old["server_cert_path"], old["server_key_path"], garbage)
    with pytest.raises(InvalidArgument, match="cannot read it"):
        load_tls(tmp_path / "missing.pem", old["server_key_path"], None)


@pytest.fixture
def rotating(pkis: tuple[dict, dict], tmp_path: Path):
    """A TLS feeder with a tokens file, its files in tmp_path/tls."""
    old, _ = pkis
    files = _install(old, tmp_path / "tls")
    tokens = write_tokens_file(tmp_path / "tls" / "tokens.yaml", JOBS)
    root = make_tenant_root(tmp_path / "root")
    with running_feeder(root, tokens_file=tokens, **files) as f:
        yield f, files, tokens


def _reload(f) -> None:
    """SIGHUP's action, on the feeder's loop."""
    f.loop.call_soon_threadsafe(f.server.reload)


def test_a_new_certificate_reaches_new_connections_only(rotating, pkis) -> None:
    f, files, _ = rotating
    old, new = pkis
    with grpc.secure_channel(f.address, grpc.ssl_channel_credentials(old["ca"])) as ch:
        stub = pb_grpc.FeederStub(ch)
        request = pb.StreamBatchesRequest(params=feeder_params(dataset="web/en", batch_size=1))
        live = stub.StreamBatches(request, metadata=bearer("pretrain"))
        first = next(live)
        _install(new, files["tls_cert"].parent)
        _reload(f)
        wait_until(lambda: f.server.watcher.reloads == 1, 60, "the reload")
        assert _info(f.address, new).datasets  # a new connection: the new certificate
        with pytest.raises(grpc.RpcError) as info:
            _info(f.address, old)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # the stream on the old connection runs to the end of its epoch, every batch exact
        batches = [*first.batches, *(b for m in live for b in m.batches)]
        assert [b.step for b in batches] == list(range(STEPS))
        for b in batches:
            rows = np.frombuffer(b.tokens, "<u4").reshape(b.rows, b.cols)
            np.testing.assert_array_equal(rows, positional_rows(b.starts, b.cols))


def test_a_failed_reload_keeps_every_old_setting(
    rotating, pkis, caplog: pytest.LogCaptureFixture
) -> None:
    f, files, tokens = rotating
    old, new = pkis
    caplog.set_level(logging.ERROR, logger="tokenfeed.server.credentials")
    # a good tokens file (pretrain gone) but a key that does not match the certificate
    write_tokens_file(tokens, {k: v for k, v in JOBS.items() if k != "pretrain"})
    shutil.copy(new["server_cert_path"], files["tls_cert"])
    _reload(f)
    wait_until(lambda: f.server.watcher.failures == 1, 60, "the failed reload")
    (error,) = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert "keeping every previous setting" in error.getMessage()
    assert "matches it" in error.getMessage()
    assert _info(f.address, old, "pretrain").datasets  # old certificate, old jobs
    # fixed: the next change applies all of it
    shutil.copy(new["server_key_path"], files["tls_key"])
    _reload(f)
    wait_until(lambda: f.server.watcher.reloads == 1, 60, "the reload")
    with pytest.raises(grpc.RpcError) as info:
        _info(f.address, new, "pretrain")
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert _info(f.address, new, "eval").datasets


def test_a_changed_file_is_reloaded_without_a_signal(rotating, pkis) -> None:
    f, _, tokens = rotating
    old, _ = pkis
    jobs = {**JOBS, "ablation": {**JOBS["ablation"], "datasets": ["web/*"]}}
    write_tokens_file(tokens, jobs)
    # polled every 2 s: waited for generously here, the promise (10 s) is the docs'
    wait_until(lambda: f.server.watcher.reloads == 1, 60, "the file change to be seen")
    names = [d.name for d in _info(f.address, old, "ablation").datasets]
    assert names == ["web/en", "web/fr"]


def test_revoked_tokens_and_grants_end_their_streams(rotating, pkis) -> None:
    f, _, tokens = rotating
    old, _ = pkis
    request = pb.StreamBatchesRequest(params=feeder_params(dataset="web/en", batch_size=1))
    creds = grpc.ssl_channel_credentials(old["ca"])
    with grpc.secure_channel(f.address, creds) as ch:
        stub = pb_grpc.FeederStub(ch)
        calls = {job: stub.StreamBatches(request, metadata=bearer(job)) for job in JOBS}
        for call in calls.values():
            next(call)  # open; then held by flow control, no one reading
        jobs = {
            "eval": JOBS["eval"],  # unchanged
            "ablation": {**JOBS["ablation"], "datasets": ["code"]},  # web/en taken away
        }  # pretrain's token withdrawn
        write_tokens_file(tokens, jobs)
        _reload(f)

        def ending(job: str) -> grpc.RpcError:
            with pytest.raises(grpc.RpcError) as info:
                for _ in calls[job]:
                    pass
            return info.value

        gone = ending("pretrain")
        assert gone.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "token of job 'pretrain' was withdrawn" in gone.details()
        moved = ending("ablation")
        assert moved.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "'web/en'" in moved.details()
        kept = [b.step for m in calls["eval"] for b in m.batches]  # to the end of its epoch
        assert kept == list(range(1, STEPS))  # after the first
    assert f.server.service.streams.per_job == {}
