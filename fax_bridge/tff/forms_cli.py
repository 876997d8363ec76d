"""`fax-bridge forms MODULE_OR_FILE:FUNCTION --form daf|mrf --clients N -o DIR`.

Builds TFF's production form of a round `(state, *client_data) -> (new_state, output)`
(see `fax_bridge.tff.forms`) with TFF 0.87 in its side environment, and writes one
`PIECE.pb` per piece, the round TFF re-derived from them (`round.pb`), the round that
went in (`input_round.pb`) and `manifest.json` (form, type of every piece, bytes,
sha256), replacing only files fax-bridge wrote in DIR before (`output_folders`; another
file in the way is refused by name unless `--force`). The program and its example
arguments are found as `fax-bridge export` finds them. A round no form can hold is refused with the operations, source lines and fix.
`--for fcp` builds the form Google's Federated Compute plan builder takes
(`fax_bridge.tff.fcp`); its manifest also lists the client data's tf.Example features,
and `state.npz` holds the example arguments' server state, which

    fax-bridge forms run DIR --population POP --rounds N [-o OUT]

starts from: the form run plan-shaped on the clients of the TFRecord population POP
(`fax_bridge.tff.fcp_run`, in the TFF side environment), each round's outputs printed,
the final state written to OUT/state.npz (default DIR/final).
"""

from __future__ import annotations

import argparse
import os
import sys

from fax_bridge.system import cli_args, output_folders
from fax_bridge.errors import FaxBridgeError


SIGNATURE_CHARS = 200  # a type printed on a terminal line: at most this, then where whole


def _run(args: argparse.Namespace) -> int:
    import jax

    from fax_bridge.tff import fcp_run, forms
    from fax_bridge.tff.cli import resolve_program

    try:
        prog, prog_args, placements = resolve_program(args.target, args.clients)
        files = forms.form_files(args.form) + (
            [fcp_run.STATE_FILE] if args.for_system == "fcp" else [])
        output_folders.check_entries(args.output, files, force=args.force,
                                     what="-o")  # before building
        build = (forms.to_distribute_aggregate_form if args.form == "daf"
                 else forms.to_map_reduce_form)
        form = build(prog, *prog_args, placements=placements, target=args.for_system)
        with output_folders.staged(args.output, "forms", force=args.force,
                                   what="-o") as stage:
            manifest = forms.write_form(form, stage)
            if args.for_system == "fcp":  # what `fax-bridge forms run` starts from
                fcp_run.write_state(os.path.join(stage, fcp_run.STATE_FILE),
                                    jax.tree_util.tree_leaves(prog_args[0]))
    except FaxBridgeError as e:
        print(f"fax-bridge forms: {e}", file=sys.stderr)
        return 2
    limit = None if args.verbose else SIGNATURE_CHARS
    whole = f"in {args.output}/manifest.json, or with --verbose"
    print(f"{manifest['form']} "
          f"{cli_args.shortened(manifest['type_signature'], limit, whole)}")
    for name, entry in manifest["files"].items():
        print(f"  {entry['file']:36s} {entry['bytes']:>10d} bytes  "
              f"{cli_args.shortened(entry['type'], limit, whole)}")
    print(f"wrote {args.output}/manifest.json")
    return 0


def register(subparsers) -> None:
    """Adds the `forms` subcommand."""
    p = cli_args.program_subcommand(
        subparsers, "forms",
        "build TFF's DistributeAggregateForm or MapReduceForm of a round", __doc__, _run,
        clients_default=3)
    p.add_argument("--form", choices=("daf", "mrf"), required=True,
                   help="daf: DistributeAggregateForm (Xla parts); mrf: MapReduceForm "
                        "(TensorFlow parts holding XlaCallModule)")
    p.add_argument("--for", dest="for_system", choices=("tff", "fcp"), default="tff",
                   help="tff: TFF's form as it is; fcp: the form Federated Compute's plan "
                        "builder takes (client data as serialized tf.Examples, TensorFlow "
                        "parts only, checkpoint dtypes; manifest.json lists the features)")
    p.add_argument("-o", "--output", required=True, type=cli_args.output_folder,
                   help="folder for the pieces and manifest (created if needed; files "
                        "fax-bridge wrote there before are replaced, any other file in "
                        "the way is refused unless --force)")
    p.add_argument("--verbose", action="store_true",
                   help=f"print whole type signatures (default: the first "
                        f"{SIGNATURE_CHARS} characters of each; manifest.json has them all)")
    cli_args.add_force(p)


def _run_plan(args: argparse.Namespace) -> int:
    import numpy as np

    from fax_bridge.tff import fcp_run

    out = args.output or os.path.join(args.form_dir, "final")
    try:
        output_folders.check_entries(out, [fcp_run.STATE_FILE], force=args.force, what="-o")
        run = fcp_run.run_plan(args.form_dir, args.population, args.rounds,
                               timeout_s=args.timeout)
        with output_folders.staged(out, "forms-run", force=args.force, what="-o") as stage:
            fcp_run.write_state(os.path.join(stage, fcp_run.STATE_FILE), run.states[-1])
    except FaxBridgeError as e:
        print(f"fax-bridge forms run: {e}", file=sys.stderr)
        return 2
    for r, outputs in enumerate(run.outputs):
        cells = [f"{name}={np.array2string(np.asarray(v), precision=6, threshold=6)}"
                 for name, v in zip(run.output_names, outputs)]
        print(f"round {r + 1}: {'  '.join(cells)}")
    print(f"{args.rounds} rounds of the FCP {run.kind.upper()} plan-shaped in "
          f"{run.seconds:.1f} s; wrote {os.path.join(out, fcp_run.STATE_FILE)}")
    return 0


def register_run(subparsers) -> None:
    """Adds `forms run` (as the subcommand `forms-run`, which `cli.main` maps it to)."""
    p = subparsers.add_parser(
        "forms-run", prog="fax-bridge forms run", description=__doc__,
        help="run a form written with --for fcp plan-shaped on a TFRecord population",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("form_dir", metavar="DIR",
                   help="what `fax-bridge forms ... --for fcp -o DIR` wrote")
    p.add_argument("--population", required=True, metavar="POP",
                   help="a folder fax_bridge.data.examples.write_population wrote, its "
                        "features named as the round's client data (data/x, mask)")
    p.add_argument("--rounds", required=True, type=cli_args.int_in(1))
    p.add_argument("-o", "--output", type=cli_args.output_folder, default=None,
                   help="folder for the final state.npz (default DIR/final)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds the TFF side process may take (default 900)")
    cli_args.add_force(p)
    p.set_defaults(func=_run_plan)
