"""Which format a location holds, and the reader for it.

    open_store("data/web")                 native store (meta.json), or bare *.bin + dtype
    open_store("s3://bucket/web")          native store in object storage
    open_store("data/seed")                chunk_NNNNNN/ save_to_disk folders (seed layout)
    open_store("data/gpt_text_document")   Megatron PREFIX (.bin or .idx path works too)

Native stores are served from local directories and from s3://; the seed layout and
Megatron indexed datasets from local paths (served in place, never converted).
"""

from __future__ import annotations

import os
from pathlib import Path

from tokenfeed.core.errors import InvalidArgument, NotFound
from tokenfeed.core.store.files import open_files
from tokenfeed.core.store.megatron import MegatronStore, is_megatron
from tokenfeed.core.store.meta import META_NAME
from tokenfeed.core.store.objects import is_url
from tokenfeed.core.store.reader import StoreReader, TokenStore
from tokenfeed.core.store.seed import SeedStore, is_seed_layout

FORMATS = ("tokenfeed", "seed", "megatron")


def detect(path: Path) -> str | None:
    """ "tokenfeed", "seed", "megatron" or None for a local path (nothing served there)."""
    if path.is_dir():
        if is_seed_layout(path):
            return "seed"
        if (path / META_NAME).is_file():
            return "tokenfeed"
    if (path.suffix in (".bin", ".idx") or not path.exists()) and is_megatron(path):
        return "megatron"
    return None


def open_store(location: str | os.PathLike[str], dtype: str | None = None) -> StoreReader:
    """The reader for whatever `location` holds (see the module docstring)."""
    if is_url(location):
        return TokenStore.open_files(open_files(str(location)), dtype)
    path = Path(open_files(location).location)  # refuses other URL schemes
    kind = detect(path)
    if kind in ("seed", "megatron") and dtype is not None:
        raise InvalidArgument(f"{path}: --dtype is for folders of bare *.bin files only")
    if kind == "seed":
        return SeedStore.open(path)
    if kind == "megatron":
        return MegatronStore.open(path)
    if path.is_dir():
        return TokenStore.open(path, dtype)
    if path.suffix in (".bin", ".idx"):
        raise NotFound(f"{path}: a Megatron dataset needs both PREFIX.bin and PREFIX.idx")
    raise NotFound(
        f"no token store at {path}: not a directory, and no {path.name}.bin + "
        f"{path.name}.idx (Megatron) beside it"
    )
