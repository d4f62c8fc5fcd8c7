"""tokenfeed.core.documents against loop references (documents_reference.py), by property."""

from __future__ import annotations

import itertools
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import documents as D

import support.documents_reference as reference

EOS = 0


@st.composite
def corpora(draw: st.DrawFn, max_seq_len: int = 24, max_shift: int = 6) -> dict:
    """A store of documents (each ending in EOS), a batch geometry and window starts.

    Document lengths run from 1 (a lone EOS) to several windows long; starts are drawn
    freely, plus some placed so that an EOS is a window's first or last input token."""
    seq_len = draw(st.integers(1, max_seq_len))
    shift = draw(st.integers(1, max_shift))
    cols = seq_len + shift
    lengths = draw(
        st.lists(
            st.one_of(st.just(1), st.integers(1, 4), st.integers(1, 3 * cols)),
            min_size=1,
            max_size=40,
        )
    )
    total = sum(lengths)
    if total < cols:  # pad with one long document so a window fits
        lengths.append(cols)
        total += cols
    doc_ends = np.cumsum(lengths)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = rng.integers(1, 50, size=total)  # 0 is EOS, never drawn here
    tokens[doc_ends - 1] = EOS
    last = total - cols
    eos_at = doc_ends - 1
    special = [int(p) for p in eos_at if p <= last] + [
        int(p) - seq_len + 1 for p in eos_at if 0 <= p - seq_len + 1 <= last
    ]
    rows = draw(st.integers(1, 6))
    starts = draw(
        st.lists(
            st.one_of(
                st.integers(0, last), st.sampled_from(special) if special else st.integers(0, last)
            ),
            min_size=rows,
            max_size=rows,
        )
    )
    return {
        "tokens": tokens,
        "doc_ends": doc_ends,
        "seq_len": seq_len,
        "shift": shift,
        "starts": np.array(starts, dtype=np.int64),
    }


def batch_of(c: dict) -> np.ndarray:
    cols = c["seq_len"] + c["shift"]
    return np.stack([c["tokens"][s : s + cols] for s in c["starts"]])


def check(out: dict, ref: dict, rows: int, seq_len: int) -> None:
    assert out["position_ids"].dtype == np.int64
    assert out["document_ids"].dtype == np.int32
    assert out["cu_seqlens"].dtype == np.int32
    assert type(out["max_seqlen"]) is int
    assert out["position_ids"].shape == out["document_ids"].shape == (rows, seq_len)
    np.testing.assert_array_equal(out["position_ids"], ref["position_ids"])
    np.testing.assert_array_equal(out["document_ids"], ref["document_ids"])
    np.testing.assert_array_equal(out["cu_seqlens"], ref["cu_seqlens"])
    assert out["max_seqlen"] == ref["max_seqlen"]
    if "labels" in out:
        assert out["labels"].dtype == np.int64
        np.testing.assert_array_equal(out["labels"], ref["labels"])


@given(corpora())
def test_eos_batches_match_both_references(c: dict) -> None:
    buf = batch_of(c)
    seq_len, shift, rows = c["seq_len"], c["shift"], len(c["starts"])
    before = buf.copy()
    ends = D.eos_ends(buf, EOS)
    # What travels on the wire, and back.
    ends = D.ends_from_bytes(D.ends_to_bytes(ends))
    out = D.from_ends(ends, rows, seq_len, shift, labels=buf[:, shift:])
    np.testing.assert_array_equal(buf, before)  # labels is a view of buf: never written
    assert out["labels"].flags.c_contiguous
    # The label runs cover the buffer exactly and make exactly the masked labels (both
    # label paths: the shift-1 scatter and the runs).
    seqs = D.sequences(ends, rows, seq_len, shift)
    runs = D.label_runs(seqs)
    assert runs.sum() == rows * (seq_len + shift)
    assert np.all(runs[1::2] > 0)
    assert np.all(runs >= 0)
    np.testing.assert_array_equal(D.label_mask(seqs), out["labels"] == -100)
    check(
        out,
        reference.from_tokens(buf, lambda r, k: buf[r][k] == EOS, seq_len, shift),
        rows,
        seq_len,
    )
    check(
        out,
        reference.from_documents(c["tokens"], c["starts"], c["doc_ends"], seq_len, shift),
        rows,
        seq_len,
    )


