"""The `tokenfeed` command: one entry point, one module per subcommand.

Every subcommand is a module `tokenfeed.cli.<name>` with `add_arguments(parser)` and
`run(args) -> int`. A module declares its arguments at import time and imports what
it needs (grpc, torch, transformers, datasets) inside `run`, so `tokenfeed --help`
stays fast and a missing optional extra breaks only its own subcommand.

Exit codes: 0 success, 1 a finding (`verify` found a bad chunk), 2 a bad input or an
environment that refuses (disk full, read-only output, a missing extra): a clear
message on stderr, nothing half-written left behind. 130 interrupted.

These are programs: the libraries (core, server, client, prepare) never import them.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> help; its module is tokenfeed.cli.<MODULES.get(name, name)>
COMMANDS = {
    "prepare": "tokenize a corpus into a token store",
    "import": "turn nanoGPT / llm.c token files into a store",
    "serve": "run the feeder gRPC server",
    "info": "describe a token store and its windows for sampling parameters",
    "verify": "check a token store's sizes and checksums",
    "demo": "feeder + two demo trainer ranks on the demo corpus",
    "bench": "measure tokens/s from a running feeder",
    "plan": "the feeder cores and replicas a training job needs",
}
MODULES = {"import": "imports"}  # `import` is a Python keyword


def module_of(command: str) -> str:
    return f"tokenfeed.cli.{MODULES.get(command, command)}"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported to declare its arguments."""
    parser = argparse.ArgumentParser(prog="tokenfeed", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, help_ in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if name == command:
            importlib.import_module(module_of(name)).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tokenfeed.core.errors import FeederError

    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    name = args.command
    try:
        return int(importlib.import_module(module_of(name)).run(args) or 0)
    except FeederError as e:
        print(f"tokenfeed {name}: error: {e.message}", file=sys.stderr)
        return 2
    except ImportError as e:  # a missing optional extra: the message names the pip install
        print(f"tokenfeed {name}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, read-only or missing output: the machine, not a bug
        where = f" ({e.filename})" if e.filename else ""
        print(f"tokenfeed {name}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tokenfeed {name}: interrupted", file=sys.stderr)
        return 130
