"""FeederClient(documents=..., mask_cross_document_labels=...) end to end against a real
feeder: every batch's document outputs equal an independent computation from the
store's tokens (documents_reference.py), for fixed and auto shift, flat and grouped
layouts, numpy and torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tokenfeed.client import FeederClient
from tokenfeed.core.errors import FailedPrecondition

import support.documents_reference as reference
from support.feeders import running_feeder
from support.stores import DOCUMENT_EOS as EOS
from support.stores import make_document_store, megatron_corpus

SEQ_LEN = 48


@pytest.fixture(scope="module")
def docs_feeder(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("docs-data")
    tokens = make_document_store(root / "docs", total=8_000, mean=30)
    make_document_store(root / "bare", total=2_000, eos=None)
    with running_feeder(root) as f:
        f.tokens = tokens
        yield f


def client(f, **kw) -> FeederClient:
    args = dict(dataset="docs", seq_len=SEQ_LEN, batch_size=4, shuffle=True, seed=3)
    args.update(kw)
    return FeederClient(f.address, **args)


def want(tokens: np.ndarray, batch: dict) -> dict:
    """The reference outputs of a batch, from the store's tokens at its starts."""
    shift = batch["shift"]
    buf = np.stack([tokens[s : s + SEQ_LEN + shift] for s in batch["starts"]])
    return reference.from_tokens(buf, lambda r, k: buf[r][k] == EOS, SEQ_LEN, shift)


def arr(x) -> np.ndarray:
    return x.numpy() if hasattr(x, "numpy") else np.asarray(x)


@pytest.mark.parametrize("shift", [1, 4, "auto"])
@pytest.mark.parametrize("mask", [False, True])
def test_numpy_documents_match_the_reference(docs_feeder, shift, mask) -> None:
    shifts = set()
    with client(docs_feeder, shift=shift, documents=True, mask_cross_document_labels=mask) as c:
        for batch in c:
            ref = want(docs_feeder.tokens, batch)
            shifts.add(batch["shift"])
            assert batch["position_ids"].dtype == np.int64
            assert batch["document_ids"].dtype == np.int32
            assert batch["cu_seqlens"].dtype == np.int32
            assert type(batch["max_seqlen"]) is int
            np.testing.assert_array_equal(batch["position_ids"], ref["position_ids"])
            np.testing.assert_array_equal(batch["document_ids"], ref["document_ids"])
            np.testing.assert_array_equal(batch["cu_seqlens"], ref["cu_seqlens"])
            assert batch["max_seqlen"] == ref["max_seqlen"]
            if mask:
                assert batch["labels"].dtype == np.int64
                np.testing.assert_array_equal(batch["labels"], ref["labels"])
            else:  # the batch's own view, unchanged
                s = batch["shift"]
                buf = np.stack([docs_feeder.tokens[a : a + SEQ_LEN + s] for a in batch["starts"]])
                np.testing.assert_array_equal(batch["labels"], buf[:, s:])
    if shift == "auto":
        assert len(shifts) > 1


def test_masking_alone_and_only_the_outputs_asked_for(docs_feeder) -> None:
    with client(docs_feeder, mask_cross_document_labels=True) as c:
        batch = next(iter(c))
        assert "position_ids" not in batch
        assert "cu_seqlens" not in batch
        np.testing.assert_array_equal(batch["labels"], want(docs_feeder.tokens, batch)["labels"])
        assert (batch["labels"] == -100).any()
    with client(docs_feeder, documents=["cu_seqlens", "max_seqlen"]) as c:
        batch = next(iter(c))
        assert "cu_seqlens" in batch
        assert "max_seqlen" in batch
        assert "position_ids" not in batch
        assert "document_ids" not in batch
        assert batch["labels"].dtype == np.uint16  # not masked: the narrow view