@given(corpora())
def test_offsets_give_the_eos_ends(c: dict) -> None:
    buf = batch_of(c)
    cols = c["seq_len"] + c["shift"]
    np.testing.assert_array_equal(
        D.offset_ends(c["starts"], cols, D.recorded_ends(c["doc_ends"])), D.eos_ends(buf, EOS)
    )


@given(corpora(), st.lists(st.integers(0, 39), max_size=5), st.randoms(use_true_random=False))
def test_offsets_store_without_eos(c: dict, empty: list[int], rnd) -> None:
    """A store that records offsets needs no EOS: the tokens are arbitrary (EOS-valued
    tokens inside documents included), only the offsets count; empty documents (a
    repeated end, as a Megatron index may hold, also at the start) change nothing."""
    tokens = np.array([rnd.randrange(0, 3) for _ in range(len(c["tokens"]))])
    c = dict(c, tokens=tokens)
    buf = batch_of(c)
    seq_len, shift = c["seq_len"], c["shift"]
    recorded = np.sort(np.concatenate([c["doc_ends"], [0], c["doc_ends"][: len(empty)]]))
    ends = D.offset_ends(c["starts"], seq_len + shift, D.recorded_ends(recorded))
    out = D.from_ends(ends, len(buf), seq_len, shift, labels=buf[:, shift:])
    check(
        out,
        reference.from_documents(tokens, c["starts"], c["doc_ends"], seq_len, shift),
        len(buf),
        seq_len,
    )


@given(st.integers(1, 5), st.integers(1, 30), st.integers(1, 8), st.data())
def test_cu_seqlens_invariants(rows: int, seq_len: int, shift: int, data) -> None:
    cols = seq_len + shift
    density = data.draw(st.sampled_from([0.0, 0.1, 0.5, 1.0]))  # 1.0: every token ends one
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    mask = rng.random((rows, cols)) < density
    out = D.from_ends(mask.reshape(-1).nonzero()[0], rows, seq_len, shift)
    cu = out["cu_seqlens"].astype(np.int64)
    assert cu[0] == 0
    assert cu[-1] == rows * seq_len
    assert np.all(np.diff(cu) > 0)  # no empty sequence
    assert set(range(0, rows * seq_len, seq_len)) <= set(cu.tolist())  # every row start
    assert out["max_seqlen"] == int(np.diff(cu).max())
    flat_docs, flat_pos = out["document_ids"].reshape(-1), out["position_ids"].reshape(-1)
    for a, b in itertools.pairwise(cu):  # a sequence is one run of one document
        assert np.all(flat_docs[a:b] == flat_docs[a])
        np.testing.assert_array_equal(flat_pos[a:b], np.arange(b - a))


