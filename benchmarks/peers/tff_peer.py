"""The shared FedAvg workload on TensorFlow Federated 0.87's C++ runtime (runs in .venv-tff).

A hand-written ``tff.federated_computation`` per round: ``federated_broadcast`` of the
server model, ``federated_map`` of a ``tff.tensorflow.computation`` that runs the local
SGD steps (``tf.GradientTape``), and ``federated_mean`` weighted by the clients' example
counts, for the models and for the losses. It executes on TFF's local C++ execution
context, which starts TFF's ``worker_binary`` (TensorFlow executor) and talks to it over
gRPC on loopback. The worker is started during setup with a tiny computation, under a
watchdog: if it is not serving within ``--startup-timeout`` seconds the script kills
its child processes and exits with status 3 (so a caller can retry). Every child left
at the end is terminated.

    .venv-tff/bin/python benchmarks/peers/tff_peer.py [--rounds 20] [--seed 0] [--json OUT]
"""

from __future__ import annotations

import common  # first: starts the clock and puts workload on the path

import collections
import os
import sys
import threading
import time
from typing import Any, Dict

import numpy as np

import workload

# TensorFlow's C++ logging (also read by TFF's worker, which inherits the environment).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
STARTUP_EXIT = 3


def start_runtime(timeout_s: float) -> Any:
    """Imports TFF, installs the C++ context and starts its worker, under a watchdog."""
    done = threading.Event()

    def watchdog() -> None:
        if not done.wait(timeout_s):
            print(f"tff_peer: TFF's worker did not start within {timeout_s:.0f} s",
                  file=sys.stderr, flush=True)
            common.end_processes(grace_s=1.0)
            os._exit(STARTUP_EXIT)

    threading.Thread(target=watchdog, name="tff-startup-watchdog", daemon=True).start()
    import tensorflow_federated as tff

    tff.backends.native.set_sync_local_cpp_execution_context()

    @tff.federated_computation(tff.FederatedType(np.float32, tff.SERVER))
    def ping(x: Any) -> Any:
        return tff.federated_sum(tff.federated_broadcast(x))

    ping(np.float32(1.0))  # starts the worker and waits until it serves
    done.set()
    return tff


def build(tff: Any) -> Any:
    """The round computation, traced and type-checked."""
    import tensorflow as tf

    names = workload.PARAM_NAMES
    model_type = tff.StructType(
        [(k, tff.TensorType(np.float32, workload.PARAM_SHAPES[k])) for k in names]
    )
    xb_type = tff.TensorType(np.float32,
                             [workload.LOCAL_STEPS, workload.BATCH, workload.N_FEATURES])
    yb_type = tff.TensorType(np.int32, [workload.LOCAL_STEPS, workload.BATCH])

    @tff.tensorflow.computation(model_type, xb_type, yb_type)
    def client_update(params: Any, xb: Any, yb: Any) -> Any:
        p = [params[k] for k in names]
        losses = []
        for s in range(workload.LOCAL_STEPS):
            with tf.GradientTape() as tape:
                tape.watch(p)
                h = tf.nn.relu(tf.matmul(xb[s], p[0]) + p[1])
                logits = tf.matmul(h, p[2]) + p[3]
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=yb[s], logits=logits)
                )
            grads = tape.gradient(loss, p)
            p = [w - workload.LR * g for w, g in zip(p, grads)]
            losses.append(loss)
        return collections.OrderedDict(zip(names, p)), tf.reduce_mean(tf.stack(losses))

    @tff.federated_computation(
        tff.FederatedType(model_type, tff.SERVER),
        tff.FederatedType(xb_type, tff.CLIENTS),
        tff.FederatedType(yb_type, tff.CLIENTS),
        tff.FederatedType(np.float32, tff.CLIENTS),
    )
    def fedavg_round(params: Any, xb: Any, yb: Any, counts: Any) -> Any:
        params_at_clients = tff.federated_broadcast(params)
        new_params, losses = tff.federated_map(client_update, (params_at_clients, xb, yb))
        return (
            tff.federated_mean(new_params, weight=counts),
            tff.federated_mean(losses, weight=counts),
        )

    return fedavg_round


def run(rounds: int, seed: int, startup_timeout_s: float) -> Dict[str, Any]:
    """The benchmark: setup (import, worker start, tracing), then timed rounds."""
    rss = common.PeakRss().start()
    tff = start_runtime(startup_timeout_s)
    round_fn = build(tff)
    split = workload.load_split()
    data = workload.client_data(split)
    params = collections.OrderedDict(workload.load_init_params())
    setup_s = time.perf_counter() - common.PROCESS_T0

    round_s, losses, history = [], [], []
    for r in range(rounds):
        t0 = time.perf_counter()
        ids = workload.cohort(seed, r)
        new_params, loss = round_fn(
            params,
            [data.x[i] for i in ids],
            [data.y[i] for i in ids],
            [np.float32(data.counts[i]) for i in ids],
        )
        params = collections.OrderedDict(
            (k, np.asarray(new_params[k], dtype=np.float32)) for k in workload.PARAM_NAMES
        )
        round_s.append(time.perf_counter() - t0)
        losses.append(float(loss))
        history.append(dict(params))
    peak = rss.stop()
    import tensorflow as tf

    return common.result_line(
        "tff", setup_s, round_s, losses, history, peak, None,
        extra={"versions": {"tensorflow_federated": tff.__version__, "tensorflow": tf.__version__}},
    )


def main() -> None:
    parser = common.base_parser(__doc__.splitlines()[0])
    parser.add_argument("--startup-timeout", type=float, default=90.0,
                        help="seconds to wait for TFF's worker to serve (default 90)")
    args = parser.parse_args()
    try:
        result = run(args.rounds, args.seed, args.startup_timeout)
    finally:
        common.end_processes()
    common.emit(result, args.json)


if __name__ == "__main__":
    main()
