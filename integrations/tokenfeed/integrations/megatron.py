"""Megatron's `--data-path` blends as tokenfeed mixtures.

    parse_blend("0.3 /data/web/part 0.7 /data/code", data_root="/data")
    # {"web/part": "0.3", "code": "0.7"}
    FeederClient(address, mixture=parse_blend(blend, data_root="/data"), seq_len=..., ...)

A blend is Megatron's list `[w1, p1, w2, p2, ...]` (or the same words in one
string), a lone prefix (weight 1), or the per-split JSON form `{"train": [...],
"valid": [...], "test": [...]}`. A prefix names a `.bin`/`.idx` pair, which the
feeder serves in place as the dataset of that name under its data root
(docs/stores.md), so the mixture's names are the prefixes relative to the root.
The weights stay the decimals as written: tokenfeed normalizes them exactly
(docs/mixtures.md), so `mixture=` with the raw weights streams the same windows.
Pure: it reads a file only when given the path of a per-split JSON file.
"""

from __future__ import annotations

import json
import os
import posixpath
from collections.abc import Mapping, Sequence
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from tokenfeed.core.errors import InvalidArgument

SPLIT_KEYS = {"train": "train", "valid": "valid", "validation": "valid", "test": "test"}


def parse_blend(
    data_path: str | Sequence[str] | Mapping[str, Any] | os.PathLike[str],
    *,
    data_root: str | os.PathLike[str] | None = None,
    split: str = "train",
) -> dict[str, str]:
    """A Megatron blend -> mixture: dataset name -> weight as written (docs/integrations.md).

    `data_path`: `"w1 p1 w2 p2"`, `["w1", "p1", ...]`, a lone prefix, or the per-split
    form (a mapping, its JSON text, or the path of its JSON file), of which `split`
    ("train", "valid"/"validation" or "test") is taken. With `data_root`, absolute
    prefixes are made relative to it; without, every prefix must already be a name
    under the feeder's data root. InvalidArgument (a ValueError) names what is wrong.
    """
    words = _words(data_path, split)
    if not words:
        raise InvalidArgument("data_path: an empty blend")
    if len(words) == 1:
        pairs = [("1", words[0])]
    elif len(words) % 2 or not all(_is_number(w) for w in words[0::2]):
        raise InvalidArgument(
            f"data_path: several prefixes need a weight each ('w1 p1 w2 p2 ...'), got "
            f"{words!r}; Megatron blends unweighted prefixes by their sizes, a mixture by "
            f"the weights you write"
        )
    else:
        pairs = list(zip(words[0::2], words[1::2], strict=False))
    mixture: dict[str, str] = {}
    for weight, prefix in pairs:
        name = _dataset_name(prefix, data_root)
        if name in mixture:
            raise InvalidArgument(f"data_path: prefix {prefix!r} appears twice")
        if Decimal(weight) < 0:
            raise InvalidArgument(f"data_path: the weight of {prefix!r} is negative: {weight}")
        mixture[name] = weight
    return mixture


def _words(data_path: Any, split: str) -> list[str]:
    """The blend's words: weights and prefixes, in order."""
    if isinstance(data_path, os.PathLike):
        data_path = _read_json(Path(data_path))
    elif isinstance(data_path, str) and data_path.lstrip().startswith("{"):
        data_path = _loads(data_path, "data_path")
    if isinstance(data_path, Mapping):
        return _split_words(data_path, split)
    if isinstance(data_path, str):
        return data_path.split()
    if isinstance(data_path, Sequence) and all(isinstance(w, str) for w in data_path):
        return [part for w in data_path for part in w.split()]
    raise InvalidArgument(
        f"data_path: a blend is a string, a list of strings or the per-split mapping, "
        f"got {type(data_path).__name__}"
    )


def _split_words(per_split: Mapping[str, Any], split: str) -> list[str]:
    key = SPLIT_KEYS.get(split)
    if key is None:
        raise InvalidArgument(f"split must be one of {sorted(SPLIT_KEYS)}, got {split!r}")
    unknown = sorted(set(per_split) - set(SPLIT_KEYS.values()))
    if unknown:
        raise InvalidArgument(
            f"data_path: the per-split form has the keys train, valid and test, got {unknown}"
        )
    if per_split.get(key) is None:
        raise InvalidArgument(f"data_path: the per-split form has no {key!r} blend")
    return _words(per_split[key], split)


def _read_json(path: Path) -> Any:
    try:
        text = path.read_text()
    except OSError as e:
        raise InvalidArgument(f"data_path: cannot read {path}: {e.strerror}") from None
    return _loads(text, str(path))


def _loads(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"data_path: {what} is not valid JSON: {e}") from None


def _is_number(word: str) -> bool:
    try:
        return Decimal(word).is_finite()
    except InvalidOperation:
        return False


def _dataset_name(prefix: str, data_root: str | os.PathLike[str] | None) -> str:
    """The feeder's dataset name of a Megatron prefix (a path without .bin/.idx)."""
    if data_root is not None and os.path.isabs(prefix):
        root = os.path.normpath(os.fspath(data_root))
        path = os.path.normpath(prefix)
        if not os.path.isabs(root) or os.path.commonpath([root, path]) != root or path == root:
            raise InvalidArgument(f"data_path: prefix {prefix!r} is not under data_root {root!r}")
        prefix = os.path.relpath(path, root)
    elif os.path.isabs(prefix):
        raise InvalidArgument(
            f"data_path: prefix {prefix!r} is absolute: pass data_root= (the feeder's "
            f"--data-root as this machine sees it) to make it a dataset name"
        )
    if prefix.endswith(("/", os.sep)):  # <prefix>.bin: a folder's name is no prefix
        raise InvalidArgument(
            f"data_path: prefix {prefix!r} ends with a separator; a prefix names its "
            "files without .bin/.idx (data/web, not data/web/)"
        )
    name = posixpath.normpath(prefix.replace(os.sep, "/"))
    if name in (".", "") or name.startswith("../") or name == "..":
        raise InvalidArgument(f"data_path: prefix {prefix!r} leaves the data root")
    return name
