"""A planted fault: a client runtime whose answer is wrong in one element of one client's
result, so that a parity check can be watched failing (docs/fleet_rounds.md).

`Fault(base="xla" or "litert", ...)` runs client parts as `base` does ("xla": the client
part's XLA, one client at a time; "litert": the LiteRT interpreter) and, before
aggregating, changes the value that client `client` feeds aggregation `aggregation` (its
index in the round's split, or its kind: "mean", "sum", ...; None: the first with a leaf
that can be changed):

  leaf      the tensor within that value: its path of names or positions, "/"-separated
            ("1", "params/d1"); None: the tensor holding the value's largest element.
            A value that is one tensor has the one leaf "".
  element   the flat index of the element within the leaf; None: its largest in magnitude
  how       "relative" multiplies the element by 1 + `rel` (rel=0 changes nothing);
            "nan" makes it NaN; "plus_one" adds 1 (integer leaves)

Only the first aggregation that matches is changed, once per call (`done` records
`(aggregation, leaf, element)` in this process). A fault names itself as `base` does, so a
fleet or `check_parity` treats it as that runtime. A fleet's devices take it as
`fax-bridge device --fault "client=1,aggregation=mean,leaf=0,rel=1e-3"`
(`device_args`, parsed back by `parse`, which refuses any other key or value by name).
A name the value does not have is refused listing the leaves it has. A round with no
single client part (one run phase by phase) is refused up front.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Union

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import ArgumentError
from fax_bridge.runtime import aggregation as aggregations
from fax_bridge.runtime.evaluator import select_element

HOWS = ("relative", "nan", "plus_one")
BASES = ("xla", "litert")
KEYS = ("client", "aggregation", "leaf", "element", "how", "rel")
MAX_REL = 1e6


@dataclasses.dataclass
class Fault:
    """One wrong element of one client's result (module docstring).

    Example:
      >>> from fax_bridge.rounds.faults import Fault, parse
      >>> fault = Fault("xla", aggregation="mean", leaf="0", rel=1e-3, client=1)
      >>> fault.device_args()
      ['--fault', 'client=1,aggregation=mean,leaf=0,how=relative,rel=0.001']
      >>> parse(fault.device_args()[1], base="xla") == fault
      True
    """

    base: str = "xla"
    how: str = "relative"
    rel: float = 1e-4
    client: int = 0
    aggregation: Union[int, str, None] = None
    leaf: Optional[str] = None
    element: Optional[int] = None
    models_dir: Optional[str] = None
    done: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    def __post_init__(self):
        if self.base not in BASES:
            raise ArgumentError(f"Fault: base={self.base!r}: expected one of {list(BASES)}")
        if self.how not in HOWS:
            raise ArgumentError(f"Fault: how={self.how!r}: expected one of {list(HOWS)} "
                                "(relative: times 1 + rel; nan; plus_one: integers)")
        if isinstance(self.rel, bool) or not isinstance(self.rel, (int, float)) or \
                not math.isfinite(self.rel) or abs(self.rel) > MAX_REL:
            raise ArgumentError(f"Fault: rel={self.rel!r}: expected a finite number of "
                                f"magnitude at most {MAX_REL:g} (1e-3: 0.1% off)")
        for name in ("client", "element"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ArgumentError(f"Fault: {name}={value!r}: expected an integer >= 0")
        if self.client is None:
            raise ArgumentError("Fault: client=None: expected an integer >= 0")
        a = self.aggregation
        if a is not None and (isinstance(a, bool) or not isinstance(a, (int, str)) or
                              (isinstance(a, int) and a < 0) or
                              (isinstance(a, str) and a not in aggregations.KINDS)):
            raise ArgumentError(f"Fault: aggregation={a!r}: expected an index >= 0 or a "
                                f"kind, one of {sorted(aggregations.KINDS)}")
        if self.leaf is not None and (not isinstance(self.leaf, str) or
                                      not _NAME_CHARS.issuperset(self.leaf)):
            raise ArgumentError(f"Fault: leaf={self.leaf!r}: expected a path of names or "
                                "positions joined by '/' (letters, digits, _ . -)")

    @property
    def name(self) -> str:
        return self.base

    def _base(self):
        """The honest runtime this fault runs as."""
        if self.base == "litert":
            from fax_bridge.litert.runner import LiteRTClientRuntime

            return LiteRTClientRuntime(models_dir=self.models_dir)
        from fax_bridge.rounds.client_runtime import XlaClientRuntime

        return XlaClientRuntime()

    def check_round(self, proto, split) -> None:
        if split is None:
            raise ArgumentError("Fault: this round has no single client part (it runs "
                                "phase by phase); a fault changes a client part's result, "
                                "so plant it in a round that splits")
        self._base().check_round(proto, split)

    def carrying(self, models_dir) -> "Fault":
        return self if models_dir is None else dataclasses.replace(self, models_dir=models_dir)

    def device_args(self) -> list:
        return self._base().device_args() + ["--fault", self.flag()]

    def flag(self) -> str:
        """This fault as `--fault`'s value (`parse` reads it back)."""
        parts = [f"client={self.client}"]
        for key in ("aggregation", "leaf", "element"):
            if getattr(self, key) is not None:
                parts.append(f"{key}={getattr(self, key)}")
        return ",".join(parts + [f"how={self.how}", f"rel={self.rel!r}"])

    def map_clients(self, fn, members, key=None, no_argument: bool = False, guard=None):
        raise ArgumentError("Fault: a fault runs rounds that split only (check_round)")

    def _results(self, fn, key, sent, members, specs, guard) -> list:
        if self.base == "litert":
            from fax_bridge.litert import runner

            return runner.run_clients(runner.model_for(fn, key, sent, members, specs,
                                                       models=self.models_dir),
                                      sent, members, guard)
        from fax_bridge.runtime import client_map

        return client_map.map_clients(fn, members, sent, key=key, guard=guard)

    def _wants(self, tensor: np.ndarray) -> bool:
        kind = np.integer if self.how == "plus_one" else np.floating
        return np.issubdtype(tensor.dtype, kind) and tensor.size > 0

    def _perturb(self, value, s: int):
        """`value` with the fault planted, or None where it has no leaf to change."""
        paths, leaves = _leaves(value)
        if self.leaf is not None:
            if self.leaf not in paths:
                raise ArgumentError(
                    f"Fault: leaf={self.leaf!r}: aggregation {s} has no such leaf; its "
                    "leaves: " + ", ".join(f"{p!r} {t.dtype}{list(t.shape)}"
                                           for p, t in zip(paths, leaves)))
            t = paths.index(self.leaf)
            if not self._wants(leaves[t]):
                raise ArgumentError(
                    f"Fault: leaf={self.leaf!r} of aggregation {s} is "
                    f"{leaves[t].dtype}{list(leaves[t].shape)}; how={self.how!r} changes "
                    f"{'integer' if self.how == 'plus_one' else 'float'} tensors")
        else:
            sizes = [float(np.max(np.abs(x.astype(np.float64)))) if self._wants(x) else -1.0
                     for x in leaves]
            if max(sizes, default=-1.0) < 0:
                return None
            t = int(np.argmax(sizes))
        tensor = leaves[t]
        if self.element is None:
            flat = int(np.argmax(np.abs(tensor.astype(np.float64))))
        elif self.element < tensor.size:
            flat = self.element
        else:
            raise ArgumentError(f"Fault: element={self.element}: leaf {paths[t]!r} of "
                                f"aggregation {s} has {tensor.size} elements")
        at = np.unravel_index(flat, tensor.shape)
        if self.how == "relative":
            tensor[at] = tensor[at] * tensor.dtype.type(1.0 + self.rel)
        elif self.how == "nan":
            tensor[at] = np.nan
        else:
            tensor[at] += 1
        self.done.append((s, paths[t], flat))
        if isinstance(value, structure.Struct):
            return structure.pack_sequence_as(value, leaves)
        return leaves[0]

    def client_partials(self, fn, key, sent, members, specs, guard=None,
                        least_rows: int = 0) -> list:
        del least_rows
        results = self._results(fn, key, sent, members, specs, guard)
        out, planted = [], False
        for s, (kind, vi, wi, *bound) in enumerate(specs):
            values = [select_element(r, vi) for r in results]
            weights = None if wi is None else [select_element(r, wi) for r in results]
            if not planted and self.aggregation in (None, s, kind) and \
                    self.client < len(values):
                changed = self._perturb(values[self.client], s)
                if changed is not None:
                    values[self.client], planted = changed, True
            out.append(aggregations.partial_of(kind, values, weights,
                                               bound[0] if bound else None))
        return out


