"""One round of every algorithm in `fax_bridge.algorithms`, on a digits cohort, for export.

    fax-bridge export examples/algorithm_rounds.py:fed_adam --clients 3 -o fed_adam.pb
    fax-bridge parity examples/algorithm_rounds.py:fed_fish --clients 3 --devices 2

`export_targets(clients)` maps each name to (program, example arguments, placements);
`make tff-check` exports all of them and has TFF 0.87 read them back.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

import _digits as D
from fax_bridge import algorithms as A


def _recon_loss(global_params, local_params, batch):
    return D.loss(dict(global_params, **local_params), batch)


def export_targets(clients: int) -> dict:
    """name -> (program, args, placements) at `clients` clients."""
    pop = D.Population(0)
    cohort = pop.cohort(range(clients))
    data, mask = cohort.data, cohort.mask
    params = D.init_mlp(0)
    targets = {}
    for name, make in (("fed_avg", A.fed_avg), ("fed_adam", A.fed_adam),
                       ("fed_yogi", A.fed_yogi), ("fed_adagrad", A.fed_adagrad),
                       ("fed_fish", A.fed_fish), ("learned_server_lr", A.learned_server_lr),
                       ("learned_server_lr_one_trip", A.learned_server_lr_one_trip),
                       ("learned_client_weights", A.learned_client_weights)):
        alg = make(D.loss, optax.sgd(0.1), clients=clients)
        args = (alg.init(params), data, mask)
        if name.startswith("learned"):
            args = args + (data, mask)
        targets[name] = (alg.next, args, alg.placements)
    sgd = A.fed_sgd(D.loss, clients=clients)
    targets["fed_sgd"] = (sgd.next, (sgd.init(params), data, mask), sgd.placements)
    sgd1 = A.fed_sgd_one_trip(D.loss, clients=clients)
    targets["fed_sgd_one_trip"] = (sgd1.next, (sgd1.init(params), data, mask),
                                   sgd1.placements)
    diloco = A.streaming_diloco(D.loss, params, clients=clients,
                                sync_every=4, num_fragments=2, overlap=1,
                                quantize=True)
    steps = {k: v[:, :2] for k, v in data.items()}  # two batches of inner steps
    targets["streaming_diloco"] = (diloco.rounds[0], (diloco.init(params), steps,
                                                      mask[:, :2]), diloco.placements)
    recon = A.fed_reconstruction(_recon_loss, {"b1": jnp.zeros(10)}, clients=clients,
                                 client_optimizer=optax.sgd(0.1),
                                 reconstruction_optimizer=optax.sgd(0.5))
    global0 = {k: v for k, v in params.items() if k != "b1"}
    targets["fed_reconstruction"] = (recon.next, (recon.init(global0), data, mask, data, mask),
                                     recon.placements)
    return targets
