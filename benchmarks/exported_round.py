"""One exported FedAvg round through `run_computation`, timed beside the same program
under `jax.jit` in the same process: the host path (clients' results read back, exact
sums on the CPU) and the device path (`on_device=True`: values stay on jax's default
device and are summed exactly there, `runtime.device_sums`).

The model is `--layers` square float32 matrices of `--params` parameters in all (a tanh
MLP); each of `--clients` clients takes `--steps` SGD steps on its own batch of
`--batch` examples from the broadcast model, and the server takes the clients' mean.
The round is exported once (`export_tff`); each way runs once to compile, then
`--repeats` times; the best of those is reported with its ratio to jit's. The printed
results also say whether the two paths gave the same bits. `--mlp` is the row of the
docs: a 2-layer MLP of 69,938 parameters, 64 clients of 32 examples, 2 local steps.

    .venv/bin/python benchmarks/exported_round.py [--params 1000000] [--clients 4]
        [--layers 4] [--batch 8] [--steps 1] [--repeats 3] [--clients-per-step K]
        [--json OUT]
    .venv/bin/python benchmarks/exported_round.py --mlp
    .venv/bin/python benchmarks/exported_round.py --memory 16 32 64 128 [--params ...]

The first calls (compiles included) are reported too; `--memory` runs the device path
at each cohort in a fresh process and reports its peak resident set and its chunk
step's `memory_analysis()`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import fax_bridge as fb
from fax_bridge.runtime import run_computation


def make_round(clients: int, steps: int = 1):
    """The FedAvg round as a fax_bridge program of `clients` clients, `steps` local
    SGD steps each."""
    def loss(params, batch):
        h = batch["x"]
        for name in sorted(params):
            h = jnp.tanh(h @ params[name])
        return jnp.mean((h - batch["y"]) ** 2)

    def local(params, batch):
        for _ in range(steps):
            grads = jax.grad(loss)(params, batch)
            params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
        return params

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


def _timed(fn, repeats: int) -> tuple[float, float, object]:
    """(seconds of the first call, compiles included; the best seconds of `repeats`
    calls after it; the last result)."""
    start = time.perf_counter()
    out = jax.block_until_ready(fn())
    first = time.perf_counter() - start
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return first, min(times), out


def measure(params: int, clients: int, layers: int = 4, batch: int = 8,
            repeats: int = 3, clients_per_step=None, steps: int = 1) -> dict:
    """Round times (seconds) of jit, the host path and the device path (its clients
    `clients_per_step` at a time), first calls (compiles included), and ratios."""
    program = make_round(clients, steps)
    model, data = make_args(params, clients, layers, batch)
    proto = fb.export_tff(program, model, data, placements=("server", "clients"))
    jitted = jax.jit(program)
    on_chip = jax.device_put((model, data))
    jit_first, jit_s, _ = _timed(lambda: jitted(*on_chip), repeats)
    host_first, host_s, host = _timed(
        lambda: run_computation(proto, model, data, on_device=False), repeats)
    device_first, device_s, device = _timed(
        lambda: run_computation(proto, model, data, on_device=True,
                                clients_per_step=clients_per_step), repeats)
    same = all(np.array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
               for a, b in zip(jax.tree.leaves(host), jax.tree.leaves(device)))
    total = sum(int(np.size(w)) for w in model.values())
    return {"backend": jax.default_backend(), "params": total, "clients": clients,
            "layers": layers, "batch": batch, "steps": steps, "jit_first_s": jit_first, "host_first_s": host_first,
            "device_first_s": device_first, "device_first_over_host": device_first / host_first,
            "jit_s": jit_s, "host_s": host_s, "device_s": device_s,
            "host_over_jit": host_s / jit_s, "device_over_jit": device_s / jit_s,
            "host_over_device": host_s / device_s, "same_bits": same}


def peak_memory(params: int, clients: int, layers: int = 4, batch: int = 8,
                clients_per_step=None) -> dict:
    """The device path's memory at `clients` clients, in a fresh process: its peak
    resident set after two rounds (`ru_maxrss`; on the CPU jax's arrays are this
    process's memory) and its chunk step's `memory_analysis()`."""
    code = (f"import json, resource, sys; sys.path.insert(0, {repr(__file__.rsplit('/', 1)[0])});"
            "import exported_round as e; from fax_bridge.runtime import device_rounds as d;"
            f"p = e.make_round({clients}); m, x = e.make_args({params}, {clients}, "
            f"{layers}, {batch}); import fax_bridge as fb;"
            "proto = fb.export_tff(p, m, x, placements=('server', 'clients'));"
            "[e.run_computation(proto, m, x, on_device=True, "
            f"clients_per_step={clients_per_step!r}) for _ in range(2)];"
            "a = d.step_memory(); print(json.dumps(dict(peak_rss_bytes=resource.getrusage("
            "resource.RUSAGE_SELF).ru_maxrss * 1024, step_temp_bytes=a.temp_size_in_bytes,"
            " step_argument_bytes=a.argument_size_in_bytes)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    return dict(json.loads(done.stdout.splitlines()[-1]), clients=clients, params=params)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=1e6)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=1, help="local SGD steps per client")
    parser.add_argument("--mlp", action="store_true",
                        help="the docs' row: --params 69938 --layers 2 --clients 64 "
                        "--batch 32 --steps 2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--clients-per-step", type=int,
                        help="the device path's chunk (default: \"auto\")")
    parser.add_argument("--memory", type=int, nargs="+", metavar="CLIENTS",
                        help="instead: the device path's peak memory at these cohorts")
    args = parser.parse_args(argv)
    if args.mlp:
        args.params, args.layers, args.clients, args.batch, args.steps = 69938, 2, 64, 32, 2
    if args.memory:
        rows = [peak_memory(int(args.params), n, args.layers, args.batch,
                            args.clients_per_step) for n in args.memory]
        for row in rows:
            print(f"{row['clients']:5d} clients: peak RSS {row['peak_rss_bytes'] / 2**20:.0f} "
                  f"MiB, chunk step temporaries {row['step_temp_bytes'] / 2**20:.1f} MiB")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return {"memory": rows}
    out = measure(int(args.params), args.clients, args.layers, args.batch, args.repeats,
                  args.clients_per_step, args.steps)
    print(f"{out['backend']}: {out['params']:,} parameters, {out['clients']} clients of "
          f"{out['batch']} examples, {out['steps']} local step(s)")
    print(f"  first calls: jit {out['jit_first_s']:.2f} s, host path "
          f"{out['host_first_s']:.2f} s, device path {out['device_first_s']:.2f} s "
          f"({out['device_first_over_host']:.2f}x the host path's)")
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
