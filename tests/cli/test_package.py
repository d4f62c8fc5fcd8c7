"""Packaging promises: light client import, one command, namespace layout."""

from __future__ import annotations

import subprocess
import sys


def _modules_after(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return set(out.split())


def test_client_import_loads_no_torch_transformers_or_datasets() -> None:
    mods = _modules_after("import tokenfeed.client")
    assert "tokenfeed.client" in mods
    heavy = {m for m in mods if m.split(".")[0] in {"torch", "transformers", "datasets"}}
    assert not heavy, f"importing tokenfeed.client pulled in {sorted(heavy)}"


def test_store_and_sampling_import_no_grpc() -> None:
    mods = _modules_after("import tokenfeed.core.store, tokenfeed.core.sampling")
    assert not {m for m in mods if m.split(".")[0] in {"grpc", "torch", "transformers"}}


def test_tokenfeed_is_a_namespace_package_over_the_source_roots() -> None:
    import tokenfeed

    roots = {p.replace("\\", "/").rsplit("/", 2)[-2] for p in tokenfeed.__path__}
    assert {"server", "client", "prepare", "protos"} <= roots


def test_command_lists_every_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "tokenfeed", "--help"], check=True, capture_output=True, text=True
    ).stdout
    for name in ("prepare", "import", "serve", "info", "verify", "demo", "bench", "plan"):
        assert name in out
