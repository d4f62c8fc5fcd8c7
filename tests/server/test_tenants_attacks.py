"""A shared feeder tried as an attacker would, against `tokenfeed serve` processes.

Each attack gets the documented status (docs/tenants.md) and reads nothing it may
not read, while another job's stream (a `Canary`, opened before the attack and read
to the end after it) comes through whole: every step once, every row exact.
"""

from __future__ import annotations

import os
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from tokenfeed.server.tenants import token_digest
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import wait_until
from support.feeders import FeederProcess, feeder_params
from support.pki import make_pki
from support.stores import make_positional_store
from support.tenants import (
    JOBS,
    TOKENS,
    Canary,
    bearer,
    make_tenant_root,
    write_tokens_file,
)

OK, DENIED = grpc.StatusCode.OK, grpc.StatusCode.PERMISSION_DENIED
INVALID, MISSING = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A data root with links planted in it, and the tokens file."""
    d = tmp_path_factory.mktemp("shared")
    root = make_tenant_root(d / "root", big=True)
    make_positional_store(d / "outside" / "store", 10_000, 1_000)
    os.symlink(d / "outside" / "store", root / "web" / "escape")  # out of the root
    os.symlink(root / "secret" / "eval-set", root / "web" / "alias")  # to an ungranted store
    os.symlink(d / "outside", root / "web" / "out")  # a directory out of the root
    return root, write_tokens_file(d / "tokens.yaml", JOBS)


@pytest.fixture(scope="module")
def feeder(data: tuple[Path, Path]):
    root, tokens = data
    with FeederProcess(root, tokens_file=tokens) as proc:
        yield proc


def _status(call) -> tuple[grpc.StatusCode, str]:
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return OK, ""


def _stream(stub, dataset: str, job: str) -> tuple[grpc.StatusCode, str]:
    request = pb.StreamBatchesRequest(params=feeder_params(dataset=dataset))
    return _status(lambda: next(stub.StreamBatches(request, metadata=bearer(job))))


def _info(stub, dataset: str, job: str) -> tuple[grpc.StatusCode, str]:
    return _status(lambda: stub.Info(pb.InfoRequest(dataset=dataset), metadata=bearer(job)))


def test_a_token_for_another_jobs_dataset(feeder) -> None:
    with grpc.insecure_channel(feeder.address) as ch:
        stub = pb_grpc.FeederStub(ch)
        canary = Canary(ch, "eval")
        for job, dataset in (
            ("ablation", "web/fr"),
            ("ablation", "code"),
            ("pretrain", "secret/eval-set"),
        ):
            for ask in (_info, _stream):
                code, details = ask(stub, dataset, job)
                assert code == DENIED, (job, dataset, details)
                assert f"job {job!r} may not read dataset {dataset!r}" in details
                assert TOKENS[job] not in details
        # tokens that are not a job's: none, garbage, the digest from the file itself,
        # another case, another scheme
        digest = token_digest(TOKENS["eval"])
        request = pb.StreamBatchesRequest(params=feeder_params(dataset="web/en"))
        for metadata in (
            [],
            [("authorization", "Bearer ")],
            [("authorization", f"Bearer {digest}")],
            [("authorization", f"Bearer {TOKENS['eval'].upper()}")],
            [("authorization", f"Basic {TOKENS['eval']}")],
        ):
            code, _ = _status(lambda m=metadata: next(stub.StreamBatches(request, metadata=m)))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        assert canary.finish() > 100


def test_a_mixture_hiding_a_forbidden_source(feeder) -> None:
    params = feeder_params(dataset="")
    for name, weight in (("web/en", 0.98), ("code", 0.01), ("secret/eval-set", 0.01)):
        params.sources.add(name=name, weight=weight)
    request = pb.StreamBatchesRequest(params=params)
    with grpc.insecure_channel(feeder.address) as ch:
        stub = pb_grpc.FeederStub(ch)
        canary = Canary(ch, "eval")
        code, details = _status(
            lambda: next(stub.StreamBatches(request, metadata=bearer("pretrain")))
        )
        assert code == DENIED
        assert details.startswith("sources['secret/eval-set']: job 'pretrain' may not read")
        code, _ = _status(
            lambda: stub.Info(pb.InfoRequest(params=params), metadata=bearer("pretrain"))
        )
        assert code == DENIED
        # the same source behind a link, and a source that does not exist outside the grant
        params.sources[2].name = "web/alias"
        request = pb.StreamBatchesRequest(params=params)
        code, details = _status(
            lambda: next(stub.StreamBatches(request, metadata=bearer("pretrain")))
        )
        assert code == DENIED
        assert "a link to a store outside" in details
        params.sources[2].name = "secret/other"
        request = pb.StreamBatchesRequest(params=params)
        code, _ = _status(lambda: next(stub.StreamBatches(request, metadata=bearer("pretrain"))))
        assert code == DENIED  # not NOT_FOUND: nothing learned about the root
        assert canary.finish() > 100


@pytest.mark.parametrize(
    ("dataset", "job", "expected"),
    [
        ("../secret/eval-set", "pretrain", INVALID),
        ("web/../secret/eval-set", "pretrain", INVALID),
        ("./code", "ablation", INVALID),
        ("web/en/", "ablation", INVALID),
        ("/etc/passwd", "eval", INVALID),
        ("web\\en", "ablation", INVALID),
        ("web/en\x00", "ablation", INVALID),
        ("web/alias", "pretrain", DENIED),  # a link inside the root to an ungranted store
        ("web/escape", "pretrain", MISSING),  # a link out of the root: not a dataset
        ("web/escape", "eval", MISSING),
        ("web/out/store", "pretrain", DENIED),  # web/* is one segment
        ("web/out/store", "eval", MISSING),  # through a linked directory out of the root
        ("web/*", "pretrain", MISSING),  # a name, never a pattern
        ("**", "pretrain", DENIED),
        ("**", "eval", MISSING),
        ("secret/*", "ablation", DENIED),
        ("WEB/EN", "ablation", DENIED),
    ],
)
def test_path_tricks_against_the_grants(feeder, dataset: str, job: str, expected) -> None:
    with grpc.insecure_channel(feeder.address) as ch:
        stub = pb_grpc.FeederStub(ch)
        for ask in (_info, _stream):
            code, details = ask(stub, dataset, job)
            assert code == expected, (dataset, job, details)
            assert "outside/store" not in details
            assert str(feeder.data_root) not in details
            if code == MISSING:
                assert "secret" not in details or job == "eval"


def test_a_flood_beyond_max_streams(feeder) -> None:
    request = pb.StreamBatchesRequest(params=feeder_params(dataset="web/big", seq_len=1024))
    with grpc.insecure_channel(feeder.address) as ch:
        canary = Canary(ch, "eval")
        channels = [grpc.insecure_channel(feeder.address) for _ in range(24)]

        def attempt(channel: grpc.Channel):
            call = pb_grpc.FeederStub(channel).StreamBatches(request, metadata=bearer("pretrain"))
            try:
                next(call)
            except grpc.RpcError as e:
                return call, e.code(), e.details()
            return call, OK, ""

        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(attempt, channels))
        codes = [code for _, code, _ in results]
        assert codes.count(OK) == 3  # pretrain's max_streams
        assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 21
        refused = next(d for _, c, d in results if c != OK)
        assert "job 'pretrain' already has 3 streams open, its max_streams" in refused
        # another job is not held back by pretrain's flood
        code, _ = _stream(pb_grpc.FeederStub(ch), "web/en", "ablation")
        assert code == OK
        for call, _, _ in results:
            call.cancel()
        for c in channels:
            c.close()
        assert canary.finish() > 100


def test_a_certificate_swapped_mid_stream(data: tuple[Path, Path], tmp_path: Path) -> None:
    root, tokens = data
    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old, new = make_pki(tmp_path / "old"), make_pki(tmp_path / "new")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    shutil.copy(old["server_cert_path"], cert)
    shutil.copy(old["server_key_path"], key)
    with FeederProcess(root, tokens_file=tokens, tls_cert=cert, tls_key=key) as proc:
        with grpc.secure_channel(proc.address, grpc.ssl_channel_credentials(old["ca"])) as ch:
            canary = Canary(ch, "eval")
            # a certificate without its key: refused, the old one stays
            shutil.copy(new["server_cert_path"], cert)
            proc.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "reload (SIGHUP) failed" in proc.log(), 60, "the refused reload")
            assert _trusts(proc.address, old) == OK
            # with its key: new connections get it, a client that trusts the old one is out
            shutil.copy(new["server_key_path"], key)
            proc.proc.send_signal(signal.SIGHUP)
            wait_until(lambda: "reloaded (SIGHUP)" in proc.log(), 60, "the reload")
            assert _trusts(proc.address, new) == OK
            assert _trusts(proc.address, old) == grpc.StatusCode.UNAVAILABLE
            assert canary.finish() > 100
        assert "BEGIN" not in proc.log()  # no certificate or key in the log


def _trusts(address: str, pki: dict) -> grpc.StatusCode:
    """Whether a new connection trusting `pki`'s CA gets through."""
    with grpc.secure_channel(address, grpc.ssl_channel_credentials(pki["ca"])) as ch:
        code, _ = _info(pb_grpc.FeederStub(ch), "web/en", "eval")
    return code
