"""Bearer-token auth and TLS (server and client certificates) over real gRPC."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tokenfeed.core.errors import InvalidArgument
from tokenfeed.server.config import ServerConfig
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support.feeders import FEEDER_DATASET, running_feeder
from support.pki import server_tls

INFO = pb.InfoRequest(dataset=FEEDER_DATASET)


def test_bearer_token_checked_on_every_call(feeder_root: Path, tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    with (
        running_feeder(feeder_root, auth_token_file=token_file) as f,
        grpc.insecure_channel(f.address) as ch,
    ):
        s = pb_grpc.FeederStub(ch)
        for metadata in (
            None,
            [("authorization", "Bearer wrong")],
            [("authorization", "s3cret-token")],
        ):
            with pytest.raises(grpc.RpcError) as info:
                s.Info(INFO, metadata=metadata)
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in info.value.details()
            assert "s3cret" not in info.value.details()
            with pytest.raises(grpc.RpcError) as info:
                list(s.StreamBatches(pb.StreamBatchesRequest(), metadata=metadata))
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        good = [("authorization", "Bearer s3cret-token")]
        assert s.Info(INFO, metadata=good).datasets[0].name == FEEDER_DATASET
        # health stays open for orchestrator probes
        r = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert r.status == health_pb2.HealthCheckResponse.SERVING
        assert (
            f.registry.get_sample_value(
                "tokenfeed_server_errors_total", {"code": "UNAUTHENTICATED"}
            )
            == 6
        )


# ------------------------------------------------------------------------------ TLS


def _info(address: str, creds: grpc.ChannelCredentials) -> pb.InfoResponse:
    with grpc.secure_channel(address, creds) as ch:
        return pb_grpc.FeederStub(ch).Info(INFO, timeout=10)


def test_tls_server_certificate(feeder_root: Path, pki) -> None:
    with running_feeder(feeder_root, **server_tls(pki)) as f:
        assert _info(f.address, grpc.ssl_channel_credentials(pki["ca"])).datasets
        with grpc.insecure_channel(f.address) as ch, pytest.raises(grpc.RpcError) as info:
            pb_grpc.FeederStub(ch).Info(INFO, timeout=10)  # plaintext to a TLS port
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_tls_client_certificates_required(feeder_root: Path, pki) -> None:
    with running_feeder(feeder_root, **server_tls(pki, client_certificates=True)) as f:
        with_cert = grpc.ssl_channel_credentials(
            pki["ca"], private_key=pki["client_key"], certificate_chain=pki["client_cert"]
        )
        assert _info(f.address, with_cert).datasets
        with pytest.raises(grpc.RpcError) as info:
            _info(f.address, grpc.ssl_channel_credentials(pki["ca"]))  # no client cert
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def test_config_validation_and_loud_warning(feeder_root: Path, tmp_path: Path, pki) -> None:
    env = {
        "TOKENFEED_DATA_ROOT": str(feeder_root),
        "TOKENFEED_CACHE_BYTES": "512M",
        "TOKENFEED_PORT": "6000",
    }
    cfg = ServerConfig.from_sources({"port": 7000}, env)
    assert (cfg.cache_bytes, cfg.port, cfg.host) == (512 << 20, 7000, "127.0.0.1")
    assert cfg.insecure_warning() is None
    assert cfg.readahead_budget == 0  # automatic, local root: read-ahead shares the cache
    ahead = ServerConfig.from_sources({"readahead_bytes": "64M"}, env)
    assert ahead.readahead_budget == 64 << 20
    exposed = ServerConfig.from_sources({"host": "0.0.0.0"}, env)
    assert "neither TLS nor an auth token" in exposed.insecure_warning()
    tls = ServerConfig.from_sources(
        {"host": "0.0.0.0", "tls_cert": pki["server_cert_path"], "tls_key": pki["server_key_path"]},
        env,
    )
    assert tls.insecure_warning() is None
    bad = [
        ({}, {}, "TOKENFEED_DATA_ROOT"),
        ({"data_root": tmp_path / "missing"}, {}, "not a directory"),
        ({"port": 70000}, env, "--port must be in"),
        ({"cache_bytes": "lots"}, env, "--cache-bytes"),
        ({"tls_cert": pki["server_cert_path"]}, env, "together"),
        ({"tls_client_ca": pki["ca_path"]}, env, "--tls-client-ca needs"),
        ({"auth_token_file": tmp_path / "none"}, env, "no such file"),
        ({"grace_seconds": -1}, env, "--grace-seconds"),
        ({"readahead_bytes": "-2"}, env, "--readahead-bytes must be in"),
    ]
    for flags, environ, message in bad:
        with pytest.raises(InvalidArgument, match=message):
            ServerConfig.from_sources(flags, environ)
