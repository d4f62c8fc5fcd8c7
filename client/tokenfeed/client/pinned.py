"""The CUDA path: each batch through a pinned slot to the device, finished there on a
side stream, in the reader thread; the training loop's stream waits for it on the GPU.

Per batch, in a reader thread (PyTorch's rules for copies that overlap compute):

1. The narrow tokens (uint16/uint32: what travelled) and, with documents, the batch's
   sparse document description (`documents.Sequences`: segment starts and lengths, the
   masked label positions; a few hundred bytes) go into one slot of a `HostRing` of
   pinned buffers, and from there to the device in one `non_blocking` copy on the
   side stream. The slot's own event is recorded right after that copy, and the ring
   hands the slot out again only once that event has completed: the source outlives
   its copy.
2. On the side stream, the device makes `input_ids` and `labels` as two contiguous
   int64 tensors (one allocation, `[2, rows, seq_len]`) and expands the document
   outputs from the sparse description (`repeat_interleave` with `output_size`, so no
   host synchronization): the dense arrays never cross PCIe.
3. A ready event (from a pool: events are reused) is recorded after that work. The
   loop's `next()` makes its current stream wait on it (a GPU-side wait; the CPU does
   not block) and calls `record_stream` on the batch's tensors, so the caching
   allocator does not give their memory to the side stream while the loop's stream
   may still read it.

Every thread that touches the device first makes it the thread's current device
(`Device.enter_thread`), as PyTorch's own pin-memory thread does: otherwise a thread
starts on device 0 and would create a CUDA context there in every rank.

The device is an interface (`Device`): `device.CudaDevice` is the real one; tests
drive this same code with a CPU device whose copies finish late.
"""

from __future__ import annotations

import threading
from collections import deque
from contextlib import AbstractContextManager
from typing import Any, Protocol

import numpy as np

from tokenfeed.client.buffers import AnyBatch, HostRing, Slot, batch_sequences
from tokenfeed.core import documents

# Slots at most: two readers (an epoch's and the next one's opened ahead), each filling
# one while the copy out of its previous one finishes. A copy takes microseconds, so
# the ring rarely grows past two.
SLOTS = 4
ALIGN = 8  # every part of a slot starts at a multiple of the widest dtype


class Device(Protocol):
    """What the pinned path needs of a device."""

    torch: Any  # the torch module: the batch is made with its ops
    device: Any  # the torch.device the tensors go to

    def enter_thread(self) -> None:
        """Called once in every thread, before it touches the device."""

    def side(self) -> AbstractContextManager[Any]:
        """The side stream as the thread's current stream, for the duration: the
        copy and the work on it are ordered on it, apart from the loop's stream."""

    def pinned(self, nbytes: int) -> Any:
        """A host staging buffer: a uint8 tensor of `nbytes`."""

    def event(self) -> Any:
        """A new event: record() via `record`, query(), synchronize()."""

    def upload(self, host: Any) -> Any:
        """A non-blocking copy of the uint8 tensor `host` to the device (within
        `side`)."""

    def record(self, event: Any) -> None:
        """Record `event` on the side stream, after everything issued so far."""

    def wait(self, event: Any, tensors: list[Any]) -> None:
        """In the training loop: its current stream waits for `event`, and `tensors`
        (made on the side stream) are marked as used by it."""


