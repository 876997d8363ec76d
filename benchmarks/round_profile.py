"""Where a fleet round's time goes: the shared FedAvg workload, timed piece by piece.

Runs the round of `benchmarks/peers/fax_bridge_peer.py` (cohort 10 of 100 clients, the
devices hosting the population, a round by split through the round engine: one request
per device) on a
`LocalFleet`, with timers wrapped around the coordinator's steps and, in each device
process (started through a shim that installs the same kind of timers and then runs
`fax_bridge.fleet.device_cli`), around the device's steps. No module of the package is
changed. Timestamps are `time.perf_counter()`, the system's monotonic clock on Linux,
so coordinator and device times line up: the gaps between them (call start to handler
entry, handler exit to the answers in hand) are the RPC's own cost.

    .venv/bin/python benchmarks/round_profile.py [--devices 2] [--rounds 200]
        [--json OUT]

Prints one table (medians over the rounds after the first, in ms) and writes the
rows to OUT as JSON.
"""

from __future__ import annotations

import argparse
import functools
import glob
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PROFILE_DIR_ENV = "FAX_BRIDGE_ROUND_PROFILE_DIR"


def _timed(owner: Any, name: str, log: list, label: str) -> None:
    """Replaces `owner.name` by a wrapper appending (label, start, end) to `log`; a call
    inside another of the same label (a recursive decode) is part of the outer one."""
    original = getattr(owner, name)
    depth = [0]

    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if depth[0]:
            return original(*args, **kwargs)
        depth[0] += 1
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            log.append((label, start, time.perf_counter()))
            depth[0] -= 1

    setattr(owner, name, wrapper)


# ---------------------------------------------------------------------------------------
# The device side (in the device process)


def _device_shim(argv: list[str]) -> None:
    """Installs the device timers, then runs what the fleet asked its python to run: the
    fork server's script (`python SCRIPT ...`: the devices it forks inherit the timers),
    or a device started fresh (`python -m fax_bridge.fleet.device_cli ...`)."""
    import runpy

    from fax_bridge.fleet import device, device_round, shared_memory
    from fax_bridge.rounds import partials, round_split, wire
    from fax_bridge.runtime import aggregation, client_map

    log: list = []
    _timed(device.DeviceServicer, "read_clients", log, "read the request")
    _timed(device.DeviceServicer, "read_store", log, "read the cohort's rows")
    _timed(wire, "decode_value", log, "decode the broadcast")
    _timed(round_split, "client_partials", log, "client part and partials")
    _timed(client_map, "map_clients_stacked", log, "of which the XLA call (all clients)")
    _timed(aggregation, "partial_of_columns", log, "of which the partial sums (float64)")
    _timed(partials, "to_message", log, "encode the partials")
    _timed(shared_memory.Writer, "write", log, "write the answer's shared-memory segment")
    original = device_round.run_round

    def run_round(*args, **kwargs):
        del log[:]
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            end = time.perf_counter()
            # The device's own pid, read here: devices forked from one server share
            # everything the shim set up in it.
            path = os.path.join(os.environ[PROFILE_DIR_ENV], f"device_{os.getpid()}.jsonl")
            with open(path, "a") as f:
                f.write(json.dumps({"handler": [start, end], "parts": log}) + "\n")

    device_round.run_round = run_round
    at = 0
    while at < len(argv) and argv[at].startswith("-") and argv[at] != "-m":
        at += 1  # the interpreter's own options
    rest = argv[at:]
    if rest[:1] == ["-m"]:
        sys.argv = [rest[1]] + rest[2:]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = list(rest)
        runpy.run_path(rest[0], run_name="__main__")


# ---------------------------------------------------------------------------------------
# The coordinator side


def _coordinator_timers(log: list) -> None:
    from fax_bridge.fleet import coordinator, grpc_transport
    from fax_bridge.rounds import engine

    _timed(engine, "plan_round", log, "sample the cohort")
    _timed(grpc_transport, "_streams", log, "build the requests")
    _timed(grpc_transport.wire, "to_message", log, "encode the broadcast")
    _timed(grpc_transport.shared_memory.Writer, "write", log,
           "write the broadcast's shared-memory segment")
    _timed(grpc_transport.shared_memory, "open_segment", log,
           "map the answers' shared-memory segments")
    _timed(coordinator.GrpcClientsBackend, "call_each", log, "RPCs (call_each)")
    _timed(engine.validate, "check_partial", log, "check and decode the partials")
    _timed(engine.validate, "check_pending", log, "check and decode the partials")
    _timed(engine.aggregation, "merge", log, "merge the partials")
    _timed(engine.aggregation, "finish", log, "finish the aggregates")
    _timed(engine.server_steps, "prepare", log, "server prepare and result")
    _timed(engine.server_steps, "result", log, "server prepare and result")
    _timed(engine.values, "check_value", log, "check arguments and result")
    _timed(engine, "run_round", log, "run_round (all of the above but sampling)")


def shim_script(directory: str, script: str = __file__) -> str:
    """An interpreter for device processes, written into `directory`: `script` run with
    `--device-shim` and the device's arguments (this script's by default)."""
    path = os.path.join(directory, "device-python")
    with open(path, "w") as f:
        f.write(f'#!/bin/sh\nexec "{sys.executable}" "{os.path.abspath(script)}" '
                f'--device-shim "$@"\n')
    os.chmod(path, 0o755)
    return path


