"""The LiteRT interpreter running a round's client part over a holder's clients.

`client_partials(fn, key, sent, members, specs, guard)` is `round_split.client_partials`
with the client part run by the LiteRT interpreter (ai-edge-litert) through the model's
named signature instead of XLA: each client's leaves are fed by name, its outputs read
back into the client part's result, and each aggregation's exact partial is made by the
same code (`runtime.aggregation.partial_of`), so a device or SuperNode running LiteRT
answers the coordinator in the same form. A process loads a model once per client part,
tensor names and shapes (`runner_for`) and runs one client at a time, on one thread, so
a client's result does not depend on how clients are split over devices.

A model carried with an app or deployment (`carried`: a directory of models converted
where the app was written) is taken before any conversion (`model_for`), so a node
without the converter's environment runs it.

A client whose inputs do not have the shapes the model was converted for (another batch
size) is refused, naming the input and the fix.

`LiteRTClientRuntime(models_dir=...)` is this runner as a client runtime
(`rounds.client_runtime`): what a fleet, a device, a Flower node or an in-process round
is handed when its client parts run in LiteRT. `loaded()` says which models this process
ran, and on how many clients; `served(key)` the sha256 of the model that last ran client
part `key` here (what a Flower node's answer names).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import types
from typing import Any, Optional

import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import AggregationError, ArgumentError, ComputationError
from fax_bridge.litert import carried, convert, lowering, phases
from fax_bridge.rounds import round_split
from fax_bridge.runtime import aggregation
from fax_bridge.runtime.local_eval import select_element


class ClientRunner:
    """One loaded model: feeds a client's leaves to its signature, gives its outputs."""

    def __init__(self, model: convert.ClientModel, num_threads: int = 1):
        from ai_edge_litert.interpreter import Interpreter

        self.model = model
        self._interpreter = Interpreter(model_content=model.tflite, num_threads=num_threads)
        self._run = self._interpreter.get_signature_runner(model.signature)
        self._lock = threading.Lock()  # an interpreter runs one call at a time
        self.calls = 0  # clients run
        self.sha256 = hashlib.sha256(model.tflite).hexdigest()  # the model's bytes

    def check(self, leaves: list, where: str) -> None:
        """Refuses leaves of other shapes or dtypes than the model's inputs."""
        if len(leaves) != len(self.model.inputs):
            raise ArgumentError(f"{where}: {len(leaves)} input tensors for a model of "
                                f"{len(self.model.inputs)} ({self.model.inputs[0].name}, ...)")
        for leaf, tensor in zip(leaves, self.model.inputs):
            arr = np.asarray(leaf)
            if tuple(arr.shape) == tensor.shape and arr.dtype.name == tensor.dtype:
                continue
            fix = ("convert the round again at this client's shape (each batch size is a "
                   "model of its own: `fax-bridge litert` writes one per round shape), or "
                   "pad the client's data to the model's batch (fax_bridge.data.padding)")
            raise ArgumentError(
                f"{where}: input {tensor.name} is {arr.dtype.name}{list(arr.shape)}, but the "
                f"LiteRT model was converted for {tensor.dtype}{list(tensor.shape)}: a "
                f"LiteRT model has fixed shapes; {fix}")

    def __call__(self, leaves: list, where: str = "client") -> list:
        """The output leaves, in the signature's order, for one client's input leaves."""
        self.check(leaves, where)
        feed = {t.name: np.ascontiguousarray(leaf)
                for t, leaf in zip(self.model.inputs, leaves)}
        with self._lock:
            out = self._run(**feed)
            self.calls += 1
        # A scalar may come back as shape [1]: the signature's shape is the round's.
        return [np.array(out[t.name], copy=True).reshape(t.shape) for t in self.model.outputs]


_RUNNERS: dict = {}
_SERVED: dict = {}  # client part hash -> sha256 of the model that last ran it
_LOCK = threading.Lock()


def runner_for(model: convert.ClientModel) -> ClientRunner:
    """The process's runner of `model`, loaded on first use: one per client part,
    tensors' names and shapes (models of one client part named otherwise are other
    bytes, which `served` names)."""
    key = (model.client_part_hash, model.inputs, model.outputs)
    with _LOCK:
        runner = _RUNNERS.get(key)
        if runner is None:
            runner = _RUNNERS[key] = ClientRunner(model)
        return runner


def loaded() -> dict:
    """{client part hash: clients run} of every model this process has loaded."""
    with _LOCK:
        runners = list(_RUNNERS.values())
    out: dict = {}
    for r in runners:
        out[r.model.client_part_hash] = out.get(r.model.client_part_hash, 0) + r.calls
    return out


def served(key: str) -> Optional[str]:
    """The sha256 of the model that last ran client part `key` in this process (None:
    none has)."""
    with _LOCK:
        return _SERVED.get(key)


def run_clients(model: convert.ClientModel, sent: Any, members, guard=None) -> list:
    """The client part's result (a local value) for each client, in client order."""
    runner = runner_for(model)
    with _LOCK:
        _SERVED[model.client_part_hash] = runner.sha256
    types = model.signature_types
    shared = lowering.flatten(sent, types.parameter[0], [])
    results, produced = [], 0
    for i, member in enumerate(members):
        if guard is not None:
            guard.tick()
        leaves = shared + lowering.flatten(member, types.parameter[1], [])
        out = runner(leaves, where=f"client {i}")
        result = lowering.build(types.result, iter(out))
        if guard is not None:
            produced += guard.size(result)
            guard.room(produced)
        results.append(result)
    return results


