"""Parity with TFF 0.87's DifferentiallyPrivateFactory (gaussian_fixed, gaussian_adaptive).

With the noise multiplier at 0 the aggregators are deterministic, so fax_bridge's must
give TFF's aggregate and TFF's clip-norm trajectory round after round, under jit and (one
case) as the exported proto run by the runtime. TFF runs once, in .venv-tff, for every case
(while the test computes its own side), and also reads back an exported DP-FedAvg round
and the secure aggregations (sums, mean and the mean's gradient program) with the
signatures federated_language gives.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from federated_language.compiler import building_blocks

import fax_bridge as fb
from fax_bridge import privacy
from fax_bridge.algorithms import dp_fed_avg
from fax_bridge.runtime import run_computation
from fax_bridge.tff import side_env

TFF_PYTHON = side_env.tff_python()
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


class _TffRun:
    """TFF's answers, computed in .venv-tff while the test computes its own: starting
    TensorFlow takes most of the run, so the test does not wait for it idle."""

    def __init__(self, rounds, read=()):
        spec = {"read": [str(p) for p in read],
                "rounds": [[{k: r[k][i].tolist() for k in r} for i in range(CLIENTS)]
                           for r in rounds],
                "cases": [{"name": n, "factory": f, "kwargs": kw}
                          for n, (f, kw) in CASES.items()]}
        # Files, not pipes (side_env.run_json's): TFF's runtime starts worker processes
        # that would hold a pipe open after the script exits; the whole group is ended
        # afterwards.
        self.fin, self.fout, self.ferr = (tempfile.TemporaryFile() for _ in range(3))
        self.fin.write(json.dumps(spec).encode())
        self.fin.seek(0)
        self.proc = subprocess.Popen(
            [str(TFF_PYTHON), str(side_env.script("dp_reference.py"))], stdin=self.fin,
            stdout=self.fout, stderr=self.ferr, cwd=side_env.REPO, start_new_session=True)

    def answer(self, timeout_s: float = 120.0) -> dict:
        """Waits for TFF (about 15 s on an idle 2-core machine); its JSON answer."""
        try:
            self.proc.wait(timeout=timeout_s)
        finally:
            self.stop()
        self.fout.seek(0)
        self.ferr.seek(0)
        out, err = self.fout.read(), self.ferr.read()
        for f in (self.fin, self.fout, self.ferr):
            f.close()
        assert self.proc.returncode == 0, err.decode(errors="replace")[-3000:]
        return json.loads(out)

    def stop(self) -> None:
        """Ends TFF's whole process group (its runtime's workers too)."""
        side_env.kill_group(self.proc)


def _export_dp_fed_avg_round(folder: pathlib.Path) -> pathlib.Path:
    """One DP-FedAvg round (adaptive clipping, noise) exported for TFF to read back."""
    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    alg = dp_fed_avg(loss, optax.sgd(0.1), clients=3, noise_multiplier=0.1)
    data = {"x": np.ones((3, 2, 4, 2), np.float32), "y": np.ones((3, 2, 4), np.float32)}
    args = (alg.init({"w": jnp.zeros(2)}), data, np.ones((3, 2, 4), bool))
    path = folder / "dp_fed_avg.pb"
    fb.save_computation(fb.export_tff(alg.next, *args, placements=alg.placements), path)
    return path


def _export_secure(folder: pathlib.Path) -> list:
    """The secure sums and the secure mean (with its gradient program), for TFF to read."""
    @fb.program(clients=3)
    def sums(x):
        return fb.federated_secure_sum_bitwidth(x, 8), fb.federated_secure_sum(x, 200)

    @fb.program(clients=3)
    def mean(w, d, keys):
        v = fb.federated_map_clients(lambda w, d: w * d, (fb.federated_broadcast(w), d))
        return fb.federated_secure_mean(v, keys, value_range=(-2.0, 2.0), bits=12)

    grad = fb.program(clients=3)(jax.grad(lambda w, d, k: jnp.sum(mean(w, d, k) ** 2)))
    keys = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(3))
    w, d = np.ones(2, np.float32), np.ones((3, 2), np.float32)
    paths = []
    for name, fn, args, pl in (
            ("secure_sums", sums, (np.ones((3, 2), np.int32),), ("clients",)),
            ("secure_mean", mean, (w, d, keys), ("server", "clients", "clients")),
            ("secure_mean_grad", grad, (w, d, keys), ("server", "clients", "clients"))):
        paths.append(folder / f"{name}.pb")
        fb.save_computation(fb.export_tff(fn, *args, placements=pl), paths[-1])
    return paths


def _ours(factory: str, kwargs: dict):
    agg = getattr(privacy, factory)(**kwargs)

    @fb.program(clients=CLIENTS)
    def one_round(state, value):
        return agg.aggregate(state, value)

    return agg, one_round


@pytest.mark.skipif(not TFF_PYTHON.exists(),
                    reason=".venv-tff is absent; build it with tools/tff087/setup.sh "
                           "(make test does)")
def test_same_aggregate_and_clip_trajectory_as_tff(tmp_path):
    rounds = _client_values()
    exported = [_export_dp_fed_avg_round(tmp_path), *_export_secure(tmp_path)]
    tff_run = _TffRun(rounds, read=exported)
    try:
        ours = {name: _our_trajectory(name, rounds) for name in CASES}
    except BaseException:
        tff_run.stop()
        raise
    tff = tff_run.answer()
    for path in exported:
        want_sig = str(building_blocks.ComputationBuildingBlock.from_proto(
            fb.load_computation(path)).type_signature)
        assert tff["signatures"][str(path)] == {"type_signature": want_sig, "error": None}
    for name, (factory, _) in CASES.items():
        want = tff[name]
        for r, (mean, clip) in enumerate(ours[name]):
            for k in ("a", "b"):
                np.testing.assert_allclose(mean[k], want["results"][r][k], rtol=2e-6,
                                           atol=1e-7, err_msg=f"{name} round {r} {k}")
            np.testing.assert_allclose(clip, want["clips"][r], rtol=2e-6,
                                       err_msg=f"{name} clip after round {r}")
        if factory == "gaussian_adaptive":  # the clip really moved
            assert len(set(np.round(tff[name]["clips"], 6))) == ROUNDS, tff[name]["clips"]


def _our_trajectory(name: str, rounds) -> list:
    """(mean, clip) after each round of case `name` under jit; for one case the exported
    proto, run by the runtime, must follow the same trajectory."""
    factory, kwargs = CASES[name]
    agg, one_round = _ours(factory, kwargs)
    step = jax.jit(one_round)
    state = agg.init(0)
    proto = fb.export_tff(one_round, state, rounds[0], placements=("server", "clients")) \
        if name == "adaptive_custom" else None
    exported_state = state
    trajectory = []
    for value in rounds:
        mean, state, metrics = step(state, value)
        trajectory.append((mean, state.clip))
        if proto is not None:
            e_mean, exported_state, _ = run_computation(proto, exported_state, value)
            for k in ("a", "b"):
                np.testing.assert_allclose(e_mean[k], mean[k], rtol=1e-6, atol=1e-8)
            np.testing.assert_allclose(exported_state.clip, state.clip, rtol=1e-6)
    return trajectory
