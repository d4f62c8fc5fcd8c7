"""Other formats served in place: Megatron-LM indexed datasets and the seed loader's
save_to_disk chunk folders; through the reader interface, the feeder and info/verify.

The Megatron files in tests/data/megatron were written by megatron-core's own
IndexedDatasetBuilder (0.16.1; tests/data/megatron/make_megatron_fixture.py makes them
again); the .json beside each holds the documents it was given. When megatron-core is
installed, the reader is also cross-checked against its IndexedDataset live.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.cli import main
from tokenfeed.core.errors import DataLoss, NotFound
from tokenfeed.core.store import MegatronStore, SeedStore, iter_tokens, open_store, write_store
from tokenfeed.server.datasets import Catalog
from tokenfeed.v1 import feeder_pb2 as pb
from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

from support import TESTS, fewer_examples
from support.feeders import running_feeder

DATA = TESTS / "data" / "megatron"
CASES = sorted(p.stem for p in DATA.glob("*.json"))


def _expected(name: str) -> tuple[str, list[list[list[int]]]]:
    doc = json.loads((DATA / f"{name}.json").read_text())
    return doc["dtype"], doc["docs"]


def _copy(tmp_path: Path, name: str, as_name: str | None = None) -> Path:
    for ext in (".bin", ".idx"):
        shutil.copy(DATA / f"{name}{ext}", tmp_path / f"{as_name or name}{ext}")
    return tmp_path / (as_name or name)


def tokens_of(store) -> list[int]:  # type: ignore[no-untyped-def]
    return [int(t) for part in iter_tokens(store) for t in part]


# ------------------------------------------------------------------------ Megatron


def test_megatron_fixtures_present() -> None:
    assert {"u16_items", "i32_docs", "u8_docs", "i64_items", "u16_multimodal"} <= set(CASES)


@pytest.mark.parametrize("name", [c for c in CASES if c != "i64_items"])
def test_megatron_reads_what_the_real_writer_wrote(name: str) -> None:
    dtype, docs = _expected(name)
    store = MegatronStore.open(DATA / name, chunk_tokens=7)  # many chunks, odd boundaries
    flat = [t for d in docs for s in d for t in s]
    assert store.source_dtype == np.dtype(dtype)
    assert store.meta.dtype == ("uint16" if np.dtype(dtype).itemsize <= 2 else "uint32")
    assert store.total_tokens == len(flat)
    assert tokens_of(store) == flat
    assert store.num_documents == len(docs)
    ends = np.cumsum([sum(map(len, d)) for d in docs]).tolist()
    assert store.document_ends().tolist() == ends
    assert store.verify() == []
    assert store.meta.eos_token_id is None


@pytest.mark.parametrize("suffix", ["", ".bin", ".idx"])
def test_megatron_prefix_or_either_file(suffix: str) -> None:
    store = open_store(str(DATA / "u16_items") + suffix)
    assert isinstance(store, MegatronStore)
    assert store.prefix == DATA / "u16_items"


def test_megatron_ids_beyond_uint32_are_data_loss_naming_the_file() -> None:
    store = MegatronStore.open(DATA / "i64_items")
    with pytest.raises(DataLoss, match=r"i64_items\.bin: tokens \[0, \d+\) hold ids"):
        store.read_chunk(0)
    assert len(store.verify()) == 1


def test_megatron_damage_is_named(tmp_path: Path) -> None:
    p = _copy(tmp_path, "u16_items")
    idx = p.with_suffix(".idx").read_bytes()
    p.with_suffix(".idx").write_bytes(idx[:-3])
    with pytest.raises(DataLoss, match=r"u16_items\.idx: .*truncated"):
        MegatronStore.open(p)
    p.with_suffix(".idx").write_bytes(b"XXIDIDX\x00\x00" + idx[9:])
    with pytest.raises(DataLoss, match="not a Megatron index"):
        MegatronStore.open(p)
    p.with_suffix(".idx").write_bytes(idx)
    with open(p.with_suffix(".bin"), "ab") as f:
        f.write(b"\x00\x00")
    with pytest.raises(DataLoss, match=r"u16_items\.bin: .* bytes"):
        MegatronStore.open(p)
    with pytest.raises(NotFound, match=r"nope\.idx"):
        MegatronStore.open(tmp_path / "nope")
    # a pointer moved: verify names the .idx
    p = _copy(tmp_path, "u16_items", "moved")
    raw = bytearray(p.with_suffix(".idx").read_bytes())
    s = int.from_bytes(raw[18:26], "little")
    at = 34 + 4 * s + 8 * 2  # the third sequence pointer
    raw[at : at + 8] = (int.from_bytes(raw[at : at + 8], "little") + 2).to_bytes(8, "little")
    p.with_suffix(".idx").write_bytes(bytes(raw))
    problems = MegatronStore.open(p).verify()
    assert len(problems) == 1
    assert "moved.idx: sequence 2 starts at byte" in problems[0]
    # truncated after opening: the read names the .bin, nothing crashes (no SIGBUS)
    q = _copy(tmp_path, "i32_docs")
    store = MegatronStore.open(q)
    q.with_suffix(".bin").write_bytes(b"")
    with pytest.raises(DataLoss, match=r"i32_docs\.bin: tokens .* cut short"):
        store.read_chunk(0)


def _megatron():  # type: ignore[no-untyped-def]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch = pytest.importorskip("torch")
        idx = pytest.importorskip("megatron.core.datasets.indexed_dataset")
    return torch, idx


@pytest.mark.parametrize("name", CASES)
def test_megatron_core_reads_the_same(name: str) -> None:
    _, mi = _megatron()
    ref = mi.IndexedDataset(str(DATA / name), multimodal="multimodal" in name)
    ours = MegatronStore.open(DATA / name)
    assert np.array_equal(ref.document_indices, ours.document_indices)
    assert np.array_equal(ref.sequence_lengths, ours.sequence_lengths)


@fewer_examples(8)  # a Megatron dataset written by megatron-core each
@given(
    dtype=st.sampled_from(["uint8", "int8", "int16", "int32", "int64", "uint16"]),
    docs=st.lists(st.lists(st.lists(st.integers(0, 127), max_size=6), max_size=4), max_size=8),
)
def test_roundtrip_with_the_real_writer(tmp_path_factory, dtype: str, docs) -> None:  # type: ignore[no-untyped-def]
    torch, mi = _megatron()
    prefix = tmp_path_factory.mktemp("mg") / "ds"
    b = mi.IndexedDatasetBuilder(f"{prefix}.bin", dtype=getattr(np, dtype))
    for doc in docs:
        for s in doc:
            b.add_item(torch.tensor(s, dtype=torch.int64))
        b.end_document()
    b.finalize(f"{prefix}.idx")
    store = MegatronStore.open(prefix, chunk_tokens=5)
    assert tokens_of(store) == [t for d in docs for s in d for t in s]
    assert (
        store.document_ends().tolist()
        == np.cumsum([0] + [sum(map(len, d)) for d in docs])[1:].tolist()
    )


# ------------------------------------------------------------------------ seed layout

datasets = pytest.importorskip("datasets")


def write_seed(root: Path, chunks: list[np.ndarray], value_type: str | None = None) -> None:
    """What the seed prepare script does: one save_to_disk dataset per chunk, one row."""
    datasets.disable_progress_bars()
    features = None
    if value_type is not None:
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value(value_type))})
    for i, ids in enumerate(chunks):
        ds = datasets.Dataset.from_dict({"input_ids": [ids]}, features=features)
        ds.save_to_disk(str(root / f"chunk_{i:06d}"))


@pytest.mark.parametrize("value_type", [None, "int64"])
def test_seed_layout_read_in_place(tmp_path: Path, value_type: str | None) -> None:
    rng = np.random.default_rng(0)
    chunks = [rng.integers(0, 50_000, n) for n in (1000, 1, 777)]
    write_seed(tmp_path, chunks, value_type)
    (tmp_path / "chunk_notes").mkdir()  # not a chunk folder
    store = open_store(tmp_path)
    assert isinstance(store, SeedStore)
    assert store.meta.dtype == "uint32"
    assert [c.tokens for c in store.meta.chunks] == [1000, 1, 777]
    assert tokens_of(store) == np.concatenate(chunks).tolist()
    assert store.verify() == []
    assert store.meta.eos_token_id is None


def test_seed_layout_with_meta_json_and_damage(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    chunks = [np.arange(500) % 300, np.arange(300, 700)]
    write_seed(tmp_path, chunks)
    assert main(["info", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "seed layout" in out
    assert "meta.json to add" in out
    suggested = json.loads(out[out.index("\n{", out.index("meta.json to add")) :])
    assert suggested["dtype"] == "uint32"
    assert suggested["chunks"][1] == {
        "file": "chunk_000001",
        "tokens": 400,
    }
    suggested |= {"dtype": "uint16", "eos_token_id": 0, "vocab_size": 1000}
    (tmp_path / "meta.json").write_text(json.dumps(suggested))
    store = open_store(tmp_path)
    assert store.meta.dtype == "uint16"
    assert store.meta.eos_token_id == 0
    assert tokens_of(store) == np.concatenate(chunks).tolist()
    assert main(["verify", str(tmp_path)]) == 0
    capsys.readouterr()
    data = next((tmp_path / "chunk_000001").glob("*.arrow"))
    data.write_bytes(data.read_bytes()[:-100])
    with pytest.raises(DataLoss, match=r"chunk_000001/data-00000-of-00001\.arrow"):
        open_store(tmp_path).read_chunk(1)
    assert main(["verify", str(tmp_path)]) == 1
    assert "chunk_000001" in capsys.readouterr().err


# -------------------------------------------------------------- served in place


def _stream(address: str, name: str) -> list[pb.Batch]:
    p = pb.SamplingParams(dataset=name, split="train", seq_len=16, batch_size=2, world_size=1)
    with grpc.insecure_channel(address) as ch:
        req = pb.StreamBatchesRequest(params=p)
        return [b for r in pb_grpc.FeederStub(ch).StreamBatches(req) for b in r.batches]


def test_feeder_serves_every_format_in_place(tmp_path: Path) -> None:
    """The same tokens as a native store, Megatron PREFIX, or seed folders: the same
    batches, byte for byte."""
    root = tmp_path / "root"
    tokens = (np.arange(3000) * 7) % 60_000
    write_store(root / "native", tokens.astype("uint32"), dtype="uint32", tokens_per_chunk=500)
    write_seed(root / "corpora" / "seed", [tokens[:1200], tokens[1200:]])
    (root / "corpora").mkdir(exist_ok=True)
    mg = _megatron_files(root / "mg" / "text_document", tokens.astype(np.int32))
    with running_feeder(root, cache_bytes=1 << 20) as f:
        with grpc.insecure_channel(f.address) as ch:
            names = [d.name for d in pb_grpc.FeederStub(ch).Info(pb.InfoRequest()).datasets]
        assert names == ["corpora/seed", "mg/text_document", "native"]
        want = _stream(f.address, "native")
        for name in ("corpora/seed", "mg/text_document"):
            got = _stream(f.address, name)
            assert [b.tokens for b in got] == [b.tokens for b in want]
            assert [list(b.starts) for b in got] == [list(b.starts) for b in want]
        for bad in ("mg/text_document.bin", "../root/native", "mg"):
            with pytest.raises(grpc.RpcError) as ei:
                _stream(f.address, bad)
            assert ei.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT)
    ds = Catalog(root).get("mg/text_document")
    assert ds.store.document_ends().tolist() == [1000, 3000]
    assert mg.with_suffix(".idx").is_file()


def _megatron_files(prefix: Path, tokens: np.ndarray) -> Path:
    """Two documents, written from the documented layout (the fixtures above pin it to
    what megatron-core writes)."""
    import struct

    prefix.parent.mkdir(parents=True, exist_ok=True)
    lengths = np.array([1000, 2000], dtype="<i4")
    pointers = np.array([0, 1000 * tokens.itemsize], dtype="<i8")
    docs = np.array([0, 1, 2], dtype="<i8")
    header = struct.pack("<9sQBQQ", b"MMIDIDX\x00\x00", 1, 4, 2, 3)
    prefix.with_name(prefix.name + ".idx").write_bytes(
        header + lengths.tobytes() + pointers.tobytes() + docs.tobytes()
    )
    tokens.astype("<i4").tofile(prefix.with_name(prefix.name + ".bin"))
    return prefix
