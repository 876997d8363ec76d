"""The gRPC fleet on shaped links: the coordinator and each device on hosts of their own.

The hosts are `links.py`'s (network namespaces, named `fxf-*` here: the hub at 10.77.0.1 runs the
coordinator, node K at 10.77.0.(10+K) runs one device, `fax-bridge device --listen
10.77.0.(10+K):50051 --allow-remote`, its veth shaped to the uplink and downlink rates)
and the round is `links.py`'s (`params * 0.5 + x_c`, weighted by each client's count),
exported and run by `RemoteFleet` over the devices' addresses with mutual TLS (a CA, a
certificate per device naming its address, and one for the coordinator, made here) and
the fleet token. Per size (`--sizes`) and link (`--links`), `--rounds` rounds each of
`--per-node` clients a device (the first round set apart): the round's wall time, the
bytes each device's link carried up and down a round (its veth's counters), the report's
own bytes per client, and the link floor as in `links.py`.

    sudo .venv/bin/python benchmarks/links_fleet.py [--sizes 1000000 10000000] \\
        [--links 20/100 100/1000] [--per-node 1 2] [--rounds 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import links  # noqa: E402
import netns  # noqa: E402

PORT = 50051
PREFIX = "fxf-"  # its own namespaces, apart from links.py's


def fleet_tls(folder: str, hosts: list) -> dict:
    """A CA, a certificate per device (its address in the SANs) and the coordinator's,
    as PEM files; {"ca", "coordinator": (cert, key), host: (cert, key)}."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(path: str, data: bytes, private: bool = False) -> str:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600 if private else 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return path

    ca_key = ec.generate_private_key(ec.SECP256R1())

    def issue(cn: str, key, ca: bool = False, san=None):
        b = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(name("fleet-ca"))
             .public_key(key.public_key()).serial_number(x509.random_serial_number())
             .not_valid_before(now - datetime.timedelta(minutes=5))
             .not_valid_after(now + datetime.timedelta(days=1))
             .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
        if san:
            b = b.add_extension(x509.SubjectAlternativeName(san), critical=False)
        return b.sign(ca_key, hashes.SHA256())

    pem = serialization.Encoding.PEM
    out = {"ca": write(os.path.join(folder, "ca.pem"),
                       issue("fleet-ca", ca_key, ca=True).public_bytes(pem))}
    for host in ["coordinator", *hosts]:
        key = ec.generate_private_key(ec.SECP256R1())
        san = None if host == "coordinator" else [
            x509.IPAddress(ipaddress.ip_address(host))]
        cert = write(os.path.join(folder, f"{host}.pem"), issue(host, key, san=san)
                     .public_bytes(pem))
        out[host] = (cert, write(os.path.join(folder, f"{host}.key"), key.private_bytes(
            pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            private=True))
    return out


def start_devices(network, folder: str, tls: dict, token_file: str) -> list:
    procs = []
    for k in range(network.nodes):
        host = network.node_ip(k)
        log = open(os.path.join(folder, f"device-{k}.log"), "wb")
        procs.append(subprocess.Popen(
            ["ip", "netns", "exec", network.ns(k), sys.executable, "-m",
             "fax_bridge.fleet.device_cli", "--listen", f"{host}:{PORT}", "--allow-remote",
             "--device-id", f"device-{k}", "--token-file", token_file,
             "--tls-ca", tls["ca"], "--tls-cert", tls[host][0], "--tls-key", tls[host][1]],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True))
    return procs


def wait_listening(procs: list, hosts: list, timeout_s: float = 600.0) -> None:
    """Waits until the device at each of `hosts` (its process in `procs`) accepts
    connections (they load jax first)."""
    import socket

    end = time.monotonic() + timeout_s
    for k, proc in enumerate(procs):
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"device {k} exited with code {proc.returncode}")
            try:
                socket.create_connection((hosts[k], PORT), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > end:
                    raise SystemExit(f"device {k} did not listen within {timeout_s}s")
                time.sleep(0.5)


def inside(args: argparse.Namespace) -> int:
    sys.path.insert(0, ROOT)
    import numpy as np

    from fax_bridge.fleet import security
    from fax_bridge.fleet.remote import RemoteFleet
    from fax_bridge.system.process_tree import end_group
    from fax_bridge.tff import forms

    network = netns.Network(args.nodes, PREFIX)
    results = {"machine": f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} "
                          "at start", "nodes": args.nodes, "rounds": args.rounds, "rows": []}
    with tempfile.TemporaryDirectory(prefix="links-fleet-") as folder:
        hosts = [network.node_ip(k) for k in range(args.nodes)]
        tls = fleet_tls(folder, hosts)
        token_file = os.path.join(folder, "token")
        security.write_token_file(token_file, secrets.token_hex(32))
        procs = start_devices(network, folder, tls, token_file)
        try:
            wait_listening(procs, hosts)
            for size in args.sizes:
                for per_node in args.per_node:
                    cohort = args.nodes * per_node
                    ids = np.arange(cohort)
                    data = {"x": ((ids + 1) / 1000).astype(np.float32),
                            "w": (ids + 1).astype(np.float32)}
                    params = np.zeros(size, np.float32)
                    proto, _ = forms.round_proto(links.fax_round(cohort), params, data,
                                                 placements=("server", "clients"))
                    config = security.TlsConfig(tls["ca"], *tls["coordinator"])
                    with RemoteFleet([f"{h}:{PORT}" for h in hosts], token_file=token_file,
                                     tls=config, connect_timeout_s=300,
                                     rpc_timeout_s=600) as fleet:
                        for up, down in [tuple(float(x) for x in link.split("/"))
                                         for link in args.links]:
                            for k in range(args.nodes):
                                network.shape(k, up, down)
                            walls, ups, downs, reports = [], [], [], []
                            state = params
                            for r in range(args.rounds):
                                before = [network.counters(k) for k in range(args.nodes)]
                                start = time.perf_counter()
                                (state, _), rep = fleet.run(proto, state, data, report=True)
                                walls.append(time.perf_counter() - start)
                                after = [network.counters(k) for k in range(args.nodes)]
                                ups.append(max(a[0] - b[0] for a, b in zip(after, before)))
                                downs.append(max(a[1] - b[1] for a, b in zip(after, before)))
                                reports.append({"up_per_client": rep.bytes_up_per_client,
                                                "down_per_client": rep.bytes_down_per_client})
                            later = slice(1, None)
                            up_b = statistics.median(ups[later])
                            down_b = statistics.median(downs[later])
                            floor = up_b * 8 / (up * 1e6) + down_b * 8 / (down * 1e6)
                            row = {"size": size, "per_node": per_node,
                                   "link": f"{up:g}/{down:g}", "system": "fleet",
                                   "round_s": statistics.median(walls[later]),
                                   "first_s": walls[0], "up_bytes": up_b,
                                   "down_bytes": down_b, "floor_s": floor,
                                   "reported": reports[-1], "wall_s": walls}
                            row["to_floor"] = row["round_s"] / floor
                            results["rows"].append(row)
                            print(json.dumps({k: v for k, v in row.items()
                                              if k != "wall_s"}), flush=True)
        finally:
            for proc in procs:
                end_group(proc)
    print(f"{'link':>9s} {'size':>9s} {'cl/node':>7s} {'round s':>8s} {'up MB':>7s} "
          f"{'down MB':>8s} {'floor s':>8s} {'/floor':>6s}")
    for r in results["rows"]:
        print(f"{r['link']:>9s} {r['size']:>9d} {r['per_node']:>7d} {r['round_s']:8.2f} "
              f"{r['up_bytes'] / 1e6:7.2f} {r['down_bytes'] / 1e6:8.2f} "
              f"{r['floor_s']:8.2f} {r['to_floor']:6.2f}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


def _exit_on_signal(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 10_000_000])
    p.add_argument("--links", nargs="+", default=["20/100", "100/1000"])
    p.add_argument("--per-node", type=int, nargs="+", default=[1, 2])
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=4,
                   help="rounds a row, at least 2: the first compiles and is reported "
                        "apart (first_s), the figures are medians over the others")
    p.add_argument("--json", default=None)
    p.add_argument("--timeout-s", type=float, default=3600)
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rounds < 2:
        p.error(f"--rounds {args.rounds}: give at least 2 (the first round compiles and is "
                "reported apart; a row's figures are medians over the rounds after it)")
    signal.signal(signal.SIGTERM, _exit_on_signal)  # so that every exit path cleans up
    if args.inside:
        return inside(args)
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        print("links_fleet: needs root with `ip` and `tc`; skipped", file=sys.stderr)
        return 2
    with netns.Network(args.nodes, PREFIX) as network:
        return netns.run_in_hub(network, __file__, args.timeout_s)


if __name__ == "__main__":
    sys.exit(main())
