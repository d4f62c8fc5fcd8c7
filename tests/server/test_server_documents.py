"""The feeder's document ends (Batch.document_ends) against a real server: exactly the
document-ending tokens of each batch, for EOS stores and stores with recorded offsets,
byte-identical to protobuf's encoding, and FAILED_PRECONDITION for a store with
neither."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from tokenfeed.core import documents
from tokenfeed.core.request import SamplingSpec
from tokenfeed.core.store import TokenStore
from tokenfeed.server import documents as server_documents
from tokenfeed.server import service
from tokenfeed.server.datasets import Catalog
from tokenfeed.server.mixtures import MixtureSpace
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support.feeders import running_feeder
from support.stores import DOCUMENT_EOS as EOS
from support.stores import make_document_store, megatron_corpus


def params(dataset: str = "docs", **kw) -> pb.SamplingParams:
    base = dict(dataset=dataset, seq_len=60, stride=37, batch_size=3, shuffle=True, seed=5)
    base.update(kw)
    return pb.SamplingParams(**base)


def raw_messages(address: str, request: pb.StreamBatchesRequest) -> list[bytes]:
    """The stream's messages as the bytes the server sent."""
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream("/tokenfeed.v1.Feeder/StreamBatches")
        return list(call(request.SerializeToString()))


def check_ends(raw: list[bytes], want_ends: bool = True) -> int:
    """Every batch's document_ends are its EOS positions; the bytes are protobuf's."""
    count = 0
    for data in raw:
        msg = pb.StreamBatchesResponse.FromString(data)
        assert msg.SerializeToString() == data  # byte-identical to protobuf's encoding
        for b in msg.batches:
            tokens = np.frombuffer(b.tokens, dtype=b.dtype).reshape(b.rows, b.cols)
            want = documents.eos_ends(tokens, EOS) if want_ends else []
            got = documents.ends_from_bytes(b.document_ends)
            np.testing.assert_array_equal(got, want)
            count += len(got)
    return count


@pytest.fixture
def docs_root(tmp_path: Path) -> Path:
    root = tmp_path / "data"
    make_document_store(root / "docs")
    make_document_store(root / "wide", dtype="uint32", seed=1)
    make_document_store(root / "bare", eos=None)
    return root


@pytest.mark.parametrize("per_message", [1, 5])
@pytest.mark.parametrize("shift", [dict(shift=1), dict(shift=4), dict(auto_shift=True)])
def test_each_batch_carries_its_document_ends(docs_root, per_message, shift) -> None:
    with running_feeder(docs_root) as f:
        for name in ("docs", "wide"):
            req = pb.StreamBatchesRequest(
                params=params(name, **shift), batches_per_message=per_message, document_ends=True
            )
            assert check_ends(raw_messages(f.address, req)) > 100
            # Not asked for: not sent.
            req.document_ends = False
            check_ends(raw_messages(f.address, req), want_ends=False)


def test_worker_thread_path_and_rows_loaded_chunk_by_chunk(docs_root, monkeypatch) -> None:
    """Messages built in the pool, and from chunks that are not all resident (a cache
    of 2 chunks: gather() loads them one at a time) carry the same ends."""
    monkeypatch.setattr(service, "INLINE_MAX_BYTES", 0)
    with running_feeder(docs_root, cache_bytes=2 * 2000) as f:
        req = pb.StreamBatchesRequest(
            params=params(seq_len=120, stride=50, shuffle_blocks=4),
            batches_per_message=4,
            document_ends=True,
        )
        assert check_ends(raw_messages(f.address, req)) > 100
        assert f.server.cache.stats.evictions > 0


def test_a_store_without_boundaries_is_failed_precondition(docs_root) -> None:
    with running_feeder(docs_root) as f, grpc.insecure_channel(f.address) as ch:
        stub = pb_grpc.FeederStub(ch)
        with pytest.raises(grpc.RpcError) as info:
            list(
                stub.StreamBatches(
                    pb.StreamBatchesRequest(params=params("bare"), document_ends=True)
                )
            )
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dataset 'bare'" in info.value.details()
        assert "eos_token_id" in info.value.details()
        assert str(docs_root) not in info.value.details()
        # Still served without them.
        got = list(stub.StreamBatches(pb.StreamBatchesRequest(params=params("bare"))))
        assert got
        assert not any(b.document_ends for m in got for b in m.batches)