def _median_ms(values: list) -> float:
    return round(statistics.median(values) * 1e3, 3) if values else float("nan")


def profile(devices: int, rounds: int) -> dict:
    """Runs the rounds and returns the table's rows (medians, ms)."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(HERE, "peers"))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import fax_bridge_peer as peer  # noqa: E402  (the workload's program and data)
    import workload  # noqa: E402

    import fax_bridge as fb
    from fax_bridge.system import forks

    data = workload.client_data(workload.load_split())
    params = workload.load_init_params()
    program, _, _ = peer.build(workload.COHORT)
    first = workload.cohort(0, 0)
    proto = fb.export_tff(program, params, data.x[first], data.y[first],
                          data.counts[first], placements=peer.PLACEMENTS)
    log: list = []
    _coordinator_timers(log)
    with tempfile.TemporaryDirectory(prefix="round_profile_") as scratch:
        population = os.path.join(scratch, "clients")
        peer.write_population(data, population)
        os.environ[PROFILE_DIR_ENV] = scratch
        rounds_log: list = []
        with fb.LocalFleet(devices=devices, population=population,
                           python=shim_script(scratch)) as fleet:
            # As users get them: forked by the fork server, not started afresh (its
            # fallback, slower to start and to serve its first rounds).
            forked = forks.available() and all(
                isinstance(p, forks.ForkedProcess) for p in fleet._procs)
            for r in range(rounds):
                ids = workload.cohort(0, r)
                cohort = tuple(fb.PopulationRef(keys=[k], client_ids=ids)
                               for k in ("xb", "yb", "counts"))
                del log[:]
                start = time.perf_counter()
                result, report = fleet.run(proto, params, *cohort, report=True)
                end = time.perf_counter()
                params, _ = peer._split_result(result)
                rounds_log.append({"round": [start, end], "parts": list(log),
                                   "compute_s": report.compute_s})
        device_logs = [[json.loads(line) for line in open(path)]
                       for path in sorted(glob.glob(os.path.join(scratch, "device_*.jsonl")))]
    rows = _table(rounds_log[1:], [d[1:] for d in device_logs], devices)
    rows["devices_forked"] = forked
    return rows


def _table(rounds_log: list, device_logs: list, devices: int) -> dict:
    """Medians per piece; the RPC gaps from the aligned clocks."""
    coordinator: dict = {}
    for entry in rounds_log:
        sums: dict = {}
        for label, start, end in entry["parts"]:
            sums[label] = sums.get(label, 0.0) + end - start
        for label, total in sums.items():
            coordinator.setdefault(label, []).append(total)
        coordinator.setdefault("whole round (fleet.run)", []).append(
            entry["round"][1] - entry["round"][0])
    device: dict = {}
    for log in device_logs:
        for entry in log:
            device.setdefault("whole handler", []).append(
                entry["handler"][1] - entry["handler"][0])
            sums: dict = {}
            for label, start, end in entry["parts"]:
                sums[label] = sums.get(label, 0.0) + end - start
            for label, total in sums.items():
                device.setdefault(label, []).append(total)
    gaps: dict = {"call start to first handler entry": [],
                  "first handler entry to last handler exit": [],
                  "last handler exit to the answers in hand": []}
    calls = [[(s, e) for label, s, e in entry["parts"] if label == "RPCs (call_each)"]
             for entry in rounds_log]
    for i, call in enumerate(calls):
        if len(call) != 1 or any(len(log) <= i for log in device_logs):
            continue
        (start, end), handlers = call[0], [log[i]["handler"] for log in device_logs]
        gaps["call start to first handler entry"].append(min(h[0] for h in handlers) - start)
        gaps["first handler entry to last handler exit"].append(
            max(h[1] for h in handlers) - min(h[0] for h in handlers))
        gaps["last handler exit to the answers in hand"].append(end - max(h[1] for h in handlers))
    return {"devices": devices, "rounds": len(rounds_log),
            "coordinator_ms": {k: _median_ms(v) for k, v in coordinator.items()},
            "device_ms": {k: _median_ms(v) for k, v in device.items()},
            "rpc_gaps_ms": {k: _median_ms(v) for k, v in gaps.items()},
            "compute_s_median_ms": _median_ms([e["compute_s"] for e in rounds_log])}


def _print(rows: dict) -> None:
    how = ("forked by the fork server" if rows.get("devices_forked")
           else "started afresh (no fork server)")
    print(f"{rows['devices']} devices ({how}), {rows['rounds']} rounds after the first; "
          "medians, ms")
    for section in ("coordinator_ms", "rpc_gaps_ms", "device_ms"):
        print(f"\n| {section.replace('_ms', '')} | ms |\n|---|---:|")
        for label, ms in rows[section].items():
            print(f"| {label} | {ms} |")
    print(f"\ndevices' compute per round (RoundReport.compute_s, summed over devices): "
          f"{rows['compute_s_median_ms']} ms")


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--device-shim"]:
        _device_shim(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--json", help="write the rows here as JSON")
    args = parser.parse_args(argv)
    if args.devices < 1 or args.rounds < 2:
        parser.error("--devices must be at least 1 and --rounds at least 2 (the first "
                     "round compiles and is left out)")
    rows = profile(args.devices, args.rounds)
    _print(rows)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
