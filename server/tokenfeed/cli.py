"""The `tokenfeed` command: one entry point, one module per group of subcommands.

Each subcommand module only declares its arguments at import time and imports what it
needs (grpc, torch, transformers, datasets) inside its `run` function, so
`tokenfeed --help` and `tokenfeed verify` stay fast and need no optional extras.

Exit codes: 0 success, 1 a finding (`verify` found a bad chunk), 2 a bad input or an
environment that refuses (disk full, read-only output): a clear message on stderr,
nothing half-written left behind. 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> module with `add_arguments(parser)` and `run(args) -> int`
COMMANDS = {
    "prepare": ("tokenfeed.prepare.cli", "tokenize a corpus into a token store"),
    "import": ("tokenfeed.prepare.importers", "turn nanoGPT / llm.c token files into a store"),
    "serve": ("tokenfeed.server.cli", "run the feeder gRPC server"),
    "info": ("tokenfeed.server.inspect", "describe a token store"),
    "verify": ("tokenfeed.server.inspect", "check a token store's sizes and checksums"),
    "demo": ("tokenfeed.client.demo", "feeder + two demo trainer ranks on the demo corpus"),
    "bench": ("tokenfeed.client.bench", "measure tokens/s from a running feeder"),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; only `command`'s module is imported to declare its arguments, so a
    broken optional extra breaks its own subcommand, never the others or --help."""
    parser = argparse.ArgumentParser(prog="tokenfeed", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_module=module, _name=name)
        if name == command:
            mod = importlib.import_module(module)
            getattr(mod, f"add_{name}_arguments", getattr(mod, "add_arguments", None))(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from tokenfeed.server.errors import FeederError

    argv = list(sys.argv[1:] if argv is None else argv)
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command).parse_args(argv)
    mod = importlib.import_module(args._module)
    run = getattr(mod, f"run_{args._name}", getattr(mod, "run", None))
    try:
        return int(run(args) or 0)
    except FeederError as e:
        print(f"tokenfeed {args._name}: error: {e.message}", file=sys.stderr)
        return 2
    except OSError as e:  # disk full, read-only or missing output: the machine, not a bug
        where = f" ({e.filename})" if e.filename else ""
        print(f"tokenfeed {args._name}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"tokenfeed {args._name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
