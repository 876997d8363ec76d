"""The `fax-bridge device` command line (also `python -m fax_bridge.fleet.device_cli`, the
command a launcher starts each device with): flags (every resource bound among them, with
safe defaults) read, checked and handed to `device_process.serve`."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Optional, Sequence

from fax_bridge.system import cli_args
from fax_bridge.errors import ArgumentError, FleetError
from fax_bridge.fleet import security
from fax_bridge.fleet.device_process import serve
from fax_bridge.fleet.protocol import (DEFAULT_IDLE_TIMEOUT_S, DEFAULT_MAX_CALL_SECONDS,
                                      DEFAULT_MAX_CLIENTS, DEFAULT_MAX_CONCURRENT_CALLS,
                                      DEFAULT_MAX_CONNECTIONS, DEFAULT_MAX_MESSAGE_BYTES,
                                      DEFAULT_MAX_STORED_BYTES, MAX_DELAY_SECONDS,
                                      DeviceLimits)
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds import faults

DESCRIPTION = ("The device server: one process hosting virtual clients, their data and "
               "their results.")


def _run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format=f"%(asctime)s {args.device_id} %(levelname)s %(message)s")
    try:
        token = security.resolve_token(token_file=args.token_file)
        os.environ.pop(security.TOKEN_ENV, None)  # not inherited by anything we start
        tls = security.tls_from_args(args.tls_ca, args.tls_cert, args.tls_key)
        runtime = runtimes.resolve(args.client_runtime, args.litert_models)
        if args.fault is not None:  # checked by _fault; now on the chosen runtime
            runtime = faults.parse(args.fault, base=args.client_runtime,
                                   models_dir=args.litert_models)
        return serve(args.listen, args.device_id, args.max_workers, args.parent_pid,
                     token=token, tls=tls, allow_remote=args.allow_remote,
                     allow_no_auth=args.insecure_no_auth,
                     limits=DeviceLimits.from_flags(args), population=args.population,
                     population_name=args.population_name,
                     shared_memory=args.shared_memory,
                     client_runtime=runtime)
    except (FleetError, ArgumentError) as e:
        print(f"fax-bridge device: {e}", file=sys.stderr)
        return 2


def _models_folder(text: str) -> str:
    """--models DIR: an existing folder (its models are checked when a round asks)."""
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a folder; give the folder of LiteRT models (an app's "
            "fax_round/litert, or carried.write's)")
    return text


def _fault(text: str) -> str:
    """--fault KEY=VALUE,...: a fault this device plants (`rounds.faults.parse`)."""
    try:
        faults.parse(text)
    except ArgumentError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default="127.0.0.1:0", type=cli_args.listen_address,
                        help="HOST:PORT to serve on (default 127.0.0.1:0: loopback, free port)")
    parser.add_argument("--allow-remote", action="store_true",
                        help="permit a non-loopback --listen host (reachable from other "
                             "machines; use with TLS)")
    parser.add_argument("--device-id", default="device", help="name used in logs and errors")
    parser.add_argument("--max-workers", type=cli_args.int_in(1, 256), default=4,
                        help="calls run at once (1..256); Health is answered beside them")
    parser.add_argument("--parent-pid", type=cli_args.int_in(1), default=None,
                        help="exit when this process (the launcher) is no longer the parent")
    parser.add_argument("--token-file", default=None,
                        help=f"file (mode 0600) holding the fleet token; default: the "
                             f"{security.TOKEN_ENV} environment variable")
    parser.add_argument("--insecure-no-auth", action="store_true",
                        help="serve without a fleet token (debugging only)")
    parser.add_argument("--tls-ca", default=None, help="PEM CA certificate (mutual TLS)")
    parser.add_argument("--tls-cert", default=None, help="PEM device certificate")
    parser.add_argument("--tls-key", default=None, help="PEM device private key")
    parser.add_argument("--max-message-bytes", type=cli_args.int_in(1, (1 << 31) - 1),
                        default=DEFAULT_MAX_MESSAGE_BYTES,
                        help="cap on every gRPC message, each direction")
    parser.add_argument("--max-stored-bytes", type=cli_args.int_in(1),
                        default=DEFAULT_MAX_STORED_BYTES,
                        help="cap on the bytes of all values held on this device, Map "
                             "results included (checked as they are computed)")
    parser.add_argument("--max-clients", type=cli_args.int_in(1), default=DEFAULT_MAX_CLIENTS,
                        help="cap on the client ids of one value (Broadcast, Put, Map)")
    parser.add_argument("--max-connections", type=cli_args.int_in(1, 65536),
                        default=DEFAULT_MAX_CONNECTIONS,
                        help="open connections at most, idle or not; more are closed at "
                             "once (lowered to fit the open-file limit)")
    parser.add_argument("--max-concurrent-calls", type=cli_args.int_in(1, 65536),
                        default=DEFAULT_MAX_CONCURRENT_CALLS,
                        help="calls in progress at most; more get RESOURCE_EXHAUSTED")
    parser.add_argument("--idle-timeout-s", type=cli_args.float_at_least(1.0),
                        default=DEFAULT_IDLE_TIMEOUT_S,
                        help="close a connection that made no call for this long")
    parser.add_argument("--max-call-seconds", type=cli_args.float_at_least(0.001),
                        default=DEFAULT_MAX_CALL_SECONDS,
                        help="compute time one Map may take (checked between clients)")
    parser.add_argument("--max-delay-seconds", type=cli_args.float_at_least(0.0),
                        default=MAX_DELAY_SECONDS,
                        help="largest emulated Map delay a caller may ask for")
    parser.add_argument("--population", default=None, metavar="DIR",
                        help="host this population (written by write_population): runs may "
                             "then name CLIENTS inputs by client id and this device reads "
                             "the rows itself")
    parser.add_argument("--population-name", default=None,
                        help="the name runs use for --population (default: its directory's "
                             "base name)")
    parser.add_argument("--shared-memory", default=None, metavar="DIR",
                        help="a directory (mode 0700, this user's) of shared-memory "
                             "segments through which a coordinator on this host passes "
                             "large payloads; LocalFleet gives its devices one")
    parser.add_argument("--client-runtime", default="xla", choices=runtimes.NAMES,
                        help="what runs a round's client part: its XLA (default) or the "
                             "LiteRT interpreter, as phones run it (fax_bridge.litert)")
    parser.add_argument("--models", "--litert-models", dest="litert_models", default=None,
                        metavar="DIR", type=_models_folder,
                        help="with --client-runtime litert: a folder of LiteRT models "
                             "(fax_bridge.litert.carried, as an app written with "
                             "`fax-bridge flower ... --litert` holds in fax_round/litert) "
                             "run before any conversion, so the device needs no converter")
    parser.add_argument("--fault", default=None, type=_fault,
                        metavar="client=N,aggregation=A,leaf=PATH,element=I,how=H,rel=R",
                        help="compute wrongly on purpose, to watch a parity check fail: "
                             "change one element of client N's value for aggregation A "
                             "(index or kind) at leaf PATH (how: relative, times 1 + R; "
                             "nan; plus_one); any key may be left out "
                             "(fax_bridge.rounds.faults)")
    parser.add_argument("--log-level", default="warning", type=str.lower,
                        choices=("debug", "info", "warning", "error", "critical"),
                        help="stderr log level")
    parser.set_defaults(func=_run)


def register(subparsers) -> None:
    """Adds the `device` subcommand to the fax-bridge CLI."""
    parser = subparsers.add_parser(
        "device", help="serve a simulated device (virtual clients) over gRPC",
        description=DESCRIPTION)
    _add_arguments(parser)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """`python -m fax_bridge.fleet.device_cli ...`: the same as `fax-bridge device ...`."""
    parser = argparse.ArgumentParser(prog="fax-bridge device", description=DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
