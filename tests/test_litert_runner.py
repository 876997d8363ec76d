"""LiteRT on the devices: a fleet whose devices run the client part in the LiteRT
interpreter answers the same requests with partials of the same form, the same bits run
to run and however the clients are split over devices, and check_parity holds it to the
stated rounding bound; rounds of several trips (and with client state) run one LiteRT
model per trip, in process and on the fleet, within that bound."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge import in_process
from fax_bridge.errors import ArgumentError
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.litert import convert, runner
from fax_bridge.parity.check import check_parity
from fax_bridge.rounds import client_runtime
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
    # the report names each device's client runtime and the model it ran, by its bytes:
    # the round's model, named by pytree path, though a device has the client part alone
    model = convert.convert_round(P.split_round(proto))
    assert [t.name for t in model.inputs] == ["broadcast/params/b", "broadcast/params/w",
                                              "client/x", "client/w"]
    assert fleet.last_report.served == {
        address: client_runtime.served("litert", hashlib.sha256(model.tflite).hexdigest())
        for address in fleet.addresses}
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
    assert "float32 rounding bound" in report.table()


def test_parity_refuses_a_fleet_of_another_client_runtime():
    with pytest.raises(ArgumentError, match="client_runtime='litert'"):
        check_parity(one_round, *_args(), placements=PLACE, fleet=object(),
                     client_runtime="litert")
    with pytest.raises(ArgumentError, match="expected one of"):
        LocalFleet(devices=1, client_runtime="tflite")


# -- rounds of several trips, and client state: a LiteRT model per trip -----------------

C = 3  # clients of the algorithms' rounds


def _loss(params, batch):
    logp = jax.nn.log_softmax(batch["x"] @ params["w"] + params["b"])
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def _algorithm(name: str):
    """(program, args, placements) of one round of algorithm `name` on softmax regression
    (4 features, 3 classes, 2 batches of 4 per client)."""
    from fax_bridge import algorithms as A

    rng = np.random.default_rng(1)
    data = {"x": rng.normal(size=(C, 2, 4, 4)).astype(np.float32),
            "y": rng.integers(0, 3, size=(C, 2, 4)).astype(np.int32)}
    mask = np.ones((C, 2, 4), bool)
    params = {"w": rng.normal(size=(4, 3)).astype(np.float32) * 0.1,
              "b": np.zeros(3, np.float32)}
    if name == "fed_sgd":
        alg = A.fed_sgd(_loss, clients=C)
        return alg.next, (alg.init(params), data, mask), alg.placements
    if name == "streaming_diloco":
        alg = A.streaming_diloco(_loss, params, clients=C, sync_every=4, num_fragments=2,
                                 overlap=1, quantize=True)
        return alg.rounds[0], (alg.init(params), data, mask), alg.placements
    alg = getattr(A, name)(_loss, optax.sgd(0.1), clients=C)
    return alg.next, (alg.init(params), data, mask, data, mask), alg.placements


@pytest.mark.parametrize("name", ["fed_sgd", "learned_server_lr", "learned_client_weights",
                                  "streaming_diloco"])
def test_rounds_of_several_trips_run_a_litert_model_per_trip_within_the_bound(fleet, name):
    fn, args, placements = _algorithm(name)
    proto = fb.export_tff(fn, *args, placements=placements)
    assert P.split_of(proto) is None  # two trips or more, or client state
    maps = [m for m in P.client_maps(proto) if m.computes]
    assert sorted(m.trip for m in maps) == list(range(1, len(maps) + 1))  # one per trip
    before = runner.loaded()
    alone = in_process.run_computation(proto, *args, client_runtime="litert")
    after = runner.loaded()
    assert all(after.get(m.key, 0) - before.get(m.key, 0) == C for m in maps)
    got = fleet.run(proto, *args)  # each device's Map answered "litert", or it is refused
    assert _bits(got) == _bits(alone)
    report = check_parity(fn, *args, placements=placements, fleet=fleet,
                          client_runtime="litert")
    assert report.ok, report.table()
