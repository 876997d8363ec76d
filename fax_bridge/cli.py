"""The `fax-bridge` command line: each stage of the flow registers its own subcommand.

Ctrl-C (SIGINT) stops any subcommand with one line on stderr and exit code 130; what
the command started (device processes) is stopped first, and a second Ctrl-C during
that cleanup is ignored so it cannot leave processes behind.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from typing import Optional, Sequence

# Modules that provide `register(subparsers)`, adding one subcommand each whose parser
# sets `func` (called with the parsed namespace, returning an exit code).
_SUBCOMMAND_MODULES = (
    "fax_bridge.tff.cli",
    "fax_bridge.tff.forms_cli",
    "fax_bridge.parity_cli",
    "fax_bridge.fleet.run_cli",
    "fax_bridge.fleet.device_cli",
    "fax_bridge.flower.cli",
    "fax_bridge.litert.cli",
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


INTERRUPTED = 130  # the shell's code for a command ended by SIGINT (128 + 2)


def _interrupt(signum, frame) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # let the cleanup the first one starts end
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script."""
    previous = signal.getsignal(signal.SIGINT)
    # only where Ctrl-C would stop it anyway (not in a thread, nor where it is ignored)
    in_main_thread = threading.current_thread() is threading.main_thread() and \
        previous is not signal.SIG_IGN
    command = "fax-bridge"
    try:
        if in_main_thread:
            signal.signal(signal.SIGINT, _interrupt)
        args = build_parser().parse_args(argv)
        command = f"fax-bridge {args.command}"
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{command}: interrupted (Ctrl-C); the processes it started are stopped",
              file=sys.stderr)
        return INTERRUPTED
    finally:
        if in_main_thread:  # None: a handler not set from Python, left to the default
            signal.signal(signal.SIGINT, previous if previous is not None
                          else signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
