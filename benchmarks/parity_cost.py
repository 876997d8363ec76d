"""What a parity verdict costs against the round it checks: the default bound's time.

For the round of `examples/strided_cnn.py` (a CNN of 105,866 parameters with two
stride-2 convolutions, under FedAdam, non-IID clients padded and masked) at
`--clients` clients, this times

  jit_compile_s   jit's first call of the round (tracing and compiling it)
  jit_round_s     a compiled jit call, the best of three
  parity_s        `check_parity` with its default bound (the float64 shadow's, twice it
                  per element) against a fleet of `--devices` devices, everything
                  included: tracing, export, the fleet's start and round, the bound
  shadow_s        of it, the float64 shadow (`parity.shadow.measure`: its compiles
                  and its runs)
  fixed_s         `check_parity` with fixed tolerances (`rtol=1e-5`): no bound
  ratio           parity_s / (jit_compile_s + jit_round_s)

and prints one row (and, with --json, writes it).

    python benchmarks/parity_cost.py [--clients 16] [--devices 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import strided_cnn  # noqa: E402

import fax_bridge as fb  # noqa: E402
from fax_bridge.parity import shadow as parity_shadow  # noqa: E402


class _Timed:
    """`parity.shadow.measure`, timed: the seconds of every call add up in `.seconds`."""

    def __init__(self):
        self.seconds, self.measure = 0.0, parity_shadow.measure

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.measure(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def measure(clients: int, devices: int) -> dict:
    """The row of one cohort size (module docstring)."""
    args, placements = strided_cnn.example_args(clients)
    round_fn = strided_cnn.make(clients).next
    jitted = jax.jit(round_fn)
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    compile_s = time.perf_counter() - start
    times = []
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(jitted(*args))
        times.append(time.perf_counter() - start)
    timed = _Timed()
    parity_shadow.measure = timed
    try:
        start = time.perf_counter()
        report = fb.check_parity(round_fn, *args, placements=placements, devices=devices)
        parity_s = time.perf_counter() - start
    finally:
        parity_shadow.measure = timed.measure
    start = time.perf_counter()
    fixed = fb.check_parity(round_fn, *args, placements=placements, devices=devices,
                            rtol=1e-5)
    fixed_s = time.perf_counter() - start
    return {"clients": clients, "devices": devices, "params": 105_866,
            "jit_compile_s": compile_s, "jit_round_s": min(times), "parity_s": parity_s,
            "shadow_s": timed.seconds, "fixed_s": fixed_s,
            "ratio": parity_s / (compile_s + min(times)),
            "verdict": "OK" if report.ok else "MISMATCH",
            "fixed_verdict": "OK" if fixed.ok else "MISMATCH", "jax": jax.__version__}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the row to this file")
    args = parser.parse_args(argv)
    row = measure(args.clients, args.devices)
    print("clients devices jit_compile_s jit_round_s parity_s shadow_s fixed_s ratio verdict")
    print(f"{row['clients']:7d} {row['devices']:7d} {row['jit_compile_s']:13.2f} "
          f"{row['jit_round_s']:11.3f} {row['parity_s']:8.1f} {row['shadow_s']:8.1f} "
          f"{row['fixed_s']:7.1f} {row['ratio']:5.1f} {row['verdict']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=1)
    return 0 if row["verdict"] == "OK" else 1


if __name__ == "__main__":
    sys.exit(main())
