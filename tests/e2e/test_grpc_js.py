"""A client in another language, built from feeder.proto alone: grpc-js with its
default settings (a 4 MiB receive limit) streams batches whose messages used to be
16 MiB. Needs node and `npm ci --prefix tests/grpc_js` (.ci/run installs it)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from support import TESTS
from support.feeders import running_feeder
from support.stores import make_positional_store

pytestmark = pytest.mark.slow

HERE = TESTS / "grpc_js"


def test_a_default_grpc_js_client_streams_batches_larger_than_its_old_messages(
    tmp_path: Path,
) -> None:
    assert (HERE / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "run: npm ci --prefix tests/grpc_js"
    )
    make_positional_store(tmp_path / "big", 120_000, 40_000)
    # 64 rows x 4096 tokens x 4 bytes: 1 MiB a batch, 16 MiB for 16 to a message
    params = {"dataset": "big", "seq_len": 4095, "stride": 64, "batch_size": 64}
    with running_feeder(tmp_path) as f:
        done = subprocess.run(
            ["node", str(HERE / "stream.js"), f.address, json.dumps(params), "16"],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
    out = json.loads(done.stdout)
    assert "error" not in out, out["error"]
    windows = (120_000 - 4096) // 64 + 1
    assert out["steps"] == list(range(windows // 64))
    assert out["tokens_ok"]
    assert out["max_batches_per_message"] == 3  # what fits in 4 MiB, not the 16 asked for
