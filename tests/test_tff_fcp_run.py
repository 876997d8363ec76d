"""`fax-bridge forms run`: a round's FCP form run plan-shaped on a TFRecord population
(fax_bridge.tff.fcp_run). End to end in the TFF side environment (marked peers: `make
test-peers`); what is refused before TFF starts, here without it."""

import os
import sys

import jax
import numpy as np
import pytest

import fax_bridge as fb

from fax_bridge import cli
from fax_bridge.data.examples import Feature, write_population
from fax_bridge.tff import fcp, fcp_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")
CLIENTS, ROUNDS = 3, 2


def test_a_folder_without_an_fcp_form_is_refused_naming_the_command(tmp_path, capsys):
    assert cli.main(["forms", "run", str(tmp_path), "--population", str(tmp_path),
                     "--rounds", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds no FCP form" in err and "--for fcp -o" in err


def test_rounds_are_counted_from_one(tmp_path):
    with pytest.raises(SystemExit):
        cli.main(["forms", "run", str(tmp_path), "--population", str(tmp_path),
                  "--rounds", "0"])


@pytest.mark.peers
def test_forms_run_is_jit_on_the_users_population(tmp_path, capsys):
    """The quickstart round's FCP MapReduceForm, two rounds on a population written from
    other data than the example arguments, against two rounds of jax.jit."""
    form_dir, pop = str(tmp_path / "form"), str(tmp_path / "population")
    assert cli.main(["forms", f"{QUICKSTART}:fedavg_round", "--form", "mrf", "--for", "fcp",
                     "--clients", str(CLIENTS), "-o", form_dir]) == 0
    sys.path.insert(0, os.path.dirname(QUICKSTART))
    import quickstart

    (params, data), _ = quickstart.example_args(CLIENTS)
    rng = np.random.default_rng(1)
    data = {k: (v + rng.normal(size=v.shape)).astype(v.dtype) for k, v in data.items()}
    features = [Feature(k, data[k].dtype, data[k].shape[1:]) for k in ("x", "y")]
    write_population(pop, features, fcp.client_values(features, data, CLIENTS))
    capsys.readouterr()
    assert cli.main(["forms", "run", form_dir, "--population", pop,
                     "--rounds", str(ROUNDS)]) == 0
    printed = capsys.readouterr().out
    assert [line.split(":")[0] for line in printed.splitlines()[:ROUNDS]] == [
        f"round {r + 1}" for r in range(ROUNDS)]
    step = jax.jit(fb.program(clients=CLIENTS)(quickstart.fedavg_round))
    state = params
    for _ in range(ROUNDS):
        state, loss = step(state, data)
    assert f"{float(loss):.4f}"[:5] in printed.splitlines()[ROUNDS - 1]
    with np.load(os.path.join(form_dir, "final", fcp_run.STATE_FILE)) as z:
        got = [z[f"state.{i}"] for i in range(int(z["num_state"]))]
    want = jax.tree_util.tree_leaves(state)
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=2e-5, atol=2e-6)
