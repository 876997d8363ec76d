"""A client runtime whose answer is wrong in one element of one client's result: the
wrong answers parity checks must catch (`tests/test_parity_mutations.py`,
`tests/test_litert_convert.py`).

`Perturbed(base, how)` runs client parts as `base` ("xla": the client part's XLA, one
client at a time; "litert": the LiteRT interpreter) and, before aggregating, changes
client `client`'s value for aggregation `spec` (its index or kind) at the element of largest magnitude of
the value's float (for "plus_one", integer) tensors: "relative" multiplies
it by 1 + `rel`, "nan" makes it NaN, "plus_one" adds 1. It names itself as `base` does,
so a fleet or `check_parity` treats it as that runtime.
"""

from __future__ import annotations

import dataclasses
from typing import Union

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.runtime import aggregation
from fax_bridge.runtime.evaluator import select_element


@dataclasses.dataclass
class Perturbed:
    base: str  # "xla" or "litert"
    how: str = "relative"  # "relative", "nan" or "plus_one"
    rel: float = 1e-4
    client: int = 0
    spec: Union[int, str, None] = None  # an aggregation's index or kind; None: the first
    # aggregation with such a tensor
    done: list = dataclasses.field(default_factory=list)  # (spec, tensor, element) changed

    @property
    def name(self) -> str:
        return self.base

    def check_round(self, proto, split) -> None:
        from fax_bridge.rounds import client_runtime

        client_runtime.resolve(self.base).check_round(proto, split)

    def carrying(self, models_dir):
        del models_dir
        return self

    def device_args(self) -> list:
        raise NotImplementedError("a test runtime runs in this process only")

    def map_clients(self, fn, members, key=None, no_argument: bool = False, guard=None):
        raise NotImplementedError("a test runtime runs rounds that split only")

    def _results(self, fn, key, sent, members, specs, guard) -> list:
        if self.base == "litert":
            from fax_bridge.litert import runner

            return runner.run_clients(runner.model_for(fn, key, sent, members, specs),
                                      sent, members, guard)
        from fax_bridge.runtime import client_map

        return client_map.map_clients(fn, members, sent, key=key, guard=guard)

    def _wants(self, tensor: np.ndarray) -> bool:
        if self.how == "plus_one":
            return np.issubdtype(tensor.dtype, np.integer) and tensor.size > 0
        return np.issubdtype(tensor.dtype, np.floating) and tensor.size > 0

    def _perturb(self, value, s: int):
        leaves = [np.array(t) for t in (structure.flatten(value)
                                        if isinstance(value, structure.Struct) else [value])]
        sizes = [float(np.max(np.abs(t.astype(np.float64)))) if self._wants(t) else -1.0
                 for t in leaves]
        if max(sizes, default=-1.0) < 0:
            return None
        t = int(np.argmax(sizes))
        tensor = leaves[t]
        at = np.unravel_index(np.argmax(np.abs(tensor.astype(np.float64))), tensor.shape)
        if self.how == "relative":
            tensor[at] = tensor[at] * tensor.dtype.type(1.0 + self.rel)
        elif self.how == "nan":
            tensor[at] = np.nan
        else:
            tensor[at] += 1
        self.done.append((s, t, tuple(int(i) for i in at)))
        if isinstance(value, structure.Struct):
            return structure.pack_sequence_as(value, leaves)
        return leaves[0]

    def client_partials(self, fn, key, sent, members, specs, guard=None,
                        least_rows: int = 0) -> list:
        del least_rows
        results = self._results(fn, key, sent, members, specs, guard)
        out = []
        for s, (kind, vi, wi, *bound) in enumerate(specs):
            values = [select_element(r, vi) for r in results]
            weights = None if wi is None else [select_element(r, wi) for r in results]
            if not self.done and self.spec in (None, s, kind) and self.client < len(values):
                changed = self._perturb(values[self.client], s)
                if changed is not None:
                    values[self.client] = changed
            out.append(aggregation.partial_of(kind, values, weights,
                                              bound[0] if bound else None))
        return out


class InProcessFleet:
    """A fleet of no devices: the round engine in this process with `client_runtime`
    (a round that splits; its clients are its arguments')."""

    num_devices = 0

    def __init__(self, client_runtime):
        self.client_runtime = client_runtime

    def run(self, proto, *args, num_clients=None):
        from fax_bridge.runtime import run_computation

        del num_clients  # given, it would interpret the proto phase by phase
        self.last = run_computation(proto, *args, client_runtime=self.client_runtime)
        return self.last
