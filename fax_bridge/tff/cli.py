"""`fax-bridge export MODULE_OR_FILE:FUNCTION [--clients N] [-o out.pb | -o -]`.

Prints the computation's type signature and its body, one call a line (as TFF's
`formatted_representation` writes it). The serialized `Computation` proto goes to the
file `-o` names, or with `-o -` to stdout alone (for a pipe; the summary then goes to
stderr).

Example arguments come from the program's module: a function `FUNCTION_example_args`
or, failing that, `example_args`, called with the number of clients and returning
`(args, placements)`: a tuple of example arguments (arrays or
`jax.ShapeDtypeStruct`s; CLIENTS values with a leading axis of `clients`) and the
placements prefix ("server"/"clients" per argument). A plain function is wrapped in
`fax_bridge.program(clients=N)` and needs `--clients`; a program declaring its clients
(`@fax_bridge.program(clients=N)`) runs at its N, and a `--clients` given must be N.

Programs built at run time (e.g. by `fax_bridge.algorithms`) are named through a
module function `export_targets(clients)` returning `{NAME: (program, args,
placements)}`; `MODULE:NAME` then picks one.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from typing import Any, Callable, Optional

from federated_language.compiler import building_blocks

from fax_bridge.system import cli_args
from fax_bridge.api import Program, program
from fax_bridge.errors import FaxBridgeError
from fax_bridge.tff.export import export_tff


def load_target(spec: str, allow_missing: bool = False) -> tuple[Any, Callable, str]:
    """Imports `MODULE_OR_FILE:FUNCTION`; returns (module, function, function name).

    With `allow_missing`, a name the module lacks but its `export_targets` may provide
    gives (module, None, name).
    """
    if ":" not in spec:
        raise FaxBridgeError(
            f"{spec!r} names no function; write MODULE_OR_FILE:FUNCTION, e.g. "
            "examples/quickstart.py:fedavg_round or mypkg.algos:round_fn.")
    where, name = spec.rsplit(":", 1)
    if where.endswith(".py") or os.sep in where:
        if not os.path.exists(where):
            raise FaxBridgeError(f"no such file: {where}")
        mod_name = "_fax_bridge_target_" + os.path.splitext(os.path.basename(where))[0]
        module_spec = importlib.util.spec_from_file_location(mod_name, where)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[mod_name] = module
        folder = os.path.dirname(os.path.abspath(where))
        sys.path.insert(0, folder)  # so an example can import its sibling modules
        try:
            module_spec.loader.exec_module(module)
        finally:
            sys.path.remove(folder)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise FaxBridgeError(f"cannot import module {where!r}: {e}") from e
    if not hasattr(module, name):
        if allow_missing and hasattr(module, "export_targets"):
            return module, None, name
        raise FaxBridgeError(f"{where} has no attribute {name!r}.")
    return module, getattr(module, name), name


def resolve_program(spec: str, clients: Optional[int]):
    """(program, example args, placements) for `spec` at `clients` clients; None: the
    clients a program (`@fb.program(clients=N)`) declares, refused for anything else."""
    module, fn, name = load_target(spec, allow_missing=True)
    maker = getattr(module, f"{name}_example_args", None) or getattr(module, "example_args",
                                                                      None)
    targets_fn = getattr(module, "export_targets", None)
    # a name the module holds (an imported function, say) without example arguments, in
    # a module whose export_targets may build it: the target is export_targets' entry
    shadowed = fn is not None and maker is None and callable(targets_fn)
    if clients is None:
        if not isinstance(fn, Program) or shadowed:
            raise FaxBridgeError(
                f"{spec} is built by export_targets(clients): give --clients N."
                if fn is None or shadowed else
                f"{spec} is a plain function, not a program declaring its clients: give "
                "--clients N, or decorate it with @fax_bridge.program(clients=N).")
        clients = fn.clients
    if fn is None or shadowed:
        targets = targets_fn(clients)
        if name not in targets:
            also = (f"; {name!r} is also a module-level {type(fn).__name__} (imported or "
                    f"defined there), but the module defines neither {name}_example_args"
                    "(clients) nor example_args(clients) for it" if shadowed else "")
            raise FaxBridgeError(f"{spec}: export_targets({clients}) has no {name!r}; it "
                                 f"has {sorted(targets)}{also}.")
        made = targets[name]
        if not (isinstance(made, tuple) and len(made) == 3):
            raise FaxBridgeError(
                f"{spec}: export_targets({clients})[{name!r}] must be (program, args, "
                f"placements), got {type(made).__name__}.")
        return made
    if maker is None:
        raise FaxBridgeError(
            f"{spec}: the module defines neither {name}_example_args(clients) nor "
            "example_args(clients) nor export_targets(clients); add example_args "
            "returning (args, placements), or export_targets returning {name: "
            "(program, args, placements)}.")
    made = maker(clients)
    if not (isinstance(made, tuple) and len(made) == 2):
        raise FaxBridgeError(
            f"{maker.__name__}({clients}) must return (args, placements), got "
            f"{type(made).__name__}.")
    args, placements = made
    if isinstance(fn, Program):
        if fn.clients != clients:
            raise FaxBridgeError(
                f"{spec} is a program with clients={fn.clients}, but --clients {clients} "
                "was given; pass the same number.")
        prog = fn
    else:
        prog = program(clients=clients)(fn)
    return prog, tuple(args), placements


def export_spec(spec: str, clients: int):
    """Exports `spec`; returns the Computation proto."""
    prog, args, placements = resolve_program(spec, clients)
    return export_tff(prog, *args, placements=placements)


def _run(args: argparse.Namespace) -> int:
    to_stdout = args.output == "-"
    try:
        if not to_stdout:
            cli_args.refuse_overwriting(args.output, {
                "the program's file": args.target.rsplit(":", 1)[0]})
        proto = export_spec(args.target, args.clients)
    except FaxBridgeError as e:
        print(f"fax-bridge export: {e}", file=sys.stderr)
        return 2
    data = proto.SerializeToString()
    block = building_blocks.ComputationBuildingBlock.from_proto(proto)
    if to_stdout:  # the bytes alone on stdout, for a pipe; the summary on stderr
        try:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        except BrokenPipeError:
            # stdout is gone: Python's exit flush must not fail on it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            print("fax-bridge export: stdout was closed before the proto was written "
                  "whole; write it to a file with -o FILE", file=sys.stderr)
            return 1
        print(f"{block.type_signature}\nwrote the proto to stdout ({len(data)} bytes)",
              file=sys.stderr)
        return 0
    print(block.type_signature)
    print(block.formatted_representation())
    if args.output:
        written, failed = cli_args.write_or_rescue(args.output, lambda f: f.write(data), ".pb",
                                                   "export")
        if failed:
            print(f"fax-bridge export: {failed}; the proto was saved to {written} instead",
                  file=sys.stderr)
            return 1
        print(f"wrote {written} ({len(data)} bytes)")
    return 0


def _output(text: str) -> str:
    """`-o`'s argparse type: `-` (stdout) or a file path (`cli_args.output_file`)."""
    return text if text == "-" else cli_args.output_file(text)


def register(subparsers) -> None:
    """Adds the `export` subcommand."""
    p = cli_args.program_subcommand(
        subparsers, "export", "export a FAX program as a TFF Computation proto", __doc__,
        _run)
    p.add_argument("-o", "--output", type=_output,
                   help="write the serialized proto (the Computation's bytes) to this "
                        "file, or with `-o -` to stdout alone (the summary then goes to "
                        "stderr); without -o only the signature and the computation, "
                        "one call a line, are printed")
