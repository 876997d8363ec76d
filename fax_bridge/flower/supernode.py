"""One command for a warm SuperNode: its worker, then `flower-supernode` naming it.

    python -m fax_bridge.flower.supernode --superlink 10.0.0.1:9093 \\
        --root-certificates ca.crt [--auth-supernode-private-key node-0.key] \\
        --population /data/pop --first-client 0 [--num-clients 4] \\
        [--client-runtime litert]

starts the node's warm `worker` (jax loaded once, the round's client part compiled
once, served on loopback with a token written to a private file), waits until it
listens, then starts Flower's own `flower-supernode` with a `--node-config` naming the
worker, and stays in front of both: a SIGTERM or SIGINT ends both, and when either exits
the other is ended too, each with every process it started; the exit status is the
SuperNode's. The SuperNode, its SuperExec and the ClientApp processes Flower starts for
each message are forked from a process that has Flower loaded (`forked_apps`;
`--no-fork-apps`: Flower's own commands, a fresh interpreter each). This is the fast
path the app README's commands use. `--cold` starts the SuperNode alone, its node config
naming the population: every round's ClientApp process then loads jax and compiles the
client part itself (the slow path).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from fax_bridge.system import cli_args, private_files
from fax_bridge.flower import forked_apps
from fax_bridge.flower.deployment import (LOOPBACK, flower_env, free_port,
                                          node_config_text, wait_port)
from fax_bridge.flower.worker import share_config, start_worker
from fax_bridge.system.process_tree import end_group


def supernode_command(args: argparse.Namespace, node_config: dict) -> list:
    """Flower's `flower-supernode` command line for this node."""
    security = ["--insecure"] if args.insecure else [
        "--root-certificates", os.path.abspath(args.root_certificates)]
    if args.auth_supernode_private_key:
        security += ["--auth-supernode-private-key",
                     os.path.abspath(args.auth_supernode_private_key)]
    return ["flower-supernode", *security, "--superlink", args.superlink,
            "--host", LOOPBACK, "--port", str(args.port or free_port()),
            "--node-config", node_config_text(node_config)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--superlink", required=True, type=cli_args.connect_address,
                        help="the SuperLink's HOST:PORT (port 1..65535; an IPv6 host in "
                             "brackets)")
    security = parser.add_mutually_exclusive_group(required=True)
    security.add_argument("--root-certificates", help="CA certificate the SuperLink's is "
                          "checked against (TLS)")
    security.add_argument("--insecure", action="store_true", help="no TLS (trials only)")
    parser.add_argument("--auth-supernode-private-key", default=None,
                        help="this node's private key (SuperNode authentication)")
    parser.add_argument("--port", type=cli_args.int_in(0, 65535), default=0,
                        help="the SuperNode's own ClientAppIo port on loopback (0: free)")
    parser.add_argument("--worker-port", type=cli_args.int_in(0, 65535), default=0,
                        help="the worker's port on loopback (0: a free one)")
    parser.add_argument("--population", required=True, help="the node's population dir")
    parser.add_argument("--first-client", type=int, default=0)
    parser.add_argument("--num-clients", type=int, default=None)
    parser.add_argument("--first-row", type=int, default=0)
    parser.add_argument("--keys", default=None, help="stored arrays, comma-separated")
    parser.add_argument("--client-runtime", default=None, choices=("xla", "litert"),
                        help="litert: run the client part in the LiteRT interpreter, from "
                             "the model the app carries (`fax-bridge flower --litert`)")
    parser.add_argument("--cold", action="store_true",
                        help="no worker: each round's ClientApp loads jax and compiles "
                             "(slow)")
    parser.add_argument("--no-fork-apps", action="store_true",
                        help="start each ClientApp as Flower's own command, a fresh "
                             "interpreter (by default they are forked from a process "
                             "that has Flower loaded: fax_bridge.flower.forked_apps)")
    parser.add_argument("--start-timeout-s", type=float, default=300.0,
                        help="how long the worker may take to listen")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    config = share_config(args)
    home = os.environ.get("FLWR_HOME", os.path.expanduser("~/.flwr"))
    try:  # Flower's processes write there as this user: it must be ours alone
        private_files.private_dir(home)
    except private_files.UnsafePathError as e:
        print(f"fax_bridge supernode: FLWR_HOME: {e}", file=sys.stderr)
        return 2
    os.environ.update(flower_env(home))
    stopping = []

    def stop(signum, _frame) -> None:
        stopping.append(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    procs: list = []
    forks = None
    with tempfile.TemporaryDirectory(prefix="fax-bridge-node-") as folder:
        try:
            if not args.no_fork_apps:
                forks = forked_apps.AppForks(
                    os.path.join(folder, "forks"), dict(os.environ),
                    forked_apps.COLD_NODE_MODULES if args.cold else forked_apps.NODE_MODULES)
            node_config = config
            if not args.cold:
                worker, node_config = start_worker(
                    config, os.path.join(folder, "worker.token"),
                    f"{LOOPBACK}:{args.worker_port or free_port()}")
                procs.append(worker)
                port = int(node_config["worker"].rsplit(":", 1)[1])
                end = time.monotonic() + args.start_timeout_s
                while not stopping and time.monotonic() < end:
                    try:  # in steps, so that a signal stops the wait
                        wait_port(port, worker, "the node's worker", 1.0)
                        break
                    except Exception as e:  # noqa: BLE001 - exited, or not yet listening
                        if worker.poll() is not None:
                            print(f"fax_bridge supernode: {e}", file=sys.stderr)
                            return 2
                else:
                    if not stopping:
                        print("fax_bridge supernode: the worker did not listen within "
                              f"{args.start_timeout_s}s", file=sys.stderr)
                    return 2 if not stopping else 0
            if forks is not None:  # then `flower-supernode` on its PATH is forked too
                forks.wait(args.start_timeout_s)
            node = subprocess.Popen(supernode_command(args, node_config),
                                    env=forks.env if forks else None,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            procs.append(node)
            while not stopping and all(p.poll() is None for p in procs):
                time.sleep(0.2)
            return node.returncode if node.returncode is not None else 0
        finally:
            for proc in reversed(procs):
                end_group(proc)
            if forks is not None:
                forks.close()


if __name__ == "__main__":
    sys.exit(main())
