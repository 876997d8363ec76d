"""Fleet scaling: round time and coordinator memory against cohort size and devices.

    python benchmarks/scaling.py --clients 1000 10000 100000 --devices 2 4 \
        --out out/scaling.json
    python benchmarks/scaling.py --device-data ...     # devices read the rows themselves
    python benchmarks/scaling.py --both ...            # both modes, side by side

Each configuration runs in a fresh coordinator process (so memory figures do not mix):
a population of tiny clients (one float32[4] example each) is written once to disk with
`fax_bridge.data.write_population`, read back through its memmap (`ClientStore`) one
cohort at a time, and run on a `LocalFleet` of K device processes, each hosting
clients/K virtual clients. The program is a broadcast, a per-client map and a mean
(`sample_computations.scaled_aggregate`). Per configuration it reports the median round
time over `--rounds` rounds after one warm-up round (which compiles on the devices), the
time to read the cohort from disk, the coordinator's peak RSS during a round above its
RSS before the round (Linux VmHWM, reset with /proc/self/clear_refs), and the devices'
peak RSS.

`--device-data` measures the other way of feeding clients: every device hosts the same
population (`LocalFleet(population=DIR)`, i.e. `fax-bridge device --population DIR`) and
the round names its CLIENTS argument by reference (`fleet.population`), so the
coordinator sends only client ids and each device reads its own clients' rows from its
memmap. `--population N` (device data only) samples a cohort of `--clients` from a
population of N clients each round.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
FEATURES = 4


def _status_kib(pid: str, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


def _population(directory: str, clients: int) -> None:
    import numpy as np

    from fax_bridge.data.stream import write_population

    if os.path.exists(os.path.join(directory, "population.json")):
        return
    rng = np.random.default_rng(0)

    def gen():
        for _ in range(clients):
            yield {"x": rng.standard_normal((1, FEATURES)).astype(np.float32)}

    write_population(directory, gen())


def _read_cohort(store, ids):
    """The cohort's examples, client by client from the memmap, into one array."""
    import numpy as np

    out = np.empty((len(ids), FEATURES), np.float32)
    for row, i in enumerate(ids):
        out[row] = store.client(int(i))["x"][0]
    return out


def child(clients: int, devices: int, rounds: int, data_dir: str,
          device_data: bool = False, population: int = 0) -> dict:
    """One configuration, in this process; returns its figures."""
    import numpy as np

    from fax_bridge.data.stream import ClientStore
    sys.path.insert(0, str(ROOT / "tests"))
    import sample_computations as sc
    from fax_bridge.fleet.launcher import LocalFleet
    from fax_bridge.runtime.population import PopulationRef

    population = max(population, clients)
    _population(data_dir, population)
    store = ClientStore(data_dir)
    proto = sc.scaled_aggregate((FEATURES,), "mean")
    s = np.full(FEATURES, 0.5, np.float32)
    ids = np.arange(clients)
    times, reads, rss_round = [], [], []
    extra = {}
    if device_data:
        extra["population"] = data_dir
        if population > clients:
            extra["cohort_size"] = clients
    with LocalFleet(devices=devices, rpc_timeout_s=600, startup_timeout_s=300,
                    **extra) as fleet:
        warm = (PopulationRef(client_ids=ids[: devices * 4]) if device_data
                else _read_cohort(store, ids[: devices * 4]))
        policy = fleet.policy
        fleet.policy = dataclasses.replace(policy, cohort_size=None)
        fleet.run(proto, warm, s)  # compile on devices
        fleet.policy = policy
        for _ in range(rounds):
            base = _status_kib("self", "VmRSS")
            exact = _reset_peak()
            start = time.perf_counter()
            if device_data:
                x = fleet.population
            else:
                x = _read_cohort(store, ids)
            read_s = time.perf_counter() - start
            got, rep = fleet.run(proto, x, s, report=True)
            times.append(time.perf_counter() - start)
            reads.append(read_s)
            del x
            peak = _status_kib("self", "VmHWM")
            rss_round.append((peak - base) if exact else None)
            expected = (_read_cohort(store, rep.participants) * s).mean(axis=0)
            if not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
                raise AssertionError(f"wrong mean: {got} vs {expected}")
        device_peaks = [_status_kib(str(pid), "VmHWM") for pid in fleet.pids]
        bytes_down, bytes_up = rep.bytes_down, rep.bytes_up
    return {
        "mode": "device-data" if device_data else "coordinator-fed",
        "population": population,
        "clients": clients, "devices": devices, "rounds": rounds,
        "round_s": statistics.median(times), "read_cohort_s": statistics.median(reads),
        "coordinator_rss_mib": _status_kib("self", "VmRSS") / 1024,
        "coordinator_round_peak_above_base_mib": (
            max(r for r in rss_round) / 1024 if all(r is not None for r in rss_round)
            else None),
        "device_peak_rss_mib": [p / 1024 for p in device_peaks],
        "bytes_down": bytes_down, "bytes_up": bytes_up,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[1000, 10000])
    parser.add_argument("--devices", type=int, nargs="+", default=[2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--data-dir", help="where populations are kept (default: temp)")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--out", help="write the figures here as JSON")
    parser.add_argument("--device-data", action="store_true",
                        help="devices host the population and read their clients' rows; "
                             "the coordinator sends only client ids")
    parser.add_argument("--both", action="store_true",
                        help="measure coordinator-fed and device-data rounds")
    parser.add_argument("--population", type=int, default=0,
                        help="device data: sample each cohort of --clients from this many")
    parser.add_argument("--child", nargs=3, type=int, metavar=("CLIENTS", "DEVICES", "ROUNDS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, data_dir=args.data_dir,
                               device_data=args.device_data,
                               population=args.population)), flush=True)
        return 0
    modes = [False, True] if args.both else [args.device_data]
    data_root = args.data_dir or tempfile.mkdtemp(prefix="fax_bridge_scaling_")
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).strip(os.pathsep)
    results = []
    for clients, devices, device_data in (
            (c, d, m) for c in args.clients for d in args.devices for m in modes):
        size = max(clients, args.population if device_data else 0)
        command = [sys.executable, __file__, "--child", str(clients), str(devices),
                   str(args.rounds), "--data-dir",
                   os.path.join(data_root, f"population-{size}")]
        if device_data:
            command += ["--device-data", "--population", str(size)]
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=args.timeout_s)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        r = json.loads(done.stdout.strip().splitlines()[-1])
        results.append(r)
        peak = r["coordinator_round_peak_above_base_mib"]
        print(f"{r['mode']:>15} clients={clients:>7}/{r['population']} "
              f"devices={devices}: round {r['round_s']:.2f}s "
              f"(cohort read {r['read_cohort_s']:.2f}s), coordinator "
              f"{r['coordinator_rss_mib']:.0f} MiB, +{peak:.1f} MiB peak in a round, "
              f"devices peak {max(r['device_peak_rss_mib']):.0f} MiB", flush=True)
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"machine": {"cpus": os.cpu_count(), "platform": sys.platform},
                       "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
