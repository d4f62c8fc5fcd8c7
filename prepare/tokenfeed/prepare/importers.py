"""`tokenfeed import`: existing token files -> a token store, without re-tokenizing.

Formats:

* `nanogpt`: nanoGPT's `train.bin` / `val.bin`, raw little-endian uint16 token ids
  with no header. Each input file becomes its own store, OUTPUT/<file stem>
  (`train.bin` -> OUTPUT/train, `val.bin` -> OUTPUT/val): nanoGPT keeps train and
  validation apart, and one store per file keeps them apart too (serve `.../train`
  with split_rate 1.0 and `.../val` with split_rate 0.0, or any split you like).
* `llmc`: llm.c shards, a header of 256 little-endian int32 (header[0] magic,
  header[1] version, header[2] token count) then the tokens: magic 20240520 ->
  uint16 (GPT-2), 20240801 -> uint32 (Llama 3). All shards are checked first, then
  concatenated in file-name order into ONE store at OUTPUT (llm.c splits train and
  val by file name, e.g. *_train_*.bin vs *_val_*.bin: import each set separately).

Neither format records the tokenizer, so `--tokenizer`, `--eos-token-id` and
`--vocab-size` may be given to record them in meta.json (`--vocab-size` also makes
every token id be checked against it). Every input is validated before anything is
written; a bad file (wrong magic, truncated, odd size) is an error naming it, and an
error after writing started removes what was written.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tokenfeed.core.errors import DataLoss, FeederError, InvalidArgument
from tokenfeed.core.store import DEFAULT_TOKENS_PER_CHUNK, StoreMeta, StoreWriter
from tokenfeed.prepare.sources import expand_globs

LLMC_HEADER_INTS = 256
LLMC_HEADER_BYTES = LLMC_HEADER_INTS * 4
LLMC_MAGIC = {20240520: "uint16", 20240801: "uint32"}
_COPY_TOKENS = 1 << 22  # tokens copied per read: bounded memory for any file size


@dataclass(frozen=True)
class TokenFile:
    """A validated input: `tokens` ids of `dtype` starting at byte `offset` of `path`."""

    path: Path
    dtype: str
    offset: int
    tokens: int


def nanogpt_file(path: Path) -> TokenFile:
    size = path.stat().st_size
    if size == 0:
        raise InvalidArgument(f"{path}: empty file, no tokens to import")
    if size % 2:
        raise DataLoss(
            f"{path}: {size} bytes is not a whole number of uint16 tokens; a nanoGPT .bin is "
            "raw uint16 (is it truncated, or an llm.c shard? try --format llmc)"
        )
    return TokenFile(path, "uint16", 0, size // 2)


def llmc_file(path: Path) -> TokenFile:
    size = path.stat().st_size
    with open(path, "rb") as f:
        raw = f.read(LLMC_HEADER_BYTES)
    if len(raw) < LLMC_HEADER_BYTES:
        raise DataLoss(
            f"{path}: {size} bytes, shorter than the llm.c header of "
            f"{LLMC_HEADER_BYTES} bytes (256 x int32)"
        )
    header = np.frombuffer(raw, dtype="<i4")
    magic = int(header[0])
    if magic not in LLMC_MAGIC:
        raise InvalidArgument(
            f"{path}: magic {magic} is not an llm.c token shard (expected 20240520 for uint16 "
            "or 20240801 for uint32); a headerless nanoGPT file? try --format nanogpt"
        )
    dtype = LLMC_MAGIC[magic]
    count = int(header[2])
    itemsize = np.dtype(dtype).itemsize
    expected = LLMC_HEADER_BYTES + count * itemsize
    if count < 0 or size != expected:
        raise DataLoss(
            f"{path}: header says {count} {dtype} tokens ({expected} bytes with the header) "
            f"but the file has {size} bytes ({'truncated' if size < expected else 'extra data'})"
        )
    return TokenFile(path, dtype, LLMC_HEADER_BYTES, count)


def write_tokens(
    files: list[TokenFile],
    output: Path,
    *,
    tokens_per_chunk: int,
    overwrite: bool,
    eos_token_id: int | None,
    vocab_size: int | None,
    tokenizer: str | None,
    source: dict[str, Any],
) -> StoreMeta:
    """Copy validated token files, in order, into one store at `output`."""
    from tokenfeed.prepare import output as out

    dtypes = {f.dtype for f in files}
    if len(dtypes) != 1:
        raise InvalidArgument(
            f"the inputs mix token dtypes {sorted(dtypes)}: "
            + ", ".join(f"{f.path.name}={f.dtype}" for f in files)
        )
    dtype = dtypes.pop()
    source = source | {"files": [[str(f.path.resolve()), f.path.stat().st_size] for f in files]}
    claim = out.claim_output(output, source, overwrite, "import")
    if claim.complete is not None:
        return claim.complete
    out.clean_output(output)  # an interrupted import starts over (it is a plain copy)
    writer = StoreWriter(
        output,
        dtype=dtype,
        tokens_per_chunk=tokens_per_chunk,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
        source=source,
    )
    out.write_progress(output, writer.meta(), {"kind": "import"})
    try:
        for f in files:
            if f.tokens == 0:
                continue
            data = np.memmap(
                f.path,
                dtype=np.dtype(dtype).newbyteorder("<"),
                mode="r",
                offset=f.offset,
                shape=(f.tokens,),
            )
            for start in range(0, f.tokens, _COPY_TOKENS):
                writer.add(np.asarray(data[start : start + _COPY_TOKENS]))
            del data
        meta = writer.finish()
    except FeederError:
        out.abandon(claim)
        raise
    out.finish_progress(output)
    return meta


def import_files(
    fmt: str,
    paths: list[str],
    output: str | os.PathLike[str],
    *,
    tokens_per_chunk: int = DEFAULT_TOKENS_PER_CHUNK,
    overwrite: bool = False,
    eos_token_id: int | None = None,
    vocab_size: int | None = None,
    tokenizer: str | None = None,
) -> dict[Path, StoreMeta]:
    """Import token files; returns {store path: meta} (see the module docstring)."""
    if tokens_per_chunk < 1:
        raise InvalidArgument("--tokens-per-chunk must be >= 1")
    files = expand_globs(paths, suffixes=None)
    output = Path(output)
    common: dict[str, Any] = dict(
        tokens_per_chunk=tokens_per_chunk,
        overwrite=overwrite,
        eos_token_id=eos_token_id,
        vocab_size=vocab_size,
        tokenizer=tokenizer,
    )
    if fmt == "nanogpt":
        inputs = [nanogpt_file(p) for p in files]  # validate all before writing any
        stems = [f.path.stem for f in inputs]
        if len(set(stems)) != len(stems):
            raise InvalidArgument(
                f"two inputs share a file name {stems}: each becomes "
                "OUTPUT/<stem>, import them into different --output dirs"
            )
        return {
            output / f.path.stem: write_tokens(
                [f], output / f.path.stem, source={"kind": "import", "format": fmt}, **common
            )
            for f in inputs
        }
    if fmt == "llmc":
        inputs = sorted((llmc_file(p) for p in files), key=lambda f: (f.path.name, str(f.path)))
        return {
            output: write_tokens(inputs, output, source={"kind": "import", "format": fmt}, **common)
        }
    raise InvalidArgument(f"unknown import format {fmt!r}; expected nanogpt or llmc")
