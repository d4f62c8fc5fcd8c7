"""What a feeder is doing, on demand: SIGUSR1 dumps every thread's stack and the event
loop's tasks (docs/serving.md, "A feeder that stops serving").

A feeder that stops serving is stuck in one of two ways, and a dump tells which. Its
event loop is blocked (a lock, a call that does not return): then the loop's thread
shows where, and no task list follows. Or the loop turns and the streams wait for
something that never comes (a turn, a storm's hold, a worker thread): then the task
list shows what each stream awaits and the threads show what the workers do. So the
threads are dumped by faulthandler from the signal itself, in C, with no lock and no
Python code, also while the loop or the GIL is held; the tasks are listed when the
loop next turns, grouped by where they wait (a thousand streams waiting at one place
make one entry).
"""

from __future__ import annotations

import asyncio
import faulthandler
import gc
import logging
import signal
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

DUMP_SIGNAL = signal.SIGUSR1


def dump_on_signal(loop: asyncio.AbstractEventLoop) -> Callable[[], None]:
    """Dump on DUMP_SIGNAL (call on the loop's thread): every thread's stack to stderr at
    once, then the threads' names and the loop's tasks to the log. Returns the undo."""
    loop.add_signal_handler(DUMP_SIGNAL, log_tasks, loop)
    try:  # chained: the loop's handler above runs after the dump
        faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=True)
    except (RuntimeError, ValueError) as e:  # no stderr to write to: the tasks only
        log.debug("no thread dump on %s: %s", DUMP_SIGNAL.name, e)

    def undo() -> None:
        faulthandler.unregister(DUMP_SIGNAL)
        loop.remove_signal_handler(DUMP_SIGNAL)

    return undo


def log_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """The second half of a dump, on the loop: which thread is which, and the tasks."""
    names = ", ".join(f"0x{t.ident or 0:016x} {t.name}" for t in threading.enumerate())
    log.warning("%s: threads %s\n%s", DUMP_SIGNAL.name, names, tasks_text(loop))


def tasks_text(loop: asyncio.AbstractEventLoop) -> str:
    """The loop's tasks, grouped by where each waits, the most common first: each place
    as the chain of coroutines from the task's own down to what it awaits."""
    places = Counter("\n".join(awaits(task.get_coro())) for task in asyncio.all_tasks(loop))
    lines = [f"{sum(places.values())} tasks on the event loop, by where they wait:"]
    for place, n in places.most_common():
        lines += [f"{n} task{'s' * (n != 1)} at:", place]
    return "\n".join(lines)


def awaits(coro: Any) -> list[str]:
    """A suspended coroutine's chain of awaits, outermost first, a line per coroutine
    (its file, line and function), then what the innermost awaits if not a coroutine."""
    lines = []
    while coro is not None:
        if type(coro).__name__ == "coroutine_wrapper":  # a coroutine awaited from Cython
            # (gRPC's handler awaiting ours, ours awaiting gRPC's): what it wraps
            coro = next((c for c in gc.get_referents(coro) if hasattr(c, "cr_await")), coro)
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # a future, or something else written in C
            lines.append(f"  awaiting {type(coro).__qualname__}")
            break
        code, line = frame.f_code, frame.f_lineno
        at = "" if line is None else f", line {line}"  # (Cython's frames have none)
        lines.append(f'  File "{code.co_filename}"{at}, in {code.co_name}')
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return lines
