"""What a trainer meets first: a wrong address or a TLS mismatch fails fast
and says why, the log says what the client does, the dataset's metadata and the steps
left are one attribute away, messages fit a stock gRPC client's 4 MiB limit, and a bad
constructor argument is refused before any feeder is contacted. All against a real
feeder on loopback."""

from __future__ import annotations

import dataclasses
import logging
import re
import socket
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from tokenfeed.client import Backoff, DatasetInfo, FeederClient, FeederUnavailable, Timeouts
from tokenfeed.core.request import SamplingSpec
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support.feeders import FEEDER_DATASET, running_feeder
from support.stores import make_positional_store

KW = {"dataset": FEEDER_DATASET, "seq_len": 16, "batch_size": 4, "rank": 0, "world_size": 1}


def _dead_address() -> str:
    """A loopback port nothing listens on (connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "tokenfeed.client" and r.levelno == logging.WARNING
    ]


# ------------------------------------------------------------ fail fast, then be patient


def test_a_wrong_address_fails_within_connect_timeout_naming_every_address(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="tokenfeed.client")
    a, b = "127.0.0.1:1", _dead_address()
    connect_timeout = 1.5
    t0 = time.monotonic()
    with (
        FeederClient(f"{a},{b}", connect_timeout=connect_timeout, **KW) as c,
        pytest.raises(FeederUnavailable) as info,
    ):
        next(iter(c))
    elapsed = time.monotonic() - t0
    assert elapsed < connect_timeout + 2  # not the outage budget (Backoff: 120 s)
    message = str(info.value)
    assert "connect_timeout=1.5 s" in message
    assert a in message
    assert b in message
    assert "Connection refused" in message  # the last gRPC error
    warnings = _warnings(caplog)
    attempts = int(message.split("gave up after ")[1].split()[0])
    assert len(warnings) == attempts >= 2  # one per failed attempt, the first included
    assert a in warnings[0]
    assert "attempt 1" in warnings[0]
    assert "Connection refused" in warnings[0]
    assert b in warnings[1]
    assert "giving up" in warnings[-1]


def test_a_last_attempt_cut_by_the_budget_still_names_why_the_others_failed() -> None:
    """When the connect budget ends during an attempt, that attempt's error is a
    deadline: the message also gives the failure before it (here, a refused connection)."""
    from tokenfeed.client.connection import Connection
    from tokenfeed.client.stream import Outage
    from tokenfeed.client.transport import Channels

    channels = Channels(Connection("127.0.0.1:1", backoff=Backoff(max_retries=1)))
    outage = Outage(channels, "Info")
    outage.failed("unavailable", "UNAVAILABLE: failed to connect: Connection refused")
    with pytest.raises(FeederUnavailable) as info:
        outage.failed("deadline_exceeded", "DEADLINE_EXCEEDED: Deadline Exceeded")
    message = str(info.value)
    assert "last error at 127.0.0.1:1: DEADLINE_EXCEEDED: Deadline Exceeded" in message
    assert "before it: 127.0.0.1:1: UNAVAILABLE: failed to connect: Connection refused" in message


def test_a_name_that_does_not_resolve_is_named_and_the_others_still_tried(
    feeder, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.WARNING, logger="tokenfeed.client")
    with (
        FeederClient("no-such-feeder.invalid:50051", connect_timeout=0.5, **KW) as c,
        pytest.raises(FeederUnavailable, match=r"no address resolves: no-such-feeder"),
    ):
        len(c)
    caplog.clear()
    with FeederClient(f"no-such-feeder.invalid:50051,{feeder.address}", **KW) as c:
        assert len(c) > 0
    assert any("no-such-feeder.invalid:50051" in w for w in _warnings(caplog))


def test_connect_timeout_is_also_a_timeouts_field() -> None:
    with (
        FeederClient("127.0.0.1:1", timeouts=Timeouts(connect_timeout=0.3), **KW) as c,
        pytest.raises(FeederUnavailable, match=r"connect_timeout=0.3 s"),
    ):
        len(c)
    for bad in (0, -1.0, float("nan"), "5"):
        with pytest.raises(ValueError, match="connect_timeout"):
            Timeouts(connect_timeout=bad)  # type: ignore[arg-type]


def test_info_lines_when_a_stream_starts_and_resumes(
    feeder, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.INFO, logger="tokenfeed.client")
    with FeederClient(feeder.address, **KW) as c:
        it = iter(c)
        for _ in range(3):
            next(it)
        state = c.state_dict()
    with FeederClient(feeder.address, **KW) as c:
        c.load_state_dict(state)
        next(iter(c))
    infos = [
        r.getMessage()
        for r in caplog.records
        if r.name == "tokenfeed.client" and r.levelno == logging.INFO
    ]
    assert f"rank 0: epoch 0 stream started at offset 0 (step 0) from {feeder.address}" in infos
    assert f"rank 0: epoch 0 stream resumed at offset 12 (step 3) from {feeder.address}" in infos
    assert not _warnings(caplog)


def test_after_first_contact_an_outage_is_bounded_by_backoff_not_connect_timeout(
    feeder_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="tokenfeed.client")
    # the first contact gets 1 s (a loaded machine's first Info), the outage 4 attempts
    # 0.5 s apart: 1.5 s, past what connect_timeout would allow
    patient = Backoff(initial=0.5, maximum=0.5, jitter=0, max_retries=3, deadline=None)
    with running_feeder(feeder_root) as f:
        c = FeederClient(f.address, backoff=patient, connect_timeout=1.0, **KW)
        assert len(c) > 0  # the feeder answered: from now on failures are outages
    with c, pytest.raises(FeederUnavailable, match="gave up after 4 attempts") as info:
        next(iter(c))  # the feeder is gone: 4 attempts 0.5 s apart, not within 1 s
    assert "connect_timeout" not in str(info.value)
    warnings = _warnings(caplog)
    assert len(warnings) == 4
    assert all(f.address in w and "stream at offset 0" in w for w in warnings)
    assert c.reconnects == 3  # between the 4 attempts


def _tls_failure(address: str, **kw) -> str:  # type: ignore[no-untyped-def]
    with (
        FeederClient(address, connect_timeout=1.0, **KW, **kw) as c,
        pytest.raises(FeederUnavailable) as info,
    ):
        len(c)
    return str(info.value)


def test_tls_mismatches_say_tls(feeder_root: Path, pki) -> None:  # type: ignore[no-untyped-def]
    mtls = {
        "tls_cert": pki["server_cert_path"],
        "tls_key": pki["server_key_path"],
        "tls_client_ca": pki["ca_path"],
    }
    with running_feeder(feeder_root, **mtls) as f:
        plaintext = _tls_failure(f.address)
        assert "TLS: the feeder speaks TLS but this client connects in plaintext" in plaintext
        no_client_cert = _tls_failure(f.address, root_certificates=pki["ca"])
        assert "TLS: the feeder requires a client certificate (mutual TLS)" in no_client_cert
        untrusted = _tls_failure(f.address, tls=True)  # the system roots do not have our CA
        assert "TLS: this client does not trust the feeder's certificate" in untrusted
    with running_feeder(feeder_root) as f:
        assert "TLS: the feeder does not speak TLS" in _tls_failure(
            f.address, root_certificates=pki["ca"]
        )
        # a plain outage is not blamed on TLS
        assert "TLS" not in _tls_failure("127.0.0.1:1")


# ----------------------------------------------------------------- dataset_info, sizes


def test_dataset_info_is_the_stores_metadata_fetched_once(feeder_root: Path) -> None:
    with running_feeder(feeder_root) as f:
        c = FeederClient(f.address, **{**KW, "split_rate": 0.9})
        info = c.dataset_info
    with c:  # the feeder is gone: both answers come from the one Info call
        assert c.dataset_info is info
        assert len(c) == info.steps
    assert isinstance(info, DatasetInfo)
    assert (info.name, info.total_tokens, info.dtype) == (FEEDER_DATASET, 10_000, "uint32")
    assert (info.vocab_size, info.eos_token_id, info.tokenizer) == (1 << 32, 0, "positions")
    assert info.split == "train"
    assert info.split_tokens == 9_000
    assert info.windows == (9_000 - 17) // 16 + 1
    assert info.steps == info.windows // 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.steps = 0  # type: ignore[misc]


def test_steps_left_after_an_elastic_resume(feeder) -> None:  # type: ignore[no-untyped-def]
    """Two ranks train 7 steps and checkpoint; three ranks resume. len() is a full
    epoch at the new world size; steps_left is what each rank then really receives."""
    kw = {"dataset": FEEDER_DATASET, "seq_len": 16, "batch_size": 3, "shuffle": True, "seed": 3}
    with FeederClient(feeder.address, rank=0, world_size=2, **kw) as c:
        assert c.steps_left == len(c)
        it = iter(c)
        for _ in range(7):
            next(it)
        assert c.steps_left == len(c) - 7
        state = c.state_dict()
    windows = (10_000 - 17) // 16 + 1
    for rank in range(3):
        with FeederClient(feeder.address, rank=rank, world_size=3, **kw) as c:
            c.load_state_dict(state)
            assert len(c) == windows // 9  # a full epoch at world size 3
            left = c.steps_left
            assert left == (windows - 7 * 6) // 9 < len(c)
            steps = []
            for batch in c:
                steps.append(batch["step"])
                assert c.steps_left == left - len(steps)
            assert len(steps) == left
            assert steps[0] == 7
            assert steps[-1] == 7 + left - 1
            assert c.steps_left == 0


# -------------------------------------------------------------------------- messages


def _big_batch_root(tmp_path: Path) -> Path:
    make_positional_store(tmp_path / "big", 120_000, 40_000)
    return tmp_path


# 64 rows x 4096 tokens x 4 bytes = 1 MiB a batch: 16 to a message would be 16 MiB.
BIG = {"dataset": "big", "seq_len": 4095, "stride": 64, "batch_size": 64}


def test_a_stock_grpc_client_with_the_4_mib_limit_streams_large_batches(tmp_path: Path) -> None:
    params = pb.SamplingParams(**BIG)  # type: ignore[arg-type]
    with (
        running_feeder(_big_batch_root(tmp_path)) as f,
        grpc.insecure_channel(f.address) as ch,  # gRPC's defaults: 4 MiB receive limit
    ):
        call = pb_grpc.FeederStub(ch).StreamBatches(
            pb.StreamBatchesRequest(params=params, batches_per_message=16)
        )
        sizes, steps = [], []
        for response in call:
            sizes.append(response.ByteSize())
            for b in response.batches:
                steps.append(b.step)
                tokens = np.frombuffer(b.tokens, dtype="<u4").reshape(b.rows, b.cols)
                expect = np.array(b.starts)[:, None] + np.arange(b.cols)
                np.testing.assert_array_equal(tokens, expect)
    windows = (120_000 - 4096) // 64 + 1
    assert steps == list(range(windows // 64))
    assert max(sizes) <= 4 << 20 < 16 * 64 * 4096 * 4  # not the 16 batches asked for
    assert len(sizes) == 1 + -(-(len(steps) - 1) // 3)  # the first alone, then three 1 MiB


@pytest.mark.parametrize("limit", [300_000, 1 << 20, (1 << 20) + 5_000])
def test_no_message_exceeds_the_clients_max_message_bytes(tmp_path: Path, limit: int) -> None:
    make_positional_store(tmp_path / "d", 50_000, 7_000, dtype="uint16")
    params = pb.SamplingParams(dataset="d", seq_len=1024, stride=64, batch_size=16, auto_shift=True)
    request = pb.StreamBatchesRequest(params=params, batches_per_message=64)
    request.max_message_bytes = limit
    with running_feeder(tmp_path) as f, grpc.insecure_channel(f.address) as ch:
        responses = list(pb_grpc.FeederStub(ch).StreamBatches(request))
    sizes = [r.ByteSize() for r in responses]
    assert max(sizes) <= limit
    # fewer batches per message, never fewer than what fits: 16 x (1024 + 512) x 2 bytes
    assert max(len(r.batches) for r in responses) == min(
        64, limit // (16 * 1536 * 2 + 16 * 10 + 128)
    )


def test_a_batch_larger_than_the_clients_limit_is_invalid_argument(tmp_path: Path) -> None:
    huge = {**BIG, "batch_size": 256, "stride": 256}  # 4 MiB of tokens a batch
    params = pb.SamplingParams(**huge)  # type: ignore[arg-type]
    with running_feeder(_big_batch_root(tmp_path)) as f:
        with grpc.insecure_channel(f.address) as ch:
            stub = pb_grpc.FeederStub(ch)
            with pytest.raises(grpc.RpcError) as info:
                list(stub.StreamBatches(pb.StreamBatchesRequest(params=params)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "max_message_bytes=4194304" in info.value.details()
        assert "gRPC's default 4 MiB" in info.value.details()
        # the Python client sends its own (unlimited) receive size: 4 MiB batches stream
        kw = {**huge, "rank": 0, "world_size": 1}
        with FeederClient(f.address, **kw) as c:
            batch = next(iter(c))
            assert batch["input_ids"].shape == (256, 4095)


# ----------------------------------------------------------------- constructor checks


BAD_ARGUMENTS = [
    ({"prefetch": 0}, ValueError, "prefetch"),
    ({"prefetch": 2.5}, TypeError, "prefetch"),
    ({"prefetch": True}, TypeError, "prefetch"),
    ({"batches_per_message": 0}, ValueError, "batches_per_message"),
    ({"batches_per_message": 5000}, ValueError, "batches_per_message"),
    ({"batches_per_message": "4"}, TypeError, "batches_per_message"),
    ({"layout": "nested"}, ValueError, "layout"),
    ({"timeouts": 5}, TypeError, "timeouts"),
    ({"backoff": {"initial": 1}}, TypeError, "backoff"),
    ({"connect_timeout": 0}, ValueError, "connect_timeout"),
    ({"connect_timeout": float("inf")}, ValueError, "connect_timeout"),
    ({"metrics_port": 70000}, ValueError, "metrics_port"),
    ({"metrics_port": "9100"}, TypeError, "metrics_port"),
    ({"metrics_addr": None}, TypeError, "metrics_addr"),
    ({"registry": "default"}, TypeError, "registry"),
    ({"rank": -1}, ValueError, "rank"),
    ({"rank": "0"}, TypeError, "rank"),
    ({"rank": 1}, ValueError, "rank"),  # world_size 1
    ({"world_size": 0}, ValueError, "world_size"),
    ({"tls": "yes"}, TypeError, "tls"),
    ({"lookahead": None}, TypeError, "lookahead"),
    ({"root_certificates": "/nonexistent/ca.pem"}, ValueError, "root_certificates"),
    ({"root_certificates": 3}, TypeError, "root_certificates"),
    ({"certificate_chain": b"pem"}, ValueError, "private_key"),  # the pair goes together
    ({"token": ""}, TypeError, "token"),
    ({"spec": {"seq_len": 8}}, TypeError, "spec"),
    ({"seq_len": 0}, ValueError, "seq_len"),  # SamplingSpec's, InvalidArgument
    ({"shift": 3}, ValueError, "shift"),
    ({"device": 0}, TypeError, "device"),
    ({"device": "gpu"}, ValueError, "device='gpu'"),
]


@pytest.fixture
def listener():  # type: ignore[no-untyped-def]
    """A TCP port that records whether anything connected to it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.setblocking(False)
    yield s
    s.close()


