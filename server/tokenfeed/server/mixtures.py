"""A mixture's sources as one virtual token space, so batch assembly stays as it is.

Source i's tokens sit at virtual offset `bases[i]`: the virtual store's chunk table is
the concatenation of the sources' chunk tables, and each chunk keeps its own dataset's
cache key, so the one LRU holds every source's chunks (shared with single-dataset
streams of the same stores) and read-ahead runs across sources. Assembly locates rows
by virtual start (`MixtureSpace.virtual`) and puts on the wire each row's start in its
own store and its source index (Batch.starts, Batch.sources).

All sources must share a token dtype (rows of one batch are one array);
FailedPrecondition names the source that differs. A mixture's order: docs/mixtures.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from tokenfeed.core.documents import EndSearch
from tokenfeed.core.errors import FailedPrecondition
from tokenfeed.core.store import StoreMeta
from tokenfeed.core.store.reader import StoreReader
from tokenfeed.server.datasets import Dataset

MIXTURE_NAME = "(mixture)"  # the space's name in logs and in per-stream metrics


class VirtualStore(StoreReader):
    """Several stores end to end: chunk c of the virtual store is chunk `local[c]` of
    source `owner[c]`. Reads go to the source's own store (checksums included)."""

    format = "mixture"

    def __init__(self, names: list[str], stores: list[StoreReader]) -> None:
        dtype = stores[0].meta.dtype
        for name, store in zip(names, stores, strict=True):
            if store.meta.dtype != dtype:
                raise FailedPrecondition(
                    f"sources[{name!r}]: source {name!r} stores {store.meta.dtype} tokens, "
                    f"source {names[0]!r} {dtype}; a mixture's sources must share a token "
                    "dtype (one batch is one array)",
                    field=f"sources[{name!r}]",
                )
        chunks = tuple(c for s in stores for c in s.meta.chunks)
        super().__init__(MIXTURE_NAME, StoreMeta(dtype=dtype, chunks=chunks))
        self.stores = stores
        self.owner = np.repeat(np.arange(len(stores)), [s.num_chunks for s in stores])
        self.local = np.concatenate(
            [np.arange(s.num_chunks, dtype=np.int64) for s in stores] or [np.zeros(0, np.int64)]
        )
        # virtual offset of each source's token 0
        self.bases = np.concatenate([[0], np.cumsum([s.total_tokens for s in stores])[:-1]]).astype(
            np.int64
        )

    @cached_property
    def remote(self) -> bool:  # asked at every burst (read-ahead); a store's never changes
        return any(s.remote for s in self.stores)

    def read_chunk(self, index: int, verify: bool = True) -> np.ndarray:
        store = self.stores[int(self.owner[index])]
        return store.read_chunk(int(self.local[index]), verify)

    @cached_property
    def in_place(self) -> bool:
        return all(s.in_place for s in self.stores)

    def chunk_file(self, index: int) -> tuple[str, int]:
        return self.stores[int(self.owner[index])].chunk_file(int(self.local[index]))

    def check_chunk_file(self, index: int, size: int | None) -> None:
        self.stores[int(self.owner[index])].check_chunk_file(int(self.local[index]), size)

    def verify(self) -> list[str]:
        return [problem for s in self.stores for problem in s.verify()]

    def document_ends(self) -> np.ndarray | None:
        """The sources' recorded document ends in the virtual token space (None unless
        every source records them)."""
        ends = [s.document_ends() for s in self.stores]
        if any(e is None for e in ends):
            return None
        return np.concatenate(
            [e + base for e, base in zip(ends, self.bases.tolist(), strict=True) if e is not None]
        )

    def end_search(self) -> EndSearch | None:
        """The sources' own searches, each over its stretch of the virtual token space
        (None unless every source records document ends)."""
        searches = [s.end_search() for s in self.stores]
        if any(e is None for e in searches):
            return None
        return JoinedEnds([e for e in searches if e is not None], self.bases)


class JoinedEnds(EndSearch):
    """Document ends of stores end to end, store i's from virtual offset bases[i]: each
    row goes to the search of the source its start lies in (a window never crosses
    sources), once per source the batch holds."""

    def __init__(self, parts: list[EndSearch], bases: np.ndarray) -> None:
        self.parts = parts
        self.bases = bases

    def ends(self, starts: np.ndarray, cols: int) -> np.ndarray:
        starts = np.asarray(starts, dtype=np.int64)
        owner = np.searchsorted(self.bases, starts, side="right") - 1
        found = []
        for i in np.unique(owner).tolist():
            rows = np.flatnonzero(owner == i)
            flat = self.parts[i].ends(starts[rows] - self.bases[i], cols)
            found.append(rows[flat // cols] * cols + flat % cols)  # back to the batch's rows
        if len(found) == 1:
            return found[0]
        return np.sort(np.concatenate(found)) if found else np.empty(0, dtype=np.int64)


@dataclass(frozen=True)
class MixtureSpace(Dataset):
    """The `Dataset` assembly sees for a mixture: the sources' stores end to end."""

    sources: tuple[Dataset, ...] = field(default=())

    @classmethod
    def of(cls, sources: list[Dataset]) -> MixtureSpace:
        store = VirtualStore([d.name for d in sources], [d.store for d in sources])
        generation = hash(tuple(d.generation for d in sources))
        return cls(MIXTURE_NAME, store, generation, tuple(sources))

    @property
    def virtual_store(self) -> VirtualStore:
        assert isinstance(self.store, VirtualStore)
        return self.store

    @cached_property
    def chunk_keys(self) -> list[tuple[str, int, int]]:
        """Each chunk's key is its own dataset's: one cache entry per real chunk."""
        vs = self.virtual_store
        return [
            self.sources[int(o)].chunk_key(int(c))
            for o, c in zip(vs.owner.tolist(), vs.local.tolist(), strict=True)
        ]

    def virtual(self, starts: np.ndarray, sources: np.ndarray | None) -> np.ndarray:
        """Starts in each row's source store -> starts in the virtual token space."""
        if sources is None:
            return starts
        return starts + self.virtual_store.bases[sources]
