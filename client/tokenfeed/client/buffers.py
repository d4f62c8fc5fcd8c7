"""Host-side batch buffers: the views of a batch's buffer, its int64 copies for torch,
and the ring of staging slots the copies to a GPU go through.

A batch arrives as rows x (seq_len + shift) tokens. Without a device, `input_ids` and
`labels` are two views of that one buffer (`buf[:, :seq_len]` and `buf[:, shift:]`),
the grouped layout of the original loader a reshape of the same views: nothing is
copied, and the buffer is the received message's bytes themselves, fresh and read-only
for each batch, which a training loop may keep as long as it likes. For torch they
are two independent contiguous int64 copies (`widened`), what a DataLoader's collate
gives: in-place writes to one never show in the other, and `.view(-1)` works.

On CUDA the bytes go through a `HostRing` of pinned slots to the device. Pinned memory
is expensive to allocate, so slots are reused, each only once the copy out of it has
completed; the reader threads (an epoch's and the next epoch's opened ahead) share
the ring.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from tokenfeed.client.responses import Batch
from tokenfeed.core import documents
from tokenfeed.core.dtypes import DTYPES
from tokenfeed.v1 import feeder_pb2

LAYOUTS = ("flat", "grouped")
# A decoded batch (`responses.Batch`), or protobuf's: both have protobuf's field names.
AnyBatch = Batch | feeder_pb2.Batch
DOCUMENT_OUTPUTS = documents.OUTPUTS  # position_ids, document_ids, cu_seqlens, max_seqlen


def token_dtype(name: str) -> np.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"the feeder sent tokens of unsupported dtype {name!r}") from None


def batch_array(batch: AnyBatch) -> np.ndarray:
    """The [rows, cols] token array of a batch, a view of its bytes (no copy)."""
    dtype = token_dtype(batch.dtype)
    data = batch.tokens
    if len(data) != batch.rows * batch.cols * dtype.itemsize:
        raise ValueError(
            f"batch step {batch.step}: {len(data)} bytes for {batch.rows} x {batch.cols} "
            f"{batch.dtype} tokens"
        )
    if isinstance(data, np.ndarray):  # a decoded batch's (responses.Batch): its bytes
        return data.view(dtype).reshape(batch.rows, batch.cols)
    return np.frombuffer(data, dtype=dtype).reshape(batch.rows, batch.cols)


def document_arrays(
    batch: AnyBatch,
    arr: np.ndarray,
    seq_len: int,
    outputs: tuple[str, ...],
    mask_labels: bool,
    layout: str = "flat",
) -> dict[str, Any]:
    """The document `outputs` of a Batch message, as numpy arrays (max_seqlen an int),
    from the document ends the feeder sent with it; with `mask_labels`, also `labels`:
    a new int64 [rows, seq_len] copy with -100 where the target lies in another
    document, in the `layout`'s shape (grouped: a reshape of it). The document arrays
    are always the flat [rows, seq_len] shape. ValueError for ends that do not fit the
    batch."""
    shift = batch.shift
    out: dict[str, Any] = documents.from_ends(
        documents.ends_from_bytes(batch.document_ends),
        batch.rows,
        seq_len,
        shift,
        labels=arr[:, shift : shift + seq_len] if mask_labels else None,
        outputs=outputs,
    )
    if mask_labels and layout == "grouped":
        out["labels"] = out["labels"].reshape(batch.rows, seq_len // shift, shift)
    return out


def views(buf: Any, seq_len: int, shift: int, layout: str = "flat") -> tuple[Any, Any]:
    """(input_ids, labels) of a [rows, seq_len + shift] buffer (numpy array or tensor).

    flat: [rows, seq_len] each. grouped: [rows, seq_len // shift, shift], the original
    loader's layout. Both are views of `buf`.
    """
    rows = buf.shape[0]
    inputs, labels = buf[:, :seq_len], buf[:, shift : shift + seq_len]
    if layout == "grouped":
        shape = (rows, seq_len // shift, shift)
        return inputs.reshape(shape), labels.reshape(shape)
    return inputs, labels


class NumpyStager:
    """device=None: each batch as numpy arrays. `input_ids` and `labels` are `views` of
    the message's read-only buffer (nothing copied); the document `outputs` and masked
    labels are `document_arrays`. The same interface as the torch stagers (device.py,
    pinned.py): `stage` in the reader thread, `ready` in next()."""

    def __init__(
        self,
        seq_len: int,
        layout: str = "flat",
        outputs: tuple[str, ...] = (),
        mask_labels: bool = False,
    ) -> None:
        self.seq_len, self.layout = seq_len, layout
        self.outputs, self.mask_labels = outputs, mask_labels

    def stage(
        self, msg: AnyBatch, arr: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, dict[str, Any] | None, None]:
        """(input_ids, labels, document outputs or None, None: nothing to wait for)."""
        docs = (
            document_arrays(msg, arr, self.seq_len, self.outputs, self.mask_labels, self.layout)
            if self.outputs or self.mask_labels
            else None
        )
        inputs, labels = views(arr, self.seq_len, msg.shift, self.layout)
        if docs is not None and self.mask_labels:
            labels = docs.pop("labels")
        return inputs, labels, docs, None

    def ready(self, tensors: list[Any], event: Any) -> None:
        """Nothing to wait for."""


def widened(
    arr: np.ndarray,
    seq_len: int,
    shift: int,
    layout: str = "flat",
    labels: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, labels) of a [rows, seq_len + shift] token buffer as new contiguous
    int64 arrays that do not overlap (one allocation), shaped as `views`. `labels`
    given (masked labels: a copy of their own already) are returned instead."""
    rows = arr.shape[0]
    shape = (rows, seq_len // shift, shift) if layout == "grouped" else (rows, seq_len)
    out = np.empty((1 if labels is not None else 2, rows, seq_len), dtype=np.int64)
    np.copyto(out[0], arr[:, :seq_len])
    if labels is None:
        np.copyto(out[1], arr[:, shift : shift + seq_len])
        labels = out[1].reshape(shape)
    return out[0].reshape(shape), labels


def batch_sequences(batch: AnyBatch, seq_len: int) -> documents.Sequences:
    """The document sequences of a Batch message (sparse: what the CUDA path ships to
    the device, which expands them there). ValueError for ends that do not fit it."""
    ends = documents.ends_from_bytes(batch.document_ends)
    return documents.sequences(ends, batch.rows, seq_len, batch.shift)


class Slot:
    """One staging buffer of a `HostRing`, its capacity in bytes, and the event recorded
    after the copy out of it (reused for every copy out of this slot)."""

    __slots__ = ("buffer", "capacity", "event", "held", "in_flight", "released")

    def __init__(self, event: Any) -> None:
        self.buffer: Any = None
        self.capacity = 0
        self.event = event
        self.held = False  # a reader has it, between acquire and release
        self.in_flight = False  # released with a copy out of it until `event` completes
        self.released = 0  # when, in releases: the oldest in flight is waited for first


class HostRing:
    """Staging slots shared by the reader threads, each reused only once the copy out
    of it has completed.

    A slot is free, held (by one reader, from `acquire` to `release`) or in flight
    (released after the copy out of it was issued and `slot.event` recorded, until the
    event completes). `acquire` never hands out a held slot, and an in-flight one only
    after its event completes: it asks the events (`query()`), makes a new slot while
    there are fewer than `limit`, and otherwise waits for the copy released first
    (`synchronize()`, outside the lock). So the ring holds as many slots as copies in
    flight need, at most `limit`. `allocate(nbytes)` makes a slot's buffer (pinned
    memory on CUDA), grown when a batch needs more room; `new_event()` its event.
    """

    def __init__(
        self, allocate: Callable[[int], Any], new_event: Callable[[], Any], limit: int
    ) -> None:
        if limit < 1:
            raise ValueError(f"a ring needs at least one slot, got {limit}")
        self._allocate, self._new_event, self.limit = allocate, new_event, limit
        self._slots: list[Slot] = []
        self._releases = 0
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return len(self._slots)

    def acquire(self, nbytes: int) -> Slot:
        """A slot of at least `nbytes` that no one else holds or reads; release it."""
        with self._changed:
            while True:
                slot, wait = self._pick()
                if slot is not None:
                    break
                self._changed.wait()  # every slot held by the other readers
            slot.held = True
        if wait:
            slot.event.synchronize()
        slot.in_flight = False
        if slot.capacity < nbytes:
            # Room to spare: batches vary a little (shift="auto", document ends).
            slot.capacity = -(-(nbytes + nbytes // 4) // 4096) * 4096
            slot.buffer = self._allocate(slot.capacity)
        return slot

    def _pick(self) -> tuple[Slot | None, bool]:
        """Under the lock: (a slot to take, whether its copy must be waited for)."""
        oldest: Slot | None = None
        for slot in self._slots:
            if slot.held:
                continue
            if not slot.in_flight or slot.event.query():
                return slot, False
            if oldest is None or slot.released < oldest.released:
                oldest = slot
        if len(self._slots) < self.limit:
            slot = Slot(self._new_event())
            self._slots.append(slot)
            return slot, False
        return oldest, oldest is not None

    def release(self, slot: Slot, in_flight: bool = True) -> None:
        """Give `slot` back: `in_flight` when a copy out of it was issued and
        `slot.event` recorded after it (False: nothing reads it any more)."""
        with self._changed:
            self._releases += 1
            slot.held, slot.in_flight, slot.released = False, in_flight, self._releases
            self._changed.notify()
