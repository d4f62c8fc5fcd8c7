"""`tokenfeed verify`: read every chunk of a store and check it.

Checks each chunk's size, its checksum (when meta.json has one: Streaming-Dataloader
and bare stores have none) and its token ids against the vocabulary size. Exit codes:
0 healthy, 1 problems found (each printed, naming the chunk), 2 the store cannot be
read at all (no such directory, unreadable meta.json).
"""

from __future__ import annotations

import argparse
import sys

from tokenfeed.cli.info import add_path_arguments, open_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_path_arguments(parser)


def run(args: argparse.Namespace) -> int:
    store = open_store(args, check_sizes=False)
    problems = store.verify()
    for problem in problems:
        print(problem, file=sys.stderr)
    checked = (
        "sizes and checksums"
        if all(c.checksum for c in store.meta.chunks)
        else "sizes (this store has no checksums)"
    )
    if problems:
        print(f"{store.path}: {len(problems)} problem(s) in {store.num_chunks} chunks")
        return 1
    print(
        f"{store.path}: OK, {store.num_chunks} chunks, {store.total_tokens} tokens "
        f"({checked} checked)"
    )
    return 0
