"""The `fax-bridge` command line: each stage of the flow registers its own subcommand."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# Modules that provide `register(subparsers)`, adding one subcommand each whose parser
# sets `func` (called with the parsed namespace, returning an exit code).
_SUBCOMMAND_MODULES = (
    "fax_bridge.tff.cli",
    "fax_bridge.tff.forms_cli",
    "fax_bridge.parity_cli",
    "fax_bridge.fleet.run_cli",
    "fax_bridge.fleet.device",
    "fax_bridge.flower.cli",
)


def build_parser() -> argparse.ArgumentParser:
    """Returns the parser with every available subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="fax-bridge",
        description="Export FAX programs to TFF, run TFF computations on a simulated fleet.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script."""
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
