"""Build hook: compile the server's one C extension (tokenfeed.server._native).

Hatchling builds the package; this hook compiles server/tokenfeed/server/_native.c with
setuptools' build_ext (the compiler and flags Python itself was built with) into the
source tree, where both an editable install (`pip install -e .`, the source roots on
the path) and the wheel (its `artifacts`) find it. A wheel with it is platform-specific.

Without a C compiler the install fails, saying so; `TOKENFEED_PURE_PYTHON=1` installs
without the extension and the server splices messages in Python (correct, slower:
tokenfeed.server.splice).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

NAME = "tokenfeed.server._native"
SOURCE = Path("server/tokenfeed/server/_native.c")


class CustomBuildHook(BuildHookInterface):  # type: ignore[type-arg]
    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        if self.target_name != "wheel":
            return
        if os.environ.get("TOKENFEED_PURE_PYTHON") == "1":
            self.app.display_warning("TOKENFEED_PURE_PYTHON=1: building without the C splice")
            return
        root = Path(self.root)
        target = root / SOURCE.parent / compiled_name()
        build(root, target)
        build_data["pure_python"] = False
        build_data["infer_tag"] = True

    def clean(self, versions: list[str]) -> None:
        for path in (Path(self.root) / SOURCE.parent).glob("_native*.so"):
            path.unlink()


def compiled_name() -> str:
    import sysconfig

    return "_native" + str(sysconfig.get_config_var("EXT_SUFFIX") or ".so")


def build(root: Path, target: Path) -> None:
    from setuptools import Distribution, Extension
    from setuptools.command.build_ext import build_ext

    ext = Extension(NAME, [str(root / SOURCE)], extra_compile_args=["-O2"])
    with tempfile.TemporaryDirectory(prefix="tokenfeed-build-") as tmp:
        cmd = build_ext(Distribution({"name": "tokenfeed", "ext_modules": [ext]}))
        cmd.build_lib, cmd.build_temp = os.path.join(tmp, "lib"), os.path.join(tmp, "temp")
        cmd.ensure_finalized()
        try:
            cmd.run()
        except Exception as e:  # CompileError and friends: say what to do
            sys.stderr.write(
                f"tokenfeed: compiling {SOURCE} failed ({e}). Install a C compiler and "
                "Python's headers (Debian: gcc python3-dev), or set TOKENFEED_PURE_PYTHON=1 "
                "to install without the extension (a slower server).\n"
            )
            raise
        shutil.copyfile(cmd.get_ext_fullpath(NAME), target)
