"""Overhead of the fax_bridge local path against hand-written `jax.vmap` code.

One FedAvg round on an MLP of about 100k parameters: every client runs `steps` local
SGD steps (a `lax.scan`) on its own batches starting from the broadcast server model;
the server averages the client deltas (example-weighted by default, `--aggregate mean`
for the unweighted mean) and applies them with a server learning rate.

The round is written twice with the same math:

- `fax_bridge`: `@fax_bridge.program(clients=N)` with `federated_broadcast`,
  `federated_map_clients` (local training), `federated_weighted_mean` /
  `federated_mean` of the deltas and `federated_map_server` (server update);
- `hand`: `jax.vmap` of the same per-client function and `jnp.sum` / `jnp.mean`.

Both are compiled ahead of time (`jit(...).lower(...).compile()`; lowering and
compile times are reported), then run alternately `--repeats` times in one process so
they share machine noise; the medians, their ratio (fax_bridge / hand) and the largest
absolute difference between the two results are printed, and written as JSON with
`--json OUT`.

    python benchmarks/local_overhead.py --repeats 50 --clients 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Optional, Sequence

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

import fax_bridge  # noqa: E402

Params = dict[str, jax.Array]

DEFAULT_LAYERS = (128, 256, 256, 10)


# --------------------------------------------------------------------------- model


def init_mlp(key: jax.Array, layers: Sequence[int]) -> Params:
    """Dense layers `w{i}`/`b{i}` with LeCun-normal weights and zero biases."""
    params = {}
    keys = jax.random.split(key, len(layers) - 1)
    for i, (k, fan_in, fan_out) in enumerate(zip(keys, layers[:-1], layers[1:])):
        params[f"w{i}"] = jax.random.normal(k, (fan_in, fan_out), jnp.float32) / np.sqrt(fan_in)
        params[f"b{i}"] = jnp.zeros((fan_out,), jnp.float32)
    return params


def param_count(params: Params) -> int:
    """The number of scalar parameters in `params`."""
    return sum(int(np.prod(p.shape)) for p in jax.tree_util.tree_leaves(params))


def _n_layers(params: Params) -> int:
    return len(params) // 2


def mlp_logits(params: Params, x: jax.Array) -> jax.Array:
    h = x
    n = _n_layers(params)
    for i in range(n):
        h = h @ params[f"w{i}"] + params[f"b{i}"]
        if i < n - 1:
            h = jax.nn.relu(h)
    return h


def loss_fn(params: Params, x: jax.Array, y: jax.Array) -> jax.Array:
    logits = mlp_logits(params, x)
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def make_client_update(lr: float) -> Callable:
    """Per client: SGD over its batches (leading axis = steps); returns (delta, mean loss)."""

    def client_update(params: Params, xs: jax.Array, ys: jax.Array):
        def step(p, batch):
            x, y = batch
            loss, g = jax.value_and_grad(loss_fn)(p, x, y)
            return jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g), loss

        final, losses = lax.scan(step, params, (xs, ys))
        delta = jax.tree_util.tree_map(lambda a, b: a - b, final, params)
        return delta, jnp.mean(losses)

    return client_update


def make_server_update(server_lr: float) -> Callable:
    def server_update(params: Params, delta: Params) -> Params:
        return jax.tree_util.tree_map(lambda p, d: p + server_lr * d, params, delta)

    return server_update


# --------------------------------------------------------------------------- the two rounds


def make_fax_round(clients: int, lr: float, server_lr: float, aggregate: str) -> Callable:
    """The round written with fax_bridge's federated building blocks."""
    client_update = make_client_update(lr)
    server_update = make_server_update(server_lr)

    @fax_bridge.program(clients=clients)
    def fedavg_round(params, xs, ys, weights):
        params_c = fax_bridge.federated_broadcast(params)
        deltas, losses = fax_bridge.federated_map_clients(client_update, (params_c, xs, ys))
        if aggregate == "weighted":
            delta = fax_bridge.federated_weighted_mean(deltas, weights)
            loss = fax_bridge.federated_weighted_mean(losses, weights)
        else:
            delta = fax_bridge.federated_mean(deltas)
            loss = fax_bridge.federated_mean(losses)
        new_params = fax_bridge.federated_map_server(server_update, (params, delta))
        return new_params, loss

    return fedavg_round


