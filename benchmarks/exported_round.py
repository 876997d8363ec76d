"""One exported FedAvg round through `run_computation`, timed beside the same program
under `jax.jit` in the same process: the host path (clients' results read back, exact
sums on the CPU) and the device path (`on_device=True`: values stay on jax's default
device and are summed exactly there, `runtime.device_sums`).

The model is `--layers` square float32 matrices of `--params` parameters in all; each of
`--clients` clients takes one SGD step on its own batch from the broadcast model, and
the server takes the clients' mean. The round is exported once (`export_tff`); each way
runs once to compile, then `--repeats` times; the median is reported with its ratio to
jit's. The printed results also say whether the two paths gave the same bits.

    .venv/bin/python benchmarks/exported_round.py [--params 1000000] [--clients 4]
        [--layers 4] [--batch 8] [--repeats 3] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import fax_bridge as fb
from fax_bridge.runtime import run_computation


def make_round(clients: int):
    """The FedAvg round as a fax_bridge program of `clients` clients."""
    def loss(params, batch):
        h = batch["x"]
        for name in sorted(params):
            h = jnp.tanh(h @ params[name])
        return jnp.mean((h - batch["y"]) ** 2)

    def local(params, batch):
        grads = jax.grad(loss)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)

    def round_(params, data):
        new = fb.federated_map_clients(local, (fb.federated_broadcast(params), data))
        return fb.federated_mean(new)

    return fb.program(clients=clients)(round_)


def make_args(params: int, clients: int, layers: int, batch: int, seed: int = 0):
    """(model, clients' data): `layers` matrices of width sqrt(params / layers)."""
    width = max(1, int(round((params / layers) ** 0.5)))
    rng = np.random.default_rng(seed)
    model = {f"w{i}": (rng.standard_normal((width, width)) / width ** 0.5
                       ).astype(np.float32) for i in range(layers)}
    data = {"x": rng.standard_normal((clients, batch, width)).astype(np.float32),
            "y": rng.standard_normal((clients, batch, width)).astype(np.float32)}
    return model, data


def _timed(fn, repeats: int) -> tuple[float, object]:
    """(median seconds of `repeats` calls after one to compile, the last result)."""
    out = jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def measure(params: int, clients: int, layers: int = 4, batch: int = 8,
            repeats: int = 3) -> dict:
    """Round times (seconds) of jit, the host path and the device path, and ratios."""
    program = make_round(clients)
    model, data = make_args(params, clients, layers, batch)
    proto = fb.export_tff(program, model, data, placements=("server", "clients"))
    jitted = jax.jit(program)
    on_chip = jax.device_put((model, data))
    jit_s, _ = _timed(lambda: jitted(*on_chip), repeats)
    host_s, host = _timed(lambda: run_computation(proto, model, data, on_device=False),
                          repeats)
    device_s, device = _timed(lambda: run_computation(proto, model, data, on_device=True),
                              repeats)
    same = all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
               for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(device)))
    total = sum(int(np.size(w)) for w in model.values())
    return {"backend": jax.default_backend(), "params": total, "clients": clients,
            "jit_s": jit_s, "host_s": host_s, "device_s": device_s,
            "host_over_jit": host_s / jit_s, "device_over_jit": device_s / jit_s,
            "host_over_device": host_s / device_s, "same_bits": same}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e6)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    out = measure(int(args.params), args.clients, args.layers, args.batch, args.repeats)
    print(f"{out['backend']}: {out['params']:,} parameters, {out['clients']} clients")
    print(f"  jit          {out['jit_s']:.4f} s")
    print(f"  host path    {out['host_s']:.4f} s  ({out['host_over_jit']:.1f}x jit)")
    print(f"  device path  {out['device_s']:.4f} s  ({out['device_over_jit']:.1f}x jit, "
          f"host/device {out['host_over_device']:.2f}); same bits: {out['same_bits']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
