"""The shared FedAvg workload on fax_bridge, locally under jit or exported to a device fleet.

Runs in the main venv (``.venv``). One round is one ``fax_bridge.program(clients=10)``:
``federated_broadcast`` of the server model, ``federated_map_clients`` of the local SGD
loop (``lax.scan`` over the 5 batches), and ``federated_weighted_mean`` by the clients'
example counts of the client models and of their mean losses. The cohort and its
batches come from ``workload.py`` exactly as for the other peers.

``--mode local``  the program under ``jax.jit``, compiled ahead of time during setup.
``--mode fleet``  the program exported once with ``fax_bridge.export_tff`` (setup), then
                  run each round on a ``fax_bridge.LocalFleet`` of ``--devices`` device
                  processes (started in setup); ``bytes_moved`` is the sum over rounds of
                  the wire bytes down and up of the round reports. The devices compile
                  the exported stages on first use, so the first round includes that.
                  The round goes as one request per device (a round plan).
``--workload large``  fleet mode on ``large_workload.py`` (a cohort of 1,000 from 10,000
                  clients): the population is written once with
                  ``fax_bridge.data.write_population`` to ``--population-dir`` (kept and
                  reused; the write is reported as ``population_write_s``, not setup),
                  every device hosts it (``LocalFleet(population=DIR)``), and each round
                  names its cohort by reference (``PopulationRef`` with the cohort's
                  ids), so the coordinator sends client ids and the model, no rows. Same
                  round program as the shared workload (every client's count is 80). The
                  first round is the warm-up; ``round_s_median`` is over the others.

    .venv/bin/python benchmarks/peers/fax_bridge_peer.py [--mode local|fleet]
        [--devices 2] [--rounds 20] [--seed 0] [--json OUT]
    .venv/bin/python benchmarks/peers/fax_bridge_peer.py --mode fleet --workload large
        [--devices 2] [--rounds 3] [--population-dir DIR] [--json OUT]
    .venv/bin/python benchmarks/peers/fax_bridge_peer.py --grad-check [--json OUT]

``--grad-check`` prints the loss and gradient of the fixed program that
``fax_peer.py --grad-check`` prints (``workload.check_program_inputs``: the mean over
round 0's clients of the loss of the broadcast initial weights on each client's first
batch), differentiated through fax_bridge's federated primitives.

Peak memory is the largest sampled RSS sum over this process and all its descendants
(the fleet's device processes); without psutil it is read from ``/proc``.
"""

from __future__ import annotations

