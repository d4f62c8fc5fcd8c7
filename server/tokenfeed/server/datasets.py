"""Dataset names -> open token stores, never reaching outside the data root.

A dataset's name is its path relative to `--data-root` ("demo", "web/en"). A name
comes from the network, so it is checked before it touches the filesystem: plain
relative components only (no absolute paths, `.`/`..`, backslashes, control
characters), and the resolved directory (symlinks followed) must still be inside the
root. Opened stores are kept (opening stats every chunk) and reopened when their
`meta.json` changes, and the cache key carries that generation, so a re-prepared
store never serves stale chunks.
"""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from tokenfeed.core.errors import FeederError, InvalidArgument, NotFound
from tokenfeed.core.store import META_NAME, TokenStore

log = logging.getLogger(__name__)

MAX_NAME_LEN = 1024


@dataclass(frozen=True)
class Dataset:
    name: str
    store: TokenStore
    generation: int  # meta.json mtime_ns: part of every cache key of this store

    @cached_property
    def chunk_bounds(self) -> list[int]:
        """store.chunk_starts as Python ints (cheap indexing in per-row loops)."""
        return [int(x) for x in self.store.chunk_starts]

    @cached_property
    def chunk_keys(self) -> list[tuple[str, int, int]]:
        """The cache key of every chunk (made once: a stream pins chunks per message)."""
        return [(self.name, self.generation, c) for c in range(self.store.num_chunks)]

    def chunk_key(self, index: int) -> tuple[str, int, int]:
        return self.chunk_keys[index]

    def virtual(self, starts: np.ndarray, sources: np.ndarray | None) -> np.ndarray:
        """Where rows starting at `starts` lie in this dataset's token space: as they
        are; a mixture (mixtures.MixtureSpace) maps each source's starts into its own."""
        return starts


class Catalog:
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).resolve(strict=True)
        self._open: dict[str, Dataset] = {}
        self._lock = threading.Lock()

    def check_name(self, name: str) -> str:
        """Validate a requested name; InvalidArgument with the reason if it is not plain."""
        if not name:
            raise InvalidArgument("dataset name is empty; Info lists the datasets available")
        if len(name) > MAX_NAME_LEN:
            raise InvalidArgument(
                f"dataset name is {len(name)} characters long (max {MAX_NAME_LEN})"
            )
        if any(ord(c) < 32 or ord(c) == 127 for c in name) or "\\" in name:
            raise InvalidArgument(
                f"dataset name {name!r} contains control characters or backslashes"
            )
        if name.startswith("/"):
            raise InvalidArgument(
                f"dataset name {name!r} is absolute; use a path relative to the data root"
            )
        parts = name.split("/")
        if any(p in ("", ".", "..") for p in parts):
            raise InvalidArgument(
                f"dataset name {name!r} has empty, '.' or '..' components; use a plain "
                "relative path such as 'demo' or 'web/en'"
            )
        return name

    def resolve(self, name: str) -> Path:
        """The store directory of `name`, inside the root; NotFound when there is none."""
        self.check_name(name)
        try:
            path = (self.root / name).resolve(strict=True)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            raise NotFound(self._not_found(name)) from None
        if not path.is_relative_to(self.root) or path == self.root:
            raise NotFound(self._not_found(name))
        if not (path / META_NAME).is_file():
            raise NotFound(self._not_found(name))
        return path

    def _not_found(self, name: str) -> str:
        names = self.names()
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        return f"no dataset {name!r} under the data root; available: {shown or 'none'}"

    def get(self, name: str) -> Dataset:
        path = self.resolve(name)
        try:
            generation = (path / META_NAME).stat().st_mtime_ns
        except OSError:
            raise NotFound(self._not_found(name)) from None
        with self._lock:
            ds = self._open.get(name)
            if ds is not None and ds.generation == generation:
                return ds
        store = TokenStore.open(path)
        ds = Dataset(name, store, generation)
        with self._lock:
            self._open[name] = ds
        return ds

    def names(self) -> list[str]:
        """Every store under the root (a directory holding meta.json), sorted.

        Symlinked directories are not walked, so listing never leaves the root.
        """
        found = []
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            if META_NAME in filenames and Path(dirpath) != self.root:
                found.append(Path(dirpath).relative_to(self.root).as_posix())
        return sorted(found)

    def all(self) -> list[Dataset]:
        """Every store that opens; broken ones are logged and left out of the list."""
        out = []
        for name in self.names():
            try:
                out.append(self.get(name))
            except FeederError as e:
                log.warning("skipping dataset %r: %s", name, self.redact(e.message))
        return out

    def redact(self, message: str) -> str:
        """A message with the server's data-root path replaced (clients see names only)."""
        return message.replace(str(self.root) + os.sep, "").replace(str(self.root), "<data-root>")