def model_for(fn: computation_pb2.Computation, key: str, sent: Any, members: Any,
              specs: list, split: Any = None,
              models: Optional[str] = None) -> convert.ClientModel:
    """The LiteRT model of client part `fn` (content hash `key`): the one carried in the
    directory `models` where it holds one (`carried.find`: never converted then, and a
    carried model of another client part is refused), else converted (`convert`):
    named by pytree path from `split` where given (`convert.convert_round`), else (a
    fleet device has the client part alone) as the round named it where this machine
    converted it with its split, else by index (`convert.convert_without_split`)."""
    aggregations = split.aggregations if split is not None else [
        types.SimpleNamespace(value_index=vi, weight_index=wi) for _, vi, wi, *_ in specs]
    param_result = None
    if models and carried.versions(models):
        param_result = (lowering.split_types(split) if split is not None
                        else _types_of(fn, sent, members))
        found = carried.find(models, key, lowering.client_signature(*param_result,
                                                                    aggregations), fn=fn)
        if found is not None:
            return found
    if split is not None:
        return convert.convert_round(split)
    return convert.convert_without_split(fn, *(param_result or _types_of(fn, sent, members)),
                                         aggregations, key=key)


def client_partials(fn: computation_pb2.Computation, key: str, sent: Any, members: Any,
                    specs: list, guard: Any = None, split: Any = None,
                    models: Optional[str] = None) -> list:
    """`round_split.client_partials` run by the LiteRT interpreter (module docstring).
    `split`: the round split the client part comes from, where the caller has it (it
    names the outputs; the model is the same either way); `models`: a directory of
    carried models (`model_for`)."""
    model = model_for(fn, key, sent, members, specs, split, models)
    results = run_clients(model, sent, members, guard)
    out = []
    for kind, vi, wi, *bound in specs:
        try:
            values = [select_element(r, vi) for r in results]
            weights = None if wi is None else [select_element(r, wi) for r in results]
        except ComputationError as e:
            raise ComputationError(f"the aggregation inputs at {vi} are not in the client "
                                   f"part's result: {e}") from None
        out.append(aggregation.partial_of(kind, values, weights, bound[0] if bound else None))
    return out


@dataclasses.dataclass(frozen=True)
class LiteRTClientRuntime:
    """Client parts as LiteRT models in the LiteRT interpreter (`rounds.client_runtime`).

    `models_dir`: a directory of models carried with an app or deployment
    (`litert.carried`), taken before any conversion; None converts (`convert`, which
    needs `.venv-litert`). A round that splits runs its one client part as one model; a
    round of several trips runs each trip's client map as a model of its own
    (`litert.phases`).
    """

    models_dir: Optional[str] = None
    name = "litert"

    def check_round(self, proto: computation_pb2.Computation,
                    split: Optional[round_split.RoundSplit]) -> None:
        """Converts (or finds carried) the split's model once, before any client work,
        or, for a round with no split, the model of each trip (`phases.convert_round`);
        refuses a client computation LiteRT cannot run, naming the op."""
        if split is None:
            phases.convert_round(proto, self.models_dir)
            return
        model_for(split.client_part, split.client_part_hash, None, None,
                  [a.spec for a in split.aggregations], split, self.models_dir)

    def map_clients(self, fn, members, key=None, no_argument: bool = False,
                    guard=None) -> list:
        return phases.map_clients(fn, members, runner_for, key, no_argument, guard,
                                  self.models_dir)

    def client_partials(self, fn, key, sent, members, specs, guard=None,
                        least_rows: int = 0) -> list:
        del least_rows  # one client per call: nothing is batched
        return client_partials(fn, key, sent, members, specs, guard, models=self.models_dir)

    def carrying(self, models_dir: Optional[str]) -> "LiteRTClientRuntime":
        return dataclasses.replace(self, models_dir=models_dir)

    def device_args(self) -> list:
        return ["--client-runtime", self.name] + (
            ["--litert-models", str(self.models_dir)] if self.models_dir else [])


def _types_of(fn, sent, members) -> tuple:
    """(parameter type, result type) of a client part known only by its proto and the
    values it runs on: the parameter from the values, the result from one XLA trace."""
    import federated_language

    from fax_bridge.runtime import local_eval

    if not len(members):
        raise AggregationError("no clients to run the client part on")

    def type_of(value):
        if isinstance(value, structure.Struct):
            return federated_language.StructType(
                [(name, type_of(v)) for name, v in structure.iter_elements(value)])
        arr = np.asarray(value)
        return federated_language.TensorType(arr.dtype, arr.shape)

    param = federated_language.StructType([(None, type_of(sent)),
                                           (None, type_of(members[0]))])
    result = local_eval.compile_local(fn)(structure.Struct([(None, sent),
                                                            (None, members[0])]))
    return param, type_of(result)


__all__ = ["ClientRunner", "LiteRTClientRuntime", "client_partials", "loaded", "model_for",
           "run_clients", "runner_for", "served"]
