"""Parity of a Flower run with jit: `fax-bridge flower ... --check`.

`run_check` starts a loopback deployment (`deployment.LocalDeployment`, warm workers)
for an app `fax-bridge flower` wrote and the populations it wrote, runs its rounds with
`flwr run` (every client in every round), and `parity_of_run` compares the last round's
result (`result.npz`) leaf by leaf with the same rounds under `jax.jit`, as
`fax-bridge parity` compares the fleet (`parity.compare_leaves`, its tolerances), and
says whether the run also has the bits of the fleet's round plan run in process.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from fax_bridge.parity import ParityReport, compare_leaves


def parity_of_run(prog, args: tuple, made, result_npz: str, rounds: int,
                  nodes: int, flower_s: float, rtol: float = 1e-5,
                  atol: float = 1e-6) -> tuple:
    """(ParityReport of the run's result against `rounds` rounds of jit, whether its
    bits equal the fleet plan's)."""
    import jax
    from federated_language.common_libs import structure

    from fax_bridge.fleet import engine
    from fax_bridge.runtime import npz_keys, values

    start = time.perf_counter()
    state, data = args[0], args[1]
    step = jax.jit(prog)
    result = None
    for _ in range(rounds):
        result = step(state, data)
        state = result[0]
    local_s = time.perf_counter() - start
    result_type = made.prepared.result
    want = npz_keys.result_to_npz(values.from_pytree(jax.device_get(result), result_type),
                                result_type)
    with np.load(result_npz) as f:
        got = {k: f[k] for k in f.files}
    keys = sorted(want)
    leaves = compare_leaves([want[k] for k in keys], [got.get(k, np.zeros(0)) for k in keys],
                            rtol, atol, paths=keys)
    report = ParityReport(leaves=leaves, rtol=rtol, atol=atol, devices=nodes,
                          local_s=local_s, fleet_s=flower_s,
                          signature=str(made.prepared.type))
    bound = values.bind_arguments(made.prepared.parameter, args, {}).runtime_value()
    fleet_state = made.state_value(made.state)
    fleet = None
    for _ in range(rounds):
        fleet = engine.run_in_process(made.split, structure.Struct(
            [(None, fleet_state), (None, bound[1])]))
        fleet_state = fleet[0]
    fleet_npz = npz_keys.result_to_npz(fleet, result_type)
    same = sorted(fleet_npz) == sorted(got) and all(
        fleet_npz[k].tobytes() == np.asarray(got[k]).tobytes() for k in fleet_npz)
    return report, same


def run_check(app: str, nodes: list, home: str, rounds: int) -> tuple:
    """Runs the app on a loopback deployment; (the `flwr run` output, result.npz path,
    seconds the run took)."""
    from fax_bridge.errors import FleetError
    from fax_bridge.flower.deployment import LocalDeployment

    out = os.path.join(home, "results")
    with LocalDeployment(nodes, home) as deployment:
        start = time.perf_counter()
        run = deployment.run(app, {"num-rounds": rounds, "out-dir": out,
                                   "min-nodes": len(nodes), "cohort-size": 0,
                                   "dropout": 0.0, "min-clients": 1})
        took = time.perf_counter() - start
    if run.returncode != 0:
        raise FleetError(f"`flwr run` failed on the loopback deployment:\n"
                         f"{run.stdout[-3000:]}")
    return run.stdout, os.path.join(out, "result.npz"), took


def describe(report: ParityReport, same_bits: bool, rounds: int) -> str:
    """The report's table, labelled for a Flower run."""
    table = report.table().replace("fleet of", "Flower deployment of").replace(
        "device(s)", "SuperNode(s)")
    return (f"{table}\nafter {rounds} rounds; the same bits as the fleet's round plan: "
            f"{'yes' if same_bits else 'NO'}")


def check_app(prog, args: tuple, made: Any, app: str, nodes: list, home: str,
              rounds: int) -> tuple:
    """`run_check` then `parity_of_run`: (text, ok)."""
    _, result_npz, took = run_check(app, nodes, home, rounds)
    report, same = parity_of_run(prog, args, made, result_npz, rounds, len(nodes), took)
    return describe(report, same, rounds), report.ok and same
