"""The ServerApp of a Flower round: rounds under a `RoundPolicy` over the SuperNodes.

Each round runs through the fleet's round engine (`rounds.engine`): planned as the fleet
plans it (`engine.open_round`: the seeded cohort, dropouts, late clients,
`min_clients`), the server prepare here, one `train` message to each SuperNode holding
participants (the broadcast and the ids of its participants: `flower.transport`), the
answers checked as the coordinator checks a device's and merged in node order, which is
population order, then finished and fed to the server result. The round's secure sums
are not in the answers: Flower's SecAgg+ sums them over the nodes that answered
(`secagg.aggregate`, the transport's secure phase, run after the lost nodes are
dropped), so this app sees only their totals. A node that answers with an error or not
within the deadline (`round-deadline-s`, else `node-timeout-s`) is dropped with its
clients, as the fleet drops a lost device (`engine.drop_lost`); so is a node lost
during SecAgg+ before its masked vector is summed (its other partials leave the round
too), while fewer nodes than SecAgg+'s reconstruction threshold (`secagg-threshold`,
`secagg.shares_needed`) fail the round; when fewer than `min-clients` clients remain
the round fails with a `FleetError` naming the nodes (none left: how many did not
answer and how many answered but had their answers refused, each with why; the run's
first round waits longer, `first-round-timeout-s`: nodes start then), while with
`min-clients=0` a round every node left finishes over no clients, its sums the zeros of
their types. Every
round leaves a `RoundReport` (logged, and written to `reports.jsonl`), whose `served`
names, for each node that answered, the client runtime that computed its answer and the
sha256 of the LiteRT model that ran (None for XLA).

The run's settings are the app's run config (`[tool.flwr.app.config]`, overridable with
`flwr run --run-config`), see `Settings`: every key checked once against `RUN_CONFIG`.
What a node answers is read strictly and a node whose answer deviates is dropped,
named: its block (`nodes.discover`, bounded by `population-size`), its round answer
(`transport`), its SecAgg+ replies (`secagg_replies`). With `checkpoint-dir` the state is saved
after every round (`rounds.checkpoint`) and a rerun resumes after the last saved round
(`checkpoint.resume`, which refuses a checkpoint of another run) with the same bits as
an uninterrupted run.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from typing import Any, Optional

import numpy as np

from fax_bridge.errors import FleetError
from fax_bridge.flower import nodes as flower_nodes
from fax_bridge.flower import secagg
from fax_bridge.rounds.cohort import Cohort
from fax_bridge.rounds.policy import RoundPolicy, RoundReport


def _flag(value) -> bool:
    """A run config's yes/no value: a TOML boolean, or true/false, 1/0 written as text."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no", ""):
        return False
    raise ValueError(text)


MAX_WAIT_S = 7 * 24 * 3600.0  # the longest wait a run config may ask for: a week
MAX_CLIENTS = 2 ** 31 - 1     # the most clients a run config may name
MAX_NODES = 1 << 16           # the most SuperNodes min-nodes may ask for


@dataclasses.dataclass(frozen=True)
class _Key:
    """One run config key: its kind ("whole", "number", "flag", "text"), default and
    accepted range [`low`, `high`] (`low_open`, `high_open`: that end excluded)."""

    kind: str
    default: Any
    low: float = 0
    high: float = 0
    low_open: bool = False
    high_open: bool = False

    def accepted(self) -> str:
        if self.kind == "flag":
            return "true or false"
        if self.kind == "text":
            return "a string (quoted in --run-config)"
        show = (lambda x: str(int(x))) if self.kind == "whole" else (lambda x: f"{x:g}")
        return (f"{'a whole number' if self.kind == 'whole' else 'a number'} in "
                f"{'(' if self.low_open else '['}{show(self.low)}, {show(self.high)}"
                f"{')' if self.high_open else ']'}")

    def holds(self, number) -> bool:
        return ((self.low < number if self.low_open else self.low <= number)
                and (number < self.high if self.high_open else number <= self.high))


