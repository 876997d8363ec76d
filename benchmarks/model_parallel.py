"""A FedAvg round over a model sharded on a `model` mesh axis: memory, collectives, time.

On 8 emulated CPU devices (`XLA_FLAGS=--xla_force_host_platform_device_count=8`, set
here), for each `clients x model` mesh (default 8x1, 4x2, 2x4, 1x8, Auto axes), one
FedAvg round of a two-layer MLP (`w1: [width, hidden]` split over `model` by columns,
`w2: [hidden, width]` by rows) over 8 clients, written three ways with the same math:

- `fax_bridge`: `@fax_bridge.program` with broadcast, map (one local SGD step), mean;
- `drjax`: the same program in DrJAX 0.2.1;
- `baseline`: hand-written `jax.jit` of `jax.vmap` + `jnp.mean`, same input shardings.

Reported per mesh and version:

- per-device bytes of arguments, outputs and temporaries from
  `compiled.memory_analysis()` at `--width/--hidden` (default 4096 x 12288: 100.7M
  parameters), compiled from shapes only (nothing that size is allocated), and the
  parameter bytes each device holds;
- all-gathers and all-reduces in the optimized HLO;
- round time (median of `--repeats` alternating runs) at `--time-width/--time-hidden`,
  a size that fits a shared machine, and the ratios fax_bridge / drjax and
  fax_bridge / baseline, with the largest difference between the three results.

    python benchmarks/model_parallel.py --json out/model_parallel.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from typing import Any, Callable

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P  # noqa: E402

import fax_bridge as fb  # noqa: E402

CLIENTS = 8
SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}


def shapes(width: int, hidden: int) -> dict[str, tuple]:
    return {"w1": (width, hidden), "b1": (hidden,), "w2": (hidden, width), "b2": (width,)}


def loss(p, x, y):
    h = jax.nn.relu(x @ p["w1"] + p["b1"])
    return jnp.mean((h @ p["w2"] + p["b2"] - y) ** 2)


def local_step(p, x, y, lr: float = 0.01):
    g = jax.grad(loss)(p, x, y)
    return jax.tree.map(lambda a, b: a - lr * b, p, g)


@fb.program(clients=CLIENTS)
def fax_round(p, x, y):
    trained = fb.federated_map_clients(local_step, (fb.federated_broadcast(p), x, y))
    return fb.federated_mean(trained)


def baseline_round(p, x, y):
    return jax.tree.map(lambda a: jnp.mean(a, axis=0),
                        jax.vmap(local_step, in_axes=(None, 0, 0))(p, x, y))


def make_drjax_round() -> Callable:
    import drjax

    @drjax.program(placements={"clients": CLIENTS})
    def drjax_round(p, x, y):
        return drjax.reduce_mean(drjax.map_fn(local_step, (drjax.broadcast(p), x, y)))

    return drjax_round


def make_mesh(spec: str):
    c, m = (int(v) for v in spec.split("x"))
    return jax.make_mesh((c, m), ("clients", "model"), axis_types=(AxisType.Auto,) * 2)


def arg_shardings(mesh, width: int, hidden: int, batch: int):
    params = {k: jax.ShapeDtypeStruct(s, jnp.float32, sharding=NamedSharding(mesh, SPECS[k]))
              for k, s in shapes(width, hidden).items()}
    data = jax.ShapeDtypeStruct((CLIENTS, batch, width), jnp.float32,
                                sharding=NamedSharding(mesh, P("clients")))
    return params, data, data


def collectives(text: str) -> dict[str, int]:
    return {k: len(re.findall(rf"\b{k}(?:-start)?\(", text))
            for k in ("all-gather", "all-reduce", "reduce-scatter", "all-to-all")}


def param_bytes_per_device(mesh, width: int, hidden: int) -> int:
    total = 0
    for k, shape in shapes(width, hidden).items():
        shard = NamedSharding(mesh, SPECS[k]).shard_shape(shape)
        total += int(np.prod(shard)) * 4
    return total


def versions() -> dict[str, Callable]:
    return {"fax_bridge": fax_round, "drjax": make_drjax_round(), "baseline": baseline_round}


def analyse(mesh_spec: str, width: int, hidden: int, batch: int) -> dict[str, Any]:
    """Memory and collectives of every version, compiled from shapes on one mesh."""
    mesh = make_mesh(mesh_spec)
    args = arg_shardings(mesh, width, hidden, batch)
    out: dict[str, Any] = {"param_bytes_per_device": param_bytes_per_device(mesh, width, hidden)}
    with jax.set_mesh(mesh):
        for name, fn in versions().items():
            compiled = jax.jit(fn).lower(*args).compile()
            mem = compiled.memory_analysis()
            out[name] = {"argument_bytes": int(mem.argument_size_in_bytes),
                         "output_bytes": int(mem.output_size_in_bytes),
                         "temp_bytes": int(mem.temp_size_in_bytes),
                         **collectives(compiled.as_text())}
    return out


def time_round(mesh_spec: str, width: int, hidden: int, batch: int, repeats: int,
               seed: int = 0) -> dict[str, Any]:
    """Median round time of every version on real arrays, run alternately."""
    mesh = make_mesh(mesh_spec)
    rng = np.random.default_rng(seed)
    params = {k: jax.device_put((rng.normal(size=s) / np.sqrt(s[0])).astype(np.float32),
                                NamedSharding(mesh, SPECS[k]))
              for k, s in shapes(width, hidden).items()}
    x, y = (jax.device_put(rng.normal(size=(CLIENTS, batch, width)).astype(np.float32),
                           NamedSharding(mesh, P("clients"))) for _ in range(2))
    times: dict[str, list] = {}
    results = {}
    with jax.set_mesh(mesh):
        compiled = {name: jax.jit(fn).lower(params, x, y).compile()
                    for name, fn in versions().items()}
        for name, c in compiled.items():
            results[name] = jax.block_until_ready(c(params, x, y))  # warm up
        for _ in range(repeats):
            for name, c in compiled.items():
                start = time.perf_counter()
                jax.block_until_ready(c(params, x, y))
                times.setdefault(name, []).append(time.perf_counter() - start)
    med = {k: statistics.median(v) for k, v in times.items()}
    diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
               for other in ("drjax", "baseline")
               for a, b in zip(jax.tree.leaves(results["fax_bridge"]),
                               jax.tree.leaves(results[other])))
    specs = {k: str(v.sharding.spec) for k, v in results["fax_bridge"].items()}
    return {"median_s": med, "fax_over_drjax": med["fax_bridge"] / med["drjax"],
            "fax_over_baseline": med["fax_bridge"] / med["baseline"],
            "max_abs_diff": diff, "output_specs": specs}


def main(argv=None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--meshes", default="8x1,4x2,2x4,1x8")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=12288)
    parser.add_argument("--time-width", type=int, default=1024)
    parser.add_argument("--time-hidden", type=int, default=3072)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if jax.device_count() < 8:
        raise SystemExit(f"needs 8 devices, found {jax.device_count()}; run it as a script "
                         "(it sets XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    n_params = sum(int(np.prod(s)) for s in shapes(args.width, args.hidden).values())
    n_timed = sum(int(np.prod(s)) for s in shapes(args.time_width, args.time_hidden).values())
    result: dict[str, Any] = {
        "config": {"clients": CLIENTS, "params": n_params, "timed_params": n_timed,
                   "batch": args.batch, "repeats": args.repeats,
                   "machine": f"{platform.processor() or platform.machine()}, "
                              f"{os.cpu_count()} cores", "jax": jax.__version__},
        "meshes": {}}
    print(f"FedAvg round, {CLIENTS} clients, {n_params:,} parameters (memory, HLO); "
          f"{n_timed:,} parameters (time)")
    for spec in args.meshes.split(","):
        entry = analyse(spec, args.width, args.hidden, args.batch)
        entry["time"] = time_round(spec, args.time_width, args.time_hidden, args.batch,
                                   args.repeats)
        result["meshes"][spec] = entry
        fax, t = entry["fax_bridge"], entry["time"]
        print(f"{spec}: params/device {entry['param_bytes_per_device'] / 2**20:8.1f} MiB | "
              + " | ".join(f"{v}: arg {entry[v]['argument_bytes'] / 2**20:.1f} "
                           f"out {entry[v]['output_bytes'] / 2**20:.1f} "
                           f"temp {entry[v]['temp_bytes'] / 2**20:.1f} MiB "
                           f"AG {entry[v]['all-gather']} AR {entry[v]['all-reduce']}"
                           for v in ("fax_bridge", "drjax", "baseline"))
              + f" | time fax/drjax {t['fax_over_drjax']:.3f} fax/base "
                f"{t['fax_over_baseline']:.3f}, max diff {t['max_abs_diff']:.1e}", flush=True)
        del fax
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
    sys.exit(0)
