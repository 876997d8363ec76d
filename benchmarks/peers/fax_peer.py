"""The shared FedAvg workload written with google-fax 0.0.2's own API (runs in .venv-fax).

One round is one ``fax.fax_program`` over the cohort (``placements={"clients": 10}``):
``federated_broadcast`` of the server model, ``federated_map_clients`` of the local SGD
loop over (model, batches), and ``federated_weighted_mean`` of the client models and
losses by example count. fax's decorator does not compile by itself, so the program is
wrapped in ``jax.jit`` and compiled ahead of time during setup. Note that fax patches
its own module while tracing: the federated names must be looked up as ``fax.NAME``.

    .venv-fax/bin/python benchmarks/peers/fax_peer.py [--rounds 20] [--seed 0] [--json OUT]
    .venv-fax/bin/python benchmarks/peers/fax_peer.py --grad-check [--json OUT]

``--grad-check`` prints (one JSON line) the loss and gradient of a fixed small program,
``workload.check_program_inputs``: the mean over round 0's clients of the loss of the
broadcast initial weights on each client's first batch.
"""

from __future__ import annotations

import common  # first: starts the clock and puts workload on the path

import time
from typing import Any, Dict, Tuple

import workload


def build(cohort: int) -> Tuple[Any, Any, Any]:
    """(fax module, compiled round function, fax gradient-check program)."""
    import jax
    import jax.numpy as jnp

    import fax

    from jax_mlp import local_train, loss_fn

    @fax.fax_program(placements={"clients": cohort})
    def fedavg_round(params: Any, xb: Any, yb: Any, counts: Any) -> Tuple[Any, Any]:
        params_at_clients = fax.federated_broadcast(params)
        new_params, losses = fax.federated_map_clients(local_train, (params_at_clients, xb, yb))
        # fax's weighted mean maps x * w leaf by leaf: the weights need x's structure.
        weights = {k: counts for k in new_params}
        new_global = fax.federated_weighted_mean(new_params, weights)
        loss = fax.federated_weighted_mean(losses, counts)
        return new_global, loss

    @fax.fax_program(placements={"clients": cohort})
    def mean_client_loss(params: Any, x: Any, y: Any) -> Any:
        params_at_clients = fax.federated_broadcast(params)
        losses = fax.federated_map_clients(loss_fn, (params_at_clients, x, y))
        return fax.federated_mean(losses)

    f32 = jnp.float32
    specs = (
        {k: jax.ShapeDtypeStruct(s, f32) for k, s in workload.PARAM_SHAPES.items()},
        jax.ShapeDtypeStruct(
            (cohort, workload.LOCAL_STEPS, workload.BATCH, workload.N_FEATURES), f32),
        jax.ShapeDtypeStruct((cohort, workload.LOCAL_STEPS, workload.BATCH), jnp.int32),
        jax.ShapeDtypeStruct((cohort,), f32),
    )
    compiled = jax.jit(fedavg_round).lower(*specs).compile()
    return fax, compiled, mean_client_loss


def grad_check() -> Dict[str, Any]:
    """Loss and gradient of the fixed check program, through fax's AD rules."""
    _, _, program = build(workload.COHORT)
    return common.grad_check("fax", program)


def run(rounds: int, seed: int) -> Dict[str, Any]:
    """The benchmark: setup, then ``rounds`` timed rounds."""
    rss = common.PeakRss().start()
    import jax

    split = workload.load_split()
    data = workload.client_data(split)
    params = {k: jax.device_put(v) for k, v in workload.load_init_params().items()}
    _, round_fn, _ = build(workload.COHORT)
    setup_s = time.perf_counter() - common.PROCESS_T0
    round_s, losses, history = common.jitted_rounds(round_fn, params, data, rounds, seed)
    peak = rss.stop()
    return common.result_line(
        "fax", setup_s, round_s, losses, history, peak, None,
        extra={"versions": {"jax": jax.__version__, "google-fax": "0.0.2"}},
    )


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0], grad_check=True)
    args = parser.parse_args()
    result = grad_check() if args.grad_check else run(args.rounds, args.seed)
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
