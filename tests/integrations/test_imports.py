"""Each integration imports its framework when it is imported, and a missing one is an
ImportError naming the extra to install; the package itself and the Megatron blends
need no framework (and no torch). Each case runs in a fresh interpreter whose import
of the framework is blocked."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize(
    ("module", "blocked", "extra"),
    [
        ("transformers", "transformers", "transformers"),
        ("transformers", "accelerate", "transformers"),
        ("lightning", "lightning", "lightning"),
        ("torchtitan", "torchtitan", "torchtitan"),
    ],
)
def test_a_missing_framework_names_its_extra(module: str, blocked: str, extra: str) -> None:
    done = run(
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "try:\n"
        f"    import tokenfeed.integrations.{module}\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    assert done.returncode == 0, done.stderr
    assert f"pip install 'tokenfeed[{extra}]'" in done.stdout
    assert blocked in done.stdout


def test_the_package_and_megatron_blends_import_no_framework() -> None:
    done = run(
        "import sys\n"
        "import tokenfeed.integrations, tokenfeed.integrations.megatron\n"
        "print(sorted({'torch', 'transformers', 'lightning', 'torchtitan'} & set(sys.modules)))"
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
