"""Every algorithm's round exports to a TFF proto and matches jit on a LocalFleet."""

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge.algorithms import (
    fed_adam, fed_avg, fed_fish, fed_reconstruction, fed_sgd, learned_client_weights,
    learned_server_lr, streaming_diloco)

N = 3


def loss(p, b):
    return jnp.mean((b["x"] @ p["w"] + p["b"] - b["y"]) ** 2)


def recon_loss(g, l, b):
    return jnp.mean((b["x"] @ g["w"] + l["b"] - b["y"]) ** 2)


def _data():
    rng = np.random.default_rng(0)
    data = {"x": rng.normal(size=(N, 2, 4, 2)).astype(np.float32),
            "y": rng.normal(size=(N, 2, 4)).astype(np.float32)}
    mask = np.ones((N, 2, 4), bool)
    mask[1, 1, 2:] = False
    return data, mask


def _case(name):
    data, mask = _data()
    p = {"w": jnp.zeros(2), "b": jnp.zeros(())}
    if name == "fed_avg":
        a = fed_avg(loss, optax.sgd(0.1), clients=N)
        return a.next, (a.init(p), data, mask), a.placements
    if name == "fed_sgd":
        a = fed_sgd(loss, clients=N)
        return a.next, (a.init(p), data, mask), a.placements
    if name == "fed_adam":
        a = fed_adam(loss, optax.sgd(0.1), clients=N)
        return a.next, (a.init(p), data, mask), a.placements
    if name == "fed_fish":
        a = fed_fish(loss, optax.sgd(0.1), clients=N)
        return a.next, (a.init(p), data, mask), a.placements
    if name == "learned_server_lr":
        a = learned_server_lr(loss, optax.sgd(0.1), clients=N)
        return a.next, (a.init(p), data, mask, data, mask), a.placements
    if name == "learned_client_weights":
        a = learned_client_weights(loss, optax.sgd(0.1), clients=N)
        return a.next, (a.init(p), data, mask, data, mask), a.placements
    if name == "streaming_diloco":
        a = streaming_diloco(loss, p, clients=N, sync_every=4, num_fragments=2, overlap=1)
        return a.rounds[0], (a.init(p), data, mask), a.placements
    a = fed_reconstruction(recon_loss, {"b": jnp.zeros(())}, clients=N,
                           client_optimizer=optax.sgd(0.1),
                           reconstruction_optimizer=optax.sgd(0.5))
    return a.next, (a.init({"w": jnp.zeros(2)}), data, mask, data, mask), a.placements


@functools.lru_cache(maxsize=None)
def _exported(name):
    """`_case(name)` and its round exported, once for the tests that read the proto."""
    fn, args, placements = _case(name)
    return fn, args, placements, fb.export_tff(fn, *args, placements=placements)


NAMES = ["fed_avg", "fed_sgd", "fed_adam", "fed_fish", "learned_server_lr",
         "learned_client_weights", "streaming_diloco", "fed_reconstruction"]
@pytest.mark.parametrize("name", NAMES)
def test_round_exports_to_a_typed_tff_proto(name):
    from federated_language.compiler import building_blocks

    proto = _exported(name)[3]
    sig = str(building_blocks.ComputationBuildingBlock.from_proto(proto).type_signature)
    assert "@CLIENTS" in sig.split("->")[0] and "@SERVER" in sig.split("->")[1]


# The rounds that are not one trip, with the reason `why_not_split` gives.
UNSPLIT = {"fed_sgd": "two trips", "learned_server_lr": "two trips",
           "learned_client_weights": "a server step that reads client values",
           "streaming_diloco": "a server step that reads client values"}


def _interpreted(name):
    """(round, args, proto, prepared, runtime argument, the interpreter's result)."""
    from fax_bridge.runtime import interpreter, values

    fn, args, _, proto = _exported(name)
    prepared = interpreter.prepare(proto)
    arg = values.bind_arguments(prepared.parameter, args, {}).runtime_value()
    return fn, args, proto, prepared, arg, interpreter.evaluate(prepared, arg)


@pytest.mark.parametrize("name", [n for n in NAMES if n not in UNSPLIT])
def test_round_splits_run_the_server_pieces_compiled_with_the_interpreters_bits(name):
    """Each algorithm whose round is one trip gets its server prepare and result
    compiled (`rounds.server_steps`), and the split gives the interpreter's bits."""
    import jax

    from fax_bridge import in_process
    from fax_bridge.rounds import round_split
    from fax_bridge.runtime import values

    _, _, proto, prepared, arg, want = _interpreted(name)
    split = round_split.split_round(proto)
    assert split is not None and split.server_program is not None
    got = values.check_value(in_process.run_in_process(split, arg), prepared.result, "result")
    bits = [[np.asarray(v).tobytes() for v in jax.tree_util.tree_leaves(
        values.to_pytree(r, prepared.result))] for r in (got, want)]
    assert bits[0] == bits[1]


@pytest.mark.parametrize("name", sorted(UNSPLIT))
def test_rounds_of_two_trips_are_refused_a_split_by_name(name):
    """Not one trip: no split, and the reason named; the phase path runs them instead
    (`test_round_parity_on_local_fleet` compares that with jax.jit)."""
    from fax_bridge.rounds import round_split

    proto = _exported(name)[3]
    assert round_split.split_round(proto) is None
    assert UNSPLIT[name] in round_split.why_not_split(proto, secure=False)


@pytest.fixture(scope="module")
def fleet():
    with fb.LocalFleet(devices=2) as f:
        yield f


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_round_parity_on_local_fleet(name, fleet):
    fn, args, placements = _case(name)
    report = fb.check_parity(fn, *args, placements=placements, fleet=fleet)
    assert report.ok, report.table()
