"""The feeder over real gRPC on loopback: content, cache sharing, errors, metrics.

Stores are positional (token i == i), so every window is checked token by token:
row r of a batch must be starts[r] + arange(cols). The expected order comes from
the sampling engine itself (the one home of that math): the server must send
exactly what `DatasetSampler.batches` says.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import native, sampling
from tokenfeed.core.errors import NotFound
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import TokenStore
from tokenfeed.server import assembly, readahead, rounds, service, wire
from tokenfeed.server.datasets import Catalog
from tokenfeed.server.service import sampler_for
from tokenfeed.server.status import serve_http
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import registered_series, wait_until
from support.feeders import FEEDER_DATASET, running_feeder
from support.feeders import feeder_params as params
from support.stores import make_positional_store, positional_rows


def stub(address: str) -> pb_grpc.FeederStub:
    return pb_grpc.FeederStub(grpc.insecure_channel(address))


def messages(address: str, p: pb.SamplingParams, **kw) -> list[pb.StreamBatchesResponse]:
    with grpc.insecure_channel(address) as ch:
        return list(pb_grpc.FeederStub(ch).StreamBatches(pb.StreamBatchesRequest(params=p, **kw)))


def stream(address: str, p: pb.SamplingParams, **kw) -> list[pb.Batch]:
    return [b for r in messages(address, p, **kw) for b in r.batches]


def check_positional(b: pb.Batch, modulo: int) -> None:
    rows = np.frombuffer(b.tokens, dtype=np.dtype(b.dtype).newbyteorder("<"))
    assert len(b.starts) == b.rows
    np.testing.assert_array_equal(
        rows.reshape(b.rows, b.cols), positional_rows(b.starts, b.cols, modulo)
    )


def expected(root: Path, p: pb.SamplingParams, epoch=0, rank=0, offset=0, step=0):
    ds = Catalog(root).get(p.dataset)
    return list(sampler_for(SamplingSpec.from_proto(p), ds).batches(epoch, rank, offset, step))


def assert_matches(
    batches: list[pb.Batch],
    rank_batches: list[sampling.RankBatch],
    seq_len: int,
    modulo: int = 1 << 32,
) -> None:
    assert len(batches) == len(rank_batches)
    for b, bp in zip(batches, rank_batches, strict=True):
        assert (b.epoch, b.step, b.offset, b.shift) == (bp.epoch, bp.step, bp.offset, bp.shift)
        assert list(b.starts) == bp.starts.tolist()
        assert b.cols == seq_len + bp.shift
        check_positional(b, modulo)


def test_batch_threads_are_started_before_the_first_request(feeder_root: Path) -> None:
    # Started one per task, each start would keep the event loop waiting in the way of
    # the first streams' first batches.
    def batch_threads() -> int:
        return sum(t.name.startswith("tokenfeed-batch") for t in threading.enumerate())

    before = batch_threads()
    with running_feeder(feeder_root, assembly_threads=3):
        assert batch_threads() - before == 3


def test_a_feeder_opens_its_stores_as_it_starts(feeder_root: Path) -> None:
    """A feeder opens its local stores as it starts, on a thread of its own: the first
    stream finds its store open, a store that does not open is left to the requests
    (which get its error as before), and the status page lists only stores asked for."""
    broken = feeder_root / "broken"
    make_positional_store(broken, 2_000, 1_000)
    (broken / "meta.json").write_text("{not json")
    opened: list[str] = []

    def open_store(path: Path) -> TokenStore:
        store = TokenStore.open(path)
        opened.append(path.name)
        return store

    with running_feeder(feeder_root, open_store=open_store) as f:
        wait_until(lambda: opened == [FEEDER_DATASET], 30, "the store opened ahead")
        assert f.server.catalog.opened() == []
        assert len(stream(f.address, params())) > 1
        assert opened == [FEEDER_DATASET]  # the stream's request did not open it again
        assert [ds.name for ds in f.server.catalog.opened()] == [FEEDER_DATASET]
        err = call_error(f.address, pb.InfoRequest(dataset="broken"), "Info")
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert "unreadable meta.json" in err.details()


# ----------------------------------------------------------------------------- Info


def test_info_lists_every_store_with_metadata_and_split_counts(feeder_root: Path) -> None:
    make_positional_store(feeder_root / "web" / "en", 5_000, 700, dtype="uint16")
    (feeder_root / "not-a-store").mkdir()
    with running_feeder(feeder_root) as f:
        resp = stub(f.address).Info(pb.InfoRequest())
        by_name = {d.name: d for d in resp.datasets}
        assert sorted(by_name) == [FEEDER_DATASET, "web/en"]
        d = by_name["web/en"]
        assert (
            d.total_tokens,
            d.num_chunks,
            d.dtype,
            d.vocab_size,
            d.eos_token_id,
            d.tokenizer,
            d.tokens_per_chunk,
        ) == (5_000, 8, "uint16", 65536, 0, "positions", 700)
        assert list(d.splits) == []  # no params, no split counts

        p = params(batch_size=3, world_size=2)
        resp = stub(f.address).Info(pb.InfoRequest(dataset=FEEDER_DATASET, params=p, rank=1))
        (d,) = resp.datasets
        ds = Catalog(feeder_root).get(FEEDER_DATASET)
        for s in d.splits:
            sampler = sampler_for(SamplingSpec.from_proto(p).with_(split=s.name), ds)
            assert (s.tokens, s.windows, s.steps) == (
                sampler.split_end - sampler.split_begin,
                sampler.num_windows,
                sampler.steps(1),
            )
        assert [s.name for s in d.splits] == ["train", "validation"]
        assert d.splits[0].tokens == 9_000
        assert d.splits[0].steps > 0


def test_info_errors_and_broken_stores(feeder_root: Path) -> None:
    broken = feeder_root / "broken"
    make_positional_store(broken, 2_000, 1_000)
    (broken / "meta.json").write_text("{not json")
    with running_feeder(feeder_root) as f:
        names = [d.name for d in stub(f.address).Info(pb.InfoRequest()).datasets]
        assert names == [FEEDER_DATASET]  # a broken store is logged and left out
        err = call_error(f.address, pb.InfoRequest(dataset="broken"), "Info")
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert "unreadable meta.json" in err.details()
        err = call_error(
            f.address, pb.InfoRequest(dataset=FEEDER_DATASET, params=params(stride=-1)), "Info"
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "stride" in err.details()
        err = call_error(
            f.address, pb.InfoRequest(dataset=FEEDER_DATASET, params=params(), rank=1), "Info"
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "rank" in err.details()


def test_unset_fields_mean_the_documented_defaults(feeder) -> None:
    """A raw client that sets only dataset, seq_len and batch_size gets what the Python
    client's defaults give: split train, split_rate 1.0, stride = seq_len, shift 1,
    world_size 1, and Info reports the windows of a split too small for one step."""
    bare = pb.SamplingParams(dataset=FEEDER_DATASET, seq_len=100, batch_size=4)
    spec = SamplingSpec(dataset=FEEDER_DATASET, seq_len=100, batch_size=4)
    assert SamplingSpec.from_proto(bare) == spec
    assert SamplingSpec.from_proto(spec.to_proto()) == spec
    got = stream(feeder.address, bare)
    assert_matches(got, expected(feeder.data_root, spec.to_proto()), 100)
    assert [b.starts[0] for b in got[:2]] == [0, 400]
    assert len(got) == 99 // 4
    (d,) = (
        stub(feeder.address)
        .Info(
            pb.InfoRequest(
                dataset=FEEDER_DATASET, params=pb.SamplingParams(seq_len=100, batch_size=200)
            )
        )
        .datasets
    )
    train = d.splits[0]
    assert (train.tokens, train.windows, train.steps) == (10_000, 99, 0)


# ---------------------------------------------------------------------- StreamBatches


@pytest.mark.parametrize(
    "kw",
    [
        dict(),  # in order, shift 1
        dict(shuffle=True, seed=7, shift=4),
        dict(shuffle=True, seed=3, auto_shift=True, shuffle_blocks=2),
        dict(split="validation", batch_size=5, seq_len=32, stride=5),  # short last step
        dict(seq_len=1500, stride=700, batch_size=2, shift=3),  # windows span 2-3 chunks
    ],
)
@pytest.mark.parametrize("per_message", [0, 3])
def test_stream_sends_exactly_the_planned_windows(feeder, kw, per_message) -> None:
    p = params(**kw)
    got = messages(feeder.address, p, batches_per_message=per_message)
    sizes = [len(m.batches) for m in got]  # the first batch alone, full messages, the rest
    assert sizes[0] == 1
    assert sizes[1:-1] == [max(1, per_message)] * (len(sizes) - 2)
    assert 1 <= sizes[-1] <= max(1, per_message)
    assert_matches([b for m in got for b in m.batches], expected(feeder.data_root, p), p.seq_len)


@pytest.mark.parametrize("per_message", [1, 5])
def test_worker_thread_path_sends_the_same(feeder_root, monkeypatch, per_message) -> None:
    """Messages over INLINE_MAX_BYTES are built in the pool, double-buffered."""
    monkeypatch.setattr(service, "INLINE_MAX_BYTES", 0)
    with running_feeder(feeder_root, cache_bytes=3 * 4000) as f:  # 3 chunks: evictions too
        p = params(shuffle=True, seed=11, seq_len=96, stride=40, shuffle_blocks=2)
        got = stream(f.address, p, batches_per_message=per_message)
        assert_matches(got, expected(feeder_root, p), p.seq_len)
        assert f.server.cache.stats.evictions > 0
        assert f.server.cache.pinned_count == 0


@given(
    st.integers(0, 2**62),
    st.integers(0, 2**40),
    st.sampled_from(["uint16", "uint32", ""]),
    st.lists(
        st.tuples(
            st.integers(0, 2**62),
            st.integers(0, 64),
            st.integers(0, 5),
            st.integers(0, 40),
        ),
        min_size=1,
        max_size=4,
    ),
    st.data(),
)
def test_wire_encoding_matches_protobuf(epoch, step, dtype, batches, data) -> None:
    """The hand-rolled hot path is byte-identical to protobuf's own serialization:
    consecutive batches of any shape (empty ones too), starts of any size; the C loop
    and its Python reference alike."""
    itemsize = 2
    offsets, shifts, rows, cols = (list(x) for x in zip(*batches, strict=True))
    starts = [data.draw(st.lists(st.integers(0, 2**63 - 1), min_size=r, max_size=r)) for r in rows]
    # a mixture's rows carry source indices (one varint byte each below 128)
    sources = data.draw(
        st.none() | st.lists(st.integers(0, 200), min_size=sum(rows), max_size=sum(rows))
    )
    encode = data.draw(st.sampled_from(ENCODERS))
    heads, tails = frames_of(
        encode,
        epoch,
        step,
        offsets,
        shifts,
        rows,
        cols,
        dtype,
        itemsize,
        np.array([s for ss in starts for s in ss], dtype=np.int64),
        None if sources is None else np.array(sources, dtype=np.int64),
    )
    msgs, parts = [], []
    row = 0
    for i, (offset, shift, r, c) in enumerate(batches):
        payload = bytes(range(256)) * (r * c * itemsize // 256) + bytes(r * c * itemsize % 256)
        msgs.append(
            pb.Batch(
                epoch=epoch,
                step=step + i,
                offset=offset,
                shift=shift,
                rows=r,
                cols=c,
                dtype=dtype,
                tokens=payload,
                starts=starts[i],
                sources=[] if sources is None else sources[row : row + r],
            )
        )
        row += r
        parts += [heads[i], payload, tails[i]]
    assert b"".join(parts) == pb.StreamBatchesResponse(batches=msgs).SerializeToString()


def test_wire_encoding_of_a_large_batch() -> None:
    payload = b"".join(bytes([i]) * 70_000 for i in range(5))  # multi-byte length varints
    starts = np.array([0, 1, 2, 3, 2**40], dtype=np.int64)
    want = pb.StreamBatchesResponse(
        batches=[
            pb.Batch(
                step=3,
                rows=5,
                cols=35_000,
                dtype="uint16",
                tokens=payload,
                starts=starts.tolist(),
            )
        ]
    ).SerializeToString()
    for encode in ENCODERS:
        heads, tails = frames_of(encode, 0, 3, [0], [0], [5], [35_000], "uint16", 2, starts)
        assert heads[0] + payload + tails[0] == want


# wire.frames' per-batch loop: the C one (where it runs) and its Python reference
ENCODERS = ["C", "Python"]


def frames_of(encode, *args) -> tuple[list[bytes], list[bytes]]:
    """wire.frames with the `encode` loop, cut into (heads, tails)."""
    with native.disabled() if encode == "Python" else contextlib.nullcontext():
        blob, sizes = wire.frames(*args)
    at = np.concatenate(([0], np.cumsum(sizes))).tolist()
    pieces = [blob[a:b] for a, b in itertools.pairwise(at)]
    return pieces[0::2], pieces[1::2]


def test_resume_at_an_offset_and_every_rank(feeder) -> None:
    p = params(shuffle=True, seed=1, world_size=3, batch_size=2, split="validation", split_rate=0.5)
    rank_batches = expected(feeder.data_root, p, epoch=2, rank=1)
    mid = rank_batches[len(rank_batches) // 2]
    got = stream(feeder.address, p, epoch=2, rank=1, offset=mid.offset, step=mid.step)
    assert_matches(got, rank_batches[len(rank_batches) // 2 :], p.seq_len)
    seen = []
    for rank in range(3):
        for b in stream(feeder.address, p, epoch=2, rank=rank):
            seen += list(b.starts)
    assert len(seen) == len(set(seen))  # every window of the epoch once across ranks
    ds = Catalog(feeder.data_root).get(FEEDER_DATASET)
    assert len(seen) == sampler_for(SamplingSpec.from_proto(p), ds).num_windows


def test_uint16_store_and_nested_name(tmp_path: Path) -> None:
    root = tmp_path / "root"
    make_positional_store(root / "a" / "b", 70_000, 9_000, dtype="uint16")  # ids wrap at 65536
    with running_feeder(root) as f:
        p = params(dataset="a/b", seq_len=128, stride=100, batch_size=8, shuffle=True)
        got = stream(f.address, p, batches_per_message=4)
        assert got[0].dtype == "uint16"
        assert_matches(got, expected(root, p), 128, modulo=1 << 16)


def test_a_request_locates_each_name_once(tmp_path: Path) -> None:
    """Within names_once (one request: its grant's check, then its opening) a name is
    located once, on that thread only; outside it every lookup sees the root as it is."""
    make_positional_store(tmp_path / "a", 2_000, 1_000)
    catalog = Catalog(tmp_path)
    seen: list[object] = []
    with catalog.names_once():
        first = catalog.locate("a")
        (tmp_path / "a").rename(tmp_path / "b")
        assert catalog.locate("a") == first  # the request's own lookup
        with catalog.names_once():  # nested: the same request
            assert catalog.locate("a") == first
        other = threading.Thread(target=lambda: seen.append(_located(catalog, "a")))
        other.start()
        other.join()
    assert seen == ["NotFound"]  # another thread looks for itself
    assert _located(catalog, "a") == "NotFound"
    assert catalog.locate("b") == ("tokenfeed", tmp_path.resolve() / "b")


def _located(catalog: Catalog, name: str) -> object:
    try:
        return catalog.locate(name)
    except NotFound:
        return "NotFound"


def test_many_concurrent_streams_load_each_chunk_once(feeder) -> None:
    p = params(shuffle=True, seed=5, batch_size=2, stride=16, shuffle_blocks=3)
    rank_batches = expected(feeder.data_root, p)
    results: list[list[pb.Batch]] = [[] for _ in range(8)]

    def run(i: int) -> None:
        results[i] = stream(feeder.address, p)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for got in results:
        assert_matches(got, rank_batches, p.seq_len)
    stats = feeder.server.cache.stats
    assert stats.evictions == 0
    assert stats.failures == 0
    assert stats.loads <= 10  # 10 chunks in the store: none loaded twice
    assert stats.hits > 0


# ----------------------------------------------------------------------------- errors


def call_error(address: str, request, method: str = "StreamBatches") -> grpc.RpcError:
    s = stub(address)
    call = s.Info if method == "Info" else lambda r: list(s.StreamBatches(r))
    with pytest.raises(grpc.RpcError) as info:
        call(request)
    return info.value


INVALID = [
    (dict(seq_len=0), {}, "seq_len must be"),
    (dict(stride=-4), {}, "stride must be"),
    (dict(seq_len=64, shift=5), {}, "must divide seq_len"),
    (dict(seq_len=61, auto_shift=True), {}, "proper divisors"),
    (dict(world_size=2), dict(rank=2), "rank must be in"),
    (dict(world_size=-1), {}, "world_size must be"),
    (dict(split="test"), {}, "split must be one of"),
    (dict(split_rate=1.5), {}, "split_rate"),
    (dict(), dict(offset=10**9), "outside the epoch"),
    (dict(), dict(epoch=-1), "non-negative"),
    (dict(), dict(batches_per_message=-1), "batches_per_message"),
    (dict(), dict(batches_per_message=100_000), "batches_per_message"),
    (dict(dataset="../etc"), {}, "'..'"),
    (dict(dataset="/etc"), {}, "absolute"),
    (dict(dataset=""), {}, "empty"),
    (dict(dataset="a\x00b"), {}, "control"),
]


@pytest.mark.parametrize(("pkw", "rkw", "message"), INVALID)
def test_invalid_argument(feeder, pkw, rkw, message) -> None:
    err = call_error(feeder.address, pb.StreamBatchesRequest(params=params(**pkw), **rkw))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert message in err.details()
    assert str(feeder.data_root) not in err.details()


def test_batch_larger_than_max_batch_bytes(feeder_root: Path) -> None:
    with running_feeder(feeder_root, max_batch_bytes=4 * 65 * 4 * 2 - 1) as f:
        assert len(stream(f.address, params(seq_len=64))) > 0  # 4 x 65 x 4 bytes fits
        err = call_error(
            f.address, pb.StreamBatchesRequest(params=params(seq_len=64), batches_per_message=2)
        )
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "exceeds the server's --max-batch-bytes 2079" in err.details()


def test_undecodable_request_is_invalid_argument(feeder) -> None:
    # field 1 (params) -> field 1 (dataset) holding bytes that are not UTF-8
    raw = bytes([0x0A, 4, 0x0A, 2, 0xFF, 0xFE])
    with grpc.insecure_channel(feeder.address) as ch:
        call = ch.unary_stream("/tokenfeed.v1.Feeder/StreamBatches")
        with pytest.raises(grpc.RpcError) as info:
            list(call(raw))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in info.value.details()


def test_not_found_and_nothing_outside_the_root(tmp_path: Path, feeder_root: Path) -> None:
    outside = tmp_path / "outside"
    make_positional_store(outside / "secret", 1_000, 500)
    os.symlink(outside / "secret", feeder_root / "link")  # resolves outside the root
    os.symlink(feeder_root / FEEDER_DATASET, feeder_root / "alias")  # inside: fine
    with running_feeder(feeder_root) as f:
        for name in ("nope", "link", "positions/chunk_000000.bin", "positions/x"):
            err = call_error(f.address, pb.StreamBatchesRequest(params=params(dataset=name)))
            assert err.code() == grpc.StatusCode.NOT_FOUND, (name, err.details())
            assert f"no dataset {name!r}" in err.details()
            assert "positions" in err.details()
            assert str(outside) not in err.details()
        err = call_error(f.address, pb.InfoRequest(dataset="link"), "Info")
        assert err.code() == grpc.StatusCode.NOT_FOUND
        names = [d.name for d in stub(f.address).Info(pb.InfoRequest()).datasets]
        assert names == [FEEDER_DATASET]  # symlinks are not walked
        assert len(stream(f.address, params(dataset="alias"))) > 0


def test_failed_precondition_when_the_split_is_too_short(feeder) -> None:
    err = call_error(
        feeder.address, pb.StreamBatchesRequest(params=params(split="validation", split_rate=0.999))
    )
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "too short for one window" in err.details()
    err = call_error(feeder.address, pb.StreamBatchesRequest(params=params(batch_size=1000)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "fewer than one global batch" in err.details()


def test_corrupt_chunk_is_data_loss_for_its_streams_only(feeder_root: Path) -> None:
    bad = make_positional_store(feeder_root / "bad", 10_000, 1_000)
    path = bad.chunk_path(4)
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF
    path.write_bytes(bytes(data))
    registry_metrics = None
    with running_feeder(feeder_root) as f:
        good_result: list[int] = []
        slow = threading.Thread(
            target=lambda: good_result.append(len(stream(f.address, params(batch_size=1))))
        )
        slow.start()
        err = call_error(f.address, pb.StreamBatchesRequest(params=params(dataset="bad")))
        assert err.code() == grpc.StatusCode.DATA_LOSS
        assert "chunk_000004.bin is corrupt" in err.details()
        assert "tokenfeed verify" in err.details()
        assert str(feeder_root) not in err.details()
        slow.join(120)
        assert good_result == [len(expected(feeder_root, params(batch_size=1)))]
        registry_metrics = f.registry
        # the server still serves the healthy parts of the bad store
        assert len(stream(f.address, params(dataset="bad", split="validation"))) > 0
    assert registry_metrics.get_sample_value("tokenfeed_cache_checksum_failures_total") >= 1
    assert (
        registry_metrics.get_sample_value("tokenfeed_server_errors_total", {"code": "DATA_LOSS"})
        >= 1
    )


def test_a_cold_streams_first_message_is_read_in_place_and_a_bad_checksum_ends_it(
    feeder_root: Path,
) -> None:
    """A stream whose chunks are not cached sends its first message (one batch) from rows
    read in place: the file's bytes, before any whole-chunk load checks the checksum;
    that load then ends the stream with DATA_LOSS naming the chunk (docs/stores.md)."""
    bad = make_positional_store(feeder_root / "bad", 10_000, 1_000)
    path = bad.chunk_path(0)
    data = bytearray(path.read_bytes())
    data[8] ^= 0xFF  # the low byte of token 2 (uint32)
    path.write_bytes(bytes(data))
    with running_feeder(feeder_root) as f:
        call = stub(f.address).StreamBatches(pb.StreamBatchesRequest(params=params(dataset="bad")))
        first = next(call)
        assert len(first.batches) == 1
        (b,) = first.batches
        rows = np.frombuffer(b.tokens, dtype="<u4").reshape(b.rows, b.cols)
        want = np.array(b.starts)[:, None] + np.arange(b.cols)
        want[0, 2] ^= 0xFF  # the first window starts at 0: the flipped byte, as read
        np.testing.assert_array_equal(rows, want)
        with pytest.raises(grpc.RpcError) as info:
            list(call)
        assert info.value.code() == grpc.StatusCode.DATA_LOSS
        assert "chunk_000000.bin is corrupt" in info.value.details()
        assert f.registry.get_sample_value("tokenfeed_cache_checksum_failures_total") >= 1


@pytest.mark.parametrize("world_size", [1, 16])  # chunks loaded whole; rows read in place
def test_missing_or_short_chunk_is_data_loss_at_its_first_read(
    feeder_root: Path, world_size: int
) -> None:
    """Opening a store reads its meta.json only: a chunk it lists that is missing or cut
    short is found when a stream first needs it, DATA_LOSS naming it, and only the
    streams that need it end (docs/stores.md, "What is checked when")."""
    make_positional_store(feeder_root / "holes", 10_000, 1_000)
    (feeder_root / "holes" / "chunk_000003.bin").unlink()
    os.truncate(feeder_root / "holes" / "chunk_000006.bin", 1_000)
    p = params(dataset="holes", split_rate=1.0, seq_len=100, stride=100, batch_size=1)
    with running_feeder(feeder_root) as f:
        (info,) = stub(f.address).Info(pb.InfoRequest(dataset="holes")).datasets
        assert (info.total_tokens, info.num_chunks) == (10_000, 10)  # opening is cheap
        healthy: list[int] = []
        beside = threading.Thread(
            target=lambda: healthy.append(len(stream(f.address, params(batch_size=1))))
        )
        beside.start()
        for offset, chunk, problem in ((0, 3, "is missing"), (48, 6, "has 1000 bytes")):
            got: list[pb.Batch] = []
            with grpc.insecure_channel(f.address) as ch:
                call = pb_grpc.FeederStub(ch).StreamBatches(
                    pb.StreamBatchesRequest(
                        params=params(**{**_fields(p), "world_size": world_size}),
                        offset=offset,
                    )
                )
                with pytest.raises(grpc.RpcError) as err:  # noqa: PT012 - read to the error
                    for response in call:
                        got += response.batches
            assert err.value.code() == grpc.StatusCode.DATA_LOSS
            assert f"holes: chunk chunk_00000{chunk}.bin {problem}" in err.value.details()
            assert str(feeder_root) not in err.value.details()
            for b in got:  # the batches before it (a burst's, at most) are right
                check_positional(b, 1 << 32)
                assert all((s + b.cols - 1) // 1_000 < chunk for s in b.starts)
        beside.join(120)
        assert healthy == [len(expected(feeder_root, params(batch_size=1)))]
        # the chunks that are there are still served: the windows of chunks 7-9
        tail = stream(f.address, params(**{**_fields(p), "world_size": world_size}), offset=70)
        assert len(tail) == (99 - 70) // world_size
        for b in tail:
            check_positional(b, 1 << 32)


def _fields(p: pb.SamplingParams) -> dict:
    return {f.name: v for f, v in p.ListFields()}


def test_resource_exhausted_beyond_max_streams(feeder_root: Path) -> None:
    with running_feeder(feeder_root, max_streams=1) as f, grpc.insecure_channel(f.address) as ch:
        s = pb_grpc.FeederStub(ch)
        first = s.StreamBatches(pb.StreamBatchesRequest(params=params(batch_size=1, stride=1)))
        next(first)  # the stream is open and holds the only slot
        with pytest.raises(grpc.RpcError) as info:
            list(s.StreamBatches(pb.StreamBatchesRequest(params=params())))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-streams 1" in info.value.details()
        first.cancel()
        # a cancelled stream frees its slot and everything it held
        wait_until(lambda: not f.server.service.active_streams, 30, "the slot to be freed")
        assert f.server.cache.pinned_count == 0
        assert f.registry.get_sample_value("tokenfeed_server_streams_active") == 0
        assert len(stream(f.address, params())) > 0


def test_chunk_bigger_than_the_cache(feeder_root: Path) -> None:
    with running_feeder(feeder_root, cache_bytes=1000) as f:
        err = call_error(f.address, pb.StreamBatchesRequest(params=params()))
        assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--cache-bytes" in err.details()


# ----------------------------------------------------- health, reflection, metrics


def test_health_and_reflection(feeder) -> None:
    with grpc.insecure_channel(feeder.address) as ch:
        h = health_pb2_grpc.HealthStub(ch)
        for service in ("", "tokenfeed.v1.Feeder"):
            r = h.Check(health_pb2.HealthCheckRequest(service=service))
            assert r.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        (resp,) = list(
            refl.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")])
            )
        )
        names = {s.name for s in resp.list_services_response.service}
        assert {
            "tokenfeed.v1.Feeder",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= names
        (resp,) = list(
            refl.ServerReflectionInfo(
                iter(
                    [
                        reflection_pb2.ServerReflectionRequest(
                            file_containing_symbol="tokenfeed.v1.Feeder"
                        )
                    ]
                )
            )
        )
        assert resp.file_descriptor_response.file_descriptor_proto


def test_metrics_endpoint_exposes_the_documented_series(feeder) -> None:
    p = params()
    n = len(stream(feeder.address, p))
    call_error(feeder.address, pb.StreamBatchesRequest(params=params(seq_len=0)))
    http, port = serve_http(feeder.registry, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        text = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        http.shutdown()
        http.server_close()
    for name in registered_series(client=False):
        assert f"\n{name}" in text or f"\n{name}{{" in text, name
    labels = f'dataset="{FEEDER_DATASET}",split="train"'
    assert f"tokenfeed_server_batches_sent_total{{{labels}}} {float(n)}" in text
    tokens = sum(len(bp.starts) * (p.seq_len + bp.shift) for bp in expected(feeder.data_root, p))
    # tokens_sent has a `source` label, empty (= absent in PromQL) for one dataset
    one = f'dataset="{FEEDER_DATASET}",source="",split="train"'  # labels print sorted
    assert f"tokenfeed_server_tokens_sent_total{{{one}}} {float(tokens)}" in text
    assert f"tokenfeed_server_bytes_sent_total{{{labels}}} {float(tokens * 4)}" in text
    assert 'tokenfeed_server_errors_total{code="INVALID_ARGUMENT"} 1.0' in text
    assert "tokenfeed_server_streams_active 0.0" in text
    assert "tokenfeed_chunk_load_seconds_count" in text
    samples = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert not [line for line in samples if "/" in line]  # no paths in any label


def test_rows_across_chunks_and_an_empty_chunk(tmp_path: Path) -> None:
    """Windows spanning several chunks, one of them empty, with two shifts in one round:
    the load path (`gather`, chunk by chunk) and the all-cached path (the splice
    program over pinned views) give the same, right tokens."""
    import json

    from tokenfeed.core.store import checksum
    from tokenfeed.server.cache import ChunkCache

    root = tmp_path / "root"
    make_positional_store(root / "gaps", 3_000, 700)
    meta_path = root / "gaps" / "meta.json"
    meta = json.loads(meta_path.read_text())
    (root / "gaps" / "empty.bin").write_bytes(b"")
    meta["chunks"].insert(2, {"file": "empty.bin", "tokens": 0, "checksum": checksum(b"")})
    meta_path.write_text(json.dumps(meta))
    ds = Catalog(root).get("gaps")
    cache = ChunkCache(1 << 20)
    starts = np.array([[0, 650, 1390, 1400], [2000, 100, 0, 0]], dtype=np.int64)
    rnd = sampling.Round(0, 0, [0, 8], [1, 3], [4, 2], starts)  # the last batch is short
    lr = rounds.LocatedRound(ds, rnd, seq_len=900)
    assert sorted(rounds.spans_chunks([(lr, 0, 2)])) == [0, 1, 3, 4, 5]  # 2 is the empty one
    assert readahead.chunk_uses([(lr, 0, 2)])[0] == [0, 1, 3, 4, 5]
    for i, rows in enumerate(rnd.rows):
        cols = lr.cols[i]
        want = starts[i, :rows, None] + np.arange(cols)
        loaded = assembly.gather(ds, cache, lr.row_pieces(i))
        chunks = sorted(rounds.spans_chunks([(lr, i, i + 1)]))
        pinned = assembly.pin_views(ds, cache, chunks)
        assert pinned is not None  # gather loaded this batch's chunks
        try:
            cached = pinned.rows(lr, i)
        finally:
            pinned.release()
        for payload in (loaded, cached):
            got = np.frombuffer(payload, dtype="<u4").reshape(rows, cols)
            np.testing.assert_array_equal(got, want)
    assert cache.stats.hits > 0
    assert cache.pinned_count == 0
    cache.close()
