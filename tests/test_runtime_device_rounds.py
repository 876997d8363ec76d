"""The device path's rounds in chunks of clients (`runtime.device_rounds`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge.errors import ArgumentError
from fax_bridge.in_process import run_computation
from fax_bridge.runtime import device_rounds

CLIENTS = 5


def _round(params, data):
    def local(p, d):
        g = jax.grad(lambda q: jnp.mean((d["x"] @ q["w"] + q["b"] - d["y"]) ** 2))(p)
        return jax.tree.map(lambda a, b: a - d["lr"] * b, p, g), d["n"]

    new, n = fb.federated_map_clients(local, (fb.federated_broadcast(params), data))
    return fb.federated_weighted_mean(new, n), fb.federated_mean(new["b"])


def _args(scale: float):
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((3, 2)).astype(np.float32),
              "b": np.zeros(2, jnp.bfloat16)}
    data = {"x": rng.standard_normal((CLIENTS, 4, 3)).astype(np.float32),
            "y": rng.standard_normal((CLIENTS, 4, 2)).astype(np.float32),
            "lr": np.full(CLIENTS, scale, np.float32),
            "n": np.arange(1, CLIENTS + 1).astype(np.float32)}
    return params, data


PROTO = fb.export_tff(fb.program(clients=CLIENTS)(_round), *_args(0.1),
                      placements=("server", "clients"))


def _bits(tree):
    return [np.asarray(leaf).tobytes() for leaf in jax.tree.leaves(tree)]


def test_chunks_of_any_size_give_the_host_bits(capsys):
    args = _args(0.1)
    host = run_computation(PROTO, *args, on_device=False)
    for k in (1, 2):  # "auto" resolves as test_clients_per_step_is_refused_by_name says
        assert _bits(run_computation(PROTO, *args, on_device=True, clients_per_step=k,
                                     progress=k == 2)) == _bits(host)
    assert "clients, 2 a step" in capsys.readouterr().err  # the bar, asked for once


def test_values_spread_past_the_window_are_summed_over_the_whole_range():
    """Clients whose values differ by 2^100 in one element: the window overflows, the
    chunks run again over the dtype's whole range, and the bits are still the host's."""
    @fb.program(clients=CLIENTS)
    def scaled_sum(scale, x):
        return fb.federated_sum(fb.federated_map_clients(
            lambda s, v: v * s, (fb.federated_broadcast(scale), x)))

    x = np.array([[1e-30, 1.0], [1.0, 3e-12], [1e5, -1.0], [2.0, 7.0], [-1e5, 1e20]],
                 np.float32)
    proto = fb.export_tff(scaled_sum, np.float32(3), x, placements=("server", "clients"))
    host = run_computation(proto, np.float32(3), x, on_device=False)
    assert _bits(run_computation(proto, np.float32(3), x, on_device=True,
                                 clients_per_step=2)) == _bits(host)


def test_rounds_whose_deltas_change_scale_compile_once():
    """Ten rounds, each's deltas 10x the last's: no compile after the first (a compile
    counter, not a timing)."""
    compiles = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _s, **_k: compiles.append(event)
        if event == "/jax/core/compile/backend_compile_duration" else None)
    params, data = _args(1e-6)
    for i in range(10):
        data["lr"] = np.full(CLIENTS, 1e-6 * 10.0 ** i, np.float32)
        host = run_computation(PROTO, params, data, on_device=False)
        before = len(compiles)
        device = run_computation(PROTO, params, data, on_device=True, clients_per_step=2)
        assert _bits(device) == _bits(host)
        if i:
            assert len(compiles) == before, f"round {i} compiled"


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2", True, [2]], ids=repr)
def test_clients_per_step_is_refused_by_name(bad):
    with pytest.raises(ArgumentError, match="clients_per_step="):
        device_rounds.chunk_size(bad, 8, 100)
    assert device_rounds.chunk_size(None, 8, device_rounds.AUTO_BYTES // 3) == 3
    assert device_rounds.chunk_size(64, 8, 1) == 8
