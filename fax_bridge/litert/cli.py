"""`fax-bridge litert MODULE_OR_FILE:FUNCTION [--clients N] -o DIR`: a round's client part
as a LiteRT model for phones.

Exports the program with its example arguments, at `--clients` or the clients the program
declares (as `fax-bridge export` does, `tff.cli.resolve_program`), splits the
round, converts its client part (`convert`), and writes the model, its manifest, the
example client and `check.py` into DIR (`manifest`: each tensor named by pytree path,
with its dtype and shape, which it also prints), and the model as a carried one,
`<client part hash>.json` (`carried`), so that DIR is a models folder a fleet's devices
take instead of converting (`fax-bridge device --litert-models DIR`,
`LiteRTClientRuntime(models_dir=DIR)`); through `output_folders`: files
fax-bridge wrote in DIR before are replaced, any other file in the way is refused by
name unless `--force`); then runs the check (the model on
the example client in the LiteRT interpreter against XLA, within the rounding bound),
unless `--no-check`. Exit status 0 when written and checked, 1 when the check fails,
2 when the program cannot be a LiteRT client part (the message names why).
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

from fax_bridge.system import cli_args, output_folders
from fax_bridge.errors import FaxBridgeError


def _run(args: argparse.Namespace) -> int:
    import federated_language

    import fax_bridge as fb
    from fax_bridge.parity import rounding as parity_rounding
    from fax_bridge.litert import carried, manifest
    from fax_bridge.rounds import round_split
    from fax_bridge.runtime import interpreter, values
    from fax_bridge.tff.cli import resolve_program

    try:
        prog, example, placements = resolve_program(args.target, args.clients)
        output_folders.check_entries(args.out, manifest.FILES, force=args.force,
                                     what="-o")  # before exporting and converting
        proto = fb.export_tff(prog, *example, placements=placements)
        split = round_split.split_of(proto)  # as every runtime splits it, secure sums too
        if split is None:  # a round of several trips: a model per trip, run elsewhere
            round_split.refuse_unsplit("`fax-bridge litert` writes one model and", proto)
        carried_name = f"{split.client_part_hash}.json"
        output_folders.check_entries(args.out, [carried_name], force=args.force,
                                     what="-o")  # its name known once exported
        comp, aggregands = manifest.traced_with_paths(prog, example, placements)
        # The one conversion: named by pytree path, refused here naming the op.
        model = manifest.convert_named(split, aggregands)
        prepared = interpreter.prepare(proto)
        arg = values.bind_arguments(prepared.parameter, example, {}).runtime_value()
        bounds = manifest.output_bounds(split, model,
                                        parity_rounding.aggregand_bounds(comp, example))
        signature = str(federated_language.framework.ComputationBuildingBlock.from_proto(
            proto).type_signature)
        out = pathlib.Path(args.out)
        with output_folders.staged(args.out, "litert", force=args.force,
                                   what="-o") as stage:
            written = manifest.write(pathlib.Path(stage), split, model, signature,
                                     manifest.example_client(split, arg), bounds)
            # the same model as a carried one: DIR is a models folder for devices
            carried.write(stage, [carried.pack(split, signature, aggregands)])
    except FaxBridgeError as e:
        print(f"fax-bridge litert: {e}", file=sys.stderr)
        return 2
    print(f"wrote {out / manifest.MODEL_FILE} ({model.size} bytes, signature "
          f"{model.signature!r}: {len(written['inputs'])} inputs, "
          f"{len(written['outputs'])} outputs), manifest.json, {manifest.EXAMPLE_FILE}, "
          f"check.py and {carried_name} (the model as `--litert-models {out}` takes it)")
    for role in ("inputs", "outputs"):  # as manifest.json names them
        print(f"{role}:")
        for t in written[role]:
            print(f"  {t['name']}: {t['dtype']}{t['shape']}")
    if args.no_check:
        return 0
    return subprocess.call([sys.executable, str(out / "check.py")])


def register(subparsers) -> None:
    """Adds the `litert` subcommand."""
    p = cli_args.program_subcommand(
        subparsers, "litert",
        "write a round's client part as a LiteRT model (.tflite) for phones", __doc__, _run,
        clients_help="number of clients of the example arguments")
    p.add_argument("-o", "--out", required=True, type=cli_args.output_folder,
                   help="directory to write into (created if needed; files fax-bridge "
                        "wrote there before are replaced, any other file in the way is "
                        "refused unless --force)")
    cli_args.add_force(p)
    p.add_argument("--no-check", action="store_true",
                   help="do not run check.py after writing")
