"""descriptors.open_files and close_files: the C loops against their references."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tokenfeed.core import native
from tokenfeed.server import descriptors


@pytest.fixture(params=["C", "Python"])
def way(request: pytest.FixtureRequest) -> Iterator[str]:
    if request.param == "C" and descriptors._open_files_c is None:
        pytest.fail("the extension is not built: `make install` builds it")
    with native.disabled() if request.param == "Python" else contextlib.nullcontext():
        yield request.param


def test_each_path_is_opened_and_stated_or_says_why(tmp_path: Path, way: str) -> None:
    """Every path is tried: a failure is its -errno, with nothing of it left open, and the
    paths after it are opened all the same."""
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "b").write_bytes(b"")
    paths = [
        str(tmp_path / "a"),
        str(tmp_path / "missing"),
        str(tmp_path / "b"),
        str(tmp_path / "no" / "such" / "dir"),
        str(tmp_path / ("x" * 300)),
        str(tmp_path),  # a directory opens read-only: its size tells the caller
    ]
    before = set(os.listdir("/proc/self/fd"))
    got = descriptors.open_files(paths, advise_random=True)
    a, b, d = (os.stat(p) for p in (paths[0], paths[2], paths[5]))
    assert [row[1:] for row in got] == [
        (a.st_dev, a.st_ino, 10),
        (0, 0, 0),
        (b.st_dev, b.st_ino, 0),
        (0, 0, 0),
        (0, 0, 0),
        (d.st_dev, d.st_ino, d.st_size),
    ]
    fds = [row[0] for row in got]
    assert [-fd for fd in fds if fd < 0] == [errno.ENOENT, errno.ENOENT, errno.ENAMETOOLONG]
    opened = [fd for fd in fds if fd >= 0]
    assert os.pread(opened[0], 3, 7) == b"xxx"
    assert all(os.get_inheritable(fd) is False for fd in opened)  # close-on-exec
    descriptors.close_files(opened)
    assert set(os.listdir("/proc/self/fd")) == before
    for fd in opened:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)


def test_close_files_closes_every_one_and_reports_the_first_failure(
    tmp_path: Path, way: str
) -> None:
    (tmp_path / "a").write_bytes(b"x")
    fds = [row[0] for row in descriptors.open_files([str(tmp_path / "a")] * 2)]
    bad = os.open(tmp_path / "a", os.O_RDONLY)
    os.close(bad)  # a number no file has now
    with pytest.raises(OSError, match="Bad file descriptor") as e:
        descriptors.close_files([fds[0], bad, fds[1]])
    assert e.value.errno == errno.EBADF
    for fd in fds:
        with pytest.raises(OSError, match="Bad file descriptor"):
            os.fstat(fd)
    descriptors.close_files([])
    assert descriptors.open_files([]) == []


def test_a_path_with_a_nul_is_a_value_error(way: str) -> None:
    with pytest.raises(ValueError, match="null"):
        descriptors.open_files(["a\0b"])


def test_close_files_takes_what_os_close_takes(way: str) -> None:
    with pytest.raises(OSError, match="Bad file descriptor"):
        descriptors.close_files([-5])
    with pytest.raises(OverflowError):
        descriptors.close_files([2**40])
