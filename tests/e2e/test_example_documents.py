"""examples/train_documents.py as a user runs it, against a real feeder: a store of
documents that each repeat one random token (the next token is learnable inside a
document, random across one). The loss falls, and the batches held document segments
and masked cross-document labels."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from tokenfeed.core.store import write_store

from support import ROOT
from support.feeders import running_feeder

EXAMPLE = ROOT / "examples" / "train_documents.py"
SUMMARY = re.compile(
    r"trained (\d+) steps: loss ([\d.]+) -> ([\d.]+) .*?; ([\d.]+) document segments per row; "
    r"([\d.]+) % of labels"
)


def repeating_documents(path: Path, total: int = 60_000, eos: int = 1, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    parts = []
    while sum(len(p) for p in parts) < total:
        token, n = int(rng.integers(10, 250)), int(rng.integers(4, 40))
        parts.append(np.append(np.full(n, token), eos))
    write_store(
        path,
        np.concatenate(parts)[:total].astype(np.uint16),
        dtype="uint16",
        tokens_per_chunk=8_192,
        eos_token_id=eos,
        vocab_size=256,
        tokenizer="repeating",
        source={"kind": "test", "generator": "repeating documents"},
    )


def test_example_trains_with_a_document_mask(tmp_path: Path) -> None:
    attention, steps = "sdpa", 60  # flex: GPU only (no backward on CPU); see the attention tests
    repeating_documents(tmp_path / "repeating")
    with running_feeder(tmp_path) as f:
        out = subprocess.run(
            [
                sys.executable,
                str(EXAMPLE),
                "--feeder",
                f.address,
                "--dataset",
                "repeating",
                "--seq-len",
                "64",
                "--batch-size",
                "8",
                "--dim",
                "32",
                "--layers",
                "1",
                "--steps",
                str(steps),
                "--attention",
                attention,
                "--log-every",
                "10",
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        )
    assert out.returncode == 0, out.stderr
    m = SUMMARY.search(out.stderr)
    assert m, out.stderr
    done, first, last, segments, ignored = m.groups()
    assert int(done) == steps
    assert float(segments) > 2  # documents of ~24 tokens in rows of 64
    assert float(ignored) > 1  # labels whose target is the next document
    assert float(last) < float(first) - 1.0, out.stderr  # it learned "next = previous"
