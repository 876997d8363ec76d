"""LiteRT on the devices: a fleet whose devices run the client part in the LiteRT
interpreter answers the same requests with partials of the same form, the same bits run
to run and however the clients are split over devices, and check_parity holds it to the
stated rounding bound."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import fax_bridge as fb
from fax_bridge import in_process
from fax_bridge.errors import ArgumentError
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.parity import check_parity
from fax_bridge.rounds import round_split as P
from fax_bridge.runtime import interpreter, values

N = 5
PLACE = ("server", "clients", "clients")


def _update(p, x, w):
    def step(q, _):
        g = jax.grad(lambda q: ((x @ q["w"] + q["b"]) ** 2).mean())(q)
        return jax.tree.map(lambda a, b: a - 0.05 * b, q, g), None

    q, _ = jax.lax.scan(step, p, None, length=2)
    return jax.tree.map(lambda a, b: a - b, q, p), w


@fb.program(clients=N)
def one_round(params, x, w):
    delta, weight = fb.federated_map_clients(_update, (fb.federated_broadcast(params), x, w))
    return fb.federated_weighted_mean(delta, weight), fb.federated_sum(weight)


def _args():
    rng = np.random.default_rng(0)
    return ({"w": rng.normal(size=(3, 2)).astype(np.float32),
             "b": np.zeros(2, np.float32)},
            rng.normal(size=(N, 4, 3)).astype(np.float32),
            rng.uniform(1, 3, size=N).astype(np.float32))


@pytest.fixture(scope="module")
def fleet():
    with LocalFleet(devices=2, client_runtime="litert") as f:
        yield f


def _bits(result) -> list:
    return [np.asarray(leaf).tobytes() for leaf in jax.tree_util.tree_leaves(result)]


def test_litert_devices_give_the_same_bits_run_to_run_and_however_clients_are_split(fleet):
    args = _args()
    proto = fb.export_tff(one_round, *args, placements=PLACE)
    first = fleet.run(proto, *args)
    assert _bits(fleet.run(proto, *args)) == _bits(first)
    prepared = interpreter.prepare(proto)
    arg = values.bind_arguments(prepared.parameter, args, {}).runtime_value()
    alone = in_process.run_in_process(P.split_round(proto), arg, client_runtime="litert")
    assert _bits(values.to_pytree(values.check_value(alone, prepared.result, "result"),
                                  prepared.result)) == _bits(first)


def test_check_parity_holds_litert_to_the_stated_bound(fleet):
    report = check_parity(one_round, *_args(), placements=PLACE, fleet=fleet,
                          client_runtime="litert")
    assert report.ok, report.table()
    floats = [leaf for leaf in report.leaves if leaf.dtype == "float32"]
    assert floats and all(leaf.bound is not None and leaf.max_abs <= leaf.bound
                          for leaf in floats)
    assert "running client parts in litert" in report.table()
    assert "n*eps*sum|x|" in report.table()


def test_parity_refuses_a_fleet_of_another_client_runtime():
    with pytest.raises(ArgumentError, match="client_runtime='litert'"):
        check_parity(one_round, *_args(), placements=PLACE, fleet=object(),
                     client_runtime="litert")
    with pytest.raises(ArgumentError, match="expected one of"):
        LocalFleet(devices=1, client_runtime="tflite")
