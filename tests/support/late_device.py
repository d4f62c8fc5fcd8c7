"""A device for the client's pinned path (tokenfeed.client.pinned.Device) whose copies
finish late: the CUDA path's ordering rules, checked on the CPU.

Tensors are CPU tensors. `upload` returns the copy at once (so the batch made from it
is real), but like a DMA engine the device keeps reading the source until the copy
completes: copies complete in issue order on a device thread, `latency` seconds each,
and an event completes when every copy issued before it was recorded has. At
completion the device checks that the source still holds the bytes it had when the
copy was issued. It records every breach of the rules in `violations`:

- a source overwritten while its copy was in flight (a slot handed out too early);
- an upload from a buffer whose previous copy has not completed;
- a thread touching the device before `enter_thread` (a real one would start on
  device 0 and create a context there).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from typing import Any

import torch


class LateEvent:
    def __init__(self, device: LateCopies) -> None:
        self._device = device
        self._until = 0  # completes once this many copies have completed

    def query(self) -> bool:
        return self._device.completed >= self._until

    def synchronize(self) -> None:
        with self._device.progress:
            self._device.progress.wait_for(self.query)


class LateCopies:
    torch = torch
    device = torch.device("cpu")

    def __init__(self, latency: float = 0.0005) -> None:
        self.latency = latency
        self.violations: list[str] = []
        self.issued = 0
        self.completed = 0
        self.progress = threading.Condition()
        self.in_flight: dict[int, int] = {}  # source data_ptr -> copies in flight from it
        self._entered: set[int] = set()
        self._copies: queue.SimpleQueue[tuple[Any, Any] | None] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="late-device", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._copies.put(None)
        self._thread.join(10)

    # -------------------------------------------------------- pinned.Device
    def enter_thread(self) -> None:
        self._entered.add(threading.get_ident())

    def side(self) -> contextlib.nullcontext[None]:
        self._check_thread("side")
        return contextlib.nullcontext()

    def pinned(self, nbytes: int) -> Any:
        self._check_thread("pinned")
        return torch.empty(nbytes, dtype=torch.uint8)

    def event(self) -> LateEvent:
        return LateEvent(self)

    def upload(self, host: Any) -> Any:
        self._check_thread("upload")
        copy = host.clone()
        with self.progress:
            if self.in_flight.get(host.data_ptr()):
                self.violations.append("an upload from a buffer whose copy is in flight")
            self.in_flight[host.data_ptr()] = self.in_flight.get(host.data_ptr(), 0) + 1
            self.issued += 1
        self._copies.put((host, copy))
        return copy

    def record(self, event: LateEvent) -> None:
        self._check_thread("record")
        with self.progress:
            event._until = self.issued

    def wait(self, event: LateEvent, tensors: list[Any]) -> None:
        event.synchronize()  # the loop's stream waits (here the CPU, for the check)

    # ------------------------------------------------------------- internals
    def _check_thread(self, what: str) -> None:
        if threading.get_ident() not in self._entered:
            self.violations.append(f"{what} in a thread that did not enter the device")

    def _run(self) -> None:
        while (item := self._copies.get()) is not None:
            host, copy = item
            self._stop.wait(self.latency)  # the copy engine at work
            with self.progress:
                if not torch.equal(host, copy):
                    self.violations.append("a source overwritten while its copy was in flight")
                self.in_flight[host.data_ptr()] -= 1
                self.completed += 1
                self.progress.notify_all()
