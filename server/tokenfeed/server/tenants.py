"""Jobs and what each may read: the tokens file, parsed and checked, and its grants.

A feeder shared by several jobs reads a tokens file (`--tokens-file`, YAML or JSON):

    jobs:
      pretrain:
        token_sha256: 9f86d0...       # hex SHA-256 of the job's bearer token
        datasets: ["web/*", "code"]   # names or globs under the data root
        weight: 2                     # share of the sending capacity (default 1)
        max_streams: 64               # optional

The file holds digests only, so reading it reveals no token; a call's token is hashed
and looked up. A grant is a list of patterns over dataset names (paths relative to the
data root): `*` matches within one path segment, `**` any number of whole segments,
`?` and `[...]` as in fnmatch. A pattern is checked like a dataset name (relative, no
`.` or `..` segment, no backslash), so no pattern reaches outside the root; which real
store a name means (symlinks) is the catalog's business, and the servicer asks the
grant about that real name.

`--auth-token-file` (one token, every dataset) is the one-job file `single_job`
builds. Pure: no gRPC; the only I/O is reading the file (`load_tokens_file`). Who
may read what: docs/tenants.md.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from tokenfeed.core.errors import InvalidArgument

ANONYMOUS = "anonymous"  # the job of every call when the feeder checks no token
SINGLE_JOB = "default"  # the job of `--auth-token-file`'s token
MAX_WEIGHT = 1_000_000
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KEYS = {"token_sha256", "datasets", "weight", "max_streams"}


def token_digest(token: str) -> str:
    """The hex SHA-256 of a bearer token, as the tokens file stores it."""
    return hashlib.sha256(token.encode()).hexdigest()


def check_pattern(pattern: str) -> tuple[str, ...]:
    """A grant pattern's segments; InvalidArgument if it could name something that is
    not a plain dataset name under the root."""
    if not isinstance(pattern, str) or not pattern:
        raise InvalidArgument(f"a grant must be a non-empty string, got {pattern!r}")
    if pattern.startswith("/") or "\\" in pattern or any(ord(c) < 32 for c in pattern):
        raise InvalidArgument(
            f"grant {pattern!r}: patterns are dataset names relative to the data root "
            "(no leading '/', no backslashes or control characters)"
        )
    parts = tuple(pattern.split("/"))
    for p in parts:
        if p in ("", ".", ".."):
            raise InvalidArgument(f"grant {pattern!r}: empty, '.' or '..' segment")
        if "**" in p and p != "**":
            raise InvalidArgument(f"grant {pattern!r}: '**' must be a whole segment")
    return parts


def _match(pattern: tuple[str, ...], name: tuple[str, ...]) -> bool:
    """Segment-wise glob match; `**` takes zero or more whole segments."""
    if not pattern:
        return not name
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, name[i:]) for i in range(len(name) + 1))
    return bool(name) and fnmatchcase(name[0], head) and _match(rest, name[1:])


@dataclass(frozen=True)
class Job:
    """One job of the tokens file: its name, token digest, grant and share."""

    name: str
    token_sha256: str
    datasets: tuple[str, ...]
    weight: float = 1.0
    max_streams: int | None = None
    patterns: tuple[tuple[str, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "patterns", tuple(check_pattern(p) for p in self.datasets))

    def allows(self, name: str) -> bool:
        """Whether the grant covers the dataset name `name` (a real name: see the catalog)."""
        parts = tuple(name.split("/"))
        return any(_match(p, parts) for p in self.patterns)


@dataclass(frozen=True)
class Tenants:
    """The jobs of a tokens file, by token digest."""

    jobs: tuple[Job, ...]
    by_digest: dict[str, Job] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_digest", {j.token_sha256: j for j in self.jobs})

    def job_for(self, token: str | None) -> Job | None:
        """The job whose token this is, or None (no token, or an unknown one)."""
        if not token:
            return None
        return self.by_digest.get(token_digest(token))

    def by_name(self) -> dict[str, Job]:
        return {j.name: j for j in self.jobs}


def open_job() -> Job:
    """The one job of a feeder that checks no token: every dataset."""
    return Job(ANONYMOUS, "", ("**",))


def single_job(token: str) -> Tenants:
    """`--auth-token-file`: one job, SINGLE_JOB, reading every dataset."""
    return Tenants((Job(SINGLE_JOB, token_digest(token), ("**",)),))


def parse_tenants(doc: Any, where: str = "tokens file") -> Tenants:
    """Tenants from a parsed tokens file; InvalidArgument naming the entry at fault."""
    if not isinstance(doc, Mapping) or set(doc) != {"jobs"}:
        raise InvalidArgument(f"{where}: must be a mapping with one key, 'jobs'")
    jobs = doc["jobs"]
    if not isinstance(jobs, Mapping) or not jobs:
        raise InvalidArgument(f"{where}: 'jobs' must map job names to their entries")
    out = []
    seen: dict[str, str] = {}
    for name, entry in jobs.items():
        at = f"{where}: job {name!r}"
        if not isinstance(name, str) or not _JOB_NAME.fullmatch(name):
            raise InvalidArgument(
                f"{at}: a job name is 1-64 letters, digits, '.', '_' or '-', starting with "
                "a letter or digit"
            )
        if not isinstance(entry, Mapping):
            raise InvalidArgument(f"{at}: must be a mapping (token_sha256, datasets, ...)")
        unknown = sorted(set(map(str, entry)) - _KEYS)
        if unknown:
            raise InvalidArgument(f"{at}: unknown keys {unknown}; known: {sorted(_KEYS)}")
        digest = entry.get("token_sha256")
        if not isinstance(digest, str) or not _DIGEST.fullmatch(digest.lower()):
            raise InvalidArgument(
                f"{at}: token_sha256 must be 64 hex digits, the SHA-256 of the token "
                "(never the token itself)"
            )
        digest = digest.lower()
        if digest in seen:
            raise InvalidArgument(f"{at}: the same token_sha256 as job {seen[digest]!r}")
        seen[digest] = name
        datasets = entry.get("datasets")
        if isinstance(datasets, str):
            datasets = [datasets]
        if not isinstance(datasets, list) or not datasets:
            raise InvalidArgument(f"{at}: datasets must be a non-empty list of names or globs")
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)):
            raise InvalidArgument(f"{at}: weight must be a number, got {weight!r}")
        if not 0 < weight <= MAX_WEIGHT:
            raise InvalidArgument(f"{at}: weight must be in (0, {MAX_WEIGHT}], got {weight}")
        max_streams = entry.get("max_streams")
        if max_streams is not None and (
            isinstance(max_streams, bool) or not isinstance(max_streams, int) or max_streams < 1
        ):
            raise InvalidArgument(f"{at}: max_streams must be a positive integer")
        try:
            out.append(Job(name, digest, tuple(datasets), float(weight), max_streams))
        except InvalidArgument as e:
            raise InvalidArgument(f"{at}: {e.message}") from None
    return Tenants(tuple(out))


def load_tokens_file(path: Path) -> Tenants:
    """Read and check a tokens file: JSON when it parses as JSON, else YAML."""
    where = f"--tokens-file {path}"
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidArgument(f"{where}: cannot read it: {reason}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError:
        doc = _yaml(text, where)
    return parse_tenants(doc, where)


def _yaml(text: str, where: str) -> Any:
    try:
        import yaml
    except ImportError:
        raise InvalidArgument(
            f"{where}: not JSON, and YAML needs PyYAML (pip install 'tokenfeed[server]')"
        ) from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        # the position only: a YAML error's context could quote a line of the file
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise InvalidArgument(f"{where}: not valid YAML or JSON{at}") from None


def visible(job: Job, names: Iterable[str]) -> list[str]:
    """The names of `names` the job may read."""
    return [n for n in names if job.allows(n)]
