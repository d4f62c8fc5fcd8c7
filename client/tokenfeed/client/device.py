"""Batches to a torch device: the ONLY client module that imports torch, and only when
a device is asked for (`import tokenfeed.client` and `device=None` never load it).

The narrow store dtype (uint16/uint32) is what travels: over the network, into the
host buffer and, on CUDA, over PCIe; it is widened to int64 as late as possible, on
the device. On CUDA the reader thread copies each batch into a pinned slot of a
`HostRing`, issues the host-to-device copy and the widening on a side stream with
`non_blocking=True`, and records an event; the training loop's stream waits on that
event (a GPU-side wait, the CPU does not block) when it takes the batch, so copying
batch n+1 overlaps computing on batch n. On CPU the widening happens in the reader
thread, which overlaps it with the loop's compute just the same.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from tokenfeed.client.buffers import HostRing, views


def resolve_device(device: Any, environ: Mapping[str, str] | None = None) -> str | None:
    """None stays None; "cuda" becomes "cuda:<LOCAL_RANK>" under torchrun."""
    if device is None:
        return None
    if not isinstance(device, str) and type(device).__name__ != "device":
        raise TypeError(
            f"FeederClient device must be None, a string such as 'cuda' or a torch.device, "
            f"got {device!r}"
        )
    name = str(device)
    env = os.environ if environ is None else environ
    if name == "cuda" and env.get("LOCAL_RANK", "").strip():
        return f"cuda:{int(env['LOCAL_RANK'])}"
    return name


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(
            "FeederClient(device=...) needs PyTorch: pip install 'tokenfeed[torch]' "
            "(or use device=None for numpy arrays)"
        ) from None
    return torch


def check_device(name: str) -> None:
    """Raise ValueError unless the installed torch can put tensors on `name`, saying
    what to install or pass instead (torch's own errors do not)."""
    torch = _import_torch()
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ValueError(
            f"FeederClient device={name!r} is not a torch device ({e}); pass e.g. 'cuda', "
            "'cuda:0', 'cpu', or device=None for numpy arrays"
        ) from None
    instead = "or pass device='cpu' (tensors) or device=None (numpy arrays)"
    if device.type == "cuda":
        if torch.version.cuda is None:
            raise ValueError(
                f"FeederClient device={name!r}, but the installed torch {torch.__version__} is "
                "a CPU-only build: install a CUDA build of torch (pip install torch --index-url "
                f"https://download.pytorch.org/whl/cu124, see pytorch.org), {instead}"
            )
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise ValueError(
                f"FeederClient device={name!r}, but torch {torch.__version__} sees no CUDA "
                f"device (driver missing or CUDA_VISIBLE_DEVICES={visible!r}), {instead}"
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"FeederClient device={name!r}, but torch sees {count} CUDA device(s) "
                f"(cuda:0..cuda:{count - 1}); under torchrun pass device='cuda' (it becomes "
                "cuda:<LOCAL_RANK>)"
            )
        return
    if device.type == "cpu":
        return
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(
            f"FeederClient device={name!r}, but the installed torch {torch.__version__} "
            f"has no usable MPS backend (Apple silicon with macOS 12.3+ only), {instead}"
        )
    try:  # xpu, ...: can this torch allocate there at all?
        torch.empty(0, device=device)
    except Exception as e:  # any failure means the device is unusable
        first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise ValueError(
            f"FeederClient device={name!r} is not usable with the installed torch "
            f"{torch.__version__} ({type(e).__name__}: {first_line}), {instead}"
        ) from None


class TorchStager:
    """[rows, cols] narrow numpy batch -> int64 tensor on `device` (+ a ready event)."""

    def __init__(self, device: str, slots: int) -> None:
        torch = self.torch = _import_torch()
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.cpu = self.device.type == "cpu"
        if self.cuda:
            self.stream = torch.cuda.Stream(self.device)
            self.ring = HostRing(
                slots, lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)
            )

    def stage(self, arr: np.ndarray) -> tuple[Any, Any]:
        """Called in the reader thread. Returns (int64 tensor, event or None)."""
        torch = self.torch
        if not self.cuda:
            # astype makes a fresh writable int64 array: torch shares it, no second copy.
            wide = torch.from_numpy(arr.astype(np.int64))
            return (wide if self.device.type == "cpu" else wide.to(self.device)), None
        index, slot = self.ring.acquire(arr.nbytes)
        np.copyto(slot.numpy(), arr.reshape(-1).view(np.uint8))
        signed = torch.int16 if arr.dtype.itemsize == 2 else torch.int32
        mask = (1 << (8 * arr.dtype.itemsize)) - 1
        with torch.cuda.stream(self.stream):
            narrow = slot.to(self.device, non_blocking=True).view(signed).view(arr.shape)
            # Reinterpret as signed (every torch has int16/int32), widen, undo the sign.
            wide = narrow.to(torch.int64).bitwise_and_(mask)
            event = torch.cuda.Event()
            event.record(self.stream)
        self.ring.release_after(index, event.synchronize)
        return wide, event

    def stage_views(
        self,
        arr: np.ndarray,
        seq_len: int,
        shift: int,
        layout: str,
        docs: dict[str, Any] | None = None,
    ) -> tuple[Any, Any, dict[str, Any] | None, Any]:
        """Called in the reader thread: (input_ids, labels, docs, pending), the two
        int64 tensors views of one buffer (`buffers.views`), the document arrays
        (`buffers.document_arrays`, built on the host) as tensors on the device, and
        what the loop waits for before using them ((tensors, event)) or None.

        On CPU the views are taken in numpy and wrapped by `torch.from_numpy`: about
        half the CPU of slicing a tensor twice (each torch view is a new TensorImpl),
        for the same memory; the document arrays are shared the same way, and masked
        labels in `docs` are the labels (the view of the buffer is not wrapped)."""
        torch = self.torch
        if self.cpu:
            wrap = torch.from_numpy
            inputs, labels = views(arr.astype(np.int64), seq_len, shift, layout)
            if docs is None:
                return wrap(inputs), wrap(labels), None, None
            docs = {k: v if type(v) is int else wrap(v) for k, v in docs.items()}
            labels = docs["labels"] if "labels" in docs else wrap(labels)
            return wrap(inputs), labels, docs, None
        if docs is not None and self.cuda:
            # Into the side stream before stage() records its event, so the loop's wait
            # on that event covers them too. Pageable sources: torch copies them before
            # returning, so the numpy arrays may go.
            with torch.cuda.stream(self.stream):
                docs = {k: _tensor(torch, v, self.device) for k, v in docs.items()}
        elif docs is not None:
            docs = {k: _tensor(torch, v, self.device) for k, v in docs.items()}
        buf, event = self.stage(arr)
        inputs, labels = views(buf, seq_len, shift, layout)
        if event is None:
            return inputs, labels, docs, None
        tensors = [buf] + [v for v in (docs or {}).values() if not isinstance(v, int)]
        return inputs, labels, docs, (tensors, event)

    def ready(self, tensors: list[Any], event: Any) -> None:
        """Called in the training loop: its stream waits for the copies (on the GPU)."""
        if event is None:
            return
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(current)  # the allocator must not reuse them early


def _tensor(torch: Any, value: Any, device: Any = None) -> Any:
    """A document array as a tensor (shared with numpy on CPU); ints stay ints."""
    if isinstance(value, int):
        return value
    t = torch.from_numpy(value)
    return t if device is None else t.to(device, non_blocking=True)
