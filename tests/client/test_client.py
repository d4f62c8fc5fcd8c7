"""FeederClient: pieces on their own, then against a real feeder on loopback."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter

import tokenfeed.client
from tokenfeed.client import Backoff, Connection, FeederClient, FeederUnavailable
from tokenfeed.client.buffers import NumpyStager, batch_array, views
from tokenfeed.client.epochs import LOOKAHEAD_STEPS
from tokenfeed.client.metrics import ClientMetrics, StallWindow
from tokenfeed.client.transport import Channels, expand
from tokenfeed.core import documents, errors
from tokenfeed.core.errors import (
    DataLoss,
    FailedPrecondition,
    FeederError,
    InvalidArgument,
    NotFound,
    Unauthenticated,
)
from tokenfeed.core.store import TokenStore
from tokenfeed.v1 import feeder_pb2

from support import TESTS, wait_until
from support.feeders import FEEDER_DATASET, running_feeder
from support.stores import assert_positional_batch, make_positional_store

# ---------------------------------------------------------------------------- surface


def test_public_surface_is_small_and_importable() -> None:
    assert sorted(tokenfeed.client.__all__) == [
        "Backoff",
        "Connection",
        "DataLoss",
        "DatasetInfo",
        "FailedPrecondition",
        "FeederClient",
        "FeederError",
        "FeederUnavailable",
        "InvalidArgument",
        "NotFound",
        "PermissionDenied",
        "ResourceExhausted",
        "SamplingSpec",
        "Security",
        "Timeouts",
        "Unauthenticated",
    ]
    for name in tokenfeed.client.__all__:
        assert hasattr(tokenfeed.client, name)
    # the error tree is the core's, one class per outcome
    assert tokenfeed.client.DataLoss is errors.DataLoss
    assert issubclass(tokenfeed.client.FeederUnavailable, errors.FeederError)


def test_numpy_path_never_imports_torch(feeder_root: Path) -> None:
    code = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
from support.feeders import running_feeder
from tokenfeed.client import FeederClient
with running_feeder({str(feeder_root)!r}) as f:
    with FeederClient(f.address, dataset="positions", seq_len=16, batch_size=4) as c:
        n = sum(1 for _ in c)
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {{"torch", "transformers", "datasets"}})
print(n, heavy)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split(maxsplit=1)
    assert int(out[0]) == 10_000 // 16 // 4
    assert out[1].strip() == "[]"


# --------------------------------------------------------------------------- addresses


def test_a_name_with_several_records_is_several_endpoints() -> None:
    def records(host: str, port: int, type: int) -> list:  # getaddrinfo's name
        assert host == "feeder.ns.svc"
        return [
            (socket.AF_INET, type, 6, "", ("10.0.0.1", port)),
            (socket.AF_INET6, type, 6, "", ("fd00::1", port, 0, 0)),
            (socket.AF_INET, type, 6, "", ("10.0.0.2", port)),
            (socket.AF_INET, type, 6, "", ("10.0.0.1", port)),
        ]

    eps = expand("feeder.ns.svc:50051", getaddrinfo=records)
    assert [e.target for e in eps] == ["10.0.0.1:50051", "10.0.0.2:50051"]

    def unordered(host: str, port: int, type: int) -> list:
        return [(socket.AF_INET, type, 6, "", (ip, port)) for ip in ("10.0.0.10", "10.0.0.9")]

    # sorted by address, not as text and not as the resolver returned them
    eps = expand("feeder.ns.svc:1", getaddrinfo=unordered)
    assert [e.target for e in eps] == ["10.0.0.9:1", "10.0.0.10:1"]
    assert {e.authority for e in eps} == {"feeder.ns.svc"}  # TLS still checks the name
    # One record: keep the name. IP literals: no lookup at all.
    assert [e.target for e in expand("localhost:1")] == ["localhost:1"]
    assert expand("[::1]:5", getaddrinfo=None)[0].target == "[::1]:5"
    assert expand("127.0.0.1:5", getaddrinfo=None)[0].target == "127.0.0.1:5"


def test_rank_r_starts_on_endpoint_r_mod_n_and_moves_on_wrapping_around() -> None:
    addresses = ["127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3"]
    for rank in range(7):
        ch = Channels(Connection(addresses), start=rank)
        seen = []
        for _ in range(7):
            ch.stub()  # opens the channel (lazily: nothing is dialled here)
            seen.append(ch.current)
            ch.rotate()
        ch.close()
        assert seen == [addresses[(rank + i) % 3] for i in range(7)], rank


# ----------------------------------------------------------------------------- buffers


def _batch_msg(rows: int, seq_len: int, shift: int, dtype: str = "uint16") -> feeder_pb2.Batch:
    starts = np.arange(rows, dtype=np.int64) * 100
    tokens = (starts[:, None] + np.arange(seq_len + shift)).astype(dtype)
    return feeder_pb2.Batch(
        epoch=0,
        step=0,
        offset=0,
        shift=shift,
        rows=rows,
        cols=seq_len + shift,
        dtype=dtype,
        tokens=tokens.tobytes(),
        starts=starts.tolist(),
    )


def test_views_share_one_buffer_flat_and_grouped() -> None:
    buf = batch_array(_batch_msg(3, 8, 2))
    inputs, labels = views(buf, 8, 2)
    assert inputs.shape == labels.shape == (3, 8)
    assert np.shares_memory(inputs, buf)
    assert np.shares_memory(labels, buf)
    assert (labels[:, :-2] == inputs[:, 2:]).all()
    assert labels[1, -1] == 100 + 9
    gi, gl = views(buf, 8, 2, "grouped")
    assert gi.shape == gl.shape == (3, 4, 2)
    assert np.shares_memory(gi, buf)
    assert np.shares_memory(gl, buf)
    assert (gi.reshape(3, 8) == inputs).all()
    assert (gl.reshape(3, 8) == labels).all()


def test_the_numpy_batch_is_read_only_views_and_masked_labels_a_copy() -> None:
    """What docs/client.md says writing into the numpy batch does: the views of the
    message's buffer refuse it; masked labels are a writable int64 array of their own."""
    msg = _batch_msg(3, 8, 2)
    inputs, labels, docs, _ = NumpyStager(8).stage(msg, batch_array(msg))
    assert docs is None
    assert np.shares_memory(inputs, labels)
    for view in (inputs, labels):
        with pytest.raises(ValueError, match="read-only"):
            view[0, 0] = 7
    msg.document_ends = documents.ends_to_bytes(np.array([4, 15], dtype=np.int64))
    inputs, masked, _, _ = NumpyStager(8, mask_labels=True).stage(msg, batch_array(msg))
    assert masked.dtype == np.int64
    assert (masked == documents.IGNORE_INDEX).sum() > 0  # labels across an end
    assert not np.shares_memory(inputs, masked)
    before = inputs.copy()
    masked[:] = -100
    assert (inputs == before).all()


