"""`fax-bridge parity MODULE_OR_FILE:FUNCTION [--clients N] --devices K [--flower]`.

Runs the program with jit and, exported, on a local fleet of K devices; prints the
parity table (per round: jit's compiled call and the fleet's second, warm round; the
first round and the starts on a line of their own) and exits non-zero on a mismatch.
Example arguments come from the module as for `fax-bridge export`. With `--flower` the
program, a round `(state, client_data) -> (new_state, output)`, runs `--rounds` rounds
on a loopback Flower deployment of K SuperNodes instead (each serving a block of the
example clients), compared with as many rounds of jit and with the bits of the fleet's
round plan. With `--litert` the devices run the client part in the LiteRT interpreter.
Each float output is held to twice the program's rounding bound (a float64 shadow's
measure of float32's error), which the report states per output, and integer outputs to
equality; `--rtol`/`--atol` compare with fixed tolerances instead.

The report starts with a summary (the verdict, what ran, how jit ran the clients where
in chunks, the worst leaf and the share of its bound or tolerance it used), the type
signature cut short, then the `--top` worst leaves' rows (default 20; 0 for the summary
alone); `--json FILE` writes the whole report, every leaf and the whole signature.
"""

from __future__ import annotations

import argparse
import json
import sys

from fax_bridge.system import cli_args
from fax_bridge.errors import FaxBridgeError


def _run(args: argparse.Namespace) -> int:
    from fax_bridge.parity.check import check_parity
    from fax_bridge.tff.cli import resolve_program

    try:
        prog, example, placements = resolve_program(args.target, args.clients)
        report = check_parity(prog, *example, placements=placements, devices=args.devices,
                              rtol=args.rtol, atol=args.atol, flower=args.flower or None,
                              rounds=args.rounds,
                              client_runtime="litert" if args.litert else "xla",
                              warm_round=True)
    except FaxBridgeError as e:
        print(f"fax-bridge parity: {e}", file=sys.stderr)
        return 2
    if args.json:
        text = json.dumps(report.to_json(), indent=1) + "\n"
        written, why = cli_args.write_or_rescue(args.json, lambda f: f.write(text.encode()),
                                                ".json", "parity")
        if why:
            print(f"fax-bridge parity: {why}; the report is in {written}", file=sys.stderr)
    print(report.table(top=args.top))
    return 0 if report.ok else 1


def register(subparsers) -> None:
    """Adds the `parity` subcommand."""
    p = cli_args.program_subcommand(
        subparsers, "parity", "compare the local path with the exported proto on a fleet",
        __doc__, _run)
    p.add_argument("--devices", type=cli_args.int_in(1, 1024), default=2,
                   help="local devices (1..1024, default 2)")
    p.add_argument("--rtol", type=cli_args.float_at_least(0.0), default=None,
                   help="compare with this relative tolerance (>= 0; --atol's default "
                        "1e-6 beside it) instead of each float output's rounding bound")
    p.add_argument("--atol", type=cli_args.float_at_least(0.0), default=None,
                   help="compare with this absolute tolerance (>= 0; --rtol's default "
                        "1e-5 beside it) instead of each float output's rounding bound")
    p.add_argument("--flower", action="store_true",
                   help="run the round on a loopback Flower deployment (a SuperLink and "
                        "--devices SuperNodes) instead of a fleet")
    p.add_argument("--rounds", type=cli_args.int_in(1, 10_000), default=1,
                   help="with --flower: rounds to run, each fed the state the round "
                        "before returned (1..10000, default 1)")
    p.add_argument("--top", type=cli_args.int_in(0, 10**9), default=20,
                   help="rows of the worst leaves to print, worst first (default 20; 0: "
                        "the summary alone)")
    p.add_argument("--json", type=cli_args.output_file, metavar="FILE",
                   help="write the whole report (every leaf, the whole signature) as JSON")
    p.add_argument("--litert", action="store_true",
                   help="the fleet's devices run the round's client part as a LiteRT model "
                        "in the LiteRT interpreter; float leaves are compared within the "
                        "rounding bound the report states (docs/litert.md)")