def _connected(listener: socket.socket) -> bool:
    try:
        conn, _ = listener.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize(("change", "error", "names"), BAD_ARGUMENTS)
def test_the_constructor_checks_every_argument_before_any_contact(
    listener: socket.socket, change: dict, error: type, names: str
) -> None:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    with pytest.raises(error, match=names.replace("(", r"\(")):
        FeederClient(address, **{**KW, **change})
    assert not _connected(listener)


def test_bad_addresses_are_refused_by_the_constructor() -> None:
    for address, error in (("", ValueError), ("feeder", ValueError), (["a:1", 2], TypeError)):
        with pytest.raises(error, match="address"):
            FeederClient(address, **KW)  # type: ignore[arg-type]


def test_a_good_constructor_contacts_nothing(listener: socket.socket) -> None:
    address = f"127.0.0.1:{listener.getsockname()[1]}"
    spec = SamplingSpec(dataset=FEEDER_DATASET, seq_len=16, batch_size=4)
    with FeederClient(address, spec=spec, registry=CollectorRegistry(), device="cpu"):
        assert not _connected(listener)


def test_a_cuda_device_the_installed_torch_cannot_use_says_what_to_do() -> None:
    import torch

    device = "cuda" if torch.version.cuda is None else "cuda:99"
    with pytest.raises(ValueError, match=re.escape(f"device={device!r}")) as info:
        FeederClient("127.0.0.1:1", device=device, **KW)
    message = str(info.value)
    assert f"device={device!r}" in message
    assert "device=None" in message
    if torch.version.cuda is None:
        assert "CPU-only build" in message
        assert "install a CUDA build of torch" in message