def test_batch_array_rejects_a_size_mismatch_and_unknown_dtype() -> None:
    msg = _batch_msg(2, 4, 1)
    msg.rows = 3
    with pytest.raises(ValueError, match="bytes for 3 x 5"):
        batch_array(msg)
    msg = _batch_msg(2, 4, 1)
    msg.dtype = "float32"
    with pytest.raises(ValueError, match="float32"):
        batch_array(msg)


# ----------------------------------------------------------------------------- metrics


def test_stall_window_counts_waits_and_a_wait_in_progress() -> None:
    now = [1000.0]
    w = StallWindow(window=10.0, clock=lambda: now[0])
    now[0] += 4
    w.add(1.0)
    assert w.value() == pytest.approx(1.0 / 4)
    w.begin_wait()
    now[0] += 2  # stuck in next() for 2 s so far: counted already
    assert w.value() == pytest.approx(3.0 / 6)
    w.end_wait()
    now[0] += 30  # everything aged out of the window
    assert w.value() == 0.0


def test_metric_names_are_labelled_by_rank_and_registries_can_be_shared() -> None:
    reg = CollectorRegistry()
    a, b = ClientMetrics(0, reg), ClientMetrics(1, reg)
    a.received(100, 200)
    b.reconnect("unavailable")
    a.waited(0.001)
    assert reg.get_sample_value("tokenfeed_client_tokens_received_total", {"rank": "0"}) == 100
    assert reg.get_sample_value("tokenfeed_client_bytes_received_total", {"rank": "0"}) == 200
    assert reg.get_sample_value("tokenfeed_client_batches_received_total", {"rank": "0"}) == 1
    assert (
        reg.get_sample_value(
            "tokenfeed_client_reconnects_total", {"rank": "1", "reason": "unavailable"}
        )
        == 1
    )
    assert reg.get_sample_value("tokenfeed_client_wait_seconds_count", {"rank": "0"}) == 1
    assert (
        reg.get_sample_value("tokenfeed_client_wait_seconds_bucket", {"rank": "0", "le": "1e-05"})
        == 0
    )
    for rank in ("0", "1"):
        assert reg.get_sample_value("tokenfeed_client_stall_fraction", {"rank": rank}) is not None
        assert reg.get_sample_value("tokenfeed_client_buffer_occupancy", {"rank": rank}) == 0
    ClientMetrics(0, reg)  # a second loader of rank 0 (validation) shares the series


