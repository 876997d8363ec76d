"""The `fax-bridge` command line: each stage of the flow registers its own subcommand.

The `FAX_BRIDGE_*` environment variables are checked once the arguments are read
(`env_settings.check`): a bad value stops the command with one line naming it and the
form it takes, exit code 2; `--help` works whatever they hold.

Ctrl-C (SIGINT) stops any subcommand with one line on stderr and exit code 130; what
the command started (device processes) is stopped first, and a second Ctrl-C during
that cleanup is ignored so it cannot leave processes behind. A Ctrl-C is never lost: one
whose KeyboardInterrupt is dropped (raised in a garbage-collector callback, a `__del__`)
or swallowed (by a bare `except`) is raised again in the command's own code.
"""

from __future__ import annotations

import _thread
import argparse
import importlib
import logging
import signal
import sys
import threading
import time
from typing import Optional, Sequence

from fax_bridge.system import env_settings
from fax_bridge.errors import FaxBridgeError

# Modules that provide `register(subparsers)`, adding one subcommand each whose parser
# sets `func` (called with the parsed namespace, returning an exit code).
_SUBCOMMAND_MODULES = (
    "fax_bridge.tff.cli",
    "fax_bridge.tff.forms_cli",
    "fax_bridge.parity.cli",
    "fax_bridge.fleet.run_cli",
    "fax_bridge.fleet.device_cli",
    "fax_bridge.flower.cli",
    "fax_bridge.litert.cli",
)


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose refusal of a bad argument is one line (the command, the
    argument, what was wrong) pointing at `--help`, instead of the usage block first."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    """Returns the parser with every available subcommand registered."""
    parser = _Parser(
        prog="fax-bridge",
        description="Export FAX programs to TFF, run TFF computations on a simulated fleet.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).register(sub)
    importlib.import_module("fax_bridge.tff.forms_cli").register_run(sub)
    return parser


def _two_word_commands(argv: Sequence[str]) -> list:
    """`forms run ...` as the subcommand `forms-run ...` (the `forms` subcommand's first
    argument is a program, so `run` cannot be one of its own subcommands)."""
    argv = list(argv)
    return ["forms-run"] + argv[2:] if argv[:2] == ["forms", "run"] else argv


INTERRUPTED = 130  # the shell's code for a command ended by SIGINT (128 + 2)


class _Interrupt:
    """While `main` runs: the KeyboardInterrupts Ctrl-C raised (the first, and each one
    raised again after it was lost), the thread that watches for a lost one, whether
    `main` is ending, and the unraisable hook `main` replaced."""

    raised: list = []
    watcher: Optional[threading.Thread] = None
    ending = False
    hook = staticmethod(sys.unraisablehook)


ASK_EVERY_S = 0.01  # how often the watcher has the main thread check the interrupt


def _ours(exc: Optional[BaseException]) -> bool:
    """Whether `exc`, or an exception it was raised while handling, is one of ours."""
    seen: set = set()
    while exc is not None and id(exc) not in seen:
        if any(exc is raised for raised in _Interrupt.raised):
            return True
        seen.add(id(exc))
        exc = exc.__context__
    return False


def _in_hook(frame) -> bool:
    while frame is not None:
        if frame.f_code is _unraisable.__code__:
            return True
        frame = frame.f_back
    return False


def _interrupt(signum, frame) -> None:
    """SIGINT's handler while `main` runs. The first Ctrl-C raises KeyboardInterrupt;
    later calls (a second Ctrl-C, or the watcher asking) do nothing while that exception
    is still on its way up (being handled: a cleanup runs), and raise it again where it
    was lost: raised in code whose exceptions Python drops (a garbage-collector callback
    such as jax's, a `__del__`, a weakref callback) or swallowed by a bare `except`
    (grpc's channels do that when collected). Inside the unraisable hook, where a raise
    would be dropped too, it is only noted, and the watcher asks again in a moment."""
    if _Interrupt.ending or (_Interrupt.raised and _ours(sys.exc_info()[1])):
        return
    _Interrupt.raised.append(KeyboardInterrupt())
    if _Interrupt.watcher is None:
        _Interrupt.watcher = threading.Thread(target=_watch, daemon=True,
                                              name="fax-bridge-ctrl-c")
        _Interrupt.watcher.start()
    if not _in_hook(frame):
        raise _Interrupt.raised[-1]


def _watch() -> None:
    """In a thread of its own, from the first Ctrl-C until `main` ends: has the main
    thread run `_interrupt` every `ASK_EVERY_S`, which raises the interrupt again if it
    was lost."""
    while not _Interrupt.ending:
        time.sleep(ASK_EVERY_S)
        _thread.interrupt_main(signal.SIGINT)


def _unraisable(args) -> None:
    """`sys.unraisablehook` while `main` runs: a KeyboardInterrupt of ours that Python
    dropped is not printed (the watcher has it raised again); anything else goes to the
    hook that was there before."""
    if not any(args.exc_value is raised for raised in _Interrupt.raised):
        _Interrupt.hook(args)


class _progress_lines:
    """Within it, the progress of long work (logger `fax_bridge.parity`, level INFO:
    the float64 shadow's compiles and runs) is printed to stderr, one line each, led by
    the command's name."""

    def __init__(self, command: str):
        self.logger = logging.getLogger("fax_bridge.parity")
        self.handler = logging.StreamHandler(sys.stderr)
        self.handler.setFormatter(logging.Formatter(f"{command}: %(message)s"))
        self.level = self.logger.level

    def __enter__(self):
        self.logger.addHandler(self.handler)
        self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc):
        if self.handler in self.logger.handlers:
            self.logger.removeHandler(self.handler)
            self.logger.setLevel(self.level)
        return False


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the console script."""
    previous = signal.getsignal(signal.SIGINT)
    # only where Ctrl-C would stop it anyway (not in a thread, nor where it is ignored)
    in_main_thread = threading.current_thread() is threading.main_thread() and \
        previous is not signal.SIG_IGN
    command = "fax-bridge"
    try:
        if in_main_thread:
            _Interrupt.raised, _Interrupt.watcher, _Interrupt.ending = [], None, False
            _Interrupt.hook, sys.unraisablehook = sys.unraisablehook, _unraisable
            signal.signal(signal.SIGINT, _interrupt)
        argv = _two_word_commands(sys.argv[1:] if argv is None else argv)
        args = build_parser().parse_args(argv)  # --help ends here, whatever the env
        command = f"fax-bridge {args.command}"
        try:
            env_settings.check()
        except FaxBridgeError as e:
            print(f"{command}: {e}", file=sys.stderr)
            return 2
        with _progress_lines(command):
            return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"{command}: interrupted (Ctrl-C); the processes it started are stopped",
              file=sys.stderr)
        return INTERRUPTED
    finally:
        if in_main_thread:
            _Interrupt.ending = True  # the watcher stops; a Ctrl-C now changes nothing
            if _Interrupt.watcher is not None:
                _Interrupt.watcher.join()
            # None: a handler not set from Python, left to the default (setting it runs
            # `_interrupt` first for a signal still pending)
            signal.signal(signal.SIGINT, previous if previous is not None
                          else signal.default_int_handler)
            sys.unraisablehook = _Interrupt.hook
            _Interrupt.raised, _Interrupt.watcher = [], None


if __name__ == "__main__":
    sys.exit(main())