_NAME_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.-/")


def _leaves(value: Any) -> tuple[list[str], list[np.ndarray]]:
    """The tensors of a client's value (copies) and their paths: names where the struct
    has them, else positions, joined by "/"; "" for a value that is one tensor."""
    if not isinstance(value, structure.Struct):
        return [""], [np.array(value)]
    paths, leaves = [], []
    for i, (name, item) in enumerate(structure.iter_elements(value)):
        head = name if name else str(i)
        for path, leaf in zip(*_leaves(item)):
            paths.append(f"{head}/{path}" if path else head)
            leaves.append(leaf)
    return paths, leaves


def parse(text: str, base: str = "xla", models_dir: Optional[str] = None) -> Fault:
    """The `Fault` a `--fault` value names: comma-separated `key=value` pairs of
    client (>= 0), aggregation (index or kind), leaf (path), element (>= 0), how and rel
    (finite), each at most once; ArgumentError naming the key or value that is wrong."""
    if not isinstance(text, str) or not text.strip():
        raise ArgumentError("--fault: empty; give key=value pairs, e.g. "
                            "client=0,aggregation=mean,leaf=0,rel=1e-3")
    fields: dict[str, Any] = {}
    for part in text.split(","):
        key, eq, value = part.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not value:
            raise ArgumentError(f"--fault: {part!r} is not key=value; keys: {list(KEYS)}")
        if key not in KEYS:
            raise ArgumentError(f"--fault: unknown key {key!r}; keys: {list(KEYS)}")
        if key in fields:
            raise ArgumentError(f"--fault: {key} given twice")
        fields[key] = _value(key, value)
    return Fault(base=base, models_dir=models_dir, **fields)


def _value(key: str, text: str) -> Any:
    if key in ("client", "element") or (key == "aggregation" and text.isdigit()):
        if not text.isdigit() or len(text) > 9:
            raise ArgumentError(f"--fault: {key}={text!r}: expected an integer >= 0")
        return int(text)
    if key == "rel":
        try:
            return float(text)
        except ValueError:
            raise ArgumentError(f"--fault: rel={text!r}: expected a number") from None
    return text


__all__ = ["Fault", "parse"]