class PinnedStager:
    """Stages a client's batches on `device`: `stage` in the reader threads, `ready`
    in the loop's next(). `outputs` are the document outputs asked for
    (documents.OUTPUTS), `mask_labels` whether labels are masked across documents."""

    def __init__(
        self,
        device: Device,
        seq_len: int,
        layout: str,
        outputs: tuple[str, ...] = (),
        mask_labels: bool = False,
        slots: int = SLOTS,
    ) -> None:
        self.device, self.torch = device, device.torch
        self.seq_len, self.layout = seq_len, layout
        self.outputs, self.mask_labels = outputs, mask_labels
        self.ring = HostRing(self._pinned, device.event, slots)
        # Ready events the loop has waited on, to be recorded again (deque: the loop
        # appends and the readers pop without a lock).
        self._events: deque[Any] = deque()
        self._entered = threading.local()
        self._aranges: dict[int, Any] = {}  # device arange(n), made once per size
        self._alternating: Any = None  # device bool False, True, False, ...

    def _pinned(self, nbytes: int) -> tuple[Any, np.ndarray]:
        buffer = self.device.pinned(nbytes)
        return buffer, buffer.numpy()

    # ------------------------------------------------------------ reader thread
    def stage(
        self, msg: AnyBatch, arr: np.ndarray
    ) -> tuple[Any, Any, dict[str, Any] | None, tuple[list[Any], Any]]:
        """(input_ids, labels, document outputs or None, what the loop waits for)."""
        if not getattr(self._entered, "done", False):
            self.device.enter_thread()
            self._entered.done = True
        seqs = batch_sequences(msg, self.seq_len) if self.outputs or self.mask_labels else None
        parts = self._parts(arr, seqs)
        offsets, total = _layout(parts)
        slot = self.ring.acquire(total)
        with self.device.side():
            uploaded = False
            try:
                dev = self._upload(slot, parts, offsets, total)
                uploaded = True
            finally:
                self.ring.release(slot, in_flight=uploaded)
            on_device = {
                name: dev[at : at + part.nbytes].view(self._dtype(part.dtype))
                for (name, part), at in zip(parts.items(), offsets, strict=True)
            }
            inputs, labels, docs, tensors = self._build(arr, on_device, seqs)
            tensors.append(dev)  # cu_seqlens is a view of the uploaded bytes
            try:
                event = self._events.pop()
            except IndexError:
                event = self.device.event()
            self.device.record(event)
        return inputs, labels, docs, (tensors, event)

    def _parts(self, arr: np.ndarray, seqs: documents.Sequences | None) -> dict[str, np.ndarray]:
        """The host arrays that travel, by name: the tokens, and what the document
        outputs asked for are expanded from."""
        parts = {"tokens": arr}
        if seqs is None:
            return parts
        outputs = self.outputs
        if "cu_seqlens" in outputs or "position_ids" in outputs:
            parts["cu_seqlens"] = seqs.cu_seqlens
        if "position_ids" in outputs or "document_ids" in outputs:
            parts["lengths"] = seqs.lengths
        if "document_ids" in outputs:
            parts["local"] = seqs.local
        if self.mask_labels:  # shift 1: the positions; else the masked runs
            parts["masked"] = seqs.label_at if seqs.shift == 1 else documents.label_runs(seqs)
        return parts

    def _upload(
        self, slot: Slot, parts: dict[str, np.ndarray], offsets: list[int], total: int
    ) -> Any:
        """Fill the held `slot` with `parts` and copy it to the device (side stream);
        its event, recorded after the copy, frees it."""
        buffer, host = slot.buffer
        for part, at in zip(parts.values(), offsets, strict=True):
            raw = np.ascontiguousarray(part).reshape(-1).view(np.uint8)
            np.copyto(host[at : at + part.nbytes], raw)
        dev = self.device.upload(buffer[:total])
        self.device.record(slot.event)
        return dev

    def _dtype(self, dtype: np.dtype) -> Any:
        # Tokens are read as the signed type of their width (every torch has int16
        # and int32) and the sign undone after widening.
        torch = self.torch
        return {2: torch.int16, 4: torch.int32, 8: torch.int64}[dtype.itemsize]

    def _build(
        self, arr: np.ndarray, dev: dict[str, Any], seqs: documents.Sequences | None
    ) -> tuple[Any, Any, dict[str, Any] | None, list[Any]]:
        """On the side stream: the batch's tensors from its uploaded parts, and the
        tensors whose memory the loop's stream must be recorded on."""
        torch, seq_len = self.torch, self.seq_len
        rows, cols = arr.shape
        shift = cols - seq_len
        positions = seqs is not None and "position_ids" in self.outputs
        planes = torch.empty(
            (3 if positions else 2, rows, seq_len), dtype=torch.int64, device=self.device.device
        )
        narrow = dev["tokens"].view(rows, cols)
        # Both windows of each row in one copy: unfold gives [rows, 2, seq_len].
        pair = planes[:2]
        pair.copy_(narrow.unfold(1, seq_len, shift).transpose(0, 1))
        pair.bitwise_and_((1 << (8 * arr.dtype.itemsize)) - 1)
        inputs, labels = planes[0], planes[1]
        tensors = [planes]
        docs: dict[str, Any] | None = None
        if seqs is not None:
            docs, tensors = self._documents(seqs, dev, planes, tensors)
        if self.layout == "grouped":
            shape = (rows, seq_len // shift, shift)
            inputs, labels = inputs.view(shape), labels.view(shape)
        return inputs, labels, docs, tensors

    def _documents(
        self, seqs: documents.Sequences, dev: dict[str, Any], planes: Any, tensors: list[Any]
    ) -> tuple[dict[str, Any], list[Any]]:
        """The document outputs, expanded on the device from the sparse parts; masked
        labels are written into the labels plane (it is the batch's own copy)."""
        torch, outputs = self.torch, self.outputs
        n = seqs.rows * seqs.seq_len
        docs: dict[str, Any] = {}
        if "position_ids" in outputs:
            starts = dev["cu_seqlens"][:-1].repeat_interleave(dev["lengths"], output_size=n)
            torch.sub(self._arange(n), starts, out=planes[2].view(-1))
            docs["position_ids"] = planes[2]
        if "document_ids" in outputs:
            ids = dev["local"].repeat_interleave(dev["lengths"], output_size=n)
            docs["document_ids"] = ids.view(seqs.rows, seqs.seq_len)
            tensors.append(ids)
        if "cu_seqlens" in outputs:
            docs["cu_seqlens"] = dev["cu_seqlens"]
        if "max_seqlen" in outputs:
            docs["max_seqlen"] = seqs.max_seqlen
        if self.mask_labels:
            labels = planes[1]
            if seqs.shift == 1:
                labels.view(-1).index_fill_(0, dev["masked"], documents.IGNORE_INDEX)
            else:
                runs = dev["masked"]
                cols = seqs.seq_len + seqs.shift
                flags = self._pattern(len(runs)).repeat_interleave(
                    runs, output_size=seqs.rows * cols
                )
                labels.masked_fill_(
                    flags.view(seqs.rows, cols)[:, : seqs.seq_len], documents.IGNORE_INDEX
                )
        return docs, tensors

    def _arange(self, n: int) -> Any:
        a = self._aranges.get(n)
        if a is None:
            if len(self._aranges) > 4:
                self._aranges.clear()
            a = self._aranges[n] = self.torch.arange(n, device=self.device.device)
        return a

    def _pattern(self, n: int) -> Any:
        """Alternating unmasked, masked, ... flags for `n` runs (documents.label_runs)."""
        if self._alternating is None or len(self._alternating) < n:
            torch = self.torch
            size = max(n, 1024)
            self._alternating = torch.arange(size, device=self.device.device).bitwise_and(1).bool()
        return self._alternating[:n]

    # ------------------------------------------------------------ training loop
    def ready(self, tensors: list[Any], event: Any) -> None:
        """In next(): the loop's stream waits for the batch (on the GPU), and the
        event goes back to the pool."""
        self.device.wait(event, tensors)
        self._events.append(event)


def _layout(parts: dict[str, np.ndarray]) -> tuple[list[int], int]:
    """Each part's byte offset in a slot (aligned), and the slot's size."""
    offsets, at = [], 0
    for part in parts.values():
        offsets.append(at)
        at += -(-part.nbytes // ALIGN) * ALIGN
    return offsets, at