@given(st.integers(1, 5), st.integers(1, 30), st.integers(1, 8), st.data())
def test_the_loop_and_numpy_paths_agree(rows: int, seq_len: int, shift: int, data) -> None:
    """sequences() loops over few ends and uses numpy for many: the same results."""
    cols = seq_len + shift
    density = data.draw(st.sampled_from([0.0, 0.05, 0.3, 1.0]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    ends = (rng.random(rows * cols) < density).nonzero()[0]
    loop = D._sequences_loop(ends.astype("<u4"), rows, seq_len, shift, cols)
    vec = D._sequences_numpy(ends.astype("<u4"), rows, seq_len, shift, cols, validate=True)
    for name in ("cu_seqlens", "cu", "lengths", "first", "local", "label_at"):
        a, b = getattr(loop, name), getattr(vec, name)
        assert a.dtype == b.dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)
    assert loop.max_seqlen == vec.max_seqlen
    labels = rng.integers(0, 9, size=(rows, seq_len))
    np.testing.assert_array_equal(D.masked_labels(labels, loop), D.masked_labels(labels, vec))


@given(corpora(), st.booleans())
def test_every_batch_gets_arrays_of_its_own(c: dict, loop: bool) -> None:
    """The outputs are contiguous, share no memory with each other, with the batch's
    buffer or with another batch's outputs (the loop may keep a batch; the sparse
    results live in one array sliced up, so this guards against aliasing)."""
    buf = batch_of(c)
    seq_len, shift, rows = c["seq_len"], c["shift"], len(c["starts"])
    ends = D.eos_ends(buf, EOS)
    limit = D.LOOP_MAX_ENDS
    try:
        D.LOOP_MAX_ENDS = len(ends) if loop else -1
        one = D.from_ends(ends, rows, seq_len, shift, labels=buf[:, shift:])
        two = D.from_ends(ends, rows, seq_len, shift, labels=buf[:, shift:])
    finally:
        D.LOOP_MAX_ENDS = limit
    arrays = [v for out in (one, two) for v in out.values() if isinstance(v, np.ndarray)]
    assert len(arrays) == 8
    for i, a in enumerate(arrays):
        assert a.flags.c_contiguous
        assert not np.shares_memory(a, buf)
        for b in arrays[i + 1 :]:
            assert not np.shares_memory(a, b)


def test_many_ends_take_the_numpy_path_with_the_same_results() -> None:
    rows, seq_len, shift = 8, 200, 3
    rng = np.random.default_rng(1)
    ends = (rng.random(rows * (seq_len + shift)) < 0.3).nonzero()[0]
    assert len(ends) > D.LOOP_MAX_ENDS
    buf = np.where(np.isin(np.arange(rows * (seq_len + shift)), ends), 0, 5).reshape(rows, -1)
    out = D.from_ends(ends, rows, seq_len, shift, labels=buf[:, shift:])
    check(
        out, reference.from_tokens(buf, lambda r, k: buf[r][k] == 0, seq_len, shift), rows, seq_len
    )


def test_worked_example() -> None:
    """Positions restart after each end inside the window; an EOS as a row's last input
    token opens nothing; labels crossing an end are -100 (shift 2)."""
    buf = np.array([[5, 0, 3, 4, 0, 7, 8, 0, 1], [0, 1, 2, 3, 4, 5, 6, 0, 0]])
    out = D.from_ends(D.eos_ends(buf, 0), 2, 7, 2, labels=buf[:, 2:])
    np.testing.assert_array_equal(
        out["position_ids"], [[0, 1, 0, 1, 2, 0, 1], [0, 0, 1, 2, 3, 4, 5]]
    )
    np.testing.assert_array_equal(
        out["document_ids"], [[0, 0, 1, 1, 1, 2, 2], [0, 1, 1, 1, 1, 1, 1]]
    )
    np.testing.assert_array_equal(out["cu_seqlens"], [0, 2, 5, 7, 8, 14])
    assert out["max_seqlen"] == 6
    np.testing.assert_array_equal(
        out["labels"], [[-100, -100, 0, -100, -100, 0, -100], [-100, 3, 4, 5, 6, 0, -100]]
    )


def test_row_without_boundary_and_eos_as_last_input_token() -> None:
    buf = np.array([[1, 2, 3, 4, 5], [1, 2, 3, 0, 5]])  # seq_len 4, shift 1
    out = D.from_ends(D.eos_ends(buf, 0), 2, 4, 1, labels=buf[:, 1:])
    np.testing.assert_array_equal(out["position_ids"], [[0, 1, 2, 3], [0, 1, 2, 3]])
    np.testing.assert_array_equal(out["document_ids"], np.zeros((2, 4)))
    np.testing.assert_array_equal(out["cu_seqlens"], [0, 4, 8])
    np.testing.assert_array_equal(out["labels"], [[2, 3, 4, 5], [2, 3, 0, -100]])


def test_shift_larger_than_a_document_masks_every_crossing_label() -> None:
    buf = np.array([[7, 0, 7, 7, 7, 7, 0, 7, 7, 7, 7, 7]])  # seq_len 8, shift 4
    out = D.from_ends(D.eos_ends(buf, 0), 1, 8, 4, labels=buf[:, 4:])
    # ends at 1 and 6 mask j in [0, 1] and [3, 6]; label 2 is the EOS itself (kept)
    np.testing.assert_array_equal(out["labels"], [[-100, -100, 0, -100, -100, -100, -100, 7]])


def test_only_the_outputs_asked_for() -> None:
    buf = np.array([[5, 0, 3, 4, 0]])
    out = D.from_ends(D.eos_ends(buf, 0), 1, 4, 1, outputs=("cu_seqlens", "max_seqlen"))
    assert sorted(out) == ["cu_seqlens", "max_seqlen"]


def test_more_ends_than_the_cached_run_pattern() -> None:
    """Every token an EOS, in a batch larger than the cached run pattern."""
    rows, seq_len, shift = 40, 1024, 2
    ends = np.arange(rows * (seq_len + shift))
    out = D.from_ends(ends, rows, seq_len, shift, labels=np.zeros((rows, seq_len), np.uint16))
    assert np.all(out["labels"] == -100)
    assert np.all(out["position_ids"] == 0)
    assert out["max_seqlen"] == 1


def test_megatron_style_offsets() -> None:
    """A Megatron index records cumulative document boundaries; an empty document
    repeats one."""
    recorded = D.recorded_ends(np.array([3, 4, 4, 10]))  # documents of 3, 1, 0 and 6 tokens
    np.testing.assert_array_equal(recorded, [3, 4, 10])
    # row 0 holds T[0:5]: ends at 2, 3; row 1 holds T[2:7]: ends at 2, 3 -> cols 0, 1
    np.testing.assert_array_equal(D.offset_ends(np.array([0, 2]), 5, recorded), [2, 3, 5, 6])
    assert len(D.offset_ends(np.array([10, 20]), 5, np.array([5, 100]))) == 0


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (lambda: D.sequences(np.array([3, 3]), 1, 4, 1), "strictly ascending"),
        (lambda: D.sequences(np.array([5]), 1, 4, 1), "strictly ascending"),
        (lambda: D.sequences(np.array([-1]), 1, 4, 1), "strictly ascending"),
        (lambda: D._sequences_numpy(np.array([3, 3]), 1, 4, 1, 5, True), "strictly ascending"),
        (lambda: D._sequences_numpy(np.array([5]), 1, 4, 1, 5, True), "strictly ascending"),
        (lambda: D._sequences_numpy(np.array([-1]), 1, 4, 1, 5, True), "strictly ascending"),
        (lambda: D.sequences(np.array([[1]]), 1, 4, 1), "1-d"),
        (lambda: D.sequences(np.array([], dtype=np.int64), 1, 4, 0), "shift"),
        (lambda: D.sequences(np.array([], dtype=np.int64), 2**16, 2**16, 1), "int32"),
        (lambda: D.ends_from_bytes(b"\x00\x00\x00"), "uint32"),
        (lambda: D.recorded_ends(np.array([4, 3])), "non-decreasing"),
        (lambda: D.masked_labels(np.zeros((2, 5)), D.sequences(np.array([1]), 2, 4, 1)), "shape"),
    ],
)
def test_clear_errors(bad, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bad()


def test_core_documents_imports_no_torch() -> None:
    code = "import sys, tokenfeed.core.documents; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
