"""Where a native store's files live: a local directory or an s3:// prefix, one interface.

    files = open_files("data/web")            # LocalFiles
    files = open_files("s3://bucket/web")     # ObjectFiles (obstore, the `s3` extra)
    files.read("chunk_000000.bin", nbytes)    # whole file, own anonymous mmap, size checked
    files.write("meta.json", data)            # atomic: tmp + rename / one PUT
    files.where("chunk_000003.bin")           # "data/web/chunk_000003.bin" or "s3://..."

The reader and the writer of the native format (reader.py, writer.py) and prepare's
output handling use only this interface, so a store is written and read the same way
wherever it lives. Names are plain relative paths ("chunk_000000.bin",
"part-00001/meta.json").
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from pathlib import Path

from tokenfeed.core.atomic import write_atomic
from tokenfeed.core.errors import DataLoss, InvalidArgument
from tokenfeed.core.store.memory import anonymous
from tokenfeed.core.store.objects import ObjectStore, RetryPolicy, S3Url, etag_generation, is_url


class StoreFiles(ABC):
    """The files of one store directory (or object prefix)."""

    remote = False

    @property
    @abstractmethod
    def location(self) -> str:
        """The directory or s3:// URL, for messages."""

    @abstractmethod
    def where(self, name: str) -> str:
        """A file's full location, for messages."""

    @abstractmethod
    def child(self, name: str) -> StoreFiles:
        """The files under sub-directory `name`."""

    @abstractmethod
    def size(self, name: str) -> int | None:
        """Bytes of `name`, None when it does not exist."""

    @abstractmethod
    def version(self, name: str) -> int | None:
        """A number that changes when `name` is rewritten (None: missing)."""

    @abstractmethod
    def read(self, name: str, nbytes: int) -> memoryview:
        """The whole file, exactly `nbytes` long (DataLoss otherwise), in its own
        anonymous memory map: dropping it hands the memory back to the OS."""

    @abstractmethod
    def read_small(self, name: str) -> bytes | None:
        """A small file's bytes (meta.json), None when it does not exist."""

    @abstractmethod
    def write(self, name: str, data: bytes | memoryview) -> None:
        """Write `name` so that readers see all of it or none of it."""

    @abstractmethod
    def delete(self, name: str) -> None:
        """Remove `name` if it exists."""

    @abstractmethod
    def names(self) -> dict[str, int]:
        """Every file below, by relative name (sub-directories with '/'), with sizes."""

    def exists(self, name: str) -> bool:
        return self.size(name) is not None


class LocalFiles(StoreFiles):
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    @property
    def location(self) -> str:
        return str(self.path)

    def where(self, name: str) -> str:
        return str(self.path / name)

    def child(self, name: str) -> LocalFiles:
        return LocalFiles(self.path / name)

    def size(self, name: str) -> int | None:
        try:
            st = (self.path / name).stat()
        except OSError:
            return None
        return st.st_size if not os.path.isdir(self.path / name) else None

    def version(self, name: str) -> int | None:
        try:
            return (self.path / name).stat().st_mtime_ns
        except OSError:
            return None

    def read(self, name: str, nbytes: int) -> memoryview:
        buf = anonymous(nbytes, whole=True)
        try:
            with open(self.path / name, "rb") as f:
                got = f.readinto(buf)
                extra = len(f.read(1))
        except OSError as e:
            raise DataLoss(f"{self.where(name)}: unreadable ({e.strerror or e})") from None
        if got != nbytes or extra:
            size = self.size(name)
            raise DataLoss(f"{self.where(name)}: {size} bytes, expected {nbytes}")
        return memoryview(buf)[:nbytes]

    def read_small(self, name: str) -> bytes | None:
        try:
            return (self.path / name).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise DataLoss(f"{self.where(name)}: unreadable ({e.strerror or e})") from None

    def write(self, name: str, data: bytes | memoryview) -> None:
        target = self.path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(target, data)

    def delete(self, name: str) -> None:
        (self.path / name).unlink(missing_ok=True)

    def names(self) -> dict[str, int]:
        if not self.path.is_dir():
            return {}
        out = {}
        for dirpath, _, filenames in os.walk(self.path):
            for f in filenames:
                p = Path(dirpath) / f
                out[p.relative_to(self.path).as_posix()] = p.stat().st_size
        return out


class ObjectFiles(StoreFiles):
    """A store under an s3:// prefix. PUT replaces an object atomically, so `write` is
    one PUT; there are no temporary names to clean up."""

    remote = True

    def __init__(self, store: ObjectStore) -> None:
        self.store = store

    @property
    def location(self) -> str:
        return str(self.store.url)

    def where(self, name: str) -> str:
        return self.store.full(name)

    def child(self, name: str) -> ObjectFiles:
        return ObjectFiles(self.store.child(name))

    def _head(self, name: str) -> tuple[int, int] | None:
        from tokenfeed.core.errors import NotFound

        try:
            info = self.store.head(name)
        except NotFound:
            return None
        return info.size, etag_generation(info.etag, info.size)

    def size(self, name: str) -> int | None:
        found = self._head(name)
        return None if found is None else found[0]

    def version(self, name: str) -> int | None:
        found = self._head(name)
        return None if found is None else found[1]

    def read(self, name: str, nbytes: int) -> memoryview:
        return self.store.get(name, size=nbytes)

    def read_small(self, name: str) -> bytes | None:
        from tokenfeed.core.errors import NotFound

        try:
            return bytes(self.store.get(name))
        except NotFound:
            return None

    def write(self, name: str, data: bytes | memoryview) -> None:
        self.store.put(name, data)

    def delete(self, name: str) -> None:
        self.store.delete([name])

    def names(self) -> dict[str, int]:
        return {o.key: o.size for o in self.store.list("")}


def open_files(location: str | os.PathLike[str], policy: RetryPolicy | None = None) -> StoreFiles:
    """LocalFiles for a path, ObjectFiles for `s3://bucket/prefix` (its requests retried
    by `policy`, ObjectStore's default if None)."""
    if is_url(location):
        return ObjectFiles(ObjectStore(str(location), policy=policy))
    text = os.fspath(location)
    if text.startswith(("s3:/", "S3://")) or "://" in text:
        raise InvalidArgument(
            f"{text!r}: not a local path and not an s3://bucket/prefix URL (only s3:// is "
            "supported for object storage)"
        )
    return LocalFiles(text)


__all__ = ["LocalFiles", "ObjectFiles", "S3Url", "StoreFiles", "open_files"]
