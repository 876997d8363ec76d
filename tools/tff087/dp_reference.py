"""Runs TFF 0.87's DP aggregators on given client values and prints what they produce.

Runs in .venv-tff. Reads one JSON object from stdin:

    {"rounds": [[{"a": [...], "b": [...]}, ...], ...],   # per round, per client, per leaf
     "cases": [{"name": ..., "factory": "gaussian_fixed" | "gaussian_adaptive",
                "kwargs": {...}}, ...]}

builds `tff.aggregators.DifferentiallyPrivateFactory.<factory>(**kwargs)` for a struct
value type of float32 vectors, runs `initialize` and one `next` per round on TFF's own
runtime, and prints {name: {"results": [per round {leaf: [...]}], "clips": [...]}} as
JSON, "clips" being the clip norm in TFF's state after each round. Optional
`"read": [paths]` also reads those .pb files with TFF's building blocks (as
`read_signatures.py` does) into `{"signatures": {path: {"type_signature", "error"}}}`.
"""

import collections
import json
import sys

import numpy as np


def _clip(state):
    """The clip norm in a DP aggregator's state (NormalizedQuery over a sum query)."""
    numerator = state.query_state.numerator_state
    sum_state = getattr(numerator, "sum_state", numerator)  # adaptive: the inner sum query
    return sum_state.l2_norm_clip


def main() -> None:
    spec = json.load(sys.stdin)
    import tensorflow_federated as tff

    rounds = spec["rounds"]
    first = rounds[0][0]
    keys = sorted(first)
    value_type = tff.types.to_type(collections.OrderedDict(
        (k, tff.types.TensorType(np.float32, [len(first[k])])) for k in keys))
    out = {}
    for case in spec["cases"]:
        make = getattr(tff.aggregators.DifferentiallyPrivateFactory, case["factory"])
        process = make(**case["kwargs"]).create(value_type)
        state = process.initialize()
        results, clips = [], []
        for clients in rounds:
            values = [collections.OrderedDict((k, np.asarray(c[k], np.float32)) for k in keys)
                      for c in clients]
            output = process.next(state, values)
            state = output.state
            results.append({k: np.asarray(output.result[k]).tolist() for k in keys})
            clips.append(float(_clip(state)))
        out[case["name"]] = {"results": results, "clips": clips}
    if spec.get("read"):
        from read_signatures import read_signature  # beside this script

        out["signatures"] = {p: read_signature(p) for p in spec["read"]}
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
