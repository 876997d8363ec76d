"""A FedAvg round with its clients' data streamed (`fb.stream_clients`) against the same
chunked round given the data in memory (`jax.jit` of the program, numpy arrays in).

The round: `--clients` clients, each `--steps` SGD steps of a one-hidden-layer MLP of
width `--width` on `--batch` examples of its own, `--chunk` clients a step, the server
taking the clients' mean. The streamed round reads each chunk through
`fetch(ids) = data[ids]` (numpy fancy indexing: an array of its own, taken without a
copy). Each way runs once to compile, then `--repeats` rounds each, in turn (a loaded
machine's changing load falls on both alike); the medians and their ratio are printed,
and the fastest rounds' ratio, with the seconds `fetch` itself took in a streamed round
and whether the two gave the same bits.

    .venv/bin/python benchmarks/stream_round.py [--clients 64] [--chunk 4] [--width 256]
        [--steps 8] [--batch 64] [--repeats 7] [--json OUT]
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


def make_round(clients: int, chunk: int, steps: int):
    """The FedAvg program: `steps` SGD steps per client, the clients' mean."""
    def loss(w, x, y):
        return jnp.mean((jnp.tanh(x @ w["a"]) @ w["b"] - y) ** 2)

    def local(w, d):
        def step(w, _):
            g = jax.grad(loss)(w, d["x"], d["y"])
            return jax.tree.map(lambda p, q: p - 0.05 * q, w, g), None
        return jax.lax.scan(step, w, None, length=steps)[0]

    @fb.program(clients=clients, clients_per_step=chunk)
    def fedavg(w, data):
        return fb.federated_mean(fb.federated_map_clients(
            local, (fb.federated_broadcast(w), data)))

    return fedavg


def make_args(clients: int, width: int, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = {"a": (rng.standard_normal((width, width)) / width ** 0.5).astype(np.float32),
         "b": (rng.standard_normal((width, 1)) / width ** 0.5).astype(np.float32)}
    data = {"x": rng.standard_normal((clients, batch, width)).astype(np.float32),
            "y": rng.standard_normal((clients, batch, 1)).astype(np.float32)}
    return jax.device_put(w), data


def _interleaved(ways: dict, repeats: int) -> tuple[dict, dict]:
    """({name: the seconds of each of `repeats` rounds}, {name: the last result}): each
    way once to compile, then the ways one round each in turn, so that a machine's
    changing load falls on both alike."""
    out = {name: jax.block_until_ready(fn()) for name, fn in ways.items()}
    times: dict = {name: [] for name in ways}
    for _ in range(repeats):
        for name, fn in ways.items():
            start = time.perf_counter()
            out[name] = jax.block_until_ready(fn())
            times[name].append(time.perf_counter() - start)
    return times, out


def measure(clients: int = 64, chunk: int = 4, width: int = 256, steps: int = 8,
            batch: int = 64, repeats: int = 7) -> dict:
    """Median seconds of the in-memory and the streamed round, their ratio, the seconds
    `fetch` took in the last streamed round, and whether both gave the same bits."""
    program = make_round(clients, chunk, steps)
    w, data = make_args(clients, width, batch)
    jitted = jax.jit(program)
    fetched = []

    def fetch(ids):
        start = time.perf_counter()
        out = {key: value[ids] for key, value in data.items()}
        fetched.append(time.perf_counter() - start)
        return out

    run = fb.stream_clients(program, 1)

    def streamed_round():
        fetched.clear()
        return run(w, fetch)

    times, out = _interleaved({"in_memory": lambda: jitted(w, data),
                               "streamed": streamed_round}, repeats)
    expected, got = out["in_memory"], out["streamed"]
    in_memory_s, streamed_s = (statistics.median(times[k]) for k in ("in_memory",
                                                                      "streamed"))
    same = all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree.leaves(expected), jax.tree.leaves(got)))
    return {"backend": jax.default_backend(), "clients": clients, "chunk": chunk,
            "width": width, "steps": steps, "batch": batch,
            "streamed_bytes": int(sum(v.nbytes for v in data.values())),
            "in_memory_s": in_memory_s, "streamed_s": streamed_s,
            "streamed_over_in_memory": streamed_s / in_memory_s,
            "fastest_ratio": min(times["streamed"]) / min(times["in_memory"]),
            "fetch_s": sum(fetched), "same_bits": same}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    out = measure(args.clients, args.chunk, args.width, args.steps, args.batch,
                  args.repeats)
    print(f"{out['backend']}: {out['clients']} clients, chunks of {out['chunk']}, "
          f"{out['streamed_bytes'] / 2**20:.1f} MiB streamed")
    print(f"  in memory  {out['in_memory_s']:.4f} s")
    print(f"  streamed   {out['streamed_s']:.4f} s  ({out['streamed_over_in_memory']:.2f}x;"
          f" fastest rounds {out['fastest_ratio']:.2f}x; fetch {out['fetch_s']:.4f} s); "
          f"same bits: {out['same_bits']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
