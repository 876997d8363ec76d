"""Benchmark: how long a `LocalFleet` takes to start and run its first round, with its
devices forked by `fax_bridge.system.forks` against started as fresh interpreters.

For each device count, alternating the two ways (`fresh` is the launcher with the fork
server taken away, as on a platform without one), each repeat starts a fleet, runs one
round of a small computation (a scaled sum over 8 clients: the devices' first Load,
their XLA import helper, XLA's compile), and closes it. It reports the median wall time
of the start and of the first round, and the machine's CPU-seconds (all processes, from
/proc/stat) over start, round and close: run it on an otherwise quiet machine. The
fork server starts once per launching process, with the first forked fleet, which is
timed apart before the runs.

    .venv/bin/python benchmarks/fleet_start.py [--devices 2 4] [--repeats 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from unittest import mock

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from fax_bridge.system import forks  # noqa: E402
from fax_bridge.fleet import launcher  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import sample_computations as sc  # noqa: E402

WAYS = ("forked", "fresh")


def machine_cpu_s() -> float:
    """CPU-seconds every process on this machine has used (busy jiffies of /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def one_fleet(devices: int, way: str, proto, state, data) -> dict:
    """Starts a fleet the given way, runs one round, closes it; its timings."""
    patch = (mock.patch.object(forks, "available", return_value=False) if way == "fresh"
             else mock.patch.object(forks, "available", wraps=forks.available))
    with patch:
        cpu0, t0 = machine_cpu_s(), time.perf_counter()
        fleet = launcher.LocalFleet(devices=devices).start()
        try:
            t1 = time.perf_counter()
            got = fleet.run(proto, data, state)
            t2 = time.perf_counter()
            forked = all(isinstance(p, forks.ForkedProcess) for p in fleet._procs)
        finally:
            fleet.close()
        cpu = machine_cpu_s() - cpu0
    np.testing.assert_allclose(got, data.sum(axis=0) * state)
    if forked != (way == "forked"):
        raise RuntimeError(f"the {way} fleet's devices were {'' if forked else 'not '}forked")
    return {"start_s": t1 - t0, "first_round_s": t2 - t1, "cpu_s": cpu}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if not forks.available():
        print("fleet_start: this platform has no fork server (Linux pidfds)", file=sys.stderr)
        return 2
    proto = sc.scaled_aggregate((4,), "sum")
    state = np.full(4, 2.0, np.float32)
    data = np.arange(32, dtype=np.float32).reshape(8, 4)
    load = os.getloadavg()[0]
    first = one_fleet(1, "forked", proto, state, data)  # the fork server starts here
    results = {"first_forked_start_s": first["start_s"], "load": load, "rows": []}
    print(f"first forked fleet of 1 device, the fork server's start included: "
          f"{first['start_s']:.2f} s")
    print(f"{'devices':>7}  {'way':6}  {'start s':>8}  {'1st round s':>11}  {'CPU-s':>6}")
    for devices in args.devices:
        runs = {way: [] for way in WAYS}
        for _ in range(args.repeats):
            for way in WAYS:
                runs[way].append(one_fleet(devices, way, proto, state, data))
        for way in WAYS:
            row = {"devices": devices, "way": way, "repeats": args.repeats}
            for key in ("start_s", "first_round_s", "cpu_s"):
                row[key] = statistics.median(r[key] for r in runs[way])
            results["rows"].append(row)
            print(f"{devices:>7}  {way:6}  {row['start_s']:8.2f}  "
                  f"{row['first_round_s']:11.2f}  {row['cpu_s']:6.2f}")
    results["load_after"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
