"""`fax-bridge flower MODULE_OR_FILE:FUNCTION -o DIR [--clients N] [--rounds R] [--litert]`.

Writes a Flower app directory for a round `(state, client_data) -> (new_state, output)`
(`app_dir.write_app`): `flwr run DIR fax-bridge --stream` runs it against a SuperLink
(`FLWR_HOME=DIR/.flwr`, which names the connection), offline, with no edits. The
program and its example arguments are found as `fax-bridge export` finds them; the
example state is the first round's state. With `--write-population FOLDER --nodes K`
the example clients are also written as K populations (one per SuperNode, contiguous
blocks) and DIR/README.md gives the commands that start those SuperNodes. `--check`
then runs the rounds on a loopback deployment (its SuperNodes with
`client-runtime="litert"` under `--litert`) and compares the result with jax.jit as
`fax-bridge parity` does (and with the fleet's bits, the nodes' runtime in process),
printing what each node's answer was computed by and each node lost, with why. A round that one broadcast and
aggregations cannot run is refused with the operations and the fix. `--litert` also
converts the round's client part to a LiteRT model and puts it, with its manifest, in
the app (`fax_round/litert/`), for SuperNodes with `client-runtime="litert"`; a client
part that cannot convert is refused, naming the op, before anything is written.

DIR and FOLDER are written through `output_folders`: files fax-bridge wrote there before
are replaced, any other file in the way (a project's own pyproject.toml with `-o .`) is
refused by name unless `--force`. `--superlink` is checked as HOST:PORT
(`addresses.parse_address`) when read.
"""

from __future__ import annotations

import argparse
import os
import sys

from fax_bridge.system import cli_args
from fax_bridge.errors import FaxBridgeError


def _run(args: argparse.Namespace) -> int:
    from fax_bridge.flower import app_dir, bundle, populations
    from fax_bridge.tff.cli import resolve_program

    check_dir = os.path.join(args.output, ".flwr", "check")  # outside the bundle
    try:
        prog, prog_args, placements = resolve_program(args.target, args.clients)
        app_dir.check_folder(args.output, force=args.force,  # before building, converting
                             reserve=[".flwr/check/"] if args.check else [])
        made = bundle.build_round(prog, *prog_args, placements=placements)
        models = app_dir.litert_models(made) if args.litert else []  # before any write
        pops = args.write_population or (os.path.join(check_dir, "pops") if args.check
                                         else None)
        nodes = populations.plan(prog_args[-1], pops, args.nodes) if pops else []
        written = app_dir.write_app(made, args.output, superlink=args.superlink,
                                    config={"num-rounds": args.rounds,
                                            "min-nodes": max(1, len(nodes))},
                                    nodes=nodes, root_certificates=args.root_certificates,
                                    litert=models, force=args.force,
                                    reserve=[".flwr/check/"] if args.check else [])
        if pops:  # after the app, which claims the check's folder
            populations.write_populations(prog_args[-1], pops, args.nodes,
                                          force=args.force)
    except FaxBridgeError as e:
        print(f"fax-bridge flower: {e}", file=sys.stderr)
        return 2
    print(f"Flower round {made.prepared.type}")
    for path in written:
        print(f"  {path}")
    for config in nodes:
        print(f"  population {config['population']} (first client {config['first-client']})")
    print(f"run: FLWR_HOME={os.path.join(os.path.abspath(args.output), '.flwr')} "
          f"flwr run {os.path.abspath(args.output)} fax-bridge --stream "
          f"(start the SuperLink and SuperNodes first: {args.output}/README.md)")
    if not args.check:
        return 0
    from fax_bridge.parity.flower import check_app

    if args.litert:  # the check's nodes run the model the app carries
        nodes = [dict(c, **{"client-runtime": "litert"}) for c in nodes]
    try:
        text, ok = check_app(prog, prog_args, made, args.output, nodes,
                             os.path.join(check_dir, "home"), args.rounds)
    except FaxBridgeError as e:
        print(f"fax-bridge flower --check: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0 if ok else 1


def register(subparsers) -> None:
    """Adds the `flower` subcommand."""
    p = cli_args.program_subcommand(
        subparsers, "flower",
        "write a Flower app that runs a round on Flower's Deployment Engine", __doc__, _run,
        clients_default=8, clients_help="clients of the example arguments")
    p.add_argument("-o", "--output", required=True, type=cli_args.output_folder,
                   help="the app directory to write (created if needed); files of an app "
                        "written there before are replaced, any other file that would be "
                        "is refused unless --force")
    p.add_argument("--rounds", type=cli_args.int_in(1), default=3,
                   help="num-rounds in the app's run config (default 3)")
    p.add_argument("--superlink", default="127.0.0.1:9093", type=cli_args.connect_address,
                   help="HOST:PORT of the SuperLink `flwr run` talks to (default "
                        "127.0.0.1:9093)")
    p.add_argument("--root-certificates", default=None, metavar="CA",
                   type=cli_args.input_file,
                   help="the CA certificate of a SuperLink serving TLS: the connection in "
                        "DIR/.flwr/config.toml and README's commands use TLS (default: "
                        "insecure)")
    p.add_argument("--write-population", default=None, metavar="FOLDER",
                   type=cli_args.output_folder,
                   help="also write the example clients as one population per SuperNode "
                        "(FOLDER/node-K; other files there are kept, and one in the way "
                        "is refused unless --force)")
    p.add_argument("--nodes", type=cli_args.int_in(1), default=2,
                   help="SuperNodes for --write-population and --check (default 2)")
    p.add_argument("--litert", action="store_true",
                   help="convert the round's client part to a LiteRT model now and carry "
                        "it in the app, so SuperNodes with client-runtime=\"litert\" run it "
                        "with no converter (a client part LiteRT cannot run is refused "
                        "here, naming the op)")
    p.add_argument("--check", action="store_true",
                   help="then run --rounds rounds on a loopback deployment (a SuperLink and "
                        "--nodes SuperNodes, running LiteRT with --litert) and compare the "
                        "result with jax.jit and with the fleet's round plan; print what "
                        "each node ran, and each node lost and why; exit 1 on a mismatch")
    cli_args.add_force(p)