def make_hand_round(clients: int, lr: float, server_lr: float, aggregate: str) -> Callable:
    """The same round by hand: `jax.vmap` over clients and `jnp` reductions."""
    del clients
    client_update = make_client_update(lr)
    server_update = make_server_update(server_lr)

    def weighted_mean(x, w):
        wx = w.reshape(w.shape + (1,) * (x.ndim - 1)).astype(x.dtype)
        return jnp.sum(wx * x, axis=0) / jnp.sum(w).astype(x.dtype)

    def fedavg_round(params, xs, ys, weights):
        deltas, losses = jax.vmap(client_update, in_axes=(None, 0, 0))(params, xs, ys)
        if aggregate == "weighted":
            delta = jax.tree_util.tree_map(lambda d: weighted_mean(d, weights), deltas)
            loss = weighted_mean(losses, weights)
        else:
            delta = jax.tree_util.tree_map(lambda d: jnp.mean(d, axis=0), deltas)
            loss = jnp.mean(losses, axis=0)
        return server_update(params, delta), loss

    return fedavg_round


def make_inputs(key: jax.Array, layers: Sequence[int], clients: int, steps: int,
                batch: int):
    """Server model, per-client batches (clients, steps, batch, ...) and example counts."""
    kp, kx, ky, kw = jax.random.split(key, 4)
    params = init_mlp(kp, layers)
    xs = jax.random.normal(kx, (clients, steps, batch, layers[0]), jnp.float32)
    ys = jax.random.randint(ky, (clients, steps, batch), 0, layers[-1], jnp.int32)
    weights = jax.random.randint(kw, (clients,), 1, 100).astype(jnp.float32)
    return params, xs, ys, weights


# --------------------------------------------------------------------------- measurement


def _hlo_summary(text: str) -> dict[str, int]:
    """Instruction counts of an optimized HLO module's text."""
    lines = [ln.strip() for ln in text.splitlines()
             if " = " in ln and not ln.strip().startswith("//")]

    def count(op: str) -> int:
        return sum(1 for ln in lines if f" {op}(" in ln)

    return {"instructions": len(lines), "dot": count("dot"), "fusion": count("fusion"),
            "reduce": count("reduce"), "broadcast": count("broadcast"),
            "copy": count("copy"), "transpose": count("transpose"),
            "while": count("while"), "custom-call": count("custom-call")}


def _compile(fn: Callable, args: tuple):
    t0 = time.perf_counter()
    lowered = jax.jit(fn).lower(*args)
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return compiled, t1 - t0, t2 - t1


def _max_abs_diff(a: Any, b: Any) -> float:
    diffs = jax.tree_util.tree_map(
        lambda x, y: float(np.max(np.abs(np.asarray(x) - np.asarray(y)))), a, b)
    return max(jax.tree_util.tree_leaves(diffs))