# Every key `Settings.from_run_config` reads, as `[tool.flwr.app.config]` spells it.
RUN_CONFIG = {
    "num-rounds": _Key("whole", 1, 1, 10 ** 6),
    "cohort-size": _Key("whole", 0, 0, MAX_CLIENTS),
    "population-size": _Key("whole", 0, 0, MAX_CLIENTS),
    "dropout": _Key("number", 0.0, 0.0, 1.0, high_open=True),
    "round-deadline-s": _Key("number", 0.0, 0.0, MAX_WAIT_S),
    "min-clients": _Key("whole", 1, 0, MAX_CLIENTS),
    "seed": _Key("whole", 0, 0, 2 ** 63 - 1),
    "rounded-partials": _Key("flag", False),
    "node-timeout-s": _Key("number", 120.0, 0.0, MAX_WAIT_S, low_open=True),
    "first-round-timeout-s": _Key("number", 300.0, 0.0, MAX_WAIT_S),
    "min-nodes": _Key("whole", 1, 1, MAX_NODES),
    "wait-nodes-s": _Key("number", 60.0, 0.0, MAX_WAIT_S),
    "poll-s": _Key("number", 0.05, 0.0, 60.0, low_open=True),
    "out-dir": _Key("text", ""),
    "checkpoint-dir": _Key("text", ""),
    "secagg-threshold": _Key("number", 0.0, 0.0, 1.0),
    "initial-state": _Key("text", ""),
    "app-state": _Key("text", ""),
}


def run_config_value(config, key: str) -> Any:
    """The run config's `key` (`RUN_CONFIG`), else its default, checked: a whole number
    (an int, or a float or string of one), a finite number, true/false or a string, in
    the key's range; a FleetError naming the key, the value and what it accepts
    otherwise (never NaN, an infinity, a fraction cut to a whole number, or a type's
    name)."""
    spec = RUN_CONFIG[key]
    value = config.get(key, spec.default)
    shown = repr(value)[:60]
    example = '""' if spec.kind == "text" else str(spec.default).lower()
    refuse = FleetError(f"run config {key}={shown} is not {spec.accepted()}; give e.g. "
                        f"{key}={example}")
    if spec.kind == "flag":
        try:
            return _flag(value)
        except ValueError:
            raise refuse from None
    if spec.kind == "text":
        if not isinstance(value, str) or "\0" in value:
            raise refuse
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float, str, np.integer,
                                                          np.floating)):
        raise refuse
    try:
        number = int(value) if isinstance(value, (int, np.integer)) else float(value)
        if spec.kind == "number":
            number = float(number)
    except (TypeError, ValueError, OverflowError):
        raise refuse from None
    if isinstance(number, float) and not math.isfinite(number):
        raise refuse
    if spec.kind == "whole" and isinstance(number, float):
        if not number.is_integer():
            raise refuse
        number = int(number)
    if not spec.holds(number):
        raise refuse
    return number


