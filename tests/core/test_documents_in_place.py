"""Recorded document ends searched in a Megatron index in place (documents.indexed_ends,
MegatronStore.end_search): exactly what the whole list of ends gives (`document_ends()`
through `recorded_ends` and `offset_ends`), compiled and reference alike, over indexes
with empty documents, empty sentences and arrays at the file's unaligned offsets; an
index that contradicts its layout is an error, never ends outside a row; and a batch's
search allocates nothing per document."""

from __future__ import annotations

import contextlib
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.core import documents as D
from tokenfeed.core import native
from tokenfeed.core.errors import DataLoss
from tokenfeed.core.store import MegatronStore

from support import fewer_examples
from support.stores import write_megatron

ITEMSIZES = {1: "uint8", 2: "uint16", 4: "int32", 8: "int64"}
CODES = {1: 1, 2: 8, 4: 4, 8: 5}  # the index's dtype code of each


def index_of(docs: list[list[int]], itemsize: int) -> D.Sentences:
    """The index of documents given as sentence lengths: its pointers and document
    indices as views at the offsets a .idx holds them (34 + 4 S and 34 + 12 S:
    unaligned)."""
    lengths = np.array([n for d in docs for n in d], dtype=np.int64)
    s = len(lengths)
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * itemsize
    doc_indices = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    buf = np.zeros(34 + 12 * s + 8 * len(doc_indices), dtype=np.uint8)
    buf[34 + 4 * s : 34 + 12 * s] = pointers.view(np.uint8)
    buf[34 + 12 * s :] = doc_indices.view(np.uint8)
    return D.Sentences(
        buf[34 + 4 * s : 34 + 12 * s].view("<i8"),
        buf[34 + 12 * s :].view("<i8"),
        itemsize,
        int(lengths.sum()),
    )


def whole_list(docs: list[list[int]]) -> np.ndarray:
    """What a store's `document_ends()` holds: each document's exclusive end."""
    return np.cumsum([sum(d) for d in docs]).astype(np.int64)


def both(starts: np.ndarray, cols: int, index: D.Sentences) -> np.ndarray:
    """indexed_ends compiled (when built) and its reference: the same values."""
    got = D.indexed_ends(starts, cols, index)
    with native.disabled():
        ref = D.indexed_ends(starts, cols, index)
    np.testing.assert_array_equal(got, ref)
    return got


# documents as sentence lengths: empty documents (no sentence) and empty sentences too
corpora = st.lists(st.lists(st.integers(0, 9), max_size=4), min_size=1, max_size=40).filter(
    lambda docs: sum(map(sum, docs)) > 0
)


@given(corpora, st.sampled_from(sorted(ITEMSIZES)), st.integers(1, 24), st.data())
def test_in_place_gives_what_the_whole_list_gives(docs, itemsize, cols, data) -> None:
    index = index_of(docs, itemsize)
    total = index.total
    # rows anywhere, also past the end of the tokens and overlapping
    starts = np.array(data.draw(st.lists(st.integers(0, total + 3), min_size=1, max_size=8)))
    want = D.offset_ends(starts, cols, D.recorded_ends(whole_list(docs)))
    got = both(starts, cols, index)
    np.testing.assert_array_equal(got, want)
    assert got.dtype == np.int64


@given(corpora, st.integers(1, 24))
def test_every_window_of_the_store(docs, cols) -> None:
    """Every window start of the store, one row each, in one batch."""
    index = index_of(docs, 2)
    starts = np.arange(max(1, index.total - cols + 1))
    want = D.offset_ends(starts, cols, D.recorded_ends(whole_list(docs)))
    np.testing.assert_array_equal(both(starts, cols, index), want)


