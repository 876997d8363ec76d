"""Benchmark: what running the clients on device processes costs over the in-process backend.

For each number of clients and devices, runs the same federated computation (one
least-squares local step per client, example-weighted model mean, per-client losses
returned) through `LocalFleet` and through `LocalClientsBackend`, and prints the median
round time of each, the overhead per client task in ms, and wire bytes over array payload
bytes (down, up, both). Usage:

    python benchmarks/fleet_overhead.py [--clients 10,100,1000] [--devices 1,2,4]
        [--rounds 3] [--features 32] [--examples 16] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from fax_bridge.fleet.launcher import LocalFleet  # noqa: E402
from fax_bridge.runtime import interpreter  # noqa: E402
from fax_bridge.runtime.local_backend import LocalClientsBackend  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import sample_computations as sc  # noqa: E402


def _data(clients: int, features: int, examples: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = rng.normal(size=features).astype(np.float32)
    x = rng.normal(size=(clients, examples, features)).astype(np.float32)
    y = rng.normal(size=(clients, examples)).astype(np.float32)
    return w, x, y


def _median_time(fn, rounds: int) -> float:
    fn()  # warm-up: compile, load computations
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", default="10,100,1000")
    parser.add_argument("--devices", default="1,2,4")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--examples", type=int, default=16)
    parser.add_argument("--json", default=None, help="also write the rows to this file")
    args = parser.parse_args(argv)
    client_counts = [int(c) for c in args.clients.split(",")]
    device_counts = [int(d) for d in args.devices.split(",")]
    proto = sc.linear_regression_step(args.features, args.examples)

    local = {}
    for n in client_counts:
        data = _data(n, args.features, args.examples)
        local[n] = _median_time(
            lambda: interpreter.interpret(proto, *data, backend=LocalClientsBackend()),
            args.rounds)

    rows = []
    print(f"machine: {os.cpu_count()} cores; computation: linear_regression_step("
          f"features={args.features}, examples={args.examples}); median of {args.rounds} "
          "rounds after one warm-up")
    header = (f"{'clients':>7} {'devices':>7} {'local s':>8} {'fleet s':>8} "
              f"{'ms/client':>9} {'down x':>7} {'up x':>7} {'wire x':>7} {'MB down':>8} "
              f"{'KB up':>7}")
    print(header)
    for k in device_counts:
        with LocalFleet(devices=k) as fleet:
            for n in client_counts:
                data = _data(n, args.features, args.examples)
                fleet_s = _median_time(lambda: fleet.run(proto, *data), args.rounds)
                rep = fleet.last_report
                row = {
                    "clients": n, "devices": k, "local_s": local[n], "fleet_s": fleet_s,
                    "overhead_ms_per_client": 1e3 * (fleet_s - local[n]) / n,
                    "bytes_down": rep.bytes_down, "bytes_up": rep.bytes_up,
                    "payload_down": rep.payload_down, "payload_up": rep.payload_up,
                    "down_ratio": rep.bytes_down / max(1, rep.payload_down),
                    "up_ratio": rep.bytes_up / max(1, rep.payload_up),
                    "wire_ratio": (rep.bytes_down + rep.bytes_up)
                    / max(1, rep.payload_down + rep.payload_up),
                }
                rows.append(row)
                print(f"{n:>7} {k:>7} {local[n]:>8.3f} {fleet_s:>8.3f} "
                      f"{row['overhead_ms_per_client']:>9.3f} {row['down_ratio']:>7.3f} "
                      f"{row['up_ratio']:>7.3f} {row['wire_ratio']:>7.3f} "
                      f"{rep.bytes_down / 1e6:>8.3f} {rep.bytes_up / 1e3:>7.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
