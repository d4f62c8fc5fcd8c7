"""`tokenfeed prepare merge OUTPUT`: join the part stores of a sharded prepare.

The parts are OUTPUT/part-00000 ... OUTPUT/part-{N-1}, each a complete store written
by `tokenfeed prepare ... --num-shards N --shard-index i`. The merge refuses unless
every part 0..N-1 is there and complete and all agree on the command (same source,
tokenizer, dtype, EOS, chunk size; only the shard index differs). It then hard-links
(copies, where links are not possible) the parts' chunks, in part order, into OUTPUT
as one chunk sequence, writes OUTPUT/meta.json last, and only then removes the part
directories (`keep_parts` keeps them). Chunks are never rewritten, so their
checksums carry over; a merge interrupted before meta.json simply runs again.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Any

from tokenfeed.core.errors import FailedPrecondition, InvalidArgument, NotFound
from tokenfeed.core.store import (
    META_NAME,
    Chunk,
    StoreMeta,
    TokenStore,
    chunk_name,
    write_meta,
)
from tokenfeed.prepare import output as out

_AGREE = ("dtype", "eos_token_id", "vocab_size", "tokenizer", "tokens_per_chunk")


def _link(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def _open_parts(output: Path) -> list[TokenStore]:
    parts = sorted(p for p in output.iterdir() if p.is_dir() and out.PART_RE.match(p.name))
    if not parts:
        raise NotFound(f"{output} holds no part-NNNNN directories to merge")
    unfinished = [p.name for p in parts if not (p / META_NAME).is_file()]
    if unfinished:
        raise FailedPrecondition(
            f"part(s) {', '.join(unfinished)} in {output} are not finished (no meta.json); "
            "re-run their `tokenfeed prepare --shard-index` commands, then merge"
        )
    stores = [TokenStore.open(p) for p in parts]
    num_shards = {s.meta.source.get("num_shards") for s in stores}
    if len(num_shards) != 1 or None in num_shards:
        raise InvalidArgument(f"the parts in {output} disagree on --num-shards: {num_shards}")
    n = int(num_shards.pop() or 0)
    indices = [s.meta.source.get("shard_index") for s in stores]
    missing = [out.part_dir(output, i).name for i in range(n) if i not in indices]
    if missing:
        raise FailedPrecondition(
            f"{output} lacks part(s) {', '.join(missing)} of {n}; run `tokenfeed prepare "
            f"... --num-shards {n} --shard-index i` for each, then merge"
        )
    if len(stores) != n:
        raise InvalidArgument(f"{output} holds {len(stores)} part directories for {n} shards")
    return sorted(stores, key=lambda s: s.meta.source["shard_index"])


def _common_meta(stores: list[TokenStore], output: Path) -> dict[str, Any]:
    first = stores[0].meta
    base = {k: v for k, v in first.source.items() if k != "shard_index"}
    for s in stores[1:]:
        for attr in _AGREE:
            if getattr(s.meta, attr) != getattr(first, attr):
                raise InvalidArgument(
                    f"{s.path.name} and {stores[0].path.name} disagree on {attr}: "
                    f"{getattr(s.meta, attr)!r} vs {getattr(first, attr)!r}"
                )
        other = {k: v for k, v in s.meta.source.items() if k != "shard_index"}
        if out.normalize(other) != out.normalize(base):
            raise InvalidArgument(
                f"{s.path.name} was made by a different command than {stores[0].path.name}"
            )
    return base


def merge(output: str | os.PathLike[str], keep_parts: bool = False) -> StoreMeta:
    """Join OUTPUT/part-* into one store at OUTPUT; returns its meta."""
    output = Path(output)
    if not output.is_dir():
        raise NotFound(f"{output} is not a directory")
    if (output / META_NAME).is_file():
        meta = TokenStore.open(output).meta
        if meta.source.get("merged_parts"):
            if not keep_parts:
                for p in output.iterdir():
                    if p.is_dir() and out.PART_RE.match(p.name):
                        shutil.rmtree(p)
            return meta  # already merged: nothing to do
        raise InvalidArgument(f"{output} already holds a store that is not a merge of parts")
    stores = _open_parts(output)
    base = _common_meta(stores, output)
    chunks: list[Chunk] = []
    for s in stores:
        for i, c in enumerate(s.meta.chunks):
            name = chunk_name(len(chunks))
            _link(s.chunk_path(i), output / name)
            chunks.append(Chunk(name, c.tokens, c.checksum))
    first = stores[0].meta
    meta = StoreMeta(
        dtype=first.dtype,
        chunks=tuple(chunks),
        eos_token_id=first.eos_token_id,
        vocab_size=first.vocab_size,
        tokenizer=first.tokenizer,
        tokens_per_chunk=first.tokens_per_chunk,
        source=base
        | {"merged_parts": len(stores), "part_tokens": [s.total_tokens for s in stores]},
        created_at_unix=time.time(),
        stats=_summed_stats([s.meta.stats for s in stores]),
    )
    write_meta(output, meta)
    if not keep_parts:
        for s in stores:
            shutil.rmtree(s.path)
    return meta


def _summed_stats(parts: list[dict[str, Any]]) -> dict[str, Any]:
    """The parts' counts added up (only the counts every part has)."""
    keys = set.intersection(*(set(p) for p in parts)) if parts else set()
    return {k: sum(int(p[k]) for p in parts) for k in sorted(keys)}
