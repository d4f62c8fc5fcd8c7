"""parse_blend (tokenfeed.integrations.megatron): Megatron's --data-path blends and
their per-split JSON form as mixtures, checked against megatron-core's own parser, and
a blend streaming the same windows as the equivalent `mixture=` from a real feeder
serving Megatron .bin/.idx stores in place."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tokenfeed.client import FeederClient, InvalidArgument
from tokenfeed.integrations.megatron import parse_blend

from support.feeders import running_feeder
from support.stores import write_megatron


def test_the_forms_of_a_blend() -> None:
    assert parse_blend("0.3 web/a 0.7 code") == {"web/a": "0.3", "code": "0.7"}
    assert parse_blend(["0.3", "web/a", "0.7", "code"]) == {"web/a": "0.3", "code": "0.7"}
    assert parse_blend(["0.3 web/a", "0.7 code"]) == {"web/a": "0.3", "code": "0.7"}
    assert parse_blend("web/a") == parse_blend(["web/a"]) == {"web/a": "1"}
    assert parse_blend("3 a 1e-1 b") == {"a": "3", "b": "1e-1"}  # as written


def test_absolute_prefixes_relative_to_the_data_root(tmp_path: Path) -> None:
    root = tmp_path / "data"
    blend = f"0.3 {root}/web/part-0 0.7 {root}/code/../code/x"
    assert parse_blend(blend, data_root=root) == {"web/part-0": "0.3", "code/x": "0.7"}
    assert parse_blend(f"{root}/a", data_root=str(root) + "/") == {"a": "1"}
    with pytest.raises(InvalidArgument, match="not under data_root"):
        parse_blend(f"1 {tmp_path}/elsewhere/a", data_root=root)
    with pytest.raises(InvalidArgument, match="not under data_root"):
        parse_blend(f"1 {root}", data_root=root)
    with pytest.raises(InvalidArgument, match="is absolute: pass data_root"):
        parse_blend(f"1 {root}/a")
    with pytest.raises(InvalidArgument, match="leaves the data root"):
        parse_blend("1 ../a")
    with pytest.raises(InvalidArgument, match="ends with a separator"):
        parse_blend("1 web/ 1 code")


def test_the_per_split_form(tmp_path: Path) -> None:
    per_split = {"train": ["0.6", "a", "0.4", "b"], "valid": ["c"], "test": None}
    assert parse_blend(per_split) == {"a": "0.6", "b": "0.4"}
    assert parse_blend(per_split, split="valid") == parse_blend(per_split, split="validation")
    assert parse_blend(json.dumps(per_split), split="valid") == {"c": "1"}
    path = tmp_path / "blend.json"
    path.write_text(json.dumps(per_split))
    assert parse_blend(path) == {"a": "0.6", "b": "0.4"}
    with pytest.raises(InvalidArgument, match="no 'test' blend"):
        parse_blend(per_split, split="test")
    with pytest.raises(InvalidArgument, match="split must be one of"):
        parse_blend(per_split, split="dev")
    with pytest.raises(InvalidArgument, match=r"got \['training'\]"):
        parse_blend({"training": ["a"]})
    with pytest.raises(InvalidArgument, match="not valid JSON"):
        parse_blend("{train: a}")
    with pytest.raises(InvalidArgument, match="cannot read"):
        parse_blend(tmp_path / "missing.json")


@pytest.mark.parametrize(
    ("blend", "message"),
    [
        ("", "an empty blend"),
        ("a b", "several prefixes need a weight each"),
        ("0.5 a 0.5", "several prefixes need a weight each"),
        ("0.5 a 0.5 a", "appears twice"),
        ("-1 a 2 b", "negative"),
        (42, "a blend is a string"),
    ],
)
def test_bad_blends_are_invalid_arguments(blend: object, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        parse_blend(blend)  # type: ignore[arg-type]


# prefixes Megatron would read as distinct files (no "a//b" beside "a/b", no "a/" for a)
names = st.text("abcdefghij/_-0123456789", min_size=1, max_size=12).filter(
    lambda n: (
        not n.startswith("/")
        and not n.endswith("/")
        and "//" not in n
        and ".." not in n
        and not n[0].isdigit()
    )
)
weights = st.decimals(min_value=0, max_value=1000, allow_nan=False, places=3).map(str)


@given(st.lists(st.tuples(weights, names), min_size=2, max_size=6, unique_by=lambda p: p[1]))
def test_megatron_cores_parser_reads_the_same_blend(pairs: list[tuple[str, str]]) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core warns about optional kernels
        # the dev extra installs it where it installs: Python < 3.12
        utils = pytest.importorskip("megatron.core.datasets.utils")
    get_blend_from_list = utils.get_blend_from_list
    words = [w for pair in pairs for w in pair]
    prefixes, floats = get_blend_from_list(words)
    mixture = parse_blend(words)
    assert [str(n) for n in mixture] == [str(Path(p)) for p in prefixes]
    assert [float(w) for w in mixture.values()] == floats


def test_a_blend_streams_the_same_windows_as_the_equivalent_mixture(tmp_path: Path) -> None:
    root = tmp_path / "data"
    rng = np.random.default_rng(0)
    for name in ("web/part-0", "code"):
        docs = [[rng.integers(0, 500, size=int(rng.integers(5, 80)))] for _ in range(200)]
        write_megatron(root / name, docs)
    blend = f"0.3 {root}/web/part-0 0.7 {root}/code"
    common = dict(seq_len=32, batch_size=4, world_size=2, shuffle=True, seed=9)
    with running_feeder(root) as feeder:
        streams = []
        for mixture in (parse_blend(blend, data_root=root), {"web/part-0": 0.3, "code": 0.7}):
            with FeederClient(feeder.address, mixture=mixture, rank=1, **common) as loader:
                it = iter(loader)
                streams.append([next(it) for _ in range(40)])
    for a, b in zip(*streams, strict=False):
        np.testing.assert_array_equal(a["starts"], b["starts"])
        np.testing.assert_array_equal(a["sources"], b["sources"])
        np.testing.assert_array_equal(a["input_ids"], b["input_ids"])
    assert set(np.concatenate([b["sources"] for b in streams[0]]).tolist()) == {0, 1}
