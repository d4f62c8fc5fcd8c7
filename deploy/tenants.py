#!/usr/bin/env python3
"""The compose profile `tenants`: fresh tokens for the jobs of a tokens file.

    python tenants.py EXAMPLE OUT_DIR

Writes OUT_DIR/<job>.token for each job of EXAMPLE (a random token each) and
OUT_DIR/tokens.yaml (EXAMPLE's jobs with their tokens' SHA-256 in place of its
digests), unless OUT_DIR/tokens.yaml exists: a later `docker compose up` keeps the
tokens the trainers already have. The feeder reads tokens.yaml (--tokens-file), each
job's trainers their .token file (`tokenfeed demo --token-file`). Prints the jobs, never
a token.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
from pathlib import Path

import yaml


def main(example: Path, out: Path) -> int:
    tokens_file = out / "tokens.yaml"
    if tokens_file.exists():
        print(f"tenants: {tokens_file} exists; keeping its tokens")
        return 0
    doc = yaml.safe_load(example.read_text())
    for job, entry in doc["jobs"].items():
        token = secrets.token_urlsafe(32)
        write(out / f"{job}.token", token + "\n")
        entry["token_sha256"] = hashlib.sha256(token.encode()).hexdigest()
    write(tokens_file, yaml.safe_dump(doc, sort_keys=False))  # last: the others are complete
    print(f"tenants: jobs {', '.join(doc['jobs'])} with fresh tokens in {out}")
    return 0


def write(path: Path, text: str) -> None:
    """Written whole under a temporary name, readable by its owner only."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), Path(sys.argv[2])))
