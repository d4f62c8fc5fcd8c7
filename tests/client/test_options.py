"""FeederClient's own arguments on their own (options.py), and the Info answer as a
DatasetInfo (info.py). The same checks through the constructor, before any contact:
tests/client/test_client_trainer.py."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from tokenfeed.client import DatasetInfo, InvalidArgument, NotFound, SamplingSpec
from tokenfeed.client.buffers import DOCUMENT_OUTPUTS
from tokenfeed.client.info import dataset_info, mixture_info
from tokenfeed.client.options import (
    MAX_AUTO_BATCHES_PER_MESSAGE,
    MESSAGE_TARGET_BYTES,
    Options,
    document_outputs,
    resolve_rank,
    sampling_spec,
)
from tokenfeed.core.sampling import MAX_TOKENS
from tokenfeed.v1 import feeder_pb2 as pb

SAMPLING = {
    "dataset": "d",
    "mixture": None,
    "schedule": None,
    "seq_len": 8,
    "batch_size": 2,
    "split": "train",
    "split_rate": 1.0,
    "stride": None,
    "shift": 1,
    "seed": 0,
    "shuffle": False,
    "shuffle_blocks": 0,
}

# ----------------------------------------------------------------------------- options


def test_options_defaults_and_what_they_derive() -> None:
    o = Options()
    assert (o.layout, o.prefetch, o.batches_per_message, o.lookahead) == ("flat", 2, None, True)
    assert not o.document_ends
    assert Options(mask_cross_document_labels=True).document_ends
    assert Options(documents=("cu_seqlens",)).document_ends
    # auto packing: as many batches as fit ~1 MiB, 1 to 64
    # (a batch counted as batch_size x (seq_len + 1) tokens of the dtype's bytes)
    assert o.message_batches(1, MESSAGE_TARGET_BYTES // 3 - 1, 1) == 3
    assert o.message_batches(16, 1024, 2) == 31  # 16 x 1025 x 2 bytes: 32,800
    assert o.message_batches(1, MESSAGE_TARGET_BYTES * 2, 1) == 1
    assert o.message_batches(1, 0, 1) == MAX_AUTO_BATCHES_PER_MESSAGE
    assert Options(batches_per_message=5).message_batches(1, 1 << 30, 4) == 5


# What each field refuses: a wrong type (TypeError), a value out of range (ValueError).
WRONG_TYPE = {
    "prefetch": [2.5, True, None],
    "batches_per_message": ["4", 1.0],
    "metrics_port": ["9100", False],
    "metrics_addr": [None, b"0.0.0.0"],
    "registry": ["default"],
    "lookahead": [None, 1],
    "mask_cross_document_labels": [1, "yes"],
}
OUT_OF_RANGE = {
    "layout": ["nested", None],
    "prefetch": [0, 1025],
    "batches_per_message": [0, 1025],
    "metrics_port": [-1, 65536],
    "documents": [("nope",), ("cu_seqlens", "labels")],
}


@pytest.mark.parametrize(
    ("error", "field", "value"),
    [(TypeError, f, v) for f, vs in WRONG_TYPE.items() for v in vs]
    + [(ValueError, f, v) for f, vs in OUT_OF_RANGE.items() for v in vs],
)
def test_options_check_every_field(error: type, field: str, value: object) -> None:
    with pytest.raises(error, match=field):
        Options(**{field: value})


def test_options_accept_what_users_pass() -> None:
    reg = CollectorRegistry()
    o = Options(layout="grouped", prefetch=1024, batches_per_message=1024, registry=reg)
    assert o.registry is reg
    assert Options(metrics_port=0).metrics_port == 0


def test_document_outputs_from_what_users_pass() -> None:
    assert document_outputs(True) == DOCUMENT_OUTPUTS
    assert document_outputs(False) == ()
    assert document_outputs(["cu_seqlens", "max_seqlen"]) == ("cu_seqlens", "max_seqlen")
    for bad in ("position_ids", [], ["nope"], 3, None):
        with pytest.raises(ValueError, match="documents"):
            document_outputs(bad)


# ---------------------------------------------------------------------- spec and rank


def test_the_spec_from_keywords_or_as_given() -> None:
    built = sampling_spec(None, None, {}, **SAMPLING)
    assert built == SamplingSpec(dataset="d", seq_len=8, batch_size=2)
    given = SamplingSpec(dataset="e", seq_len=4, batch_size=1)
    assert sampling_spec(given, None, {"WORLD_SIZE": "8"}, **SAMPLING) is given
    assert sampling_spec(given, 3, {}, **SAMPLING) == given.with_(world_size=3)
    assert sampling_spec(None, None, {"WORLD_SIZE": " 4 "}, **SAMPLING).world_size == 4
    assert sampling_spec(None, 2, {"WORLD_SIZE": "4"}, **SAMPLING).world_size == 2
    mix = {**SAMPLING, "dataset": None, "mixture": {"a": 0.7, "b": 0.3}}
    assert sampling_spec(None, None, {}, **mix).source_names == ("a", "b")


def test_the_spec_keywords_are_checked() -> None:
    with pytest.raises(TypeError, match="spec must be a SamplingSpec"):
        sampling_spec({"seq_len": 8}, None, {}, **SAMPLING)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument, match="mutually exclusive"):
        sampling_spec(None, None, {}, **{**SAMPLING, "mixture": {"a": 1}})
    for missing in ("dataset", "seq_len", "batch_size"):
        with pytest.raises(TypeError, match="needs dataset"):
            sampling_spec(None, None, {}, **{**SAMPLING, missing: None})
    with pytest.raises(InvalidArgument, match="world_size"):
        sampling_spec(None, 0, {}, **SAMPLING)
    with pytest.raises(ValueError, match="WORLD_SIZE='two'"):
        sampling_spec(None, None, {"WORLD_SIZE": "two"}, **SAMPLING)


def test_the_rank_from_the_argument_or_torchruns_environment() -> None:
    assert resolve_rank(None, 4, {}) == 0
    assert resolve_rank(None, 4, {"RANK": "3"}) == 3
    assert resolve_rank(1, 4, {"RANK": "3"}) == 1
    for rank, env in ((4, {}), (-1, {}), (None, {"RANK": "4"})):
        with pytest.raises(ValueError, match="rank"):
            resolve_rank(rank, 4, env)
    with pytest.raises(TypeError, match="rank"):
        resolve_rank("0", 4, {})  # type: ignore[arg-type]


# -------------------------------------------------------------------------------- info


def _dataset(name: str, splits: dict[str, tuple[int, int, int]], **kw) -> pb.DatasetInfo:
    return pb.DatasetInfo(
        name=name,
        splits=[
            pb.SplitInfo(name=n, tokens=t, windows=w, steps=s) for n, (t, w, s) in splits.items()
        ],
        **kw,
    )


def test_a_datasets_info_is_its_split_of_the_answer() -> None:
    answer = pb.InfoResponse(
        datasets=[
            _dataset("other", {"train": (1, 1, 1)}),
            _dataset(
                "d",
                {"train": (900, 56, 14), "validation": (100, 6, 2)},
                total_tokens=1000,
                dtype="uint16",
                vocab_size=0,
                eos_token_id=-1,
                tokenizer="gpt2",
            ),
        ]
    )
    info = dataset_info(answer, "d", "validation")
    assert info == DatasetInfo(
        name="d",
        total_tokens=1000,
        vocab_size=None,  # 0 on the wire: unknown
        eos_token_id=None,  # -1 on the wire: unknown
        dtype="uint16",
        tokenizer="gpt2",
        split="validation",
        split_tokens=100,
        windows=6,
        steps=2,
    )
    assert info.itemsize == 2
    with pytest.raises(NotFound, match=r"no dataset 'e' \(it has \['other', 'd'\]\)"):
        dataset_info(answer, "e", "train")
    with pytest.raises(NotFound, match="no split 'validation' for dataset 'other'"):
        dataset_info(answer, "other", "validation")


def test_a_mixtures_info_is_its_sources_together() -> None:
    answer = pb.InfoResponse(
        datasets=[
            _dataset("a", {"train": (90, 10, 0)}, total_tokens=100, dtype="uint32", vocab_size=7),
            _dataset("b", {"train": (45, 5, 0)}, total_tokens=50, dtype="uint32"),
        ],
        sources=[pb.SourceInfo(name="a", windows=10), pb.SourceInfo(name="b", windows=5)],
    )
    info = mixture_info(answer, seq_len=8)
    assert (info.name, info.total_tokens, info.split_tokens) == ("a,b", 150, 135)
    assert (info.vocab_size, info.eos_token_id, info.dtype) == (7, 0, "uint32")
    assert (info.windows, info.steps, info.source_windows) == (MAX_TOKENS // 8, 0, (10, 5))
    with pytest.raises(NotFound, match="none of the mixture's sources"):
        mixture_info(pb.InfoResponse(), seq_len=8)
