"""The one switch of the compiled loops (core/native.py): the environment variable read
at import, and `disabled()` for a block, nested or left by an exception."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tokenfeed.core import keyed, native


@pytest.mark.parametrize(("value", "on"), [("1", False), ("0", True), ("", True)])
def test_the_environment_variable_turns_the_loops_off_at_import(value, on) -> None:
    env = {**os.environ, native.ENV: value}
    code = "from tokenfeed.core import native; print(native.enabled())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True
    ).stdout
    assert out.strip() == str(on)


def test_disabled_holds_for_its_block_nested_or_left_by_an_error() -> None:
    was = native.enabled()

    def nested_then_fail() -> None:
        with native.disabled():
            assert not native.enabled()
            with native.disabled():
                assert not native.enabled()
            assert not native.enabled()  # the inner block restores "off", not "on"
            raise RuntimeError("inside")

    with pytest.raises(RuntimeError, match="inside"):
        nested_then_fail()
    assert native.enabled() == was


def test_the_references_run_inside_the_block() -> None:
    """keyed.permute with four stage keys of six: C refuses the array (TypeError), the
    numpy reference runs out of keys (IndexError), so the error says which one ran."""
    x, short = np.array([1, 2], dtype=np.int64), keyed.stage_keys(3)[:4]
    with native.disabled(), pytest.raises(IndexError):
        keyed.permute(x, 3, short)
    if native.enabled() and native.built("tokenfeed.core._keyed"):
        with pytest.raises(TypeError, match="sk"):
            keyed.permute(x, 3, short)