@given(st.integers(0, 2**32 - 1), st.sampled_from(["even", "skewed", "runs"]), st.integers(1, 64))
def test_large_and_skewed_indexes(seed, shape, cols) -> None:
    """Thousands of sentences, spread evenly (what the compiled search's interpolation
    guesses well), heavy-tailed, or in long runs of empty sentences and documents
    (where its guesses land far off): still exactly the whole list's ends."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(16, 5_000))
    if shape == "even":
        lengths = rng.integers(1, 40, n)
    elif shape == "skewed":
        lengths = (rng.pareto(0.7, n) * 3).astype(np.int64).clip(0, 10**6)
    else:
        lengths = rng.integers(1, 9, n) * (rng.random(n) < 0.03)
    per_doc = rng.integers(0, 3, n) * (rng.random(n) < (0.2 if shape == "runs" else 0.9))
    sentences, docs = iter(lengths.tolist()), []
    for k in per_doc.tolist():
        docs.append([next(sentences, 1) for _ in range(k)])
    docs.append(list(sentences) or [1])
    index = index_of(docs, 2)
    if index.total == 0:
        return
    starts = rng.integers(0, index.total, 64)
    want = D.offset_ends(starts, cols, D.recorded_ends(whole_list(docs)))
    np.testing.assert_array_equal(both(starts, cols, index), want)


@given(corpora, st.integers(1, 12), st.data())
def test_an_index_that_contradicts_its_layout_is_an_error_never_a_stray_end(
    docs, cols, data
) -> None:
    """Sentence pointers or document indices overwritten with anything: ValueError, or
    ends ascending inside their rows (what verify would report is not searched for;
    there the compiled search and the reference may find different ends)."""
    index = index_of(docs, 2)
    total = index.total
    arr = data.draw(st.sampled_from([index.pointers, index.doc_indices]))
    if len(arr):
        i = data.draw(st.integers(0, len(arr) - 1))
        arr[i] = data.draw(st.integers(-3, 2 * total + 3))
    starts = np.array(data.draw(st.lists(st.integers(0, total), min_size=1, max_size=6)))
    for compiled in (True, False):  # each its own way (they search differently)
        with contextlib.ExitStack() as stack:
            if not compiled:
                stack.enter_context(native.disabled())
            try:
                got = D.indexed_ends(starts, cols, index)
            except ValueError as e:
                assert "out of order or out of range" in str(e)  # noqa: PT017
                continue
        assert (np.diff(got) > 0).all()
        assert ((got >= 0) & (got < len(starts) * cols)).all()


def _write_index(prefix: Path, docs: list[list[int]], itemsize: int) -> None:
    lengths = np.array([n for d in docs for n in d], dtype="<i4")
    pointers = (np.concatenate([[0], np.cumsum(lengths)[:-1]]) * itemsize).astype("<i8")
    doc_indices = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype("<i8")
    header = struct.pack(
        "<9sQBQQ", b"MMIDIDX\x00\x00", 1, CODES[itemsize], len(lengths), len(doc_indices)
    )
    prefix.with_name(prefix.name + ".idx").write_bytes(
        header + lengths.tobytes() + pointers.tobytes() + doc_indices.tobytes()
    )
    with open(prefix.with_name(prefix.name + ".bin"), "wb") as f:
        f.truncate(int(lengths.sum()) * itemsize)  # zeros: only the index matters here


@fewer_examples(5)  # files written each
@given(corpora, st.sampled_from(sorted(ITEMSIZES)), st.integers(1, 24), st.data())
def test_a_megatron_store_searches_its_index_as_its_list_says(
    tmp_path_factory, docs, itemsize, cols, data
) -> None:
    prefix = tmp_path_factory.mktemp("mg") / "ds"
    _write_index(prefix, docs, itemsize)
    store = MegatronStore.open(prefix)
    assert store.verify() == []
    starts = np.array(
        data.draw(st.lists(st.integers(0, store.total_tokens), min_size=1, max_size=8))
    )
    want = D.offset_ends(starts, cols, D.recorded_ends(store.document_ends()))
    np.testing.assert_array_equal(store.end_search().ends(starts, cols), want)


def test_a_damaged_index_is_data_loss_naming_it(tmp_path: Path) -> None:
    """A sentence pointer out of order (open checks only the first and the last):
    DATA_LOSS naming the .idx when a batch's search meets it, as verify reports it."""
    prefix = tmp_path / "ds"
    _write_index(prefix, [[5, 5], [7], [3, 3, 3]], 2)  # sentences at tokens 0 5 10 17 20 23
    idx = prefix.with_name("ds.idx")
    data = bytearray(idx.read_bytes())
    struct.pack_into("<q", data, 34 + 4 * 6 + 8 * 2, 44)  # sentence 2 at token 22, not 10
    idx.write_bytes(bytes(data))
    store = MegatronStore.open(prefix)
    assert store.end_search().ends(np.array([0]), 10).size == 0  # rows that miss it
    with pytest.raises(DataLoss) as e:
        store.end_search().ends(np.array([0, 15]), 10)
    assert str(idx) in e.value.message
    assert any("sequence 2 starts at byte 44" in p for p in store.verify())


