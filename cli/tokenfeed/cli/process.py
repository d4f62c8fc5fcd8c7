"""Running `tokenfeed serve` as a child process: wait until it serves, stop it.

Used by the programs (demo), the benchmarks and the tests.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def serve_argv(data_root: Path, port_file: Path, port: int = 0, **flags: object) -> list[str]:
    """The command line of `tokenfeed serve` on 127.0.0.1 writing its port to `port_file`;
    `flags` are more flags by name (cache_bytes="1M" -> --cache-bytes 1M)."""
    argv = [sys.executable, "-m", "tokenfeed", "serve", "--data-root", str(data_root)]
    argv += ["--host", "127.0.0.1", "--port", str(port), "--port-file", str(port_file)]
    for key, value in flags.items():
        argv += ["--" + key.replace("_", "-"), str(value)]
    return argv


def wait_for_port(proc: subprocess.Popen[Any], port_file: Path, timeout: float = 60.0) -> int:
    """The port a `tokenfeed serve --port 0 --port-file F` subprocess bound, once it
    serves (the file is written atomically then). RuntimeError if the process exits or
    `timeout` seconds pass first."""
    deadline = time.monotonic() + timeout
    while not port_file.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"the feeder exited with code {proc.returncode} before serving")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the feeder was not serving after {timeout:g} s")
        time.sleep(0.05)
    return int(port_file.read_text())


def stop(
    proc: subprocess.Popen[Any], sig: int, timeout: float = 15.0, patience: float = 0.0
) -> None:
    """Give `proc` `patience` seconds to exit on its own, then `sig`, then SIGKILL."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(patience)
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()
