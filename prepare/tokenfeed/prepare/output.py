"""The output directory of `prepare`, `import` and `merge`: claim, resume, clean up.

A run owns its output directory through a progress file, `.prepare-progress.json`:
the `meta.json` the store would have if it ended now (the chunks completed so far,
with checksums, and `source`, which identifies the command) plus a `progress`
object (how far into the source those chunks reach). It is rewritten atomically after
every completed chunk; `meta.json` is written only when the store is complete, and
the progress file is removed after it. So:

* empty or missing directory       -> a fresh run;
* `meta.json` from the same command -> already complete, nothing to do (exit 0);
* a progress file from the same command -> resume after its last completed chunk;
* anything else                    -> refuse (exit 2) and say what to do, unless
  `--overwrite`, which deletes the store files (chunks, meta.json, progress, part
  directories) and refuses to delete files tokenfeed did not write.

"The same command" means an identical `source` description: corpus, text field,
tokenizer (name and a hash of its contents), tokens per chunk, max samples, shard.
`--num-proc` and `--batch-size` change speed, not the result, so they are not in it.

The output is a local directory or an `s3://bucket/prefix` (tokenfeed.core.store.files):
the same rules hold under a prefix, with "directory" meaning the objects below it;
every object is one PUT, so no temporary names are left behind there.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfeed.core.errors import DataLoss, InvalidArgument
from tokenfeed.core.store import META_NAME, LocalFiles, StoreFiles, StoreMeta, open_files

PROGRESS_NAME = ".prepare-progress.json"
PART_RE = re.compile(r"^part-\d{5}$")
_CHUNK_RE = re.compile(r"^chunk_\d{6}\.bin(\.tmp)?$")
_OWN_FILES = {META_NAME, META_NAME + ".tmp", PROGRESS_NAME, PROGRESS_NAME + ".tmp"}


Output = Path | StoreFiles  # a local directory, or any store location


def as_files(output: Output | str) -> StoreFiles:
    return output if isinstance(output, StoreFiles) else open_files(output)


def part_dir(output: Path, index: int) -> Path:
    """Where shard `index` of a `--num-shards` run writes its part store."""
    return output / f"part-{index:05d}"


def part_name(index: int) -> str:
    return f"part-{index:05d}"


def normalize(doc: Any) -> Any:
    """JSON round trip, so tuples and lists (and int/float keys) compare equal."""
    return json.loads(json.dumps(doc, sort_keys=True))


def _is_ours(p: Path) -> bool:
    if p.is_dir() and not p.is_symlink():
        return bool(PART_RE.match(p.name)) and all(_is_ours(q) for q in p.iterdir())
    return p.name in _OWN_FILES or bool(_CHUNK_RE.match(p.name))


def _is_our_key(key: str) -> bool:
    head, _, rest = key.partition("/")
    if rest:
        return bool(PART_RE.match(head)) and "/" not in rest and _is_our_key(rest)
    return key in _OWN_FILES or bool(_CHUNK_RE.match(key))


def clean_output(output: Output) -> None:
    """Delete the store files in `output`; refuse if it holds files tokenfeed did not write."""
    files = as_files(output)
    if not isinstance(files, LocalFiles):
        keys = files.names()
        foreign = sorted(k for k in keys if not _is_our_key(k))
        if foreign:
            shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
            raise InvalidArgument(
                f"{files.location} holds objects that are not part of a token store ({shown}); "
                "refusing to delete them: choose an empty or new --output prefix"
            )
        files.delete(META_NAME)  # first: the prefix stops looking complete
        for key in sorted(keys):
            files.delete(key)
        return
    path = files.path
    if not path.is_dir():
        return
    foreign = sorted(p.name for p in path.iterdir() if not _is_ours(p))
    if foreign:
        shown = ", ".join(foreign[:5]) + (", ..." if len(foreign) > 5 else "")
        raise InvalidArgument(
            f"{path} holds files that are not part of a token store ({shown}); refusing to "
            "delete them: choose an empty or new --output directory"
        )
    # meta.json first: the directory stops looking complete before anything else goes.
    (path / META_NAME).unlink(missing_ok=True)
    for p in path.iterdir():
        if p.is_dir():
            shutil.rmtree(p)
        else:
            p.unlink()


@dataclass
class Claim:
    """The state a run starts from."""

    files: StoreFiles
    created: bool  # the run made the directory (remove it again on a bad-input error)
    complete: StoreMeta | None = None  # same command already finished
    resume: StoreMeta | None = None  # same command interrupted: chunks done so far
    progress: dict[str, Any] | None = None


def _read_json(files: StoreFiles, name: str) -> Any:
    try:
        raw = files.read_small(name)
        return json.loads(raw or b"")
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataLoss(
            f"{files.where(name)}: unreadable ({e}); pass --overwrite to start over"
        ) from None


def _differences(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(keys) or "nothing"


def claim_output(output: Output, source: dict[str, Any], overwrite: bool, what: str) -> Claim:
    """Decide how a run with this `source` starts in `output` (see the module docstring)."""
    source = normalize(source)
    files = as_files(output)
    path = files.location
    created = False
    if isinstance(files, LocalFiles):
        if files.path.exists() and not files.path.is_dir():
            raise InvalidArgument(f"--output {path} exists and is not a directory")
        created = not files.path.exists()
        files.path.mkdir(parents=True, exist_ok=True)
    if overwrite:
        clean_output(files)
        return Claim(files, created)
    if not files.names():
        return Claim(files, created)
    again = "re-run with --overwrite to replace it, or choose another --output"
    if files.exists(META_NAME):
        meta = StoreMeta.from_json(_read_json(files, META_NAME), path)
        if normalize(meta.source) == source:
            files.delete(PROGRESS_NAME)  # a crash between meta.json and cleanup
            return Claim(files, False, complete=meta)
        raise InvalidArgument(
            f"{path} already holds a complete token store made by a different command "
            f"(it differs in: {_differences(normalize(meta.source), source)}); {again}"
        )
    if files.exists(PROGRESS_NAME):
        doc = _read_json(files, PROGRESS_NAME)
        meta = StoreMeta.from_json(doc, files.where(PROGRESS_NAME))
        if normalize(meta.source) == source:
            return Claim(files, False, resume=meta, progress=dict(doc.get("progress") or {}))
        raise InvalidArgument(
            f"{path} holds an unfinished {what} of a different command (it differs in: "
            f"{_differences(normalize(meta.source), source)}); re-run that command to resume "
            f"it, or {again}"
        )
    raise InvalidArgument(f"--output {path} is not empty and holds no tokenfeed run; {again}")


def write_progress(output: Output, meta: StoreMeta, progress: dict[str, Any]) -> None:
    """Record the completed chunks and how far into the source they reach (atomic)."""
    doc = meta.to_json() | {"progress": progress}
    as_files(output).write(PROGRESS_NAME, json.dumps(doc, indent=2).encode() + b"\n")


def finish_progress(output: Output) -> None:
    """The store is complete (meta.json written): the progress file goes."""
    as_files(output).delete(PROGRESS_NAME)


def drop_unrecorded_chunks(output: Output, meta: StoreMeta) -> None:
    """Remove chunk files a crash left behind that the progress file does not list."""
    files = as_files(output)
    keep = {c.file for c in meta.chunks}
    for name in files.names():
        if "/" not in name and _CHUNK_RE.match(name) and name not in keep:
            files.delete(name)


def abandon(claim: Claim) -> None:
    """After a bad-input error: leave nothing half-written (and no directory we made)."""
    clean_output(claim.files)
    if claim.created and isinstance(claim.files, LocalFiles):
        with contextlib.suppress(OSError):
            claim.files.path.rmdir()
