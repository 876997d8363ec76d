"""Parity of a Flower run with jit: `fax-bridge flower ... --check`,
`fax-bridge parity ... --flower` and `check_parity(..., flower=...)`.

`run_check` starts a loopback deployment (`deployment.LocalDeployment`, warm workers)
for an app `fax-bridge flower` wrote and the populations it wrote, and `run_rounds` runs
an app's rounds with `flwr run` on a deployment (every client in every round);
`parity_of_run` compares the last round's result (`result.npz`, read from a folder made
for that run alone, once the run's own `reports.jsonl` shows every round done without
an error: `run_outcome`) leaf by leaf with the same rounds under `jax.jit`, as
`fax-bridge parity` compares the fleet (`parity.report.compare_leaves`, its
tolerances), and says whether the run also has the bits of the fleet's round plan run
in process. `check_round` does all of it for a
program and its example arguments.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any, Optional

import numpy as np

from fax_bridge.errors import ArgumentError, FleetError
from fax_bridge.parity.report import LeafParity, ParityReport, compare_leaves


def parity_of_run(prog, args: tuple, made, result_npz: str, rounds: int,
                  nodes: int, flower_s: float, rtol: Optional[float] = None,
                  atol: Optional[float] = None, client_runtime: Any = "xla",
                  read_as: Any = None) -> ParityReport:
    """The ParityReport of the run's result against `rounds` rounds of jit, with
    `fleet_bits`: whether its bits equal the fleet split's run in process with the
    nodes' `client_runtime` (`rounds.client_runtime`: "xla", "litert" or a runtime).

    Args:
      prog: the round program; args: its (state, client data) example arguments.
      made: the app's round (`bundle.build_round` or `bundle.read_round`).
      result_npz: the run's result.npz (`run_outcome`).
      rounds: the rounds the run ran; nodes: its SuperNodes; flower_s: its seconds.
      rtol, atol: fixed tolerances of each leaf against jit; without either, each
        float leaf is held to twice the rounding bound of `rounds` chained rounds
        (`bounded.bounded_comparison`; `made.traced`, the program `build_round` traced),
        integer leaves to equality, as `check_parity` holds a fleet.
      client_runtime: what ran the nodes' client parts.
      read_as: the treedef the run's result is read back with (`flower_results.
        load_result`); where it is not jit's, a "result structure" MISMATCH row."""
    import jax
    from federated_language.common_libs import structure

    from fax_bridge import in_process
    from fax_bridge.parity import bounded
    from fax_bridge.runtime import npz_keys, values

    state, data = args[0], args[1]
    step = jax.jit(prog)
    start = time.perf_counter()
    result = jax.block_until_ready(step(state, data))
    startup = {"jit's first round (compiling)": time.perf_counter() - start}
    start = time.perf_counter()
    jax.block_until_ready(step(state, data))  # a compiled round, timed
    local_s = time.perf_counter() - start
    for _ in range(rounds - 1):
        state = result[0]
        result = step(state, data)
    result_type = made.prepared.result
    want = npz_keys.result_to_npz(values.from_pytree(jax.device_get(result), result_type),
                                result_type)
    got = npz_keys.read_npz(result_npz, what="the run's result.npz")
    keys = npz_keys.result_keys(result_type)  # in the order of jit's output leaves
    mine, theirs = [want[k] for k in keys], [got.get(k, np.zeros(0)) for k in keys]
    given = bounded.tolerances(rtol, atol)
    if given is None:
        name = getattr(client_runtime, "name", client_runtime)
        leaves, rtol, atol = bounded.bounded_comparison(
            made.traced, tuple(args), jax.tree_util.tree_leaves(result), theirs, keys,
            f"the SuperNodes ({name} clients, exact sums)", rounds=rounds,
            carry=len(jax.tree_util.tree_leaves(args[0])))
    else:
        rtol, atol = given
        leaves = compare_leaves(mine, theirs, rtol, atol, paths=keys)
    jitted = jax.tree_util.tree_structure(result)
    if read_as is not None and read_as != jitted:
        leaves.insert(0, LeafParity("result structure", (), "", 0.0, 0.0, False,
                                    f"read back as {read_as}, jit gives {jitted}"))
    walls = round_walls(os.path.dirname(result_npz))
    if len(walls) > 1:
        startup["the deployment's first round"] = walls[0]
    startup[f"flwr run of {rounds} round(s), the app's start included"] = flower_s
    report = ParityReport(leaves=leaves, rtol=rtol, atol=atol, devices=nodes,
                          local_s=local_s, fleet_s=walls[-1] if walls else flower_s,
                          startup_s=startup, signature=str(made.prepared.type),
                          target="flower")
    bound = values.bind_arguments(made.prepared.parameter, args, {}).runtime_value()
    fleet_state = made.state_value(made.state)
    fleet = None
    for _ in range(rounds):
        fleet = in_process.run_in_process(made.split, structure.Struct(
            [(None, fleet_state), (None, bound[1])]), client_runtime=client_runtime)
        fleet_state = fleet[0]
    fleet_npz = npz_keys.result_to_npz(fleet, result_type)
    differ = {k for k in fleet_npz
              if k not in got or fleet_npz[k].tobytes() != np.asarray(got[k]).tobytes()}
    report.fleet_bits = sorted(fleet_npz) == sorted(got) and not differ
    for leaf in report.leaves:  # each leaf that is not the plan's bits, by name
        if leaf.path in differ and leaf.ok:
            leaf.ok, leaf.note = False, "not the fleet plan's bits"
    return report


def round_walls(out: str) -> list:
    """Each round's seconds at the ServerApp (`wall_s` of the run's `reports.jsonl` in
    `out`, `read_reports`), or [] where a report has none."""
    walls = [r.get("wall_s") for r in read_reports(out)]
    return [float(w) for w in walls] if None not in walls else []


REPORTS_FILE = "reports.jsonl"
# a run of tens of thousands of rounds; a larger file is refused before it is read
MAX_REPORTS_BYTES = 64 << 20
# the fields of a round's report this reads, as `rounds.policy.RoundReport` writes them
_REPORT_FIELDS = (("round", "int", {"low": 0}), ("devices", "int", {"low": 0}),
                  ("wall_s", "number", {"low": 0}), ("error", "str", {"none": True}),
                  ("lost_devices", "list", {}), ("served", "object", {}))


def read_reports(out: str, missing_ok: bool = True) -> list:
    """The round reports of the run whose out-dir is `out` (`reports.jsonl`, one JSON
    object a line), read as a file another party may have written
    (`private_files.read_json_lines`: a regular file of at most `MAX_REPORTS_BYTES`,
    bounded JSON), each field this reads of the kind `RoundReport` writes: [] where
    there is no file (`FileNotFoundError` unless `missing_ok`), else a FleetError naming
    the file, the line and the field."""
    from fax_bridge.system import private_files as j

    path = os.path.join(out, REPORTS_FILE)
    try:
        reports = j.read_json_lines(path, MAX_REPORTS_BYTES, what="the Flower run's reports",
                                    fix="read the reports.jsonl the run's ServerApp wrote")
        for i, report in enumerate(reports, 1):
            where = f"{path} line {i}"
            j.json_value(report, "object", where)
            for key, kind, bounds in _REPORT_FIELDS:
                j.json_field(report, key, kind, where, default=None, **bounds)
            for node, what in report.get("served", {}).items():
                j.json_value(what, "object", f"{where}: field 'served' entry {node[:80]!r}")
    except FileNotFoundError:
        if missing_ok:
            return []
        raise
    except (j.HandedFileError, j.UnsafePathError) as e:
        raise FleetError(f"the Flower run's reports cannot be read: {e}") from None
    return reports


def run_rounds(deployment, app: str, rounds: int, out: str,
               timeout_s: float = 300.0) -> tuple:
    """`flwr run` of the app's `rounds` rounds on a running deployment, every client in
    every round, results in a new folder of this run's own under `out`; (the `flwr run`
    output, result.npz path, seconds the run took).

    Only what this run wrote is read (`run_outcome`): `flwr run` exits 0 even when the
    ServerApp fails, so its exit code alone proves nothing, and an earlier run's files
    are never in the new folder."""
    os.makedirs(out, exist_ok=True)
    out = tempfile.mkdtemp(prefix="run-", dir=out)
    start = time.perf_counter()
    run = deployment.run(app, {"num-rounds": rounds, "out-dir": out,
                               "min-nodes": len(deployment.nodes), "cohort-size": 0,
                               "dropout": 0.0, "min-clients": 1}, timeout_s=timeout_s)
    took = time.perf_counter() - start
    if run.returncode != 0:
        raise FleetError(f"`flwr run` failed on the loopback deployment:\n"
                         f"{run.stdout[-3000:]}")
    return run.stdout, run_outcome(out, rounds, run.stdout), took


def run_outcome(out: str, rounds: int, output: str = "") -> str:
    """The result.npz of a run whose ServerApp wrote to `out` (its `out-dir`), once its
    `reports.jsonl` shows `rounds` rounds, none failed; else FleetError with the
    ServerApp's own error (`output`: what `flwr run` printed, quoted when the run left
    no report)."""
    tail = f"; `flwr run` printed:\n{output[-3000:]}" if output else ""
    try:
        reports = read_reports(out, missing_ok=False)
    except FileNotFoundError:
        raise FleetError(f"the Flower run left no reports.jsonl in {out}: its ServerApp "
                         f"failed before its first round ended{tail}") from None
    failed = [r for r in reports if r.get("error")]
    if failed:
        lost = "".join(f"\n  {line}" for line in node_lines(reports) if "lost" in line)
        raise FleetError(f"the Flower run's round {failed[0].get('round')} failed: "
                         f"{failed[0]['error']}{lost}")
    if len(reports) != rounds:
        raise FleetError(f"the Flower run reported {len(reports)} of its {rounds} rounds: "
                         f"its ServerApp stopped early{tail}")
    result = os.path.join(out, "result.npz")
    if not os.path.isfile(result):
        raise FleetError(f"the Flower run reported its {rounds} rounds but wrote no "
                         f"result.npz in {out}{tail}")
    return result


def node_lines(reports: list) -> list:
    """What each round's report (`reports.jsonl`'s lines) says of its SuperNodes, one
    line a node: each node lost and why (`lost_devices`: its name, then the reason),
    then what computed each answer (`served`: the client runtime, the LiteRT model's
    sha256). Entries of another form are left out: the reports are a file's."""
    out = []
    for report in reports:
        if not isinstance(report, dict):
            continue
        where = f"round {str(report.get('round'))[:20]}"
        lost = report.get("lost_devices")
        for entry in lost if isinstance(lost, list) else []:
            out.append(f"{where}: lost {str(entry)[:300]}")
        served = report.get("served")
        for node, what in (served.items() if isinstance(served, dict) else []):
            if isinstance(what, dict):
                model = what.get("model_sha256")
                out.append(f"{where}: {str(node)[:100]} computed by "
                           f"{str(what.get('client_runtime'))[:20]}"
                           + (f" (LiteRT model sha256 {str(model)[:64]})" if model else ""))
    return out


def run_check(app: str, nodes: list, home: str, rounds: int) -> tuple:
    """Runs the app on a loopback deployment of its own; (the `flwr run` output,
    result.npz path, seconds the run took)."""
    from fax_bridge.flower.deployment import LocalDeployment

    with LocalDeployment(nodes, home) as deployment:
        return run_rounds(deployment, app, rounds, os.path.join(home, "results"))


def check_round(fn, args: tuple, *, placements: Any = None, clients: Optional[int] = None,
                deployment: Any = None, nodes: int = 2, rounds: int = 1,
                rtol: Optional[float] = None, atol: Optional[float] = None
                ) -> ParityReport:
    """`check_parity(fn, *args, flower=...)`: the round's app (and, without a running
    `deployment`, the example clients as `nodes` populations and a loopback deployment
    serving them) in a temporary folder, `rounds` rounds there and under jit, compared
    (`ParityReport` with `target="flower"` and `fleet_bits`)."""
    from fax_bridge.flower import app_dir, bundle
    from fax_bridge.flower.populations import write_populations

    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ArgumentError(f"rounds={rounds!r}: give a whole number of rounds >= 1")
    if len(args) != 2:
        # wrapping would not help a round of several trips or with client state
        bundle.refuse_phased(fn, args, placements, clients)
        raise ArgumentError(
            f"a Flower round takes (state, client_data), here {len(args)} arguments; "
            "wrap the program in one taking the client arguments as one dict")
    made = bundle.build_round(fn, *args, placements=placements, clients=clients)
    with tempfile.TemporaryDirectory(prefix="fax-bridge-flower-parity-") as folder:
        app = os.path.join(folder, "app")
        if deployment is None:
            configs = write_populations(args[-1], os.path.join(folder, "pops"), nodes)
            app_dir.write_app(made, app, config={"num-rounds": rounds,
                                                 "min-nodes": len(configs)})
            _, result_npz, took = run_check(app, configs, os.path.join(folder, "home"),
                                            rounds)
        else:
            configs = deployment.nodes
            app_dir.write_app(made, app, config={"num-rounds": rounds,
                                                 "min-nodes": len(configs)})
            _, result_npz, took = run_rounds(deployment, app, rounds,
                                             os.path.join(folder, "out"))
        report = parity_of_run(fn, args, made, result_npz, rounds, len(configs), took,
                               rtol, atol)
    return report


def describe(report: ParityReport, rounds: int) -> str:
    """The report's table (labelled for a Flower run, with whether it has the fleet
    plan's bits) and the rounds it compared."""
    return f"{report.table()}\nafter {rounds} rounds of jit and of the Flower deployment"


def check_app(prog, args: tuple, made: Any, app: str, nodes: list, home: str,
              rounds: int) -> tuple:
    """`run_check` then `parity_of_run`, with the client runtime the node configs name
    (`client-runtime`): (text, ok). The text ends with what each round's report says of
    its nodes (`node_lines`): on a mismatch, which node was lost and why."""
    runtimes = {str(c.get("client-runtime", "xla")) for c in nodes} or {"xla"}
    if len(runtimes) != 1:
        raise ArgumentError(f"the check's nodes name client runtimes {sorted(runtimes)}; "
                            "give every node the same client-runtime")
    _, result_npz, took = run_check(app, nodes, home, rounds)
    report = parity_of_run(prog, args, made, result_npz, rounds, len(nodes), took,
                           client_runtime=runtimes.pop())
    lines = node_lines(read_reports(os.path.dirname(result_npz)))
    return "\n".join([describe(report, rounds)] + lines), report.ok
