"""Runs a round's Federated Compute forms plan-shaped on a TFRecord population.

`fax-bridge forms ROUND --form mrf|daf --for fcp -o DIR` writes the FCP form of a round,
the round itself (`input_round.pb`) and its example arguments' server state
(`state.npz`). `run_plan(DIR, POPULATION, rounds)` runs that form for `rounds` rounds the
way a plan's phases run (`tools/tff087/plan_run.py`, `plan_run_daf.py`: every value
between phases through a TF checkpoint file, each client's examples read by
TensorFlow from its TFRecord file), in the TFF 0.87 side environment (`side_env`: the
main environment launches it; `make tff-venv` builds it). The population is one
written by `fax_bridge.data.examples.write_population`, its features named as the
round's client data (`data/x`, `mask`: `fcp.client_features`), checked before TFF
starts. Each round's state and outputs come back (`PlanRun`, unsigned leaves restored);
`write_state` writes a state as `state.npz` holds it (unsigned leaves as signed bits),
so a run's last state can start another.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from typing import Optional

import numpy as np
from federated_language.proto.computation_pb2 import Computation

from fax_bridge.data.examples import ExamplePopulation, check_population_features
from fax_bridge.errors import ExportError
from fax_bridge.tff import fcp, forms

STATE_FILE = "state.npz"
FORM_KINDS = {"DistributeAggregateForm": "daf", "MapReduceForm": "mrf"}


@dataclasses.dataclass
class PlanRun:
    """Per round r, `states[r]` the flat state after it and `outputs[r]` its flat
    outputs (leaves in the order of `state_names`, `output_names`), as the round's own
    dtypes; `seconds` the plan-shaped run's time in the TFF process."""

    kind: str
    state_names: list
    output_names: list
    states: list
    outputs: list
    seconds: float


def plan_rounds(path: str, rounds: int) -> list:
    """[(flat state, flat outputs)] of each round from a plan-shaped run's npz (as the
    TFF side writes it: `state.R.I`, `output.R.I`)."""
    with np.load(path) as z:
        def leaves(kind: str, r: int) -> list:
            count = sum(1 for k in z.files if k.startswith(f"{kind}.{r}."))
            return [z[f"{kind}.{r}.{i}"] for i in range(count)]
        return [(leaves("state", r), leaves("output", r)) for r in range(rounds)]


def write_state(path: str, state_leaves: list) -> str:
    """The flat server state as the plan runs keep it (`fcp.encode_state`)."""
    flat = fcp.encode_state(state_leaves)
    np.savez(path, num_state=len(flat), **{f"state.{i}": v for i, v in enumerate(flat)})
    return path


def _read_form_dir(form_dir: str) -> tuple[str, Computation]:
    manifest_path = os.path.join(form_dir, "manifest.json")
    fix = (f"write it with `fax-bridge forms MODULE:ROUND --form mrf --for fcp -o "
           f"{form_dir}`")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        with open(os.path.join(form_dir, "input_round.pb"), "rb") as f:
            proto = Computation.FromString(f.read())
    except (OSError, ValueError) as e:
        raise ExportError(f"{form_dir} holds no FCP form ({e}); {fix}") from None
    if manifest.get("for") != "fcp" or manifest.get("form") not in FORM_KINDS:
        raise ExportError(f"{manifest_path} is not a Federated Compute form (its 'for' is "
                          f"{manifest.get('for', 'tff')!r}); {fix}")
    if not os.path.isfile(os.path.join(form_dir, STATE_FILE)):
        raise ExportError(f"{form_dir} has no {STATE_FILE} (the round's initial server "
                          f"state); {fix}, or write one with fcp_run.write_state")
    return FORM_KINDS[manifest["form"]], proto


def run_plan(form_dir: str, population: str, rounds: int,
             work_dir: Optional[str] = None, timeout_s: float = 900.0) -> PlanRun:
    """Runs the FCP form in `form_dir` plan-shaped for `rounds` rounds over every client
    of `population`, from the server state in `form_dir/state.npz`.

    Args:
      form_dir: what `fax-bridge forms ... --for fcp -o DIR` wrote.
      population: a folder `fax_bridge.data.examples.write_population` wrote, one
        feature per leaf of the round's client data, named by its path.
      rounds: how many rounds (>= 1).
      work_dir: where the phases' checkpoints go (default: a temporary folder).
      timeout_s: how long the TFF side process may take.

    Returns:
      The `PlanRun`. Raises `ExportError` (a form or state missing, or a form TFF could
      not build), `DataError` (a population whose features are not the round's) or
      `side_env.SideEnvError` (no TFF environment: build it with `make tff-venv`).
    """
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ExportError(f"rounds must be an int >= 1, got {rounds!r}")
    kind, proto = _read_form_dir(form_dir)
    features = fcp.client_features(proto)
    check_population_features(population, features)
    clients = ExamplePopulation(population)
    state_names = [name for name, _, _ in fcp.state_leaves(proto)]
    dtypes = [dtype for _, dtype, _ in fcp.state_leaves(proto)]
    with tempfile.TemporaryDirectory(prefix="fax_bridge_plan_") as scratch:
        folder = work_dir or scratch
        os.makedirs(folder, exist_ok=True)
        outputs = os.path.join(folder, "fcp_outputs.npz")
        run = {"state": os.path.join(form_dir, STATE_FILE), "examples": clients.paths,
               "rounds": rounds, "outputs": outputs}
        job = fcp.with_fcp(forms.job(kind, proto, [], folder, artifacts=True), proto,
                           [kind], run)
        result = forms.build_forms([job], folder, timeout_s)[kind].get("fcp", {})
        fcp.check_result(kind, result)
        values = plan_rounds(result[kind]["outputs"], rounds)
    out_leaves = fcp.output_leaves(proto)
    return PlanRun(kind, state_names, [name for name, _, _ in out_leaves],
                   [fcp.decode_state(s, dtypes) for s, _ in values],
                   [fcp.decode_state(o, [d for _, d, _ in out_leaves]) for _, o in values],
                   result[kind].get("run_seconds", 0.0))