def test_an_index_truncated_while_served_is_data_loss_not_a_crash(tmp_path: Path) -> None:
    """The index is mapped: a search past a truncated file's end would kill the feeder
    (SIGBUS). Truncated in place, it is refused, naming the file; replaced by a rename,
    the old mapping stays whole and the search goes on."""
    prefix = tmp_path / "ds"
    docs = [[3] * 4] * 3000  # a 200 KiB index: pages past a truncation exist
    _write_index(prefix, docs, 2)
    store = MegatronStore.open(prefix)
    search = store.end_search()
    starts = np.array([5, 20_000, 35_000])
    want = search.ends(starts, 40)
    idx = prefix.with_name("ds.idx")
    fresh = tmp_path / "fresh.idx"
    fresh.write_bytes(idx.read_bytes()[:1000])
    fresh.replace(idx)  # a rename: the store's mapping is the old file's
    np.testing.assert_array_equal(search.ends(starts, 40), want)
    _write_index(prefix, docs, 2)
    store = MegatronStore.open(prefix)
    search = store.end_search()
    with open(idx, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(DataLoss, match="changed since it was opened") as e:
        search.ends(starts, 40)
    assert str(idx) in e.value.message


def test_a_batch_allocates_nothing_per_document(tmp_path: Path) -> None:
    """A store of 10^6 documents: its search and a batch's ends allocate a few KiB,
    where the whole list is 8 MB (and the old path made several such arrays)."""
    n = 1_000_000
    lengths = 1 + np.arange(n, dtype=np.int64) % 61
    prefix = tmp_path / "big"
    pointers = (np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2).astype("<i8")
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 8, n, n + 1)
    with open(prefix.with_name("big.idx"), "wb") as f:
        f.write(header)
        f.write(lengths.astype("<i4").tobytes())
        f.write(pointers.tobytes())
        f.write(np.arange(n + 1, dtype="<i8").tobytes())
    with open(prefix.with_name("big.bin"), "wb") as f:
        f.truncate(int(lengths.sum()) * 2)
    del lengths, pointers
    store = MegatronStore.open(prefix)
    starts = np.random.default_rng(0).integers(0, store.total_tokens - 2049, 8)
    tracemalloc.start()
    try:
        got = store.end_search().ends(starts, 2049)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 18  # 256 KiB: the batch's rows x cols ends at most, and no list
    want = D.offset_ends(starts, 2049, D.recorded_ends(store.document_ends()))
    np.testing.assert_array_equal(got, want)
    assert len(got) > 8 * 2049 // 61  # documents of 31 tokens on average end in them


def test_megatron_writer_layout_is_searched_in_place(tmp_path: Path) -> None:
    """The tests' own Megatron writer (support.stores) through the store: the same."""
    rng = np.random.default_rng(3)
    docs = [
        [rng.integers(0, 9, size=int(rng.integers(0, 9))) for _ in range(int(rng.integers(0, 4)))]
        for _ in range(200)
    ]
    docs[0] = [np.arange(4)]
    write_megatron(tmp_path / "mg", docs)
    store = MegatronStore.open(tmp_path / "mg")
    starts = np.arange(0, store.total_tokens - 16)
    want = D.offset_ends(starts, 17, D.recorded_ends(store.document_ends()))
    np.testing.assert_array_equal(store.end_search().ends(starts, 17), want)


def test_the_searched_index_is_mapped_for_random_access(tmp_path: Path) -> None:
    """A search's probes land on random pages of the index: the mapping is advised
    random access (VM_RAND_READ, "rr" in /proc/self/smaps), so a page not in the page
    cache reads itself, not the device's read_ahead_kb around it."""
    prefix = write_megatron(tmp_path / "ds", [[np.arange(5, dtype=np.uint16)]] * 3000)
    store = MegatronStore.open(prefix)
    idx = str(store.idx_path)

    def flags() -> list[str]:
        lines = Path("/proc/self/smaps").read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if line.endswith(idx))
        return next(line for line in lines[at:] if line.startswith("VmFlags:")).split()[1:]

    assert "rr" not in flags()
    search = store.end_search()
    assert "rr" in flags()
    assert store.end_search() is search  # made, and the mapping advised, once a store
