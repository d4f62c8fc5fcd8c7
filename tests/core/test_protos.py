"""The committed generated modules are exactly what `make protos` produces."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import support

ROOT = support.ROOT


def _generated(root: Path) -> list[Path]:
    """The generated modules under `root` (not their __pycache__ byte code)."""
    return sorted(
        p.relative_to(root)
        for pattern in ("*_pb2.py", "*_pb2.pyi", "*_pb2_grpc.py")
        for p in (root / "tokenfeed" / "v1").glob(pattern)
    )


def test_generated_code_is_in_sync(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_protos.py"), str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = _generated(tmp_path)
    committed = _generated(ROOT / "protos")
    assert fresh, "no generated modules"
    assert fresh == committed, "run `make protos` and commit the result"
    for rel in fresh:
        assert (tmp_path / rel).read_bytes() == (ROOT / "protos" / rel).read_bytes(), (
            f"{rel} is stale: run `make protos`"
        )


def test_generated_imports_use_the_package_path() -> None:
    from tokenfeed.v1 import feeder_pb2, feeder_pb2_grpc

    assert feeder_pb2.DESCRIPTOR.package == "tokenfeed.v1"
    assert hasattr(feeder_pb2_grpc, "FeederStub")
