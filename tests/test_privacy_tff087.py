"""Parity with TFF 0.87's DifferentiallyPrivateFactory (gaussian_fixed, gaussian_adaptive).

With the noise multiplier at 0 the aggregators are deterministic, so fax_bridge's must
give TFF's aggregate and TFF's clip-norm trajectory round after round, both under jit and
as the exported proto run by the runtime. TFF runs once, in .venv-tff, for every case.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge import privacy
from fax_bridge.runtime import run_computation

REPO = pathlib.Path(__file__).resolve().parents[1]
TFF_PYTHON = REPO / ".venv-tff" / "bin" / "python"
SCRIPT = REPO / "tools" / "tff087" / "dp_reference.py"
CLIENTS, ROUNDS = 5, 5

CASES = {
    "fixed": ("gaussian_fixed", {"noise_multiplier": 0.0, "clients_per_round": 5.0,
                                 "clip": 1.0}),
    "adaptive_defaults": ("gaussian_adaptive", {"noise_multiplier": 0.0,
                                                "clients_per_round": 5.0}),
    "adaptive_custom": ("gaussian_adaptive", {
        "noise_multiplier": 0.0, "clients_per_round": 4.0, "initial_l2_norm_clip": 2.0,
        "target_unclipped_quantile": 0.8, "learning_rate": 0.5}),
}


def _client_values():
    """Rounds of client updates whose norms straddle the clip norms (0.02 to 6)."""
    rng = np.random.default_rng(7)
    rounds = []
    for _ in range(ROUNDS):
        scale = np.exp(rng.uniform(np.log(0.02), np.log(6.0), size=CLIENTS))
        a = rng.normal(size=(CLIENTS, 3))
        b = rng.normal(size=(CLIENTS, 2))
        norm = np.sqrt((a ** 2).sum(1) + (b ** 2).sum(1))
        rounds.append({"a": (a * (scale / norm)[:, None]).astype(np.float32),
                       "b": (b * (scale / norm)[:, None]).astype(np.float32)})
    return rounds


def _run_tff(rounds) -> dict:
    spec = {"rounds": [[{k: r[k][i].tolist() for k in r} for i in range(CLIENTS)]
                       for r in rounds],
            "cases": [{"name": n, "factory": f, "kwargs": kw} for n, (f, kw) in CASES.items()]}
    # Files, not pipes: TFF's runtime starts worker processes that would hold a pipe open
    # after the reader exits; the whole process group is ended afterwards.
    with tempfile.TemporaryFile() as fin, tempfile.TemporaryFile() as fout, \
            tempfile.TemporaryFile() as ferr:
        fin.write(json.dumps(spec).encode())
        fin.seek(0)
        proc = subprocess.Popen([str(TFF_PYTHON), str(SCRIPT)], stdin=fin, stdout=fout,
                                stderr=ferr, cwd=REPO, start_new_session=True)
        try:
            proc.wait(timeout=60)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        fout.seek(0)
        ferr.seek(0)
        out, err = fout.read(), ferr.read()
    assert proc.returncode == 0, err.decode(errors="replace")[-3000:]
    return json.loads(out)


def _ours(factory: str, kwargs: dict):
    agg = getattr(privacy, factory)(**kwargs)

    @fb.program(clients=CLIENTS)
    def one_round(state, value):
        return agg.aggregate(state, value)

    return agg, one_round


@pytest.mark.skipif(not TFF_PYTHON.exists(),
                    reason=".venv-tff is absent; build it with tools/tff087/setup.sh "
                           "(make test does)")
def test_same_aggregate_and_clip_trajectory_as_tff():
    rounds = _client_values()
    tff = _run_tff(rounds)
    for name, (factory, kwargs) in CASES.items():
        agg, one_round = _ours(factory, kwargs)
        step = jax.jit(one_round)
        state = agg.init(0)
        proto = fb.export_tff(one_round, state, rounds[0], placements=("server", "clients"))
        exported_state = state
        for r, value in enumerate(rounds):
            mean, state, metrics = step(state, value)
            e_mean, exported_state, _ = run_computation(proto, exported_state, value)
            want = tff[name]
            for k in ("a", "b"):
                np.testing.assert_allclose(mean[k], want["results"][r][k], rtol=2e-6,
                                           atol=1e-7, err_msg=f"{name} round {r} {k}")
                np.testing.assert_allclose(e_mean[k], mean[k], rtol=1e-6, atol=1e-8)
            np.testing.assert_allclose(state.clip, want["clips"][r], rtol=2e-6,
                                       err_msg=f"{name} clip after round {r}")
            np.testing.assert_allclose(exported_state["clip"], state.clip, rtol=1e-6)
        if factory == "gaussian_adaptive":  # the clip really moved
            assert len(set(np.round(tff[name]["clips"], 6))) == ROUNDS, tff[name]["clips"]
