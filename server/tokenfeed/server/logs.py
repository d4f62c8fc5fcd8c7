"""The feeder's log: text lines, or one JSON object per line (`--log-format json`).

A JSON line has `time` (UTC, ISO 8601), `level`, `logger` and `message`, plus
`exception` with a traceback and `worker` under `--workers N`. A record that carries
audit fields (streams.py: one per stream opened, closed or refused) has them at the
top level of its object (`event`, `job`, `peer`, ...) instead of a message, so a log
pipeline reads them as fields.
"""

from __future__ import annotations

import datetime
import json
import logging
from typing import Any


class JsonFormatter(logging.Formatter):
    def __init__(self, worker: int | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        when = datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
        doc: dict[str, Any] = {
            "time": when.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
        }
        if self.worker is not None:
            doc["worker"] = self.worker
        fields = getattr(record, "audit", None)
        if isinstance(fields, dict):
            doc |= fields
        else:
            doc["message"] = record.getMessage()
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(level: str, fmt: str = "text", worker: int | None = None) -> None:
    """The root logger's one handler (stderr), as text or JSON lines."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter(worker))
    else:
        where = f" [worker {worker}]" if worker is not None else ""
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s %(name)s{where}: %(message)s")
        )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
    # what neither format shows is not gathered per record: the caller's file and line
    # (a walk up the stack), the thread's and the process's names and the pid (a system
    # call); two audit records per stream, thousands in an epoch start's second
    logging._srcfile = None  # the documented switch (logging HOWTO, "Optimization")
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
