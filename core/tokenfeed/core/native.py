"""The one switch of the compiled loops.

Each loop the package compiles has a public function `f` and, beside it, `f_py`: the
loop's reference in plain Python and numpy, its executable definition. `f` prepares its
arguments, runs the C loop when the extension is built and this switch is on, else
`f_py`, and returns the same values either way (tested through this switch):

    keyed.permute           keyed.permute_py            core/_keyed.c
    mixture.steps.step_rows mixture.steps.step_rows_py  core/_keyed.c
    documents.indexed_ends  documents.indexed_ends_py   core/_documents.c
    splice.splice           splice.splice_py            server/_native.c
    splice.program          splice.program_py           server/_native.c
    wire.frames             wire.frames_py              server/_native.c
    descriptors.open_files  descriptors.open_files_py   server/_native.c
    descriptors.close_files descriptors.close_files_py  server/_native.c
    responses.scan          responses.scan_py           client/_responses.c

`TOKENFEED_PURE_PYTHON=1` at install builds no extension; at run time, read once at
import, it turns every compiled loop off. Tests compare the two ways with
``with native.disabled(): ...``, which holds for the whole process (every thread): the
server builds messages on worker threads.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager

ENV = "TOKENFEED_PURE_PYTHON"

_on = os.environ.get(ENV) != "1"


def enabled() -> bool:
    """Whether the compiled loops may run (each also needs its extension built)."""
    return _on


def built(module: str) -> bool:
    """Whether the compiled module `module` ("tokenfeed.core._keyed") was built."""
    return importlib.util.find_spec(module) is not None


@contextmanager
def disabled() -> Iterator[None]:
    """Every compiled loop off inside the block: the references run instead."""
    global _on
    was, _on = _on, False
    try:
        yield
    finally:
        _on = was
