"""`tokenfeed prepare` when the output disk fills up or is read-only.

Real filesystems: a tiny tmpfs (ENOSPC) and the same tmpfs remounted read-only
(EROFS). Mounting needs root with CAP_SYS_ADMIN, which this project's machines and
CI have; the test fails loudly, rather than skipping, where they do not.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenfeed.core.store import META_NAME, TokenStore

from support.prepare import make_documents, prepare_argv, write_jsonl

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mnt = tmp_path / "disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def _prepare(corpus: Path, tok_dir: Path, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tokenfeed",
            *prepare_argv(corpus, tok_dir, out, "--tokens-per-chunk", 10000),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.jsonl"
    write_jsonl(path, make_documents(12_000))  # ~250k tokens: 500 kB as uint16
    return path


def test_disk_full_is_a_clear_error_and_resumes_once_there_is_room(
    small_disk: Path, corpus: Path, tok_dir: Path, tmp_path: Path
) -> None:
    out = small_disk / "store"
    r = _prepare(corpus, tok_dir, out)
    assert r.returncode == 2, r.stderr
    assert "No space left on device" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / META_NAME).exists()  # nothing looks complete
    assert not list(out.glob("*.tmp"))  # nothing half-written under any name
    done = sorted(p.name for p in out.glob("chunk_*.bin"))
    assert done, "some chunks were completed before the disk filled"

    # Move the partial output to a roomy disk and re-run: it resumes and completes.
    roomy = tmp_path / "roomy"
    subprocess.run(["cp", "-a", str(out), str(roomy)], check=True)
    r = _prepare(corpus, tok_dir, roomy)
    assert r.returncode == 0, r.stderr
    store = TokenStore.open(roomy)
    assert store.verify() == []
    fresh = tmp_path / "fresh"
    assert _prepare(corpus, tok_dir, fresh).returncode == 0
    assert [c.checksum for c in store.meta.chunks] == [
        c.checksum for c in TokenStore.open(fresh).meta.chunks
    ]


def test_read_only_output_is_a_clear_error(small_disk: Path, corpus: Path, tok_dir: Path) -> None:
    subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], check=True)
    r = _prepare(corpus, tok_dir, small_disk / "store")
    assert r.returncode == 2, r.stderr
    assert "Read-only file system" in r.stderr
    assert "Traceback" not in r.stderr
    assert not any(small_disk.iterdir())
