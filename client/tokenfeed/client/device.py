"""Batches to a torch device: the ONLY client module that imports torch, and only when
a device is asked for (`import tokenfeed.client` and `device=None` never load it).

With a device, `input_ids` and `labels` are two independent contiguous int64 tensors
and every document output a tensor of its own, all made in the reader thread, never
in the loop's next(). The narrow store dtype (uint16/uint32) is what travels: over the
network, into the host buffer and, on CUDA, over PCIe; it is widened to int64 as late
as possible. On the CPU (and devices other than CUDA) the reader thread makes them in
numpy and torch shares that memory (`HostStager`); on CUDA they are made on the device
on a side stream from the narrow tokens and the sparse document description, through
pinned memory (`pinned.PinnedStager` over a `CudaDevice`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from tokenfeed.client.buffers import AnyBatch, document_arrays, widened
from tokenfeed.client.pinned import PinnedStager


def resolve_device(
    device: Any,
    environ: Mapping[str, str] | None = None,
    cuda_devices: Callable[[], tuple[int, int]] | None = None,
) -> str | None:
    """The device a client stages on: None stays None (numpy, no torch), and "cuda"
    without an index becomes one device: cuda:<LOCAL_RANK> where the process sees at
    least LOCAL_RANK + 1 devices (torchrun on a node whose GPUs every rank sees),
    cuda:0 where it sees one (CUDA_VISIBLE_DEVICES gives each rank its own), and
    without LOCAL_RANK the current device (torch.cuda.set_device's). Anything else
    as given. `cuda_devices()` is (devices visible, current device), asked of torch
    only for "cuda"."""
    if device is None:
        return None
    if not isinstance(device, str) and type(device).__name__ != "device":
        raise TypeError(
            f"FeederClient device must be None, a string such as 'cuda' or a torch.device, "
            f"got {device!r}"
        )
    name = str(device)
    if name != "cuda":
        return name
    count, current = (cuda_devices or _cuda_devices)()
    if count == 0:
        return name  # check_device says why
    env = os.environ if environ is None else environ
    local = env.get("LOCAL_RANK", "").strip()
    if not local:
        return f"cuda:{current}"
    try:
        rank = int(local)
    except ValueError:
        raise ValueError(f"LOCAL_RANK={local!r} is not an integer") from None
    if rank < count:
        return f"cuda:{rank}"
    if count == 1:
        return "cuda:0"
    raise ValueError(
        f"FeederClient device='cuda' with LOCAL_RANK={rank}, but this process sees {count} "
        f"CUDA devices (cuda:0..cuda:{count - 1}, CUDA_VISIBLE_DEVICES="
        f"{env.get('CUDA_VISIBLE_DEVICES')!r}): make every GPU of the node visible to "
        "each rank, or one to each, or pass device='cuda:N'"
    )


def _cuda_devices() -> tuple[int, int]:
    torch = _import_torch()
    if torch.version.cuda is None or not torch.cuda.is_available():
        return 0, 0
    count = torch.cuda.device_count()
    return count, (torch.cuda.current_device() if count else 0)


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
                f"(cuda:0..cuda:{count - 1}, CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); pass device='cuda': it is "
                "cuda:<LOCAL_RANK> where the process sees every GPU of the node, the only "
                "one where it sees one"
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


def make_stager(
    device: str, seq_len: int, layout: str, outputs: tuple[str, ...], mask_labels: bool
) -> HostStager | PinnedStager:
    """What stages a client's batches on `device` (checked by check_device)."""
    torch = _import_torch()
    target = torch.device(device)
    if target.type == "cuda":
        return PinnedStager(CudaDevice(torch, target), seq_len, layout, outputs, mask_labels)
    return HostStager(torch, target, seq_len, layout, outputs, mask_labels)


class HostStager:
    """The CPU (and devices other than CUDA): the reader thread makes the int64 copies
    and the document arrays in numpy (`buffers.widened`, `buffers.document_arrays`),
    torch shares that memory (from_numpy: about half the CPU of slicing tensors), and
    another device gets a copy of each."""

    def __init__(
        self,
        torch: Any,
        device: Any,
        seq_len: int,
        layout: str,
        outputs: tuple[str, ...] = (),
        mask_labels: bool = False,
    ) -> None:
        self.torch, self.device = torch, device
        self.seq_len, self.layout = seq_len, layout
        self.outputs, self.mask_labels = outputs, mask_labels
        self._to = None if device.type == "cpu" else device

    def stage(self, msg: AnyBatch, arr: np.ndarray) -> tuple[Any, Any, dict[str, Any] | None, None]:
        """(input_ids, labels, document outputs or None, None: nothing to wait for)."""
        docs = (
            document_arrays(msg, arr, self.seq_len, self.outputs, self.mask_labels, self.layout)
            if self.outputs or self.mask_labels
            else None
        )
        masked = docs.pop("labels") if docs is not None and self.mask_labels else None
        inputs, labels = widened(arr, self.seq_len, msg.shift, self.layout, masked)
        tensor = self._tensor
        if docs is not None:
            docs = {k: v if type(v) is int else tensor(v) for k, v in docs.items()}
        return tensor(inputs), tensor(labels), docs, None

    def _tensor(self, array: np.ndarray) -> Any:
        t = self.torch.from_numpy(array)
        return t if self._to is None else t.to(self._to)

    def ready(self, tensors: list[Any], event: Any) -> None:
        """Nothing to wait for: the tensors are complete when staged."""


class CudaDevice:
    """A CUDA device for `pinned.PinnedStager`: pinned slots, one side stream for the
    copies and the work on them, reusable events."""

    def __init__(self, torch: Any, device: Any) -> None:
        self.torch, self.device = torch, device
        self.stream = torch.cuda.Stream(device)

    def enter_thread(self) -> None:
        # A new thread starts on device 0: anything it did there (leaving a stream
        # context restores that device's stream) would create a context on GPU 0.
        self.torch.cuda.set_device(self.device)

    def side(self) -> AbstractContextManager[Any]:
        return self.torch.cuda.stream(self.stream)

    def pinned(self, nbytes: int) -> Any:
        return self.torch.empty(nbytes, dtype=self.torch.uint8, pin_memory=True)

    def event(self) -> Any:
        # Blocking: a reader that waits for a slot's copy sleeps instead of spinning.
        return self.torch.cuda.Event(blocking=True)

    def upload(self, host: Any) -> Any:
        return host.to(self.device, non_blocking=True)

    def record(self, event: Any) -> None:
        event.record(self.stream)

    def wait(self, event: Any, tensors: list[Any]) -> None:
        current = self.torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for tensor in tensors:
            tensor.record_stream(current)  # not reused before the loop's stream is done
