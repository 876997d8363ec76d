"""What every algorithm builder shares: the execution options reach its programs."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fax_bridge as fb
from fax_bridge import algorithms as A
from fax_bridge.errors import ProgramError

CLIENTS = 4


def loss(params, batch):
    return jnp.mean((batch["x"] @ params["w"] - batch["y"]) ** 2)


def recon_loss(g, local, batch):
    return jnp.mean((batch["x"] @ g["w"] + local["b"] - batch["y"]) ** 2)


PARAMS = {"w": jnp.zeros((2,))}
SGD = optax.sgd(0.1)

# builder name -> (build(**options), programs of what it built). Every builder of
# fax_bridge.algorithms that makes a federated program (e3m0 is a codec: no program).
BUILDERS = {
    "fed_avg": (lambda **o: A.fed_avg(loss, SGD, clients=CLIENTS, **o),
                lambda a: [a.next]),
    "fed_opt": (lambda **o: A.fed_opt(loss, SGD, optax.adam(0.01), clients=CLIENTS, **o),
                lambda a: [a.next]),
    "fed_adam": (lambda **o: A.fed_adam(loss, SGD, clients=CLIENTS, **o),
                 lambda a: [a.next]),
    "fed_yogi": (lambda **o: A.fed_yogi(loss, SGD, clients=CLIENTS, **o),
                 lambda a: [a.next]),
    "fed_adagrad": (lambda **o: A.fed_adagrad(loss, SGD, clients=CLIENTS, **o),
                    lambda a: [a.next]),
    "fed_sgd": (lambda **o: A.fed_sgd(loss, clients=CLIENTS, **o), lambda a: [a.next]),
    "federated_loss": (lambda **o: A.federated_loss(loss, CLIENTS, **o), lambda a: [a]),
    "dp_fed_avg": (lambda **o: A.dp_fed_avg(loss, SGD, clients=CLIENTS,
                                            noise_multiplier=0.1, clip=1.0, **o),
                   lambda a: [a.next]),
    "diloco": (lambda **o: A.diloco(loss, PARAMS, clients=CLIENTS, sync_every=2, **o),
               lambda a: [a.init, *a.rounds, *a.syncs]),
    "streaming_diloco": (
        lambda **o: A.streaming_diloco(loss, {"w": jnp.zeros((2,)), "b": jnp.zeros(())},
                                       clients=CLIENTS, sync_every=2, num_fragments=2, **o),
        lambda a: [a.init, *a.rounds, *a.syncs]),
    "fed_fish": (lambda **o: A.fed_fish(loss, SGD, clients=CLIENTS, **o),
                 lambda a: [a.next]),
    "learned_server_lr": (lambda **o: A.learned_server_lr(loss, SGD, clients=CLIENTS, **o),
                          lambda a: [a.next]),
    "learned_client_weights": (
        lambda **o: A.learned_client_weights(loss, SGD, clients=CLIENTS, **o),
        lambda a: [a.init, a.next]),
    "fed_sgd_one_trip": (lambda **o: A.fed_sgd_one_trip(loss, clients=CLIENTS, **o),
                         lambda a: [a.next]),
    "learned_server_lr_one_trip": (
        lambda **o: A.learned_server_lr_one_trip(loss, SGD, clients=CLIENTS, **o),
        lambda a: [a.next]),
    "fed_reconstruction": (
        lambda **o: A.fed_reconstruction(recon_loss, {"b": jnp.zeros(())}, clients=CLIENTS,
                                         client_optimizer=SGD,
                                         reconstruction_optimizer=optax.sgd(1.0), **o),
        lambda a: [a.next, a.evaluate]),
    "federated_evaluation": (lambda **o: A.federated_evaluation(loss, clients=CLIENTS, **o),
                             lambda a: [a]),
}


def test_every_builder_is_listed():
    """A builder added to fax_bridge.algorithms without the options fails here."""
    builders = {name for name in A.__all__ if name[0].islower()
                and name not in ("accuracy", "fisher_diagonal", "quantize_e3m0",
                                 "reddi_server_optimizer")}
    assert builders == set(BUILDERS)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_options_reach_the_programs(name):
    build, programs = BUILDERS[name]
    plain = programs(build())
    assert plain and all(isinstance(p, fb.Program) for p in plain)
    assert all(p.clients_per_step is None and p.progress is False for p in plain)
    chunked = programs(build(clients_per_step=2, progress=True))
    assert len(chunked) == len(plain)
    assert [(p.clients, p.clients_per_step, p.progress) for p in chunked] == \
        [(CLIENTS, 2, True)] * len(plain)
    assert [p.clients_per_step for p in programs(build(clients_per_step="auto"))] == \
        ["auto"] * len(plain)


@pytest.mark.parametrize("name", sorted(BUILDERS))
@pytest.mark.parametrize("option, bad", [("clients_per_step", 0),
                                         ("clients_per_step", "half"),
                                         ("clients_per_step", True),
                                         ("progress", "yes")])
def test_a_bad_option_is_refused_by_name(name, option, bad):
    build, _ = BUILDERS[name]
    with pytest.raises(ProgramError, match=option):
        build(**{option: bad})


def test_a_chunked_round_is_the_round():
    """The option changes how jit runs the round, not what it computes."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(CLIENTS, 3, 2)).astype(np.float32)
    data = {"x": x, "y": x @ np.array([1.0, -2.0], np.float32)}
    mask = np.ones((CLIENTS, 3), bool)
    whole, chunked = A.fed_sgd(loss, clients=CLIENTS), A.fed_sgd(
        loss, clients=CLIENTS, clients_per_step=2)
    state = whole.init(PARAMS)
    want, _ = jax.jit(whole.next)(state, data, mask)
    got, _ = jax.jit(chunked.next)(state, data, mask)
    np.testing.assert_allclose(got.params["w"], want.params["w"], rtol=1e-6)