def test_numpy_grouped_layout_masks_the_grouped_labels(docs_feeder) -> None:
    """Masked labels follow the layout (a reshape of the flat int64 copy); the document
    arrays stay flat."""
    with client(
        docs_feeder, shift=4, layout="grouped", documents=True, mask_cross_document_labels=True
    ) as c:
        for i, batch in enumerate(c):
            ref = want(docs_feeder.tokens, batch)
            assert batch["labels"].shape == batch["input_ids"].shape == (4, SEQ_LEN // 4, 4)
            assert batch["labels"].dtype == np.int64
            np.testing.assert_array_equal(batch["labels"].reshape(4, SEQ_LEN), ref["labels"])
            np.testing.assert_array_equal(batch["position_ids"], ref["position_ids"])
            if i == 10:
                break


def test_torch_documents_without_masking_keep_the_labels_view(docs_feeder) -> None:
    torch = pytest.importorskip("torch")
    with client(docs_feeder, shift=2, device="cpu", documents=True) as c:
        for i, batch in enumerate(c):
            ref = want(docs_feeder.tokens, batch)
            buf = np.stack([docs_feeder.tokens[a : a + SEQ_LEN + 2] for a in batch["starts"]])
            assert batch["labels"].dtype == torch.int64
            np.testing.assert_array_equal(arr(batch["labels"]), buf[:, 2:])
            np.testing.assert_array_equal(arr(batch["input_ids"]), buf[:, :SEQ_LEN])
            np.testing.assert_array_equal(arr(batch["document_ids"]), ref["document_ids"])
            np.testing.assert_array_equal(arr(batch["cu_seqlens"]), ref["cu_seqlens"])
            if i == 10:
                break


@pytest.mark.parametrize("layout", ["flat", "grouped"])
def test_torch_tensors_on_the_device(docs_feeder, layout) -> None:
    torch = pytest.importorskip("torch")
    with client(
        docs_feeder,
        shift="auto",
        layout=layout,
        device="cpu",
        documents=True,
        mask_cross_document_labels=True,
    ) as c:
        for i, batch in enumerate(c):
            ref = want(docs_feeder.tokens, batch)
            s = batch["shift"]
            assert batch["position_ids"].dtype == torch.int64
            assert batch["document_ids"].dtype == torch.int32
            assert batch["cu_seqlens"].dtype == torch.int32
            assert batch["labels"].dtype == torch.int64
            # Document arrays are always flat; labels follow the layout.
            assert tuple(batch["position_ids"].shape) == (4, SEQ_LEN)
            if layout == "grouped":
                assert tuple(batch["labels"].shape) == (4, SEQ_LEN // s, s)
                assert tuple(batch["input_ids"].shape) == (4, SEQ_LEN // s, s)
            np.testing.assert_array_equal(arr(batch["labels"]).reshape(4, SEQ_LEN), ref["labels"])
            np.testing.assert_array_equal(arr(batch["position_ids"]), ref["position_ids"])
            np.testing.assert_array_equal(arr(batch["document_ids"]), ref["document_ids"])
            np.testing.assert_array_equal(arr(batch["cu_seqlens"]), ref["cu_seqlens"])
            assert batch["max_seqlen"] == ref["max_seqlen"]
            if i == 20:
                break


def test_resume_keeps_the_documents_of_each_batch(docs_feeder) -> None:
    with client(docs_feeder, documents=True) as c:
        it = iter(c)
        for _ in range(5):
            next(it)
        state = c.state_dict()
        rest = [b["cu_seqlens"] for b in it]
    with client(docs_feeder, documents=True) as c:
        c.load_state_dict(state)
        again = [b["cu_seqlens"] for b in c]
    assert len(rest) == len(again) > 0
    for a, b in zip(rest, again, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_store_without_boundaries_is_failed_precondition(docs_feeder) -> None:
    for kw in (dict(documents=True), dict(mask_cross_document_labels=True)):
        with (
            client(docs_feeder, dataset="bare", **kw) as c,
            pytest.raises(FailedPrecondition, match="dataset 'bare'"),
        ):
            next(iter(c))
    with client(docs_feeder, dataset="bare") as c:  # served without them
        assert next(iter(c))["input_ids"].shape == (4, SEQ_LEN)


@pytest.mark.parametrize("bad", ["position_ids", [], ["nope"], 3])
def test_documents_argument_is_checked_before_any_call(bad) -> None:
    with pytest.raises((TypeError, ValueError), match="documents"):
        FeederClient("127.0.0.1:1", dataset="d", seq_len=8, batch_size=1, documents=bad)
    with pytest.raises(TypeError, match="mask_cross_document_labels"):
        FeederClient(
            "127.0.0.1:1", dataset="d", seq_len=8, batch_size=1, mask_cross_document_labels=1
        )


def test_ends_that_do_not_fit_the_batch_are_an_error(tmp_path: Path) -> None:
    """The client checks what travelled: a batch whose ends lie outside it fails the
    loop with a clear error (not silently wrong outputs)."""
    from tokenfeed.client.buffers import batch_array, document_arrays
    from tokenfeed.v1 import feeder_pb2

    msg = feeder_pb2.Batch(
        shift=1,
        rows=1,
        cols=5,
        dtype="uint16",
        tokens=bytes(10),
        document_ends=np.array([7], "<u4").tobytes(),
    )
    with pytest.raises(ValueError, match="strictly ascending"):
        document_arrays(msg, batch_array(msg), 4, ("cu_seqlens",), False)


@pytest.mark.parametrize("device", [None, "cpu"])
def test_megatron_documents_come_from_its_index(tmp_path: Path, device) -> None:
    """A Megatron store has no EOS: documents are its index's (not its sentences), and
    token ids that happen to equal anything are just tokens."""
    tokens, doc_ends = megatron_corpus(tmp_path)
    with (
        running_feeder(tmp_path) as f,
        FeederClient(
            f.address,
            dataset="mg/corpus",
            seq_len=SEQ_LEN,
            batch_size=4,
            shift="auto",
            device=device,
            documents=True,
            mask_cross_document_labels=True,
        ) as c,
    ):
        n = 0
        for batch in c:
            ref = reference.from_documents(
                tokens, batch["starts"].tolist(), doc_ends.tolist(), SEQ_LEN, batch["shift"]
            )
            for key in ("position_ids", "document_ids", "labels", "cu_seqlens"):
                np.testing.assert_array_equal(arr(batch[key]), ref[key], err_msg=key)
            assert batch["max_seqlen"] == ref["max_seqlen"]
            n += 1
        assert n > 10


def test_a_mixture_of_eos_stores(tmp_path: Path) -> None:
    """A mixture's rows come from several stores; each row's documents are its own
    source's. Sources that end documents differently are FAILED_PRECONDITION naming
    the source."""
    tokens = {
        "a": make_document_store(tmp_path / "a", total=6_000, mean=20, seed=1),
        "b": make_document_store(tmp_path / "b", total=6_000, mean=60, seed=2),
    }
    make_document_store(tmp_path / "bare", total=6_000, eos=None)
    with running_feeder(tmp_path) as f:
        with FeederClient(
            f.address,
            mixture={"a": 0.5, "b": 0.5},
            seq_len=SEQ_LEN,
            batch_size=4,
            shuffle=True,
            documents=True,
            mask_cross_document_labels=True,
        ) as c:
            names = c.sources
            for i, batch in enumerate(c):
                shift = batch["shift"]
                buf = np.stack(
                    [
                        tokens[names[src]][s : s + SEQ_LEN + shift]
                        for s, src in zip(batch["starts"], batch["sources"], strict=True)
                    ]
                )
                ref = reference.from_tokens(buf, lambda r, k, b=buf: b[r][k] == EOS, SEQ_LEN, shift)
                for key in ("position_ids", "document_ids", "labels", "cu_seqlens"):
                    np.testing.assert_array_equal(batch[key], ref[key], err_msg=key)
                if i == 30:
                    break
        with (
            FeederClient(
                f.address,
                mixture={"a": 0.5, "bare": 0.5},
                seq_len=SEQ_LEN,
                batch_size=4,
                documents=True,
            ) as c,
            pytest.raises(FailedPrecondition, match="sources\\['bare'\\]"),
        ):
            next(iter(c))