# ------------------------------------------------------------------------- state dicts


def _client(address: str = "127.0.0.1:1", **kw) -> FeederClient:
    args = {
        "dataset": FEEDER_DATASET,
        "seq_len": 16,
        "batch_size": 4,
        "rank": 0,
        "world_size": 1,
        **kw,
    }
    return FeederClient(address, **args)


def test_fingerprint_ignores_world_size_rank_and_batch_size_only() -> None:
    base = _client().fingerprint
    assert _client(world_size=4, rank=3, batch_size=7).fingerprint == base
    for change in (
        {"seed": 1},
        {"shuffle": True},
        {"stride": 8},
        {"shift": 2},
        {"split_rate": 0.5},
        {"dataset": "other"},
        {"shuffle_blocks": 2},
    ):
        assert _client(**change).fingerprint != base, change


def test_load_state_dict_checks_the_fingerprint() -> None:
    with _client(seed=1) as a, _client(seed=2) as b:
        with pytest.raises(ValueError, match="different sampling parameters"):
            b.load_state_dict(a.state_dict())
        with pytest.raises(ValueError, match="missing"):
            b.load_state_dict({"epoch": 0})


def test_set_epoch_keeps_a_loaded_position_for_the_same_epoch_only() -> None:
    with _client() as c:
        state = {**c.state_dict(), "epoch": 2, "offset": 40, "step": 10}
        c.load_state_dict(state)
        c.set_epoch(2)  # the usual resume loop: keeps the position
        assert c.state_dict() == state
        c.set_epoch(3)
        assert (c.state_dict()["epoch"], c.state_dict()["offset"], c.state_dict()["step"]) == (
            3,
            0,
            0,
        )


def test_rank_and_world_size_default_to_the_torchrun_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with FeederClient("127.0.0.1:1", dataset="d", seq_len=8, batch_size=1) as c:
        assert (c.rank, c.world_size) == (2, 4)
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match="rank"):
        FeederClient("127.0.0.1:1", dataset="d", seq_len=8, batch_size=1)


# ------------------------------------------------------------- against a real feeder


def _starts(client: FeederClient, limit: int | None = None) -> list[int]:
    out: list[int] = []
    for i, batch in enumerate(client):
        out.extend(batch["starts"].tolist())
        if limit is not None and i + 1 == limit:
            break
    return out


def test_one_epoch_two_ranks_every_window_exactly_once(feeder) -> None:
    kw = {
        "seq_len": 16,
        "stride": 8,
        "batch_size": 4,
        "world_size": 2,
        "shuffle": True,
        "shuffle_blocks": 2,
        "seed": 7,
    }
    seen: list[int] = []
    for rank in (0, 1):
        with _client(feeder.address, rank=rank, **kw) as c:
            steps = 0
            for batch in c:
                assert_positional_batch(batch, 16)
                assert batch["step"] == steps
                assert batch["input_ids"].shape == (4, 16)
                seen.extend(batch["starts"].tolist())
                steps += 1
            assert steps == len(c)
    windows = (10_000 - 16 - 1) // 8 + 1
    used = windows // 8 * 8  # train drops the last partial global batch
    assert len(seen) == len(set(seen)) == used
    assert set(seen) <= set(range(0, windows * 8, 8))
    assert seen[:8] != sorted(seen[:8])  # shuffled


