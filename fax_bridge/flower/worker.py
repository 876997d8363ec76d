"""A SuperNode's warm worker: jax loaded once, the round's client part compiled once.

    python -m fax_bridge.flower.worker --listen 127.0.0.1:9300 --token-file TOKEN \\
        --population /data/pop --first-client 0 [--num-clients 4] [--first-row 0]

Started once beside a SuperNode whose `--node-config` names it (`worker=...`,
`worker-token-file=...`, see `relay`), it answers the ClientApp processes Flower starts
for each message: `/share` (the node's block of the population) and `/round` (the
partials of a round over the node's clients, computed by `client.serve_round`, the
same code a ClientApp runs in its own process). It serves HTTP on loopback only, each
connection in a thread of its own (one idle or slow connection never holds up the
others, its SuperNode's included), reads a request within `READ_TIMEOUT_S` of its last
bytes or drops the connection, computes one round at a time, and refuses requests
without its token.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import sys
import threading
from typing import Any, Callable, Optional, Sequence

from fax_bridge.flower import relay

LOOPBACK = ("127.0.0.1", "localhost", "::1")
READ_TIMEOUT_S = 60.0  # a connection that sends nothing for this long is dropped


def _handler(config: dict, token: str):
    from fax_bridge.flower import client

    share = client.NodeShare.from_config(config)  # checked before serving
    lock = threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        timeout = READ_TIMEOUT_S  # the connection's socket timeout (StreamRequestHandler)

        def log_message(self, *args) -> None:  # the SuperNode logs the rounds
            pass

        def _answer(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            if not relay.token_matches(self.headers.get(relay.TOKEN_HEADER), token):
                return self._answer(403, b"wrong or missing worker token")
            try:
                size = int(self.headers.get("Content-Length", 0))
            except ValueError:
                return self._answer(400, b"Content-Length is not a number")
            if not 0 <= size <= relay.MAX_BODY_BYTES:
                return self._answer(413, b"request too large")
            try:
                body = self.rfile.read(size)
            except OSError:  # the sender went quiet for READ_TIMEOUT_S, or away
                self.close_connection = True
                return None
            if len(body) != size:
                self.close_connection = True
                return None
            try:
                with lock:
                    if self.path == "/share":
                        return self._answer(200, json.dumps(client.describe(share)).encode())
                    if self.path != "/round":
                        return self._answer(404, f"no {self.path}".encode())
                    arrays, header = relay.unpack(body)
                    out, info = client.serve_round(str(header["bundle"]), config, arrays,
                                                   header)
                    return self._answer(200, relay.pack(out, info))
            except Exception as e:  # noqa: BLE001 - reported to the ClientApp, which fails
                return self._answer(500, f"{type(e).__name__}: {e}".encode())

    return Handler


def serve(listen: str, token: str, config: dict) -> http.server.HTTPServer:
    """The worker's server, bound (serve it with `serve_forever`): a thread per
    connection (daemon threads: they never hold the process at exit)."""
    host, port = listen.rsplit(":", 1)
    if host not in LOOPBACK:
        raise SystemExit(f"--listen {listen}: the worker serves loopback only "
                         "(127.0.0.1:PORT); it runs beside its SuperNode")
    server = http.server.ThreadingHTTPServer((host, int(port)), _handler(config, token))
    server.daemon_threads = True
    return server


def share_config(args: argparse.Namespace) -> dict:
    """The node's block of the population, as `client.NodeShare` reads it (from the
    worker's arguments, or the warm SuperNode starter's, which share their names)."""
    config = {"population": os.path.abspath(args.population),
              "first-client": args.first_client, "first-row": args.first_row}
    if args.num_clients is not None:
        config["num-clients"] = args.num_clients
    if args.keys:
        config["keys"] = args.keys
    if args.client_runtime:
        config["client-runtime"] = args.client_runtime
    return config


def start_worker(config: dict, token_file: str, address: str,
                 spawn: Optional[Callable[[list], Any]] = None) -> tuple:
    """Starts a warm worker for the share `config` serving `address` (a loopback
    HOST:PORT), with a fresh token written to `token_file` (mode 0600, never through a
    link: `private_files.write_file`); returns (its process, the node config naming
    it). `spawn` starts its command line (default: a process in a session of its own,
    stdin /dev/null). It does not listen yet: wait for the address's port."""
    import secrets
    import subprocess

    from fax_bridge.system import private_files

    token_file = private_files.write_file(token_file, secrets.token_hex(32))
    command = [sys.executable, "-m", "fax_bridge.flower.worker", "--listen", address,
               "--token-file", token_file]
    for key, value in config.items():
        command += [f"--{key}", str(value)]
    proc = spawn(command) if spawn is not None else subprocess.Popen(
        command, stdin=subprocess.DEVNULL, start_new_session=True)
    return proc, {"worker": address, "worker-token-file": token_file}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--listen", required=True, help="127.0.0.1:PORT")
    parser.add_argument("--token-file", required=True,
                        help="file holding the token (16+ characters) requests must carry")
    parser.add_argument("--population", required=True, help="the node's population dir")
    parser.add_argument("--first-client", type=int, default=0)
    parser.add_argument("--num-clients", type=int, default=None)
    parser.add_argument("--first-row", type=int, default=0)
    parser.add_argument("--keys", default=None, help="stored arrays, comma-separated")
    parser.add_argument("--client-runtime", default=None,
                        help="xla (default) or litert (`client.NodeShare`)")
    args = parser.parse_args(argv)
    config = share_config(args)
    from fax_bridge.errors import FaxBridgeError

    try:
        server = serve(args.listen, relay.read_token(args.token_file), config)
    except (FaxBridgeError, OSError, ValueError) as e:
        print(f"fax_bridge flower worker: {e}", file=sys.stderr)
        return 2
    print(f"fax_bridge flower worker on {args.listen} (pid {os.getpid()})", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