import common  # first: starts the clock and puts workload on the path

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The checkout this script belongs to is the fax_bridge measured (and the one its device
# processes run), whichever checkout the venv was installed from.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

import workload  # noqa: E402

PLACEMENTS = ("server", "clients", "clients", "clients")


class ProcTreeRss(common.PeakRss):
    """``common.PeakRss``, reading the process tree from ``/proc`` when psutil is absent."""

    def _sample(self) -> None:
        if self._proc is not None:
            super()._sample()
            return
        total = 0
        for pid in [os.getpid(), *_proc_descendants(os.getpid())]:
            total += _proc_rss_bytes(pid)
        self._peak = max(self._peak, total)


def _proc_descendants(root: int) -> List[int]:
    """Every live descendant of ``root``, from the parent ids in ``/proc/*/stat``."""
    children: Dict[int, List[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name (field 2) may hold spaces; the fields after ")" are fixed.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _proc_rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def build(cohort: int) -> Tuple[Any, Callable, Any]:
    """(round program, per-client loss function, mean-client-loss check program)."""
    import fax_bridge as fb

    from jax_mlp import local_train, loss_fn

    @fb.program(clients=cohort)
    def fedavg_round(params: Any, xb: Any, yb: Any, counts: Any) -> Tuple[Any, Any]:
        at_clients = fb.federated_broadcast(params)
        new_params, losses = fb.federated_map_clients(local_train, (at_clients, xb, yb))
        return (fb.federated_weighted_mean(new_params, counts),
                fb.federated_weighted_mean(losses, counts))

    @fb.program(clients=cohort)
    def mean_client_loss(params: Any, x: Any, y: Any) -> Any:
        at_clients = fb.federated_broadcast(params)
        return fb.federated_mean(fb.federated_map_clients(loss_fn, (at_clients, x, y)))

    return fedavg_round, loss_fn, mean_client_loss


def round_specs(cohort: int) -> Tuple[Any, ...]:
    """Shapes and dtypes of the round's arguments (params, xb, yb, counts)."""
    import jax
    import jax.numpy as jnp

    f32 = jnp.float32
    steps, batch = workload.LOCAL_STEPS, workload.BATCH
    return (
        {k: jax.ShapeDtypeStruct(s, f32) for k, s in workload.PARAM_SHAPES.items()},
        jax.ShapeDtypeStruct((cohort, steps, batch, workload.N_FEATURES), f32),
        jax.ShapeDtypeStruct((cohort, steps, batch), jnp.int32),
        jax.ShapeDtypeStruct((cohort,), f32),
    )


def _split_result(result: Any) -> Tuple[Dict[str, np.ndarray], float]:
    """(host model, loss) from a round's result, whichever container it comes back in."""
    model, loss = result
    if not isinstance(model, dict):  # a struct in the exported type's order
        model = dict(zip(sorted(workload.PARAM_NAMES), list(model)))
    host = {k: np.asarray(model[k], dtype=np.float32) for k in workload.PARAM_NAMES}
    return host, float(np.asarray(loss))


def grad_check() -> Dict[str, Any]:
    """Loss and gradient of the fixed check program, through fax_bridge's AD rules."""
    _, _, program = build(workload.COHORT)
    return common.grad_check("fax_bridge", program)


def run_local(rounds: int, seed: int) -> Dict[str, Any]:
    """Setup (import, data, ahead-of-time compilation), then ``rounds`` jitted rounds."""
    rss = ProcTreeRss().start()
    import jax

    import fax_bridge as fb

    t_data = time.perf_counter()
    data = workload.client_data(workload.load_split())
    params = {k: jax.device_put(v) for k, v in workload.load_init_params().items()}
    t_compile = time.perf_counter()
    program, _, _ = build(workload.COHORT)
    round_fn = jax.jit(program).lower(*round_specs(workload.COHORT)).compile()
    t_end = time.perf_counter()
    setup_s = t_end - common.PROCESS_T0
    breakdown = {"import_s": round(t_data - common.PROCESS_T0, 3),
                 "data_s": round(t_compile - t_data, 3), "compile_s": round(t_end - t_compile, 3)}
    round_s, losses, history = common.jitted_rounds(round_fn, params, data, rounds, seed)
    peak = rss.stop()
    return common.result_line(
        "fax_bridge_local", setup_s, round_s, losses, history, peak, None,
        extra={"mode": "local", "setup_breakdown": breakdown,
               "versions": {"jax": jax.__version__, "fax_bridge": fb.__version__}},
    )


def write_population(data: "workload.ClientData", directory: str) -> None:
    """Every client's batches as a population the devices host: client i stores one
    example of each round argument, ``xb`` [LOCAL_STEPS, BATCH, 64], ``yb``
    [LOCAL_STEPS, BATCH] and ``counts`` (its example count)."""
    from fax_bridge.data import write_population as write

    write(directory, ({"xb": data.x[i][None], "yb": data.y[i][None],
                       "counts": data.counts[i][None]} for i in range(data.x.shape[0])))


def _report_row(rep: Any) -> Dict[str, Any]:
    """The figures kept of one round's ``RoundReport``."""
    return {"bytes_down": rep.bytes_down, "bytes_up": rep.bytes_up,
            "payload_down": rep.payload_down, "payload_up": rep.payload_up,
            "rpcs": rep.rpcs, "wall_s": round(rep.wall_s, 4),
            "compute_s": round(rep.compute_s, 4), "participants": len(rep.participants)}


def _device_compute_median(reports: List[Dict[str, Any]]) -> Optional[float]:
    return float(np.median([r["compute_s"] for r in reports])) if reports else None


@dataclasses.dataclass
class FleetRounds:
    """What ``fleet_rounds`` measured: per-round times, losses, models and report rows,
    the fleet's start time, and the setup time up to the end of that start."""

    round_s: List[float] = dataclasses.field(default_factory=list)
    losses: List[float] = dataclasses.field(default_factory=list)
    history: List[Dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    reports: List[Dict[str, Any]] = dataclasses.field(default_factory=list)
    fleet_start_s: float = 0.0
    setup_s: float = 0.0


def fleet_rounds(fleet: Any, proto: Any, params: Any, rounds: int,
                 cohort_args: Callable[[int], Tuple[Any, ...]]) -> FleetRounds:
    """Starts ``fleet``, runs ``rounds`` rounds of ``proto`` from ``params`` and closes
    the fleet. ``cohort_args(r)`` gives round ``r``'s arguments after the model (the
    cohort's batches or references to them); it runs inside the round's timing, as the
    cohort's sampling is part of a round. ``setup_s`` counts from ``common.PROCESS_T0``
    to the fleet's start."""
    out = FleetRounds()
    try:
        t_start = time.perf_counter()
        fleet.start()
        out.fleet_start_s = time.perf_counter() - t_start
        out.setup_s = time.perf_counter() - common.PROCESS_T0
        for r in range(rounds):
            t0 = time.perf_counter()
            result, rep = fleet.run(proto, params, *cohort_args(r), report=True)
            params, loss = _split_result(result)
            out.round_s.append(time.perf_counter() - t0)
            out.losses.append(loss)
            out.history.append(params)
            out.reports.append(_report_row(rep))
    finally:
        fleet.close()
    return out


def fleet_result(run: FleetRounds, rss: common.PeakRss, proto: Any, devices: int,
                 setup: Dict[str, float], fields: Dict[str, Any], note: str,
                 warmup: int = 0, setup_s: Optional[float] = None) -> Dict[str, Any]:
    """The result line of a fleet run: stops ``rss``, adds the figures both workloads
    report to ``fields`` (the workload's own, placed after the mode, devices and round
    path). ``setup``: the import, data and export seconds; ``setup_s``: the setup time
    when it differs from ``run.setup_s``; ``warmup``: rounds left out of the medians."""
    import jax

    import fax_bridge as fb

    peak = rss.stop()
    reports = run.reports
    breakdown = {k: round(v, 3) for k, v in
                 {**setup, "fleet_start_s": run.fleet_start_s}.items()}
    extra = {
        "mode": "fleet",
        "devices": devices,
        "round_path": "plan",
        **fields,
        "setup_breakdown": breakdown,
        "proto_bytes": proto.ByteSize(),
        "payload_moved": sum(r["payload_down"] + r["payload_up"] for r in reports),
        "device_compute_s_median": _device_compute_median(reports[warmup:]),
        "round_reports": reports,
        "bytes_moved_note": note,
        "versions": {"jax": jax.__version__, "fax_bridge": fb.__version__},
    }
    return common.result_line(
        "fax_bridge_fleet", run.setup_s if setup_s is None else setup_s, run.round_s,
        run.losses, run.history, peak, sum(r["bytes_down"] + r["bytes_up"] for r in reports),
        warmup=warmup, extra=extra)


def run_fleet(rounds: int, seed: int, devices: int,
              data_on: str = "device") -> Dict[str, Any]:
    """Setup (import, data, export, fleet start), then ``rounds`` rounds on the fleet
    (one request per device per round). ``data_on``:
    "device", the devices host every client's batches and each round names its cohort
    by id, as Flower's clients hold their partitions; "coordinator", the coordinator
    sends the cohort's batches in each round's requests."""
    import tempfile

    rss = ProcTreeRss().start()
    import fax_bridge as fb

    t_data = time.perf_counter()
    data = workload.client_data(workload.load_split())
    params = workload.load_init_params()
    import_s = t_data - common.PROCESS_T0
    data_s = time.perf_counter() - t_data
    program, _, _ = build(workload.COHORT)
    ids0 = workload.cohort(seed, 0)
    t_export = time.perf_counter()
    proto = fb.export_tff(program, params, data.x[ids0], data.y[ids0], data.counts[ids0],
                          placements=PLACEMENTS)
    export_s = time.perf_counter() - t_export
    store = tempfile.TemporaryDirectory(prefix="fax_bridge_peer_")
    population = None
    if data_on == "device":
        population = os.path.join(store.name, "clients")
        write_population(data, population)

    def cohort_args(r: int) -> Tuple[Any, ...]:
        ids = workload.cohort(seed, r)
        if population is None:
            return data.x[ids], data.y[ids], data.counts[ids]
        return _population_refs(ids)

    try:
        run = fleet_rounds(fb.LocalFleet(devices=devices, population=population),
                           proto, params, rounds, cohort_args)
    finally:
        store.cleanup()
    reports = run.reports
    return fleet_result(
        run, rss, proto, devices,
        {"import_s": import_s, "data_s": data_s, "export_s": export_s},
        {"client_data": data_on, "rpcs_per_round": reports[0]["rpcs"] if reports else None},
        "wire bytes of the round reports, coordinator->devices and back")


def _population_refs(ids: np.ndarray) -> Tuple[Any, ...]:
    """The round arguments xb, yb and counts as references to clients ``ids`` of the
    population the devices host."""
    import fax_bridge as fb

    return tuple(fb.PopulationRef(keys=[k], client_ids=ids) for k in ("xb", "yb", "counts"))


def write_large_population(directory: str, pop: Any) -> float:
    """Writes the large workload's population to ``directory`` unless it is there
    already (checked by client count and example shapes); returns the seconds spent."""
    from fax_bridge.data import ClientStore
    from fax_bridge.data import write_population as write

    t0 = time.perf_counter()
    if os.path.exists(os.path.join(directory, "population.json")):
        store = ClientStore(directory)
        steps, batch = workload.LOCAL_STEPS, workload.BATCH
        want = {"xb": (steps, batch, workload.N_FEATURES), "yb": (steps, batch), "counts": ()}
        have = {k: tuple(shape) for k, (_, shape) in store.spec.items()}
        if store.num_clients != pop.size or have != want or set(store.sizes) != {1}:
            raise SystemExit(f"{directory} holds another population ({store.num_clients} "
                             f"clients, arrays {have}); remove it or pass another "
                             "--population-dir")
        return 0.0
    write(directory, pop.clients())
    return time.perf_counter() - t0


def run_fleet_large(rounds: int, seed: int, devices: int, population_dir: str,
                    population: Optional[int] = None,
                    cohort: Optional[int] = None) -> Dict[str, Any]:
    """The large workload: setup (import, population index, export, fleet start), then
    ``rounds`` rounds whose cohort the devices read from their own population store.
    ``population`` / ``cohort`` shrink it (tests); default 10,000 and 1,000."""
    rss = ProcTreeRss().start()
    import fax_bridge as fb
    import large_workload as large

    t_data = time.perf_counter()
    import_s = t_data - common.PROCESS_T0
    pop = large.Population(population or large.POPULATION)
    size = cohort or large.COHORT
    write_s = write_large_population(population_dir, pop)
    data_s = time.perf_counter() - t_data - write_s
    params = workload.load_init_params()
    program, _, _ = build(size)
    t_export = time.perf_counter()
    proto = fb.export_tff(program, params, *round_specs(size)[1:], placements=PLACEMENTS)
    export_s = time.perf_counter() - t_export
    fleet = fb.LocalFleet(devices=devices, population=population_dir, rpc_timeout_s=600,
                          startup_timeout_s=300)
    run = fleet_rounds(fleet, proto, params, rounds,
                       lambda r: _population_refs(large.cohort(seed, r, pop.size, size)))
    rpcs = [r["rpcs"] for r in run.reports]
    final = run.history[-1] if run.history else None
    return fleet_result(
        run, rss, proto, devices,
        {"import_s": import_s, "data_s": data_s, "export_s": export_s},
        {"workload": "large", "population": pop.size, "cohort": size,
         "one_request_per_device": all(n == devices for n in rpcs[1:]),
         "rpcs_per_round": rpcs, "population_write_s": round(write_s, 3),
         "final_params": {k: v.tolist() for k, v in final.items()} if final else None},
        "wire bytes of the round reports, coordinator->devices and back (client ids and "
        "the model; devices read the rows)", warmup=1, setup_s=run.setup_s - write_s)


def main(argv: Optional[List[str]] = None) -> None:
    parser = common.base_parser(__doc__.splitlines()[0], grad_check=True, workloads=True)
    parser.add_argument("--mode", choices=("local", "fleet"), default="local")
    parser.add_argument("--devices", type=int, default=2, help="fleet devices (default 2)")
    parser.add_argument("--data", choices=("device", "coordinator"), default="device",
                        help="fleet: where the clients' batches live (default: the devices "
                             "host them and rounds name the cohort by id)")
    parser.add_argument("--population-dir", default=os.path.join("out", "bench",
                                                                 "population-large"),
                        help="large: where the population is written once and kept")
    args = parser.parse_args(argv)
    rounds = common.rounds_of(args)
    if args.workload == "large":
        if args.mode != "fleet" or args.grad_check:
            parser.error("--workload large runs only in --mode fleet, as a round plan")
        result = run_fleet_large(rounds, args.seed, args.devices, args.population_dir,
                                 args.population_size, args.cohort_size)
    elif args.grad_check:
        result = grad_check()
    elif args.mode == "local":
        result = run_local(rounds, args.seed)
    else:
        result = run_fleet(rounds, args.seed, args.devices, args.data)
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
