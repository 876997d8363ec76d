"""`fax-bridge run COMP.pb --inputs IN.npz --devices K --output OUT.npz`.

Runs a TFF computation from a file (exported by fax_bridge or written by TFF) on a
local fleet. npz keys follow one rule for inputs and results (`runtime.values`): the
dotted path of each tensor through the value's struct elements (name, or index where
unnamed, escaped so keys never collide; placements add nothing), `arg` / `result` for
a value that is one tensor. CLIENTS values carry a leading clients axis, whose size
gives the number of clients (`--clients` when no argument is at CLIENTS but the
computation places values there). Input arrays need their tensors' dtypes (`--cast`
converts as numpy's same-kind casts do, refusing values that do not fit). The result
is written to exactly the `--output` path, never over an input; if it cannot be
written it is saved in the temporary folder and the path printed.
"""

from __future__ import annotations

import argparse
import sys

import federated_language
import numpy as np

from fax_bridge.system import cli_args
from fax_bridge.errors import ComputationError, FaxBridgeError


def missing_inputs(param: federated_language.Type) -> str:
    """Why a computation with parameter `param` cannot run without --inputs, and the fix."""
    from fax_bridge.runtime import npz_keys

    layout = npz_keys.npz_layout(param)
    shown = ", ".join(f"`{k}` ({t})" for k, t in layout[:8])
    more = f" and {len(layout) - 8} more" if len(layout) > 8 else ""
    return (f"no --inputs given, but the computation takes an argument {param}; save its "
            f"tensors with numpy.savez(IN.npz, ...) under the keys {shown}{more} (CLIENTS "
            "tensors with a leading clients axis) and pass --inputs IN.npz")


def run_file(comp_path: str, inputs_path: str | None, devices: int,
             clients: int | None = None, fleet_file: str | None = None, cast: bool = False):
    """Runs the computation in `comp_path` on `inputs_path`; returns (result npz, report).

    With `fleet_file`, the round runs on the running devices that file names
    (`RemoteFleet`) instead of `devices` local ones. Input arrays must have their
    tensors' dtypes unless `cast` (conversion within a kind, e.g. float64 to float32).
    """
    from fax_bridge.fleet.launcher import LocalFleet
    from fax_bridge.runtime import interpreter, npz_keys, values
    from fax_bridge.tff.files import load_computation

    prepared = interpreter.prepare(load_computation(comp_path))
    param = prepared.parameter
    if inputs_path is None and param is not None:
        raise ComputationError(missing_inputs(param))
    npz = cli_args.load_npz(inputs_path) if inputs_path else {}
    arg = npz_keys.args_from_npz(npz, param, cast=cast)
    args: tuple = ()
    if isinstance(param, federated_language.StructType):  # one argument per element
        tree = values.to_pytree(arg, param)
        args = tuple(tree.values()) if isinstance(tree, dict) else tuple(tree)
    elif param is not None:
        args = (values.to_pytree(arg, param),)
    if fleet_file is not None:
        from fax_bridge.fleet.remote import RemoteFleet

        fleet_cm = RemoteFleet(fleet_file=fleet_file)
    else:
        fleet_cm = LocalFleet(devices=devices)
    with fleet_cm as fleet:
        result, report = fleet.run(prepared, *args, report=True, num_clients=clients)
    value = values.from_pytree(result, prepared.result)
    return npz_keys.result_to_npz(value, prepared.result), report


def _run(args: argparse.Namespace) -> int:
    try:
        cli_args.refuse_overwriting(args.output, {
            "--inputs": args.inputs, "the computation": args.computation,
            "--fleet-file": args.fleet_file})
        out, report = run_file(args.computation, args.inputs, args.devices, args.clients,
                               args.fleet_file, args.cast)
    except (FaxBridgeError, OSError, ValueError) as e:
        print(f"fax-bridge run: {e}", file=sys.stderr)
        return 2
    for key in sorted(out):
        print(f"{key}: {np.asarray(out[key]).dtype}{list(np.shape(out[key]))}")
    print(report.summary() if hasattr(report, "summary") else report)
    if args.output:
        written, failed = cli_args.save_result(args.output, out)
        if failed:
            print(f"fax-bridge run: {failed}; the result was saved to {written} instead",
                  file=sys.stderr)
            return 1
        print(f"wrote {written}")
    return 0


def register(subparsers) -> None:
    """Adds the `run` subcommand."""
    p = subparsers.add_parser(
        "run", help="run a TFF computation file on a local device fleet",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("computation", help="serialized Computation proto (.pb)")
    p.add_argument("--inputs", help="npz file of arguments")
    p.add_argument("--devices", type=cli_args.int_in(1, 1024), default=2,
                   help="local devices to start (1..1024, default 2)")
    p.add_argument("--fleet-file",
                   help="JSON fleet file naming running devices (HOST:PORT); used instead "
                        "of --devices local ones")
    p.add_argument("--clients", type=cli_args.int_in(1),
                   help="number of clients when no input is at CLIENTS (>= 1)")
    p.add_argument("--output", type=cli_args.output_file,
                   help="write the result npz to exactly this path (never over an input)")
    p.add_argument("--cast", action="store_true",
                   help="convert inputs of another dtype of the same kind (float64 to "
                        "float32, int64 to int32) instead of refusing them; values the "
                        "dtype cannot hold are still refused")
    p.set_defaults(func=_run)
