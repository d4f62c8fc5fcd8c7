"""Who is streaming: the feeder's open streams, their progress, and the audit trail.

Every StreamBatches call gets a `StreamEntry` once its job is known: the job, the
peer, what it reads (a dataset, or a mixture's sources), its rank and world size, and
as it sends, its epoch, step, tokens and when its last message left. `OpenStreams`
holds the entries of the calls in progress (the status page's rows, each job's stream
count for `max_streams`), and writes one audit record per stream opened, closed or
refused on the `tokenfeed.server.streams` logger: a line in the text log, an object
with these fields in the JSON log (logs.py):

    {"event": "stream_open" | "stream_close" | "stream_refused", "job", "peer",
     "dataset" (or "mixture": [names]), "rank", "world_size",
     "outcome": "ok" | "cancelled" | a status name, "batches", "tokens"}

(open: no outcome, batches or tokens). A refused call whose token matched no job has
job null: the token itself is never written anywhere. Pure: no gRPC.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

from tokenfeed.core.errors import FeederError, ResourceExhausted
from tokenfeed.server.tenants import Job

audit = logging.getLogger("tokenfeed.server.streams")

RATE_SECONDS = 1.0  # tokens/s is measured over the last one to two of these
SHOWN_CHARS = 200  # of a requested name: a refused request's name may be anything
SHOWN_SOURCES = 64


def _shown(name: str) -> str:
    return name if len(name) <= SHOWN_CHARS else name[:SHOWN_CHARS] + "..."


class StreamEntry:
    """One StreamBatches call: whose, what, and how far it got."""

    def __init__(
        self,
        job: Job | None,
        peer: str,
        dataset: str = "",
        mixture: tuple[str, ...] = (),
        rank: int = 0,
        world_size: int = 0,
        epoch: int = 0,
        step: int = 0,
    ) -> None:
        self.job = job
        self.peer = peer
        self.dataset = dataset
        self.mixture = mixture
        self.rank, self.world_size = rank, world_size
        self.epoch, self.step = epoch, step  # step: the next one the stream sends
        self.real: tuple[str, ...] = ()  # the stores it reads, as the grant judged them
        self.batches = 0
        self.tokens = 0
        self.opened = False
        self.outcome = "cancelled"  # until the stream ends otherwise
        self.revoked: FeederError | None = None  # set by a reload that takes the grant away
        self.task: asyncio.Task[Any] | None = None
        now = time.monotonic()
        self.last = now  # when the last message left (or the call came)
        self._marks = [(now, 0), (now, 0)]  # (time, tokens): the older and the newer mark

    @classmethod
    def of(cls, request: Any, peer: str | None) -> StreamEntry:
        """A StreamBatchesRequest's call as recorded before anything is checked (None: a
        request that did not decode); its job is set once known."""
        entry = cls(None, peer or "")
        if request is not None:
            p = request.params
            entry.dataset = _shown(p.dataset)
            entry.mixture = tuple(_shown(s.name) for s in p.sources[:SHOWN_SOURCES])
            entry.rank, entry.world_size = request.rank, p.world_size or 1
            entry.epoch, entry.step = request.epoch, request.step
        return entry

    def sent(self, batches: int, tokens: int) -> None:
        """A burst of `batches` batches and `tokens` tokens was written."""
        self.batches += batches
        self.tokens += tokens
        self.step += batches
        now = self.last = time.monotonic()
        if now - self._marks[1][0] >= RATE_SECONDS:
            self._marks = [self._marks[1], (now, self.tokens)]

    def tokens_per_s(self, now: float) -> float:
        t, n = self._marks[0]
        return (self.tokens - n) / (now - t) if now > t else 0.0

    def revoke(self, error: FeederError) -> None:
        """End the stream with `error` (its token or grant was withdrawn by a reload)."""
        if self.revoked is None:
            self.revoked = error
            if self.task is not None and not self.task.done():
                self.task.cancel()  # wakes it wherever it waits: a write, a turn, a build

    def what(self) -> dict[str, Any]:
        return {"mixture": list(self.mixture)} if self.mixture else {"dataset": self.dataset}

    def row(self, now: float) -> dict[str, Any]:
        """The stream as a row of the status page."""
        return {
            "job": self.job.name if self.job is not None else None,
            "peer": self.peer,
            **self.what(),
            "rank": self.rank,
            "world_size": self.world_size,
            "epoch": self.epoch,
            "step": self.step,
            "tokens_per_s": round(self.tokens_per_s(now), 1),
            "idle_s": round(max(0.0, now - self.last), 3),
        }

    def record(self, event: str, outcome: str | None = None) -> dict[str, Any]:
        rec: dict[str, Any] = {
            "event": event,
            "job": self.job.name if self.job is not None else None,
            "peer": self.peer,
            **self.what(),
            "rank": self.rank,
            "world_size": self.world_size,
        }
        if event != "stream_open":
            rec |= {"outcome": outcome, "batches": self.batches, "tokens": self.tokens}
        return rec


class _Text:
    """The record as `key=value` pairs, strings quoted (a name cannot break the line);
    formatted only by a handler that shows the message (the JSON log shows the fields)."""

    __slots__ = ("rec",)

    def __init__(self, rec: dict[str, Any]) -> None:
        self.rec = rec

    def __str__(self) -> str:
        return " ".join(f"{k}={v!r}" for k, v in self.rec.items() if k != "event")


class OpenStreams:
    """The streams in progress, each job's count, and their audit records."""

    def __init__(self) -> None:
        self.entries: dict[int, StreamEntry] = {}
        self.per_job: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, entry: StreamEntry) -> None:
        """Count a call admitted for its job (its request not checked yet)."""
        self.entries[id(entry)] = entry
        if entry.job is not None:
            self.per_job[entry.job.name] += 1

    def check_limit(self, entry: StreamEntry) -> None:
        """ResourceExhausted if the entry's job already has its max_streams open."""
        job = entry.job
        limit = job.max_streams if job is not None else None
        if job is not None and limit is not None and self.per_job[job.name] >= limit:
            raise ResourceExhausted(
                f"job {job.name!r} already has {limit} streams open, its max_streams in "
                "the feeder's tokens file; end one or raise the limit"
            )

    def opened(self, entry: StreamEntry) -> None:
        """The request was good: the stream starts sending."""
        entry.opened = True
        self._log(entry.record("stream_open"))

    def remove(self, entry: StreamEntry) -> None:
        """The call ended (admitted or not): write its close, or its refusal if it never
        opened."""
        if self.entries.pop(id(entry), None) is not None and entry.job is not None:
            self._uncount(entry.job.name)
        event = "stream_close" if entry.opened else "stream_refused"
        self._log(entry.record(event, entry.outcome))

    def _uncount(self, name: str) -> None:
        self.per_job[name] -= 1
        if not self.per_job[name]:
            del self.per_job[name]

    def rejob(self, entry: StreamEntry, job: Job) -> None:
        """A reload moved the stream's token to `job` (renamed, or its settings changed)."""
        old = entry.job
        if old is not None and old.name != job.name:
            self._uncount(old.name)
            self.per_job[job.name] += 1
        entry.job = job

    def rows(self, now: float | None = None) -> list[dict[str, Any]]:
        now = time.monotonic() if now is None else now
        entries = list(self.entries.values())  # one C-level copy: safe from another thread
        return [e.row(now) for e in entries]

    @staticmethod
    def _log(rec: dict[str, Any]) -> None:
        audit.info("%s %s", rec["event"], _Text(rec), extra={"audit": rec})