def run_benchmark(repeats: int = 50, clients: int = 32, steps: int = 10, batch: int = 32,
                  layers: Sequence[int] = DEFAULT_LAYERS, aggregate: str = "weighted",
                  lr: float = 0.05, server_lr: float = 1.0, warmup: int = 3,
                  seed: int = 0) -> dict[str, Any]:
    """Compiles and times both rounds; returns the figures as a JSON-ready dict."""
    if aggregate not in ("weighted", "mean"):
        raise ValueError(f"aggregate must be 'weighted' or 'mean', got {aggregate!r}.")
    args = make_inputs(jax.random.key(seed), layers, clients, steps, batch)
    fns = {"fax_bridge": make_fax_round(clients, lr, server_lr, aggregate),
           "hand": make_hand_round(clients, lr, server_lr, aggregate)}

    compiled, lower_s, compile_s, hlo = {}, {}, {}, {}
    for name, fn in fns.items():
        compiled[name], lower_s[name], compile_s[name] = _compile(fn, args)
        hlo[name] = _hlo_summary(compiled[name].as_text())

    outs = {name: jax.block_until_ready(c(*args)) for name, c in compiled.items()}
    diff = _max_abs_diff(outs["fax_bridge"], outs["hand"])
    for _ in range(warmup):
        for c in compiled.values():
            jax.block_until_ready(c(*args))

    times: dict[str, list[float]] = {name: [] for name in compiled}
    order = list(compiled)
    for i in range(repeats):
        for name in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            jax.block_until_ready(compiled[name](*args))
            times[name].append(time.perf_counter() - t0)

    med = {name: statistics.median(t) for name, t in times.items()}
    return {
        "config": {"repeats": repeats, "clients": clients, "steps": steps, "batch": batch,
                   "layers": list(layers), "aggregate": aggregate, "lr": lr,
                   "server_lr": server_lr, "params": param_count(args[0])},
        "machine": {"jax": jax.__version__, "backend": jax.default_backend(),
                    "devices": [str(d) for d in jax.devices()], "cpus": os.cpu_count(),
                    "python": platform.python_version(), "platform": platform.platform()},
        "median_s": med,
        "min_s": {name: min(t) for name, t in times.items()},
        "ratio": med["fax_bridge"] / med["hand"],
        "lower_s": lower_s,
        "compile_s": compile_s,
        "max_abs_diff": diff,
        "hlo": hlo,
        "times_s": times,
    }


def format_report(r: dict[str, Any]) -> str:
    """A human-readable summary of `run_benchmark`'s result."""
    c = r["config"]
    lines = [
        f"FedAvg round: MLP {'->'.join(map(str, c['layers']))} ({c['params']:,} params), "
        f"{c['clients']} clients x {c['steps']} SGD steps x batch {c['batch']}, "
        f"{'weighted' if c['aggregate'] == 'weighted' else 'unweighted'} mean of deltas",
        f"jax {r['machine']['jax']} on {r['machine']['backend']} "
        f"({r['machine']['cpus']} CPUs), {c['repeats']} alternating repeats",
        f"{'':12s}{'median ms':>11s}{'min ms':>9s}{'lower s':>9s}{'compile s':>11s}"
        f"{'HLO instrs':>12s}",
    ]
    for name in ("fax_bridge", "hand"):
        lines.append(f"{name:12s}{1e3 * r['median_s'][name]:11.2f}{1e3 * r['min_s'][name]:9.2f}"
                     f"{r['lower_s'][name]:9.3f}{r['compile_s'][name]:11.3f}"
                     f"{r['hlo'][name]['instructions']:12d}")
    lines.append(f"ratio fax_bridge/hand (medians): {r['ratio']:.3f}")
    lines.append(f"max abs diff of results: {r['max_abs_diff']:.3g}")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> dict[str, Any]:
    """Command-line entry point; returns the result dict."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=50, help="timed runs of each version")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--steps", type=int, default=10, help="local SGD steps per client")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--layers", type=lambda s: tuple(int(v) for v in s.split(",")),
                   default=DEFAULT_LAYERS, help="MLP widths, e.g. 128,256,256,10")
    p.add_argument("--aggregate", choices=("weighted", "mean"), default="weighted")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="write the figures as JSON here")
    a = p.parse_args(argv)
    result = run_benchmark(repeats=a.repeats, clients=a.clients, steps=a.steps,
                           batch=a.batch, layers=a.layers, aggregate=a.aggregate,
                           warmup=a.warmup, seed=a.seed)
    print(format_report(result))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
