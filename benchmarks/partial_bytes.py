"""Bytes up per parameter of a holder's answer, by how many clients it holds.

For each count of clients on one holder (`--clients`), float32 updates of `--size`
parameters (normal, scale 1e-3, as a model's deltas; and the same with one in 1000
elements 1e4 times larger, spreading the exponents) are aggregated into the partial a
device or SuperNode sends (`rounds.partials.to_message`): the exact form (one client:
its float32 addend; more: float64 values exact for the sums, with the rare element
that float64 cannot hold exactly as integer limbs), and the rounded form
(`rounded_partials`: float32). Also measured: how many of each float64 value's
64 bits the sums use at most (sign, exponent and the mantissa down to its lowest set
bit), i.e. the narrowest fixed width of leading bytes that would carry every one of
them losslessly, and the median element's need (what a variable width would approach).

    .venv/bin/python benchmarks/partial_bytes.py [--size 1000000] [--clients 1 2 4 16 64]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def used_bits(values: np.ndarray) -> tuple:
    """(the most, the median) leading bits each of the float64 `values` needs (64 less
    its trailing zero bits; a zero needs none)."""
    bits = values.view(np.uint64)
    bits = bits[bits != 0]
    if not bits.size:
        return 0, 0
    low = bits & (~bits + np.uint64(1))  # the lowest set bit of each
    used = 64 - np.log2(low.astype(np.float64))
    return int(used.max()), float(np.median(used))


def measure(size: int, clients: int, spread: bool, seed: int = 0) -> dict:
    from fax_bridge.rounds import partials
    from fax_bridge.runtime import aggregation

    rng = np.random.default_rng(seed)
    members = []
    for _ in range(clients):
        x = rng.normal(0, 1e-3, size).astype(np.float32)
        if spread:
            x[::1000] *= np.float32(1e4)
        members.append(x)
    partial = aggregation.partial_of("sum", members)
    exact = partials.to_message(partial)
    rounded = partials.to_message(partial, rounded=True)
    leaf = exact.leaves[0]

    def nbytes(m) -> int:
        return sum(len(f) for f in (m.leaves[0].doubles, m.leaves[0].limbs,
                                    m.leaves[0].nonfinite, m.leaves[0].spilled,
                                    m.leaves[0].addend.data))

    used, median = (used_bits(np.frombuffer(leaf.doubles, "<f8")) if leaf.doubles
                    else (None, None))
    return {"clients": clients, "spread": spread,
            "exact_bytes_per_param": nbytes(exact) / size,
            "rounded_bytes_per_param": nbytes(rounded) / size,
            "spilled": len(leaf.spilled) // 8, "float64_bits_used": used,
            "median_bits_used": median,
            "lossless_width_bytes": None if used is None else -(-used // 8)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=1_000_000)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4, 16, 64])
    args = parser.parse_args(argv)
    print(f"{'clients':>7s} {'spread':>6s} {'exact B/param':>13s} {'rounded':>8s} "
          f"{'spilled':>7s} {'bits used':>9s} {'median':>6s} {'lossless width B':>16s}")
    for spread in (False, True):
        for clients in args.clients:
            r = measure(args.size, clients, spread)
            print(f"{r['clients']:7d} {str(r['spread']):>6s} "
                  f"{r['exact_bytes_per_param']:13.3f} {r['rounded_bytes_per_param']:8.3f} "
                  f"{r['spilled']:7d} {str(r['float64_bits_used']):>9s} "
                  f"{str(r['median_bits_used']):>6s} "
                  f"{str(r['lossless_width_bytes']):>16s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
