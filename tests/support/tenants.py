"""A data root shared by jobs, and the tokens file that says who reads what.

    root = make_tenant_root(tmp / "root")     # web/en, web/fr, code, secret/eval-set
    tokens = write_tokens_file(tmp / "tokens.yaml", JOBS)
    stub.Info(req, metadata=bearer("pretrain"))

The tokens here are test values made up for these tests; the file holds only their
SHA-256, as a real one does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from tokenfeed.server.tenants import token_digest

from support.stores import make_positional_store

TOKENS = {
    "pretrain": "tok-pretrain-3f9a",
    "eval": "tok-eval-77c1",
    "ablation": "tok-ablation-0b2e",
}
JOBS: dict[str, dict[str, Any]] = {
    "pretrain": {
        "token_sha256": token_digest(TOKENS["pretrain"]),
        "datasets": ["web/*", "code"],
        "weight": 2,
        "max_streams": 3,
    },
    "eval": {"token_sha256": token_digest(TOKENS["eval"]), "datasets": ["**"]},
    "ablation": {"token_sha256": token_digest(TOKENS["ablation"]), "datasets": ["web/en"]},
}
DATASETS = ("web/en", "web/fr", "code", "secret/eval-set")


def make_tenant_root(root: Path, big: bool = False) -> Path:
    """DATASETS as positional stores (10,000 uint32 tokens, chunks of 1,000) under
    `root`; with `big`, web/big too (make_big: for a Canary)."""
    for name in DATASETS:
        make_positional_store(root / name, 10_000, 1_000)
    if big:
        make_big(root)
    return root


def write_tokens_file(path: Path, jobs: dict[str, dict[str, Any]]) -> Path:
    """A tokens file (YAML) of `jobs`, written whole (a reload never reads half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump({"jobs": jobs}, sort_keys=False))
    tmp.replace(path)
    return path


def bearer(job: str) -> list[tuple[str, str]]:
    """The call metadata of `job`'s token."""
    return [("authorization", f"Bearer {TOKENS[job]}")]


class Canary:
    """One job's stream of web/big (make_big) held open while something else happens
    to the feeder: the first message read, the rest waiting on flow control.
    `finish()` reads the rest and checks that the whole epoch came, every step once,
    every row exact."""

    def __init__(self, channel, job: str, dataset: str = "web/big", batch_size: int = 4) -> None:
        from tokenfeed.v1 import feeder_pb2 as pb
        from tokenfeed.v1 import feeder_pb2_grpc as pb_grpc

        from support.feeders import feeder_params

        params = feeder_params(dataset=dataset, seq_len=1024, stride=1024, batch_size=batch_size)
        self.call = pb_grpc.FeederStub(channel).StreamBatches(
            pb.StreamBatchesRequest(params=params), metadata=bearer(job)
        )
        self.windows = (int(0.9 * BIG_TOKENS) - 1025) // 1024 + 1
        self.batches = list(next(self.call).batches)

    def finish(self) -> int:
        """Read to the end of the epoch; the number of batches (all checked)."""
        import numpy as np

        from support.stores import positional_rows

        for message in self.call:
            self.batches += message.batches
        steps = self.windows // len(self.batches[0].starts)
        assert [b.step for b in self.batches] == list(range(steps))
        for b in self.batches:
            rows = np.frombuffer(b.tokens, "<u4").reshape(b.rows, b.cols)
            np.testing.assert_array_equal(rows, positional_rows(b.starts, b.cols))
        return len(self.batches)


BIG_TOKENS = 4_000_000  # web/big: more than a stream's flow-control windows hold


def make_big(root: Path) -> None:
    """web/big: BIG_TOKENS uint32 positions, chunks of 500,000 (a canary's epoch is
    ~14 MB: the feeder is still sending it while a test works)."""
    make_positional_store(root / "web" / "big", BIG_TOKENS, 500_000)
