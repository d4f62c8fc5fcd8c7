"""Build hook: compile the package's four C extensions, nine loops in all.

* tokenfeed.server._native: the server's three loops over rows and batches: splice and
  program (splice.py), frames (wire.py); and its two over chunk files, opened and closed
  many at a time (descriptors.py);
* tokenfeed.core._keyed: the sampling's two: the keyed bijection (keyed.permute) and a
  mixture step's rows (mixture/steps.py step_rows);
* tokenfeed.core._documents: a batch's recorded document ends, searched in a store's
  index in place (documents.indexed_ends);
* tokenfeed.client._responses: where a stream response's fields lie in its bytes
  (responses.scan).

Hatchling builds the package; this hook compiles each with setuptools' build_ext (the
compiler and flags Python itself was built with) into the source tree, where both an
editable install (`pip install -e .`, the source roots on the path) and the wheel (its
`artifacts`) find them. A wheel with them is platform-specific.

Without a C compiler the install fails, saying so; `TOKENFEED_PURE_PYTHON=1` installs
without the extensions and each loop's Python/numpy reference (`f_py` beside `f`) runs
instead: correct, slower. At run time the same variable turns built loops off
(tokenfeed.core.native).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

EXTENSIONS = {  # module -> its source
    "tokenfeed.server._native": Path("server/tokenfeed/server/_native.c"),
    "tokenfeed.core._keyed": Path("core/tokenfeed/core/_keyed.c"),
    "tokenfeed.core._documents": Path("core/tokenfeed/core/_documents.c"),
    "tokenfeed.client._responses": Path("client/tokenfeed/client/_responses.c"),
}


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if os.environ.get("TOKENFEED_PURE_PYTHON") == "1":
            self.app.display_warning("TOKENFEED_PURE_PYTHON=1: building without the C loops")
            return
        root = Path(self.root)
        for name, source in EXTENSIONS.items():
            build(root, name, source)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def clean(self, versions: list[str]) -> None:
        for source in EXTENSIONS.values():
            for path in (Path(self.root) / source.parent).glob(f"{source.stem}*.so"):
                path.unlink()


def build(root: Path, name: str, source: Path) -> None:
    """Compile `source` as module `name`, next to it."""
    import sysconfig

    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    target = root / source.with_suffix(str(sysconfig.get_config_var("EXT_SUFFIX") or ".so"))
    ext = Extension(name, [str(root / source)], extra_compile_args=["-O2"])
    with tempfile.TemporaryDirectory(prefix="tokenfeed-build-") as tmp:
        cmd = build_ext(Distribution({"name": "tokenfeed", "ext_modules": [ext]}))
        cmd.build_lib, cmd.build_temp = os.path.join(tmp, "lib"), os.path.join(tmp, "temp")
        cmd.ensure_finalized()
        try:
            cmd.run()
        except Exception as e:  # CompileError and friends: say what to do
            sys.stderr.write(
                f"tokenfeed: compiling {source} failed ({e}). Install a C compiler and "
                "Python's headers (Debian: gcc python3-dev), or set TOKENFEED_PURE_PYTHON=1 "
                "to install without the extensions (a slower server).\n"
            )
            raise
        shutil.copyfile(cmd.get_ext_fullpath(name), target)
