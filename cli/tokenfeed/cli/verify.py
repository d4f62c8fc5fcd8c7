"""`tokenfeed verify`: read every chunk of a store and check it.

Any served format (see `tokenfeed info`). Native stores: each chunk's size, its
checksum (when meta.json has one: Streaming-Dataloader and bare stores have none) and
its token ids against the vocabulary size, locally or under s3://. Seed layout: every
chunk folder's Arrow files, ids fit the dtype. Megatron: the index's structure, then
every token fits the served dtype. Exit codes: 0 healthy, 1 problems found (each
printed, naming the chunk or file), 2 the store cannot be read at all (no such
directory, unreadable meta.json, object storage refusing or unreachable).
"""

from __future__ import annotations

import argparse
import sys

from tokenfeed.cli.info import add_path_arguments, open_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_path_arguments(parser)


def run(args: argparse.Namespace) -> int:
    store = open_store(args)
    problems = store.verify()
    for problem in problems:
        print(problem, file=sys.stderr)
    if store.format == "megatron":
        checked = "index structure and token ids"
    elif store.format == "seed":
        checked = "Arrow files and token ids"
    elif all(c.checksum for c in store.meta.chunks):
        checked = "sizes and checksums"
    else:
        checked = "sizes (this store has no checksums)"
    if problems:
        print(f"{store.location}: {len(problems)} problem(s) in {store.num_chunks} chunks")
        return 1
    print(
        f"{store.location}: OK, {store.num_chunks} chunks, {store.total_tokens} tokens "
        f"({checked} checked)"
    )
    return 0
