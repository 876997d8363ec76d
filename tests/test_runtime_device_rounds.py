"""The device path's rounds in chunks of clients (`runtime.device_rounds`)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import ArgumentError
from fax_bridge.in_process import run_computation
from fax_bridge.local import chunk_size
from fax_bridge.runtime import client_map, device_rounds

CLIENTS = 5
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


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


@pytest.fixture
def compiles():
    """The backend compiles of this test, as jax reports them (`jax.monitoring`)."""
    seen = []

    def listener(event, _seconds, **_kwargs):
        if event == COMPILE_EVENT:
            seen.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


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


def test_rounds_whose_deltas_change_scale_compile_once(compiles):
    """Ten rounds, each's deltas 10x the last's: no compile after the first (a compile
    counter, not a timing)."""
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
        device_rounds.chunk_size(bad, 8)
    assert device_rounds.chunk_size(64, 8) == 8
    assert device_rounds.chunk_size(3, 8) == 3


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 3000), fixed=st.integers(0, 5000), per_client=st.integers(1, 300),
       budget=st.integers(1, 200_000), option=st.sampled_from([None, "auto"]))
def test_auto_takes_the_largest_chunk_whose_compiled_step_fits(n, fixed, per_client,
                                                               budget, option):
    """None and "auto" size a chunk by what its compiled step holds (`need`, bytes at k
    clients a step), not by its results: the cohort where it fits (one compile), else the
    largest power of two below it that fits, else the smallest (2: every chunk step has
    at least 2 rows); at most `client_map.MAX_ROWS`."""
    compiled = []

    def need(k):
        compiled.append(k)
        return fixed + per_client * max(2, k)

    got = device_rounds.chunk_size(option, n, need=need, budget=budget)
    top = min(n, client_map.MAX_ROWS)
    if top == 1:
        assert got == 1 and not compiled  # one client: nothing to choose
        return
    sizes = [1 << i for i in range(1, 11) if (1 << i) < top] + [top]
    assert got == max([k for k in sizes if need(k) <= budget], default=2)
    assert compiled[0] == top and len(set(compiled)) <= top.bit_length() + 1
    assert 1 not in compiled  # a chunk of 1 holds 2 rows: sizing it would measure 2


def _mlp_round(params, data):
    def local(p, d):
        g = jax.grad(lambda q: jnp.mean(jnp.tanh(d["x"] @ q["w"]) ** 2))(p)
        return jax.tree.map(lambda a, b: a - 0.1 * b, p, g)

    return fb.federated_mean(fb.federated_map_clients(
        local, (fb.federated_broadcast(params), data)))


def _mlp(n: int, width: int = 64):
    rng = np.random.default_rng(n)
    params = {"w": (rng.standard_normal((width, width)) / width).astype(np.float32)}
    data = {"x": rng.standard_normal((n, 2, width)).astype(np.float32)}
    proto = fb.export_tff(fb.program(clients=n)(_mlp_round), params, data,
                          placements=("server", "clients"))
    return proto, params, data


def _step_bytes() -> int:
    """What the chunk step this process ran last holds (`compiled_bytes`' sum)."""
    m = device_rounds.step_memory()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def test_with_no_option_the_chunk_steps_memory_is_flat_in_the_cohort(monkeypatch, caplog):
    """With no option, 8x the clients hold at most 1.5x the memory: the chunk step is
    sized by its compiled `memory_analysis()` against the budget
    (`FAX_BRIDGE_STEP_BYTES`), and the choice is logged; the bits are the host's."""
    small, large = _mlp(16), _mlp(128)
    run_computation(small[0], *small[1:], on_device=True, clients_per_step=16)
    at_16 = _step_bytes()
    monkeypatch.setenv("FAX_BRIDGE_STEP_BYTES", str(at_16 * 5 // 4))
    held = {}
    with caplog.at_level(logging.INFO, logger=chunk_size.LOG.name):
        for n, (proto, params, data) in ((16, small), (128, large)):
            got = run_computation(proto, params, data, on_device=True)
            assert _bits(got) == _bits(run_computation(proto, params, data,
                                                       on_device=False))
            held[n] = _step_bytes()
    assert held[128] <= 1.5 * held[16], held
    assert held[128] <= at_16 * 5 // 4
    assert "of 128 clients a step (exported round's chunk step: " in caplog.text


def test_a_window_overflowing_in_a_later_round_compiles_nothing_new(compiles, caplog):
    """Ten rounds whose deltas grow 10x a round, until some elements' clients spread past
    the sums' window (from round 7 on): the whole-range sums were compiled with the
    first round, so no round after it compiles; the bits are the host's."""
    @fb.program(clients=CLIENTS)
    def shifted(p, s, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda p, s, v: p + v * s,
            (fb.federated_broadcast(p), fb.federated_broadcast(s), x)))

    p = np.full(3, 1e-12, np.float32)
    x = np.array([[0, 1, 2], [1, 0, 1], [2, 2, 0], [1, 1, 1], [0, 0, 3]], np.float32)
    proto = fb.export_tff(shifted, p, np.float32(1), x,
                          placements=("server", "server", "clients"))
    with caplog.at_level(logging.INFO, logger="fax_bridge.runtime.device_rounds"):
        for i in range(10):
            s = np.float32(10.0 ** i)
            host = run_computation(proto, p, s, x, on_device=False)
            before = len(compiles)
            device = run_computation(proto, p, s, x, on_device=True, clients_per_step=2)
            assert _bits(device) == _bits(host)
            if i:
                assert len(compiles) == before, f"round {i} compiled"
    assert "spread past the sums' window" in caplog.text  # the whole-range sums ran


def test_a_backend_reporting_no_memory_analysis_is_sized_by_an_estimate(monkeypatch,
                                                                        caplog):
    """Where a compiled step reports no `memory_analysis()`, None still sizes the chunk:
    by its arguments and `TEMP_PER_RESULT` times its results, said in the log."""
    monkeypatch.setattr(jax.stages.Compiled, "memory_analysis", lambda self: None)
    monkeypatch.setenv("FAX_BRIDGE_STEP_BYTES", str(1 << 40))
    args = _args(0.5)
    with caplog.at_level(logging.INFO):
        device = run_computation(PROTO, *args, on_device=True)
    assert _bits(device) == _bits(run_computation(PROTO, *args, on_device=False))
    assert "reports no memory_analysis() of the exported round's chunk step" in caplog.text
    assert f"{CLIENTS} of {CLIENTS} clients a step" in caplog.text