def test_numpy_and_torch_cpu_paths_give_identical_tokens(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    # uint16 with ids above 32767, so the widening of the narrow dtype is exercised.
    make_positional_store(tmp_path / "wide", 70_000, 16_384, dtype="uint16")
    kw = {
        "dataset": "wide",
        "seq_len": 64,
        "stride": 500,
        "batch_size": 8,
        "shift": "auto",
        "shuffle": True,
        "seed": 3,
        "rank": 0,
        "world_size": 1,
    }
    with (
        running_feeder(tmp_path) as f,
        FeederClient(f.address, **kw) as a,
        FeederClient(f.address, device="cpu", **kw) as b,
    ):
        n = 0
        for x, y in zip(a, b, strict=True):
            assert x["input_ids"].dtype == np.uint16
            assert y["input_ids"].dtype == torch.int64
            assert y["labels"].dtype == torch.int64
            assert (y["input_ids"].numpy() == x["input_ids"]).all()
            assert (y["labels"].numpy() == x["labels"]).all()
            assert x["shift"] == y["shift"]
            assert (x["starts"] == y["starts"]).all()
            n += 1
        assert n == len(a)
        assert int(y["input_ids"].max()) > 32_767


def test_grouped_layout_is_the_original_loaders_view(feeder) -> None:
    with _client(feeder.address, seq_len=16, shift=4, layout="grouped") as c:
        batch = next(iter(c))
    inputs, labels = batch["input_ids"], batch["labels"]
    assert inputs.shape == labels.shape == (4, 4, 4)
    assert inputs.base is not None
    assert np.shares_memory(inputs, labels)
    assert_positional_batch(
        {**batch, "input_ids": inputs.reshape(4, 16), "labels": labels.reshape(4, 16)}, 16
    )


def test_torch_grouped_layout_on_cpu(feeder) -> None:
    pytest.importorskip("torch")
    with _client(feeder.address, seq_len=16, shift=2, layout="grouped", device="cpu") as c:
        batch = next(iter(c))
    assert tuple(batch["input_ids"].shape) == (4, 8, 2)
    assert_positional_batch(
        {
            **batch,
            "input_ids": batch["input_ids"].reshape(4, 16).numpy(),
            "labels": batch["labels"].reshape(4, 16).numpy(),
        },
        16,
    )


@pytest.mark.parametrize("k", [0, 1, 7, 30])
@pytest.mark.parametrize("new_world", [2, 3, 1])
def test_resume_after_k_steps_is_exactly_once(feeder, k: int, new_world: int) -> None:
    """Two ranks train k steps and checkpoint; the job resumes with `new_world` ranks."""
    kw = {"seq_len": 16, "stride": 16, "batch_size": 3, "shuffle": True, "seed": 11}
    seen: list[int] = []
    states = []
    for rank in (0, 1):
        with _client(feeder.address, rank=rank, world_size=2, **kw) as c:
            seen += _starts(c, limit=k) if k else []
            states.append(c.state_dict())
    assert states[0]["offset"] == states[1]["offset"] == k * 3 * 2
    for rank in range(new_world):
        with _client(feeder.address, rank=rank, world_size=new_world, **kw) as c:
            c.load_state_dict(states[0])
            c.set_epoch(0)  # the resume loop's set_epoch keeps the position
            first = next(iter(c))
            assert first["step"] == k
            assert first["offset"] == k * 6
            seen += first["starts"].tolist() + _starts(c)
    assert len(seen) == len(set(seen))  # nothing repeated
    windows = (10_000 - 16 - 1) // 16 + 1
    tail = (windows - k * 6) % (3 * new_world)  # the resumed epoch drops its own tail
    assert len(seen) == windows - tail  # nothing lost


def test_resume_mid_epoch_then_next_epoch(feeder) -> None:
    with _client(feeder.address, seq_len=16, batch_size=8, shuffle=True) as c:
        c.set_epoch(1)
        first = _starts(c, limit=5)
        state = c.state_dict()
        assert state["epoch"] == 1
        assert state["step"] == 5
        rest = _starts(c)  # iterating again continues where the loop stopped
        assert len(set(first + rest)) == len(first + rest) == len(c) * 8
        assert c.state_dict()["step"] == len(c)
        again = _starts(c)  # a finished epoch iterated again starts over
        assert sorted(again) == sorted(first + rest)
        c.set_epoch(2)
        assert _starts(c, limit=1) != first[:8]


def test_validation_split_delivers_every_window_with_a_short_last_step(feeder) -> None:
    kw = {
        "split": "validation",
        "split_rate": 0.9,
        "seq_len": 16,
        "stride": 16,
        "batch_size": 4,
        "world_size": 2,
    }
    seen, rows = [], []
    for rank in (0, 1):
        with _client(feeder.address, rank=rank, **kw) as c:
            n = 0
            for batch in c:
                assert_positional_batch(batch, 16)
                rows.append(batch["input_ids"].shape[0])
                seen += batch["starts"].tolist()
                n += 1
            assert n == len(c)
    windows = (1000 - 17) // 16 + 1  # 62 windows in the last 1,000 tokens
    assert sorted(seen) == [9000 + 16 * i for i in range(windows)]
    assert sorted(rows)[0] < 4  # 62 = 7 * 8 + 6: rank 0 gets 4, rank 1 gets 2


def test_batches_per_message_packs_without_changing_the_batches(feeder) -> None:
    with _client(feeder.address) as a, _client(feeder.address, batches_per_message=5) as b:
        assert _starts(a) == _starts(b)


def test_non_retryable_errors_surface_at_once_with_the_servers_message(feeder) -> None:
    # the stream's own answer: no Info call goes first
    with _client(feeder.address, dataset="nope") as c, pytest.raises(NotFound, match="nope"):
        next(iter(c))
    with _client(feeder.address, dataset="nope") as c, pytest.raises(NotFound, match="nope"):
        len(c)
    with pytest.raises(InvalidArgument, match="must divide seq_len"):
        _client(feeder.address, seq_len=16, shift=3)  # checked before any feeder is contacted
    with (
        _client(feeder.address, seq_len=5000, batch_size=4) as c,
        pytest.raises(FailedPrecondition, match=r"fewer than one global batch|too short"),
    ):
        next(iter(c))


def test_a_feeder_bug_is_raised_after_a_few_internal_errors_not_retried_for_minutes(
    feeder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the feeder (here: every burst raises) ends every stream with INTERNAL.
    The client retries INTERNAL (a peer dying mid-message resets a stream with it), but
    INTERNAL_ATTEMPTS in a row end the call with it, well inside the retry deadline."""
    from tokenfeed.client.stream import INTERNAL_ATTEMPTS
    from tokenfeed.server.assembly import MessageBuilder

    def bug(self, *args: object, **kwargs: object) -> list:
        raise AttributeError("a bug")

    monkeypatch.setattr(MessageBuilder, "next_burst", bug)
    backoff = Backoff(initial=0.01, maximum=0.05, deadline=120)
    with _client(feeder.address, backoff=backoff) as c:
        with pytest.raises(FeederError, match="INTERNAL 3 times in a row") as info:
            next(iter(c))
        assert "internal error (AttributeError)" in str(info.value)
        assert info.value.code == "INTERNAL"
        assert c.reconnects == INTERNAL_ATTEMPTS - 1  # retried, then given up


def test_an_error_in_the_reader_thread_reaches_the_loop(tmp_path: Path) -> None:
    """A chunk corrupted on disk mid-epoch: DATA_LOSS, raised in the loop, not a hang."""
    # 4 MB of batches, far more than gRPC's flow-control window: when the chunk is
    # corrupted the server cannot have read it yet (a cache of 2 of the 10 chunks).
    store = make_positional_store(tmp_path / "positions", 1_000_000, 100_000)
    with (
        running_feeder(tmp_path, cache_bytes=800_000) as f,
        _client(f.address, seq_len=128, batch_size=8) as c,
    ):
        it = iter(c)
        got = [next(it) for _ in range(3)]
        path = store.chunk_path(9)
        data = bytearray(path.read_bytes())
        data[5] ^= 0xFF
        path.write_bytes(bytes(data))
        with pytest.raises(DataLoss, match="chunk") as info:
            got.extend(it)  # what arrives before the error is kept
        assert "DATA_LOSS" in str(info.value)
        assert len(got) < len(c)
        assert c.state_dict()["step"] == len(got)  # the position is the last good batch
    assert TokenStore.open(store.path).verify()  # really corrupt


def test_bearer_token(tmp_path: Path) -> None:
    make_positional_store(tmp_path / "positions", 10_000, 1_000)
    secret = tmp_path / "token"
    secret.write_text("s3cret\n")
    with running_feeder(tmp_path, auth_token_file=secret) as f:
        with _client(f.address) as c, pytest.raises(Unauthenticated, match="bearer token"):
            len(c)
        with _client(f.address, token="wrong") as c, pytest.raises(Unauthenticated):
            next(iter(c))
        with _client(f.address, token="s3cret") as c:
            assert len(_starts(c)) == len(c) * 4


def test_metrics_exist_move_and_are_exported(feeder) -> None:
    reg = CollectorRegistry()
    # No lookahead: the next epoch's stream would add its buffered batches to the counts.
    with _client(
        feeder.address, rank=1, world_size=2, registry=reg, metrics_port=0, lookahead=False
    ) as c:

        def value(name: str) -> float:
            v = reg.get_sample_value(name, {"rank": "1"})
            assert v is not None, name
            return v

        assert value("tokenfeed_client_tokens_received_total") == 0
        it = iter(c)
        next(it)
        wait_until(  # the thread fills the buffer
            lambda: value("tokenfeed_client_buffer_occupancy") >= 2, 30, "a full buffer"
        )
        n = 1 + sum(1 for _ in it)
        assert value("tokenfeed_client_batches_received_total") == n == len(c)
        assert value("tokenfeed_client_tokens_received_total") == n * 4 * 16
        assert value("tokenfeed_client_bytes_received_total") == n * 4 * 17 * 4
        # The first batch's wait is counted apart; the final StopIteration is a wait.
        assert value("tokenfeed_client_first_batch_seconds_count") == 1
        assert value("tokenfeed_client_first_batch_seconds_sum") == c.first_batch_seconds > 0
        assert value("tokenfeed_client_wait_seconds_count") == n
        assert value("tokenfeed_client_wait_seconds_sum") > 0
        assert 0 < value("tokenfeed_client_stall_fraction") <= 1
        assert value("tokenfeed_client_buffer_occupancy") == 0
        assert c.metrics.port
        body = urllib.request.urlopen(f"http://127.0.0.1:{c.metrics.port}/metrics").read().decode()
        assert f'tokenfeed_client_batches_received_total{{rank="1"}} {float(n)}' in body
        assert 'tokenfeed_client_wait_seconds_bucket{le="1e-05",rank="1"}' in body
        port = c.metrics.port
    with pytest.raises(urllib.error.URLError, match="Connection refused"):  # the server is gone
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _client_threads() -> set[threading.Thread]:
    return {
        t
        for t in threading.enumerate()
        if not t.name.startswith(
            ("tokenfeed-batch", "tokenfeed-readahead", "feeder-loop", "tokenfeed-open")
        )
    }


def test_close_leaves_no_thread_or_channel_behind(feeder) -> None:
    before = _client_threads()
    for stop_after in (0, 2, None):  # never iterated, mid-epoch, after the end
        c = _client(feeder.address, metrics_port=0, prefetch=3)
        with c:
            if stop_after is not None:
                _starts(c, limit=stop_after) if stop_after else None
            else:
                _starts(c)
    wait_until(lambda: _client_threads() == before, 10, "the client threads to end")
    with pytest.raises(RuntimeError, match="closed"):
        iter(c)


def test_tls_and_mutual_tls(feeder_root: Path, pki) -> None:
    with running_feeder(
        feeder_root,
        tls_cert=pki["server_cert_path"],
        tls_key=pki["server_key_path"],
        tls_client_ca=pki["ca_path"],
    ) as f:
        with _client(
            f.address,
            root_certificates=pki["ca_path"],
            certificate_chain=pki["client_cert_path"],
            private_key=pki["client_key_path"],
        ) as c:
            assert len(_starts(c)) == len(c) * 4
        once = Backoff(max_retries=1, deadline=None, initial=0.01)
        with (
            _client(f.address, root_certificates=pki["ca"], backoff=once) as c,
            pytest.raises(FeederUnavailable, match="gave up after 2 attempts"),
        ):
            len(c)  # no client certificate: the handshake fails
    with pytest.raises(ValueError, match="together"):
        _client(certificate_chain=pki["client_cert"])


def test_the_next_epoch_streams_ahead_and_is_adopted_only_when_asked_for(feeder) -> None:
    with _client(feeder.address, shuffle=True) as ref:
        ref.set_epoch(1)
        epoch1 = _starts(ref)
        ref.set_epoch(5)
        epoch5 = _starts(ref)
    with _client(feeder.address, shuffle=True) as c:
        _starts(c)  # epoch 0 to its end: epoch 1 starts streaming
        c.set_epoch(1)
        assert _starts(c) == epoch1
        c.set_epoch(2)  # streamed ahead, then not wanted: dropped
        c.set_epoch(5)
        assert _starts(c) == epoch5
        _starts(c, limit=1)  # epoch 5 again from its start (6 was streamed ahead)
        state = c.state_dict()
        assert (state["epoch"], state["step"]) == (5, 1)


# ------------------------------------------- metrics off the loop's path, first batch


def test_stall_window_leaves_first_batch_waits_out_of_the_wall_time() -> None:
    now = [1000.0]
    w = StallWindow(window=10.0, clock=lambda: now[0])
    now[0] += 3
    w.exclude(2.0)  # 2 s waiting for a first batch: neither waited nor wall time
    now[0] += 2
    w.add(0.5)
    assert w.value() == pytest.approx(0.5 / (5 - 2))
    now[0] += 20  # aged out
    assert w.value() == 0.0


@given(
    st.lists(st.tuples(st.floats(0, 3), st.floats(0, 0.5), st.booleans()), max_size=40),
    st.floats(1, 20),
)
def test_stall_window_matches_a_reference_over_one_second_bins(
    events: list[tuple[float, float, bool]], window: float
) -> None:
    """Lock-free bins (current bin + bounded deque) == summing every event's bin."""
    now = [5000.0]
    w = StallWindow(window=window, clock=lambda: now[0])
    log: list[tuple[float, float, bool]] = []
    for advance, seconds, first in events:
        now[0] += advance
        (w.exclude if first else w.add)(seconds)
        log.append((float(int(now[0])), seconds, first))
        start = max(now[0] - window, 5000.0)
        live = [(s, x, f) for s, x, f in log if s + 1 > start]
        waited = sum(x for _, x, f in live if not f)
        wall = now[0] - start - sum(x for _, x, f in live if f)
        expected = 0.0 if wall <= 0 else max(0.0, min(1.0, waited / wall))
        assert w.value() == pytest.approx(expected, abs=1e-9)


@given(st.lists(st.floats(0, 20, allow_nan=False), max_size=300))
def test_histogram_counts_match_prometheus_le_buckets(values: list[float]) -> None:
    from tokenfeed.client.metrics import WAIT_BUCKETS, Histogram

    h = Histogram(WAIT_BUCKETS)
    for v in values:
        h.observe(v)
    for i, bound in enumerate(WAIT_BUCKETS):
        assert sum(h.counts[: i + 1]) == sum(1 for v in values if v <= bound)
    assert h.count == len(values)
    assert h.sum == pytest.approx(sum(values))


def test_loop_waits_reach_prometheus_through_the_collector_only() -> None:
    reg = CollectorRegistry()
    a, b = ClientMetrics(0, reg), ClientMetrics(0, reg)  # train + validation of rank 0
    now = [100.0]
    a.stall = StallWindow(window=30, clock=lambda: now[0])
    b.stall = StallWindow(window=30, clock=lambda: now[0])
    now[0] += 10
    a.waited(3e-5)  # the loop: an append, nothing folded yet
    assert len(a.waits) == 1
    assert a.wait.count == 0
    b.waited(0.2)
    b.first_batch_waited(1.5)
    a.received(10, 20)  # the reader folds while it counts
    assert a.wait.count == 1
    assert not a.waits
    get = reg.get_sample_value
    assert get("tokenfeed_client_wait_seconds_count", {"rank": "0"}) == 2  # scrape folds b
    assert get("tokenfeed_client_wait_seconds_bucket", {"rank": "0", "le": "2.5e-05"}) == 0
    assert get("tokenfeed_client_wait_seconds_bucket", {"rank": "0", "le": "5e-05"}) == 1
    assert get("tokenfeed_client_wait_seconds_bucket", {"rank": "0", "le": "+Inf"}) == 2
    assert get("tokenfeed_client_wait_seconds_sum", {"rank": "0"}) == pytest.approx(0.20003)
    assert get("tokenfeed_client_first_batch_seconds_count", {"rank": "0"}) == 1
    assert get("tokenfeed_client_first_batch_seconds_bucket", {"rank": "0", "le": "1.0"}) == 0
    assert get("tokenfeed_client_first_batch_seconds_bucket", {"rank": "0", "le": "2.5"}) == 1
    assert b.first_batch_seconds == 1.5
    assert b.summary()["first_batch_seconds_total"] == 1.5
    assert get("tokenfeed_client_tokens_received_total", {"rank": "0"}) == 10
    assert get("tokenfeed_client_tokens_received_created", {"rank": "0"}) is not None
    assert get("tokenfeed_client_wait_seconds_created", {"rank": "0"}) is not None
    # The gauge shows the larger stall of the open clients of a rank; b's first batch
    # is out of both its waited and its wall time.
    assert get("tokenfeed_client_stall_fraction", {"rank": "0"}) == pytest.approx(0.2 / (10 - 1.5))
    b.close()
    assert get("tokenfeed_client_stall_fraction", {"rank": "0"}) == pytest.approx(3e-5 / 10)
    assert get("tokenfeed_client_wait_seconds_count", {"rank": "0"}) == 2  # counts stay
    with pytest.raises(ValueError, match="Duplicated"):  # the names stay ours
        Counter("tokenfeed_client_wait_seconds", "x", registry=reg)


def test_first_batch_is_reported_apart_from_the_steady_state(feeder_root: Path) -> None:
    """A feeder behind a slow link (connect, first message): the first batch's wait
    is in first_batch_seconds, not in wait_seconds or the stall's wall time."""
    from support.faultproxy import FaultProxy

    reg = CollectorRegistry()
    with running_feeder(feeder_root) as f:
        proxy = FaultProxy(("127.0.0.1", f.port)).start()
        try:
            proxy.delay(0.1)
            with _client(proxy.address, registry=reg, metrics_port=0) as c:
                it = iter(c)
                next(it)
                proxy.heal()
                n = 1 + sum(1 for _ in it)
                first = c.first_batch_seconds
                assert first is not None
                assert first > 0
                m = c.metrics.summary()
                assert (m["first_batches"], m["first_batch_seconds_total"]) == (1, first)
                assert m["waits"] == n  # n - 1 batches and the final StopIteration
                assert c.metrics.stall._current[2] + sum(
                    b[2] for b in c.metrics.stall._bins
                ) == pytest.approx(first)  # left out of the stall's wall time
                body = (
                    urllib.request.urlopen(f"http://127.0.0.1:{c.metrics.port}/metrics")
                    .read()
                    .decode()
                )
                assert 'tokenfeed_client_first_batch_seconds_count{rank="0"} 1.0' in body
                assert f'tokenfeed_client_wait_seconds_count{{rank="0"}} {float(n)}' in body
                c.set_epoch(1)  # adopted from lookahead: a second first batch
                assert len(_starts(c)) == len(c) * 4
                assert c.metrics.summary()["first_batches"] == 2
        finally:
            proxy.stop()


def test_lookahead_opens_the_next_epoch_before_this_one_ends(feeder) -> None:  # type: ignore[no-untyped-def]
    with _client(feeder.address, shuffle=True) as ref:
        ref.set_epoch(1)
        epoch1 = _starts(ref)
    with _client(feeder.address, shuffle=True) as c:
        steps = len(c)
        assert steps > LOOKAHEAD_STEPS + 1
        it = iter(c)
        for step in range(steps):
            assert (c._epochs._ahead is None) == (step < steps - LOOKAHEAD_STEPS), step
            next(it)
        assert c._epochs._ahead is not None
        assert c._epochs._ahead[0].request.epoch == 1
        with pytest.raises(StopIteration):
            next(it)
        ahead = c._epochs._ahead
        c.set_epoch(1)
        assert c._epochs._adopted is ahead  # the same stream, not a new one
        assert _starts(c) == epoch1  # and exactly once


def test_a_mixture_opens_no_next_epoch_ahead(feeder_root: Path) -> None:
    """A mixture stream is endless: there is no next epoch to stream ahead (the feeder
    would refuse epoch 1 with INVALID_ARGUMENT)."""
    make_positional_store(feeder_root / "other", 5_000, 1_000)
    with running_feeder(feeder_root) as f:
        mixture = {FEEDER_DATASET: 0.5, "other": 0.5}
        with _client(f.address, dataset=None, mixture=mixture, lookahead=True) as c:
            it = iter(c)
            for _ in range(LOOKAHEAD_STEPS + 3):
                next(it)
            assert c._epochs._ahead is None
            assert c._epochs._reader is not None
            assert c._epochs._reader.is_alive()


def test_batches_the_loop_dropped_are_freed_by_the_reader_thread(feeder) -> None:  # type: ignore[no-untyped-def]
    import weakref

    with _client(feeder.address, prefetch=1, batches_per_message=1, lookahead=False) as c:
        it = iter(c)
        batch = next(it)
        gone = weakref.ref(batch["input_ids"])
        freed_in: list[str] = []
        weakref.finalize(
            batch["input_ids"], lambda: freed_in.append(threading.current_thread().name)
        )
        del batch
        next(it)  # the loop's variable moved on; the client still holds one reference
        assert gone() is not None
        next(it)
        wait_until(lambda: gone() is None, 30, "the previous batch to be freed")
        assert gone() is None
        assert freed_in
        assert freed_in[0].startswith("tokenfeed-reader")
        assert len(c._epochs._spent) <= 2


def test_a_whole_message_of_batches_may_wait_in_the_buffer(feeder) -> None:  # type: ignore[no-untyped-def]
    reg = CollectorRegistry()
    with _client(feeder.address, prefetch=1, batches_per_message=4, registry=reg) as c:
        it = iter(c)
        next(it)
        wait_until(lambda: c._epochs._queue.qsize() >= 4, 30, "a full buffer")
        assert c._epochs._queue.qsize() == 4 == c._epochs._queue.maxsize
        # A new iteration from the loop's position: the buffered batches come again.
        assert len(_starts(c)) == (len(c) - 1) * 4


def test_a_channel_closed_by_another_stream_is_retried_not_raised(feeder) -> None:
    """A rank's streams share one channel: when one fails over it closes it, and a call
    another one makes on it at that moment raises ValueError("Channel closed"). The
    call is tried again on the new channel instead of killing the rank."""
    from tokenfeed.client.stream import call_with_retry

    channels = Channels(Connection([feeder.address], backoff=Backoff(deadline=10)))
    calls = []

    def info(stub, timeout):  # type: ignore[no-untyped-def]
        calls.append(stub)
        if len(calls) == 1:
            channels.rotate()  # another stream fails over: this stub's channel closes
        return stub.Info(feeder_pb2.InfoRequest(), timeout=timeout)

    try:
        resp = call_with_retry(channels, info, lambda reason: None)
    finally:
        channels.close()
    assert [d.name for d in resp.datasets] == [FEEDER_DATASET]
    assert len(calls) == 2
    assert calls[0] is not calls[1]
