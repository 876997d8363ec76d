"""Why the first-order rounding analysis's bound on the Stack Overflow LSTM is vacuous,
and what the float64 shadow measures instead, in figures.

`parity.first_order` carries a loop's error bound from step to step through |J|, the
step's Jacobian with every entry made positive (or op by op, which is no tighter): it
assumes each step's rounding errors line up with the sign pattern of every later step.
For an LSTM cell that compounds the row sums of |J|, while the error actually carried
to step T from step t goes through the product J_T ... J_(t+1), whose signs cancel.

For one sequence of `bench-litert --workloads`' LSTM (hidden size 670, embedding 96,
weights N(0, 1/fan_in) as that benchmark draws them, 20 tokens; the carry is (h, c),
1,340 floats) this prints, from the step Jacobians along the run's own trajectory:

  row_sum_abs_J       the largest row sum of |J_t| (the analysis's growth per step)
  spectral_J          ||J_t||_2
  abs_chain           max of |J_T| ... |J_1| 1 (what compounding |J| gives)
  chain_abs           max row sum of |J_T ... J_1| (the first-order worst case)
  analysis_bound      `parity.first_order.first_order_bounds` of the carry after T steps
  chain_bound         the first-order worst case of the same carry: sum over steps t of
                      |J_T ... J_(t+1)| r_t, where r_t is step t's own rounding bound
                      (`first_order_bounds` of one step from exact inputs)
  shadow_bound        `parity.rounding.evaluation_bounds` of the carry after T steps:
                      the float64 shadow's (`parity.shadow`), what parity checks use
  float32_error       |float32 - float64| of that carry (jit's f32 run against the
                      same cell in float64)

    python benchmarks/lstm_bound.py [--hidden 670] [--steps 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json

import jax

jax.config.update("jax_enable_x64", True)  # the float64 reference; the run stays float32

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from fax_bridge.parity import first_order as parity_first_order  # noqa: E402
from fax_bridge.parity import rounding as parity_rounding  # noqa: E402
from fax_bridge.language import tracing  # noqa: E402


def _model(hidden: int, steps: int, embed: int = 96, vocab: int = 10004, seed: int = 0):
    rng = np.random.default_rng(seed)
    dense = lambda a, b: (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
    table = (rng.standard_normal((vocab, embed)) * 0.05).astype(np.float32)
    weights = (dense(embed, 4 * hidden), dense(hidden, 4 * hidden),
               np.zeros(4 * hidden, np.float32))
    xs = table[rng.integers(0, vocab, steps)]
    return weights, xs


def _cell(weights, hidden: int):
    def cell(carry, xt):
        wi, wh, b = (w.astype(carry.dtype) for w in weights)
        hh, c = carry[:hidden], carry[hidden:]
        i, f, g, o = jnp.split(xt.astype(carry.dtype) @ wi + hh @ wh + b, 4, -1)
        c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
        return jnp.concatenate([jax.nn.sigmoid(o) * jnp.tanh(c), c])
    return cell


def measure(hidden: int = 670, steps: int = 20) -> dict:
    weights, xs = _model(hidden, steps)
    cell = _cell(weights, hidden)
    jacobian = jax.jit(jax.jacfwd(cell))
    carry = np.zeros(2 * hidden, np.float32)
    exact = np.zeros(2 * hidden, np.float64)
    abs_chain = np.ones(2 * hidden)
    chains: list = []  # J_t ... J_(s+1) for each earlier step s, and r_s
    row_sums, spectral = [], []
    for t in range(steps):
        J = np.asarray(jacobian(carry, xs[t]), np.float64)
        row_sums.append(float(np.abs(J).sum(1).max()))
        spectral.append(float(np.linalg.norm(J, 2)))
        abs_chain = np.abs(J) @ abs_chain
        chains = [(J @ m, r) for m, r in chains]
        one = tracing.trace(cell, carry, xs[t], clients=1)
        (r,) = parity_first_order.first_order_bounds(one, (carry, xs[t]))
        chains.append((np.eye(2 * hidden), np.asarray(r, np.float64)))
        carry = np.asarray(jax.jit(cell)(carry, xs[t]), np.float32)
        exact = np.asarray(cell(exact, xs[t]), np.float64)
    whole = chains[0][0] @ np.asarray(jacobian(np.zeros(2 * hidden, np.float32), xs[0]),
                                      np.float64) if steps else np.eye(2 * hidden)

    def run(c, x):
        return jax.lax.scan(lambda a, b: (cell(a, b), None), c, x)[0]

    zero = np.zeros(2 * hidden, np.float32)
    scan = tracing.trace(run, zero, xs, clients=1)
    (analysis,) = parity_first_order.first_order_bounds(scan, (zero, xs))
    (shadow,) = parity_rounding.evaluation_bounds(scan, (zero, xs))
    chain_bound = sum(np.abs(m) @ r for m, r in chains)
    return {
        "hidden": hidden, "steps": steps,
        "row_sum_abs_J": float(np.median(row_sums)), "spectral_J": float(np.median(spectral)),
        "abs_chain": float(abs_chain.max()),
        "chain_abs": float(np.abs(whole).sum(1).max()),
        "analysis_bound": float(np.max(analysis)),
        "chain_bound": float(np.max(chain_bound)),
        "shadow_bound": float(np.max(shadow)),
        "float32_error": float(np.max(np.abs(carry - exact))),
        "carry_max": float(np.max(np.abs(exact))),
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=670)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    row = measure(args.hidden, args.steps)
    print(json.dumps(row, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f)
    return row


if __name__ == "__main__":
    main()
