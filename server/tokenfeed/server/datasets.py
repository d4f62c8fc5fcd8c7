"""Dataset names -> open stores of any served format, never reaching outside the data root.

A dataset's name is its path relative to `--data-root` ("demo", "web/en"). The root is
a local directory or `s3://bucket/prefix`. What a name finds:

    local root   ROOT/NAME/meta.json            native store
                 ROOT/NAME/chunk_NNNNNN/        the seed loader's save_to_disk folders
                 ROOT/NAME.bin + ROOT/NAME.idx  Megatron-LM / NeMo indexed dataset
    s3:// root   ROOT/NAME/meta.json            native store

Names are looked up when first asked for, so a store written (or uploaded) after the
feeder started is found. A name comes from the network, so it is checked before it
touches storage: plain relative components only (no absolute paths, `.`/`..`,
backslashes, control characters); locally the resolved path (symlinks followed) must
still be inside the root, and under s3:// such a name can only make keys below the
root's prefix. Opened stores are kept and reopened when they change (meta.json's
mtime or ETag; the .idx/.bin of a Megatron dataset; the chunk folders of a seed
layout), and the cache key carries that generation, so a rewritten store never
serves stale chunks. Locally that check is a stat per request. Under s3:// it is a HEAD
of meta.json (a round trip, tens of ms), made at most once per PROBE_SECONDS per name,
one at a time: the ranks of a job opening their streams together (every epoch start, a
reconnect storm) cost one HEAD, not one each, and a store rewritten in object storage
is picked up by streams opened a second after it.

Opening an s3:// root lists it once (`check_access`): wrong credentials or no such
bucket fail at start, not at the first request. The formats and the object storage
layout: docs/stores.md.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from tokenfeed.core.errors import FeederError, InvalidArgument, NotFound
from tokenfeed.core.store import (
    META_NAME,
    MegatronStore,
    ObjectFiles,
    SeedStore,
    StoreReader,
    TokenStore,
    detect,
    is_url,
)
from tokenfeed.core.store.objects import ObjectStore, etag_generation
from tokenfeed.core.store.seed import chunk_dirs, is_seed_layout

log = logging.getLogger(__name__)

PROBE_SECONDS = 1.0  # how long an s3:// dataset's generation is taken as current

MAX_NAME_LEN = 1024
# Local stores a feeder opens as it starts (`Catalog.open_ahead`), the first by name: a
# data root of thousands of stores (each source of a large mixture its own) is not
# opened whole.
OPEN_AHEAD_STORES = 64


@dataclass(frozen=True)
class Dataset:
    name: str
    store: StoreReader
    generation: int  # changes when the store is rewritten: part of every cache key

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


_O_PATH = getattr(os, "O_PATH", 0)


def _real(path: str) -> str:
    """os.path.realpath(path, strict=True), resolved by the kernel where it can (Linux:
    the path opened O_PATH and read back from /proc/self/fd): ~3x cheaper than
    realpath's lstat per component, and a mixture's stream resolves each of its 1,000
    sources. OSError if it does not exist or loops, as realpath."""
    if _O_PATH:
        fd = os.open(path, _O_PATH | os.O_CLOEXEC)
        try:
            return os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass  # no /proc: the portable way
        finally:
            os.close(fd)
    return os.path.realpath(path, strict=True)


class Catalog:
    """Stores by name, every served format. `open_store` opens a native store on a
    local disk (TokenStore.open: chunks read into private memory; chunks.MappedStore
    under --workers N: chunks mapped from the page cache)."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        open_store: Callable[[Path], TokenStore] = TokenStore.open,
    ) -> None:
        self._open_store = open_store
        self.objects: ObjectStore | None = None
        if is_url(root):
            self.objects = ObjectStore(str(root))
            self.objects.check_access()  # PermissionDenied / StorageUnavailable at start
            self.root_text = str(self.objects.url)
            self.root = Path(".")  # unused for s3:// roots
        else:
            try:
                self.root = Path(root).resolve(strict=True)
            except (OSError, RuntimeError):
                raise NotFound(f"--data-root {root}: no such directory") from None
            if not self.root.is_dir():
                raise InvalidArgument(f"--data-root {root} is not a directory")
            self.root_text = str(self.root)
        # what a path inside the root begins with
        self._below = os.path.join(self.root_text, "")
        self._open: dict[str, Dataset] = {}
        self._asked: set[str] = set()  # the names requests asked for (`opened`)
        self._kinds: dict[Path, tuple[int, str]] = {}  # see _detect
        self._detecting = threading.Lock()  # one listing at a time (a miss of _kinds)
        self._lock = threading.Lock()
        self._probing: dict[str, threading.Lock] = {}  # remote: one HEAD per name at a time
        # one open per name at a time: the streams of an epoch-start storm that ask for
        # a store before it is open wait for that one open (meta.json of a 10^12-token
        # store takes tens of ms to parse) instead of each opening it again
        self._opening: dict[str, threading.Lock] = {}
        self._checked: dict[str, float] = {}  # remote: when a name's generation was probed
        self._located = threading.local()  # names_once's memo, per thread

    @property
    def remote(self) -> bool:
        return self.objects is not None

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

    def _inside(self, path: str) -> str | None:
        """`path` resolved, if it exists inside the root (and is not the root); strings,
        not Paths: a mixture's request looks up each of its 1,000 sources."""
        try:
            resolved = _real(path)
        except (OSError, RuntimeError):  # missing, or a symlink loop
            return None
        inside = resolved.startswith(self._below) and len(resolved) > len(self._below)
        return resolved if inside else None

    @contextmanager
    def names_once(self) -> Iterator[None]:
        """Within (on this thread): each name is located once. A request locates each
        name twice, for its job's grant and to open it: for a mixture of 1,000 sources,
        2,000 paths resolved and twice as many stats."""
        if getattr(self._located, "memo", None) is not None:
            yield
            return
        self._located.memo = {}
        try:
            yield
        finally:
            self._located.memo = None

    def locate(self, name: str) -> tuple[str, Path]:
        """(format, path) of a local dataset: its directory, or its Megatron PREFIX."""
        memo: dict[str, tuple[str, Path]] | None = getattr(self._located, "memo", None)
        if memo is not None and name in memo:
            return memo[name]
        found = self._locate(name)
        if memo is not None:
            memo[name] = found
        return found

    def _locate(self, name: str) -> tuple[str, Path]:
        self.check_name(name)
        named = os.path.join(self.root_text, name)
        path = self._inside(named)
        try:
            st = os.stat(path) if path is not None else None
        except OSError:
            st = None
        if path is not None and st is not None and stat.S_ISDIR(st.st_mode):
            found = Path(path)
            kind = self._detect(found, st.st_mtime_ns)
            if kind is not None:
                return kind, found
        idx = self._inside(named + ".idx")
        bin_ = self._inside(named + ".bin")
        if idx is not None and bin_ is not None and os.path.isfile(idx) and os.path.isfile(bin_):
            return "megatron", self.root / name
        raise NotFound(self._not_found(name))

    def _detect(self, path: Path, mtime: int) -> str | None:
        """detect(path), remembered while the directory's entries stay the same (its
        mtime): telling a native store from a seed layout lists the directory, tens of
        thousands of chunk files for a 10^12-token store, at every request."""
        known = self._kinds.get(path)
        if known is not None and known[0] == mtime:
            return known[1]
        with self._detecting:  # an epoch start's first requests list it once, not each
            known = self._kinds.get(path)
            if known is not None and known[0] == mtime:
                return known[1]
            kind = detect(path)
            if kind is not None:
                self._kinds[path] = (mtime, kind)
            return kind

    def real_names(self, name: str) -> tuple[str, ...]:
        """What `name` really is, as names relative to the root: a local store's resolved
        path (symlinks followed; a Megatron dataset's .idx and .bin each), or the name
        itself under s3:// (no links there). InvalidArgument or NotFound as `locate`."""
        if self.objects is not None:
            return (self.check_name(name),)
        kind, path = self.locate(name)
        if kind != "megatron":
            return (str(path)[len(self._below) :],)
        real = []
        for suffix in (".idx", ".bin"):
            file = path.with_name(path.name + suffix).resolve()
            real.append(file.relative_to(self.root).as_posix().removesuffix(suffix))
        return tuple(dict.fromkeys(real))

    def opened(self) -> list[Dataset]:
        """The datasets asked for since start (their latest generation each); a store
        opened ahead (`open_ahead`) is not one until a request asks for it."""
        with self._lock:
            return [ds for name, ds in self._open.items() if name in self._asked]

    def open_ahead(self, limit: int = OPEN_AHEAD_STORES) -> None:
        """Open the first `limit` local stores under the root, by name, as a request
        would (a feeder's start, on a thread of its own): the ranks of a job starting
        together then find their store open instead of waiting for its meta.json (tens
        of MB for a 10^12-token store) to be read. A store that does not open is left
        as it is: the requests for it get its error as before."""
        if self.objects is not None:  # object storage: a GET per store, left to requests
            return
        try:
            names = self.names()[:limit]
        except OSError as e:
            log.debug("stores not opened ahead: %s", e)
            return
        for name in names:
            try:
                self._get(name)
            except (FeederError, OSError) as e:
                log.debug("store %r not opened ahead: %s", name, e)

    def resolve(self, name: str) -> Path:
        """The local store of `name` (directory or Megatron prefix); NotFound if none."""
        return self.locate(name)[1]

    def _probe(self, name: str) -> tuple[str, Path | ObjectFiles, int]:
        """(format, where, generation) of `name` now: cheap (stats, or one HEAD)."""
        if self.objects is not None:
            self.check_name(name)
            files = ObjectFiles(self.objects.child(name))
            try:
                info = files.store.head(META_NAME)
            except NotFound:
                raise NotFound(self._not_found(name)) from None
            return "tokenfeed", files, etag_generation(info.etag, info.size)
        kind, path = self.locate(name)
        try:
            if kind == "tokenfeed":
                generation = os.stat(os.path.join(path, META_NAME)).st_mtime_ns
            elif kind == "seed":
                meta = path / META_NAME
                generation = path.stat().st_mtime_ns ^ (
                    meta.stat().st_mtime_ns if meta.is_file() else 0
                )
            else:
                generation = path.with_name(path.name + ".idx").stat().st_mtime_ns ^ (
                    path.with_name(path.name + ".bin").stat().st_mtime_ns << 1
                )
        except OSError:
            raise NotFound(self._not_found(name)) from None
        return kind, path, generation

    def _not_found(self, name: str) -> str:
        try:
            names = self.names()
        except FeederError:
            names = []
        shown = ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")
        return f"no dataset {name!r} under the data root; available: {shown or 'none'}"

    def get(self, name: str) -> Dataset:
        ds = self._get(name) if self.objects is None else self._get_remote(name)
        self._asked.add(name)  # once it opened: a name from the network is kept only then
        return ds

    def _get_remote(self, name: str) -> Dataset:
        with self._lock:
            probing = self._probing.setdefault(name, threading.Lock())
        with probing:
            ds = self._open.get(name)
            if ds is not None and time.monotonic() - self._checked[name] < PROBE_SECONDS:
                return ds
            checked = time.monotonic()
            ds = self._get(name)
            self._checked[name] = checked
            return ds

    def _get(self, name: str) -> Dataset:
        kind, where, generation = self._probe(name)
        with self._lock:
            ds = self._open.get(name)
            if ds is not None and ds.generation == generation:
                return ds
            opening = self._opening.setdefault(name, threading.Lock())
        with opening:
            with self._lock:
                ds = self._open.get(name)
            if ds is not None and ds.generation == generation:
                return ds  # opened while this call waited
            return self._open_dataset(name, kind, where, generation)

    def _open_dataset(
        self, name: str, kind: str, where: Path | ObjectFiles, generation: int
    ) -> Dataset:
        store: StoreReader
        if isinstance(where, ObjectFiles):  # object storage serves native stores only
            store = TokenStore.open_files(where)
        elif kind == "tokenfeed":
            store = self._open_store(where)
        elif kind == "seed":
            store = SeedStore.open(where)
        else:
            store = MegatronStore.open(where)
        ds = Dataset(name, store, generation)
        with self._lock:
            self._open[name] = ds
        return ds

    def names(self) -> list[str]:
        """Every dataset under the root, sorted.

        Locally symlinked directories are not walked, so listing never leaves the root.
        """
        if self.objects is not None:
            found = {
                o.key[: -len(META_NAME) - 1]
                for o in self.objects.list("")
                if o.key.endswith("/" + META_NAME)
            }
            return sorted(found)
        out = []
        for dirpath, dirnames, filenames in os.walk(self.root, followlinks=False):
            here = Path(dirpath)
            rel = here.relative_to(self.root).as_posix()
            if here != self.root and (
                META_NAME in filenames or (chunk_dirs(here) and is_seed_layout(here))
            ):
                out.append(rel)
                dirnames[:] = []  # a store's own folders are not datasets
                continue
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            files = set(filenames)
            for f in filenames:
                if f.endswith(".idx") and f[:-4] + ".bin" in files:
                    out.append((here / f[:-4]).relative_to(self.root).as_posix())
        return sorted(out)

    def all(self, names: list[str] | None = None) -> list[Dataset]:
        """Every store (of `names`, default all) that opens; broken ones are logged and
        left out of the list."""
        out = []
        for name in self.names() if names is None else names:
            try:
                out.append(self.get(name))
            except FeederError as e:
                log.warning("skipping dataset %r: %s", name, self.redact(e.message))
        return out

    def redact(self, message: str) -> str:
        """A message with a local data root's path replaced (clients see names only).

        Under s3:// the object's URL stays: it is what an operator needs to find the
        object that failed (UNAVAILABLE and DATA_LOSS name the object key).
        """
        if self.objects is not None:
            return message
        return message.replace(str(self.root) + os.sep, "").replace(str(self.root), "<data-root>")
