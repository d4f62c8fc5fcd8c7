"""Each batch's document ends, for streams whose request sets `document_ends`.

The feeder knows the store, so it finds where documents end and sends them with each
batch (Batch.document_ends: ascending flat indices into the batch's rows x cols
tokens, little-endian uint32); the client builds position ids, document ids,
cu_seqlens and the label mask from them (tokenfeed.core.documents). One wire path for
both kinds of store:

- stores that record document offsets (Megatron indexed datasets): from the batch's
  window starts, searched in the store's own index in place (the reader's
  `end_search()`: nothing per document); the tokens are not looked at (no EOS
  needed);
- stores whose documents end in EOS (meta.json's `eos_token_id`): one scan of the
  batch's tokens.

A store with neither cannot be asked for documents (FAILED_PRECONDITION naming it);
it is still served without them. What the outputs mean: docs/documents.md.

Hooks elsewhere are small on purpose: the servicer calls `for_dataset` when a request
asks, and the message builder calls `BatchEnds.field` per batch and `grow` on the
batch's head. The field goes after `starts` (field 10 follows 9), so the rest of the
hand-spliced encoding (wire.py) is unchanged; the batch's length in its head grows by
the field's size.
"""

from __future__ import annotations

import functools

import numpy as np

from tokenfeed.core import documents
from tokenfeed.core.errors import FailedPrecondition
from tokenfeed.core.store import StoreReader
from tokenfeed.server import wire
from tokenfeed.server.datasets import Dataset
from tokenfeed.server.mixtures import MixtureSpace
from tokenfeed.v1 import feeder_pb2 as pb

_FIELD = wire.varint(pb.Batch.DESCRIPTOR.fields_by_name["document_ends"].number << 3 | 2)
assert max(f.number for f in pb.Batch.DESCRIPTOR.fields) == (
    pb.Batch.DESCRIPTOR.fields_by_name["document_ends"].number
), "document_ends is written after every other Batch field"


class BatchEnds:
    """Where one dataset's documents end, batch by batch."""

    def __init__(
        self,
        name: str,
        dtype: np.dtype,
        eos: int | None,
        recorded: documents.EndSearch | np.ndarray | None,
    ) -> None:
        self.name = name
        self.dtype = dtype  # of the tokens on the wire (the store's)
        self.eos = eos
        # the store's recorded ends (a search, or one array of them), or None
        if isinstance(recorded, np.ndarray):
            recorded = documents.ArrayEnds(recorded)
        self.recorded = recorded

    def ends(self, tokens: bytes | None, starts: np.ndarray, cols: int) -> np.ndarray:
        """Flat end indices of a batch: `tokens` its rows x cols token bytes (read only
        for EOS stores), `starts` its windows' store offsets."""
        if self.recorded is not None:
            return self.recorded.ends(starts, cols)
        assert self.eos is not None
        assert tokens is not None
        return documents.eos_ends(np.frombuffer(tokens, dtype=self.dtype), self.eos)

    def field(self, tokens: bytes | None, starts: np.ndarray, cols: int) -> bytes:
        """The batch's encoded `document_ends` field (empty when no document ends in it,
        as protobuf leaves out an empty bytes field)."""
        data = documents.ends_to_bytes(self.ends(tokens, starts, cols))
        return _FIELD + wire.varint(len(data)) + data if data else b""

    def parts(
        self, head: bytes, rows: list[bytes], tail: bytes, starts: np.ndarray, cols: int
    ) -> list[bytes]:
        """A batch's pieces for the message's join (wire.frames' head, its rows' token
        bytes, its tail) with its document ends added. EOS stores join the rows first
        to scan them: one more copy of a batch's tokens, a few microseconds."""
        tokens: bytes | None = None
        if self.recorded is None:
            tokens = rows[0] if len(rows) == 1 else b"".join(rows)
            rows = [tokens]
        field = self.field(tokens, starts, cols)
        if not field:
            return [head, *rows, tail]
        return [grow(head, len(field)), *rows, tail, field]


def grow(head: bytes, extra: int) -> bytes:
    """A batch head of wire.frames (the batches field's tag, the batch's length, its
    first fields) for a batch `extra` bytes longer."""
    length, i, shift = 0, 1, 0  # the tag is one byte (field 1)
    while True:
        b = head[i]
        length |= (b & 0x7F) << shift
        i += 1
        shift += 7
        if b < 0x80:
            break
    return head[:1] + wire.varint(length + extra) + head[i:]


def for_dataset(ds: Dataset) -> BatchEnds:
    """How `ds`'s batches find their document ends; FailedPrecondition when its store
    has neither recorded document offsets nor an eos_token_id.

    A mixture (MixtureSpace: its sources end to end) works when every source records
    offsets (the virtual store has them all) or every source ends documents with the
    same EOS; FailedPrecondition names the source that does not fit."""
    if isinstance(ds, MixtureSpace) and ds.store.end_search() is None:
        return _for_eos_mixture(ds)
    return _for_store(ds.name, ds.store)


def _for_eos_mixture(ds: MixtureSpace) -> BatchEnds:
    first = ds.sources[0]
    eos = first.store.meta.eos_token_id
    for src in ds.sources:
        if src.store.end_search() is not None or src.store.meta.eos_token_id is None:
            kind = "records document offsets" if src.store.meta.eos_token_id is None else ""
            raise FailedPrecondition(
                f"sources[{src.name!r}]: documents in a mixture need every source to end "
                f"documents the same way, with one EOS or all with recorded offsets; source "
                f"{src.name!r} "
                + (kind or "has no eos_token_id")
                + f" (source {first.name!r} has eos_token_id {eos})",
                field=f"sources[{src.name!r}]",
            )
        if src.store.meta.eos_token_id != eos:
            raise FailedPrecondition(
                f"sources[{src.name!r}]: documents in a mixture need one EOS: source "
                f"{src.name!r} has eos_token_id {src.store.meta.eos_token_id}, source "
                f"{first.name!r} {eos}",
                field=f"sources[{src.name!r}]",
            )
    assert eos is not None
    return BatchEnds(ds.name, ds.store.dtype, int(eos), None)


@functools.lru_cache(maxsize=8)
def _for_store(name: str, store: StoreReader) -> BatchEnds:
    # Recorded offsets win: a Megatron store's documents are its index's, EOS or not.
    recorded = store.end_search()
    if recorded is not None:
        return BatchEnds(name, store.dtype, None, recorded)
    eos = store.meta.eos_token_id
    if eos is None:
        raise FailedPrecondition(
            f"dataset {name!r} has no document boundaries: its store has neither an "
            "eos_token_id (meta.json) nor recorded document offsets, so documents=True "
            "and mask_cross_document_labels cannot be served for it (batches without "
            "them can); add eos_token_id to its meta.json if its documents end in EOS"
        )
    return BatchEnds(name, store.dtype, int(eos), None)
