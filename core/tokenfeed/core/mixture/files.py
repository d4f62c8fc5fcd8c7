"""Mixture files: the one place the mixture code reads anything (the client and the CLI
call it; the math is pure).

A mixture is written as a mapping name -> weight, a list of (name, weight) pairs, the
command line's ``web=0.7,code=0.3``, or a YAML/JSON file
``{sources: {web: 0.7, ...}, schedule: [{from_tokens: N, weights: {...}}, ...]}``
(docs/mixtures.md, "Mixture files"); `load_mixture` turns any of them into
the (sources, schedule) that SamplingSpec and Mixture validate.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from tokenfeed.core.errors import InvalidArgument


def load_mixture(mixture: Any, schedule: Any = None) -> tuple[tuple[Any, ...], tuple[Any, ...]]:
    """(sources, schedule) from what a user writes; Mixture validates the values.

    `mixture`: a mapping name -> weight, a list of (name, weight) pairs, the command
    line's ``web=0.7,code=0.3``, or the path of a YAML/JSON file
    ``{sources: {web: 0.7, ...}, schedule: [{from_tokens: N, weights: {...}}, ...]}``.
    `schedule`: a list of segments, or the path of a file holding that list (or a
    mapping with a `schedule` key). The same file works for the client and the CLI.
    """
    file_schedule: Any = None
    if isinstance(mixture, (str, os.PathLike)):
        text = os.fspath(mixture)
        if _looks_like_file(text):
            doc = _read_doc(text, "mixture")
            if not isinstance(doc, Mapping):
                raise InvalidArgument.at(
                    "mixture", f"{text}: expected a mapping with a `sources` key"
                )
            if "sources" in doc:
                unknown = sorted(set(doc) - {"sources", "schedule"})
                if unknown:
                    raise InvalidArgument.at("mixture", f"{text}: unknown keys {unknown}")
                mixture, file_schedule = doc["sources"], doc.get("schedule")
            else:
                mixture = doc
        else:
            pairs = []
            for n, part in enumerate(p for p in text.split(",") if p.strip()):
                name, eq, weight = part.partition("=")
                if not eq:
                    raise InvalidArgument.at(
                        f"mixture[{n}]",
                        f"{part!r} is not NAME=WEIGHT (and {text!r} is not a file)",
                    )
                pairs.append((name.strip(), weight.strip()))
            mixture = pairs
    if isinstance(schedule, (str, os.PathLike)):
        doc = _read_doc(os.fspath(schedule), "schedule")
        if isinstance(doc, Mapping):
            if "schedule" not in doc:
                raise InvalidArgument.at("schedule", f"{os.fspath(schedule)}: no `schedule` key")
            doc = doc["schedule"]
        schedule = doc
    if schedule is not None and file_schedule is not None:
        raise InvalidArgument.at(
            "schedule", "given twice: in the mixture file and as schedule; keep one"
        )
    if schedule is None:
        schedule = file_schedule or ()
    if mixture is None:
        raise InvalidArgument.at("sources", "a schedule needs a mixture (sources)")
    if isinstance(mixture, Mapping):
        sources = tuple(mixture.items())
    elif isinstance(mixture, Sequence) and not isinstance(mixture, (str, bytes)):
        sources = tuple(tuple(x) if isinstance(x, list) else x for x in mixture)
    else:
        raise InvalidArgument.at(
            "sources",
            f"must be a mapping name -> weight, a list of pairs or a file, got "
            f"{type(mixture).__name__}",
        )
    if isinstance(schedule, (str, bytes)) or not isinstance(schedule, Sequence):
        raise InvalidArgument.at(
            "schedule", f"must be a list of segments, got {type(schedule).__name__}"
        )
    return sources, tuple(schedule)


def _looks_like_file(text: str) -> bool:
    return os.path.exists(text) or text.lower().endswith((".yaml", ".yml", ".json"))


def _read_doc(path: str, field: str) -> Any:
    """A YAML or JSON file's content (JSON by suffix or when PyYAML is missing)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InvalidArgument.at(field, f"cannot read {path}: {e.strerror or e}") from None
    if path.lower().endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidArgument.at(field, f"{path}: not valid JSON ({e})") from None
    try:
        import yaml
    except ImportError:
        try:
            return json.loads(text)
        except json.JSONDecodeError:
            raise InvalidArgument.at(
                field, f"{path}: YAML needs PyYAML (pip install pyyaml), or write it as JSON"
            ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise InvalidArgument.at(field, f"{path}: not valid YAML ({e})") from None