def test_recorded_offsets_win_over_eos(tmp_path: Path) -> None:
    """A store that records document offsets: ends come from them, not from the tokens
    (here EOS tokens inside documents are ignored and documents end without one)."""
    tokens = make_document_store(tmp_path / "docs", total=5_000)
    store = TokenStore.open(tmp_path / "docs")
    recorded = np.array([0, 3, 3, 50, 51, 400, 2_000, 5_000])  # an empty one, twice
    store.document_ends = lambda: recorded  # type: ignore[method-assign]
    ends = server_documents.BatchEnds("docs", store.dtype, EOS, documents.recorded_ends(recorded))
    starts = np.array([0, 45, 395, 1_990])
    cols = 12
    rows = tokens[starts[:, None] + np.arange(cols)].astype(np.uint16)
    got = ends.ends(rows.tobytes(), starts, cols)
    np.testing.assert_array_equal(got, [2, 12 + 4, 12 + 5, 24 + 4, 36 + 9])
    # for_dataset picks the offsets when the store has them.
    ds = Catalog(tmp_path).get("docs")
    object.__setattr__(ds, "store", store)
    assert server_documents.for_dataset(ds).recorded is not None


def test_megatron_store_sends_its_recorded_document_ends(tmp_path: Path) -> None:
    tokens, doc_ends = megatron_corpus(tmp_path)
    is_end = np.zeros(len(tokens) + 1, dtype=bool)
    is_end[doc_ends - 1] = True
    with running_feeder(tmp_path) as f:
        req = pb.StreamBatchesRequest(
            params=params("mg/corpus", auto_shift=True), batches_per_message=3, document_ends=True
        )
        seen = 0
        for data in raw_messages(f.address, req):
            msg = pb.StreamBatchesResponse.FromString(data)
            assert msg.SerializeToString() == data
            for b in msg.batches:
                window = np.array(b.starts)[:, None] + np.arange(b.cols)
                want = np.flatnonzero(is_end[window])  # ends of documents, not sentences
                np.testing.assert_array_equal(documents.ends_from_bytes(b.document_ends), want)
                seen += len(want)
        assert seen > 100


def test_a_mixture_of_megatron_stores_sends_each_sources_document_ends(tmp_path: Path) -> None:
    """Each row's ends are its own source's, searched in that source's index in place;
    the virtual store's whole list (its sources' lists end to end) gives the same."""
    is_end = {}
    for name, seed in (("mg/a", 1), ("mg/b", 2)):
        root = tmp_path / "parts" / name
        tokens, doc_ends = megatron_corpus(root, seed=seed)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        for ext in (".bin", ".idx"):
            (root / "mg" / f"corpus{ext}").rename(tmp_path / f"{name}{ext}")
        is_end[name] = np.zeros(len(tokens) + 1, dtype=bool)
        is_end[name][doc_ends - 1] = True
    spec = SamplingSpec(
        dataset="",
        sources=(("mg/a", 0.5), ("mg/b", 0.5)),
        seq_len=60,
        stride=37,
        batch_size=3,
        shuffle=True,
        seed=5,
        shift="auto",
    )
    with running_feeder(tmp_path) as f:
        req = pb.StreamBatchesRequest(
            params=spec.to_proto(), batches_per_message=2, document_ends=True
        )
        names, seen, both = ["mg/a", "mg/b"], 0, 0
        with grpc.insecure_channel(f.address) as ch:
            call = pb_grpc.FeederStub(ch).StreamBatches(req)
            for i, msg in enumerate(call):
                for b in msg.batches:
                    window = np.array(b.starts)[:, None] + np.arange(b.cols)
                    want = np.concatenate(
                        [
                            r * b.cols + np.flatnonzero(is_end[names[src]][w])
                            for r, (w, src) in enumerate(zip(window, b.sources, strict=True))
                        ]
                    )
                    np.testing.assert_array_equal(documents.ends_from_bytes(b.document_ends), want)
                    seen += len(want)
                    both += len(set(b.sources)) > 1
                if i == 40:
                    call.cancel()
                    break
        assert seen > 100
        assert both > 5
    ds = Catalog(tmp_path)
    space = MixtureSpace.of([ds.get("mg/a"), ds.get("mg/b")])
    starts = np.arange(0, space.store.total_tokens - 20, 3)
    whole = documents.recorded_ends(space.store.document_ends())
    np.testing.assert_array_equal(
        space.store.end_search().ends(starts, 20), documents.offset_ends(starts, 20, whole)
    )