@dataclasses.dataclass(frozen=True)
class Settings:
    """The run config of a Flower round (keys as in `[tool.flwr.app.config]`, each
    checked by `run_config_value` against `RUN_CONFIG`)."""

    num_rounds: int = 1
    policy: RoundPolicy = RoundPolicy()
    node_timeout_s: float = 120.0
    first_round_timeout_s: float = 300.0
    min_nodes: int = 1
    wait_nodes_s: float = 60.0
    poll_s: float = 0.05
    out_dir: str = ""
    checkpoint_dir: str = ""
    secagg_threshold: float = 0.0
    initial_state: str = ""  # a state of the user's (a warm start): checked as input
    app_state: str = ""  # the state written with the app: its recorded sha256 too
    population_size: int = 0  # 0: not declared (`nodes.MAX_UNDECLARED_CLIENTS` bounds it)

    @classmethod
    def from_run_config(cls, config) -> "Settings":
        """The settings of run config `config` (a mapping), every key checked
        (`run_config_value`); keys it does not name take their defaults."""
        def get(key):
            return run_config_value(config, key)

        cohort = get("cohort-size")
        deadline = get("round-deadline-s")
        policy = RoundPolicy(cohort_size=cohort if cohort > 0 else None,
                             dropout=get("dropout"),
                             round_deadline_s=deadline if deadline > 0 else None,
                             min_clients=get("min-clients"),
                             seed=get("seed"), emulate_delays=False,
                             rounded_partials=get("rounded-partials"))
        return cls(num_rounds=get("num-rounds"), policy=policy,
                   node_timeout_s=get("node-timeout-s"),
                   first_round_timeout_s=get("first-round-timeout-s"),
                   min_nodes=get("min-nodes"), wait_nodes_s=get("wait-nodes-s"),
                   poll_s=get("poll-s"), out_dir=get("out-dir"),
                   checkpoint_dir=get("checkpoint-dir"),
                   secagg_threshold=secagg.checked_threshold(get("secagg-threshold")),
                   initial_state=get("initial-state"), app_state=get("app-state"),
                   population_size=get("population-size"))

    def deadline_s(self, first: bool) -> float:
        """How long a round waits for the nodes' answers: `round-deadline-s`, else
        `node-timeout-s`; the run's first round at least `first-round-timeout-s`, as
        nodes load jax and compile the client part then."""
        deadline = self.policy.round_deadline_s
        wait = self.node_timeout_s if deadline is None else deadline
        return max(wait, self.first_round_timeout_s) if first else wait


def run_round(grid, made, nodes: list, state: Any, round_index: int, settings: Settings,
              cohort: Cohort, reports: list, first: bool = False) -> Any:
    """One round (module docstring) through the round engine over the SuperNodes
    (`flower.transport.FlowerTransport`); returns its result. `cohort`: the run's
    (`cohort_of`). Its `RoundReport` is appended to `reports` before anything runs, so
    a failed round leaves one too. `first`: the run's first round
    (`Settings.deadline_s`)."""
    from fax_bridge.rounds import engine
    from fax_bridge.flower.transport import FlowerTransport

    policy = settings.policy
    rep = engine.open_round(policy, cohort, round_index, reports, len(nodes), made.proto)
    start = time.perf_counter()
    wait = settings.deadline_s(first)

    def drop(lost: list, answered: int) -> None:
        if not answered and policy.min_clients > 0:  # else a round over no clients
            engine.record_lost(rep, lost)
            raise FleetError(_none_left(round_index, lost, policy.min_clients))
        engine.drop_lost(rep, policy, lost, "lower min-clients, raise the deadline or "
                         "restart those SuperNodes")

    try:
        transport = FlowerTransport(grid, nodes, rep.participants.array(), round_index, wait,
                                    settings.poll_s, rep.traffic, settings.secagg_threshold,
                                    cohort=cohort.size,
                                    rounded_partials=policy.rounded_partials,
                                    served=rep.served)
        return engine.run_round(made.split, made.server_arg(state), transport,
                                made.prepared.result, on_lost=drop)
    except BaseException as e:
        rep.error = f"{type(e).__name__}: {e}"
        raise
    finally:
        rep.wall_s = time.perf_counter() - start


