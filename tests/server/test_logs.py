"""The feeder's log as a serving process configures it (logs.py), in a process of its
own: the configuration is the process's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# a stream opens and closes as the servicer records it; the records as a handler sees them
_PROGRAM = """
import logging, sys
from tokenfeed.server import logs
from tokenfeed.server.streams import OpenStreams, StreamEntry

seen = []
class Keep(logging.Handler):
    def emit(self, record):
        seen.append(record)

logs.configure("info", sys.argv[1], worker=int(sys.argv[2]) if len(sys.argv) > 2 else None)
logging.getLogger().addHandler(Keep())
streams = OpenStreams()
entry = StreamEntry(None, "ipv4:127.0.0.1:1", dataset="web", rank=3, world_size=8)
streams.add(entry)
streams.opened(entry)
entry.sent(2, 64)
entry.outcome = "ok"
streams.remove(entry)
for r in seen:
    print(r.lineno, r.process, r.threadName, r.processName)
"""


def _run(*args: str) -> tuple[list[str], list[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines(), done.stderr.splitlines()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_an_audit_record_gathers_nothing_the_log_does_not_show(fmt: str) -> None:
    """Two audit records per stream, thousands in an epoch start's second: a record
    does not walk the stack for its caller or ask for the pid and the thread's and
    process's names, which neither format shows."""
    records, _ = _run(fmt)
    assert records == ["0 None None None"] * 2


def test_the_audit_lines_as_text_and_as_json() -> None:
    _, text = _run("text")
    assert [line.split(": ", 1)[1] for line in text] == [
        "stream_open job=None peer='ipv4:127.0.0.1:1' dataset='web' rank=3 world_size=8",
        "stream_close job=None peer='ipv4:127.0.0.1:1' dataset='web' rank=3 world_size=8 "
        "outcome='ok' batches=2 tokens=64",
    ]
    assert all(" INFO tokenfeed.server.streams: " in line for line in text)
    _, lines = _run("json", "1")
    docs = [json.loads(line) for line in lines]
    assert [{k: d[k] for k in d if k != "time"} for d in docs] == [
        {
            "level": "INFO",
            "logger": "tokenfeed.server.streams",
            "worker": 1,
            "event": "stream_open",
            "job": None,
            "peer": "ipv4:127.0.0.1:1",
            "dataset": "web",
            "rank": 3,
            "world_size": 8,
        },
        {
            "level": "INFO",
            "logger": "tokenfeed.server.streams",
            "worker": 1,
            "event": "stream_close",
            "job": None,
            "peer": "ipv4:127.0.0.1:1",
            "dataset": "web",
            "rank": 3,
            "world_size": 8,
            "outcome": "ok",
            "batches": 2,
            "tokens": 64,
        },
    ]
