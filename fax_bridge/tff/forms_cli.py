"""`fax-bridge forms MODULE_OR_FILE:FUNCTION --form daf|mrf --clients N -o DIR`.

Builds TFF's production form of a round `(state, *client_data) -> (new_state, output)`
(see `fax_bridge.tff.forms`) with TFF 0.87 in its side environment, and writes one
`PIECE.pb` per piece, the round TFF re-derived from them (`round.pb`), the round that
went in (`input_round.pb`) and `manifest.json` (form, type of every piece, bytes,
sha256), replacing only files fax-bridge wrote in DIR before (`output_folders`; another
file in the way is refused by name unless `--force`). The program and its example
arguments are found as `fax-bridge export` finds them. A round no form can hold is refused with the operations, source lines and fix.
`--for fcp` builds the form Google's Federated Compute plan builder takes
(`fax_bridge.tff.fcp`); its manifest also lists the client data's tf.Example features.
"""

from __future__ import annotations

import argparse
import sys

from fax_bridge.system import cli_args, output_folders
from fax_bridge.errors import FaxBridgeError


SIGNATURE_CHARS = 200  # a type printed on a terminal line: at most this, then where whole


def _run(args: argparse.Namespace) -> int:
    from fax_bridge.tff import forms
    from fax_bridge.tff.cli import resolve_program

    try:
        prog, prog_args, placements = resolve_program(args.target, args.clients)
        output_folders.check_entries(args.output, forms.form_files(args.form),
                                     force=args.force, what="-o")  # before building
        build = (forms.to_distribute_aggregate_form if args.form == "daf"
                 else forms.to_map_reduce_form)
        form = build(prog, *prog_args, placements=placements, target=args.for_system)
        with output_folders.staged(args.output, "forms", force=args.force,
                                   what="-o") as stage:
            manifest = forms.write_form(form, stage)
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