def _none_left(round_index: int, lost: list, min_clients: int) -> str:
    """Why round `round_index` failed when no SuperNode's answer is left in it (`lost`:
    every node, as `engine.LostHolder`s): how many did not answer and how many answered
    but had their answers refused, each named with why, and the fix for each."""
    refused = [h.where for h in lost if h.refused]
    silent = [h.where for h in lost if not h.refused]
    said, fixes = [], []
    if refused:
        said.append(f"{len(refused)} SuperNode{'s' * (len(refused) > 1)} answered but "
                    f"{'their answers were' if len(refused) > 1 else 'its answer was'} "
                    f"refused: {'; '.join(refused)}")
        fixes.append("check that those nodes run this fax_bridge")
    if silent:
        said.append(f"{len(silent)} did not answer: {'; '.join(silent)}" if refused
                    else f"no SuperNode answered: {'; '.join(silent)}")
        fixes.append("restart the silent ones or raise the wait (node-timeout-s, "
                     "round-deadline-s)")
    return (f"round {round_index}: {'; and '.join(said)}; no client is left but "
            f"min_clients={min_clients}; {', and '.join(fixes)}, or set min-clients=0 "
            "to let a round of sums finish over no clients")


def cohort_of(settings: Settings, nodes: list) -> Cohort:
    """The run's cohort (`rounds.cohort.Cohort.of`): the run config's cohort-size of the
    clients the SuperNodes' blocks hold together (`nodes.discover`, in population
    order), refused by name when the nodes hold fewer."""
    return Cohort.of(settings.policy.cohort_size, nodes[-1].stop if nodes else 0,
                     source="the SuperNodes' blocks, their --node-config num-clients",
                     setting="run config cohort-size")


class _Outputs:
    """What a run leaves in `out-dir`: `reports.jsonl` (one `RoundReport` a line; a file
    type Flower leaves out of app bundles, so an out-dir inside the app stays out of
    them) and `result.npz` (the last round's result, keys as `fax-bridge run` writes
    them). The folder is made and proved writable before any round
    (`output_folders.writable_folder`); if writing in it fails later, this run's reports
    and result go to a new folder under the temporary directory instead, and the log
    says where."""

    def __init__(self, folder: str, log=print):
        from fax_bridge.system import output_folders

        self.folder = folder and output_folders.writable_folder(folder, "run config out-dir")
        self.log = log

    def write_reports(self, reports: list) -> None:
        lines = [json.dumps(_plain_report(rep), default=_plain) for rep in reports]
        data = "".join(line + "\n" for line in lines).encode()
        self._write("reports.jsonl", lambda f: f.write(data))

    def result(self, made, result: Any) -> None:
        from fax_bridge.runtime import npz_keys

        arrays = npz_keys.result_to_npz(result, made.prepared.result)
        self._write("result.npz", lambda f: np.savez(f, **arrays))

    def _write(self, name: str, write) -> None:
        """`write(file)` into a new file renamed over `name` once complete."""
        if not self.folder:
            return
        try:
            self._write_in(self.folder, name, write)
            return
        except OSError as e:
            from fax_bridge.system import output_folders

            failed, self.folder = self.folder, output_folders.rescue_folder("out")
            self.log(f"fax_bridge: run config out-dir {failed} cannot be written "
                     f"({e.strerror or e}); this run's reports and result go to "
                     f"{self.folder} instead")
        self._write_in(self.folder, name, write)

    @staticmethod
    def _write_in(folder: str, name: str, write) -> None:
        import tempfile

        fd, part = tempfile.mkstemp(prefix=f".{name}.", dir=folder)  # never through a link
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
            os.chmod(part, 0o644)
            os.replace(part, os.path.join(folder, name))
        except BaseException:
            if os.path.exists(part):
                os.unlink(part)
            raise


def _plain_report(rep: RoundReport) -> dict:
    out = rep.as_dict()
    out["delays_s"] = {int(k): float(v) for k, v in out["delays_s"].items()}
    return out


def _plain(value):
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON")


def _resume(made, settings: Settings) -> tuple:
    """(state, first round, checkpoint meta) from the checkpoint or the bundle."""
    from fax_bridge.rounds import checkpoint

    meta = {"computation": str(made.prepared.type),
            "program": checkpoint.program_fingerprint(made.proto),
            "policy": repr(settings.policy), "num_rounds": settings.num_rounds}
    from fax_bridge.flower.bundle import read_state

    tensors = made.state
    if settings.initial_state:
        # The user's own start (a model of theirs, a warm start from a trained one): any
        # file holding the round's state, checked as input (a regular file, each entry's
        # dtype, shape and size), never against the digest of the app's own state.
        tensors = read_state(settings.initial_state, made.state)
    elif settings.app_state:  # the state written beside the app: exactly that file
        tensors = read_state(settings.app_state, made.state, made.state_sha256,
                             key="app-state")
    elif made.state_outside:  # too large for the bundle
        raise FleetError("this round's initial state is not in its app bundle; set "
                         "the run config's app-state to the initial_state.npz "
                         "`fax-bridge flower` wrote beside the app (a path on the "
                         "SuperLink's host), or initial-state to a state of your own")
    state, start = made.state_value(tensors), 0
    if settings.checkpoint_dir:
        saved = checkpoint.resume(settings.checkpoint_dir, meta, setting="checkpoint-dir")
        if saved is not None:
            state, start = made.state_value(saved.state), saved.round + 1
    return state, start, meta


def run_server(grid, run_config, bundle_dir: str, log=print) -> Optional[Any]:
    """Runs the rounds of the round in `bundle_dir` on the grid's SuperNodes; returns the
    last round's result (None when every round had run already)."""
    from fax_bridge.rounds import checkpoint
    from fax_bridge.flower.bundle import read_round
    from fax_bridge.runtime.backend import as_numpy, leaves

    settings = Settings.from_run_config(run_config)
    outputs = _Outputs(settings.out_dir, log)  # folders refused before any node is asked
    if settings.checkpoint_dir:
        from fax_bridge.system import output_folders

        output_folders.writable_folder(settings.checkpoint_dir, "run config checkpoint-dir")
    made = read_round(bundle_dir)
    made.split  # refuses a round that cannot be split before any node is asked
    if made.litert_models is not None:  # the carried models are the app's, or refused
        from fax_bridge.flower.bundle import models_dir
        from fax_bridge.litert import carried

        carried.recorded_files(models_dir(bundle_dir), made.litert_models)
    node_ids = flower_nodes.wait_for_nodes(grid, settings.min_nodes, settings.wait_nodes_s,
                                           settings.poll_s)
    nodes = flower_nodes.discover(grid, node_ids, settings.node_timeout_s, settings.poll_s,
                                  settings.population_size, settings.min_nodes, log)
    cohort = cohort_of(settings, nodes)  # every round's, checked once before any round
    log(f"fax_bridge: {len(nodes)} SuperNodes serve {cohort.population} clients: "
        + ", ".join(n.name for n in nodes))
    state, start, meta = _resume(made, settings)
    reports: list = []
    result = None
    for r in range(start, settings.num_rounds):
        try:
            result = run_round(grid, made, nodes, state, r, settings, cohort, reports,
                               first=r == start)
            state = result[0]
            outputs.result(made, result)  # first: a failed checkpoint loses no result
            if settings.checkpoint_dir:
                try:
                    checkpoint.save(settings.checkpoint_dir, r, leaves(as_numpy(state)),
                                    meta)
                except OSError as e:
                    log(f"fax_bridge: the checkpoint after round {r} was not saved in "
                        f"run config checkpoint-dir {settings.checkpoint_dir} "
                        f"({e.strerror or e}); the run goes on, and a rerun resumes from "
                        "the last checkpoint saved")
        finally:  # the report last: once it names a round, that round's files are there
            outputs.write_reports(reports)
            if reports and reports[-1].round == r:
                log(f"fax_bridge: {reports[-1].summary()}"
                    + (f"; failed: {reports[-1].error}" if reports[-1].error else ""))
    return result


def server_app(bundle_dir: str):
    """The Flower `ServerApp` of the round in `bundle_dir` (module docstring)."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp

    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        from logging import INFO

        from flwr.supercore import log as flwr_log

        run_server(grid, context.run_config, bundle_dir,
                   log=lambda text: flwr_log(INFO, text))

    return app
