"""Xla computations as python callables, with TFF's binding convention.

The parameter binding mirrors the parameter type; each tensor binding names the HLO
parameter number of the tensor at that place of the type. The result binding likewise
names, for each tensor of the result type, its position in the HLO module's (flattened)
outputs. Arguments are checked against the parameter type (shape, and a dtype that casts
within its kind) before XLA sees them; jax tracers pass through, so a batched caller
(`client_map`) can trace the callable. Each distinct HLO module compiles once per
process (`runtime/hlo.py`).
"""

from __future__ import annotations

import hashlib
import threading
from typing import Callable, Optional

import federated_language
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError
from fax_bridge.runtime import hlo

_lock = threading.Lock()
_executables: dict[str, hlo.HloExecutable] = {}


def executable(hlo_bytes: bytes) -> hlo.HloExecutable:
    """The module's executable, made once per distinct module and process."""
    key = hashlib.sha256(hlo_bytes).hexdigest()
    with _lock:
        exe = _executables.get(key)
    if exe is None:
        exe = hlo.compile_hlo(hlo_bytes)
        with _lock:
            exe = _executables.setdefault(key, exe)
    return exe


def _count_tensors(binding: computation_pb2.Xla.Binding, where: str) -> list[int]:
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        return [binding.tensor.index]
    if kind == "struct":
        out = []
        for b in binding.struct.element:
            out.extend(_count_tensors(b, where))
        return out
    raise ComputationError(f"the Xla {where} binding has an element with nothing set")


def _flatten_arg(value, binding, type_, path, out: dict) -> None:
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        if isinstance(value, structure.Struct):
            raise ComputationError(
                f"Xla parameter {path or '<arg>'}: expected a tensor "
                f"{type_ if type_ is not None else ''}, got a struct"
            )
        arr = value if hlo.is_traced(value) else np.asarray(value)
        if isinstance(type_, federated_language.TensorType):
            arr = _check_tensor(arr, type_, path)
        out[binding.tensor.index] = arr
        return
    elements = binding.struct.element
    if not isinstance(value, structure.Struct) or len(value) != len(elements):
        got = f"a struct of {len(value)} elements" if isinstance(
            value, structure.Struct) else f"a {type(value).__name__}"
        raise ComputationError(
            f"Xla parameter {path or '<arg>'}: expected a struct of {len(elements)} "
            f"elements, got {got}"
        )
    types = [t for _, t in type_.items()] if isinstance(
        type_, federated_language.StructType) else [None] * len(elements)
    for i, (b, v, t) in enumerate(zip(elements, value, types)):
        _flatten_arg(v, b, t, f"{path}[{i}]", out)


def _check_tensor(arr: np.ndarray, type_: federated_language.TensorType, path: str):
    shape = type_.shape or ()
    if len(arr.shape) != len(shape) or any(
            d is not None and d != a for d, a in zip(shape, arr.shape)):
        raise ComputationError(
            f"Xla parameter {path or '<arg>'}: expected {type_}, got shape "
            f"{list(arr.shape)} ({arr.dtype})"
        )
    if arr.dtype != type_.dtype:
        if not np.can_cast(arr.dtype, type_.dtype, casting="same_kind"):
            raise ComputationError(
                f"Xla parameter {path or '<arg>'}: expected dtype {type_.dtype}, got "
                f"{arr.dtype}"
            )
        arr = arr.astype(type_.dtype)
    return arr


def _pack_result(outputs, binding, type_):
    kind = binding.WhichOneof("binding")
    if kind == "tensor":
        return outputs[binding.tensor.index]
    names = [n for n, _ in type_.items()] if isinstance(
        type_, federated_language.StructType) else [None] * len(binding.struct.element)
    types = [t for _, t in type_.items()] if isinstance(
        type_, federated_language.StructType) else [None] * len(binding.struct.element)
    if len(names) != len(binding.struct.element):
        raise ComputationError(
            f"the Xla result binding has {len(binding.struct.element)} elements but the "
            f"result type {type_} has {len(names)}"
        )
    return structure.Struct([
        (n, _pack_result(outputs, b, t))
        for n, b, t in zip(names, binding.struct.element, types)
    ])


def xla_function(comp: computation_pb2.Computation,
                 fn_type: Optional[federated_language.Type]) -> Callable:
    """A python callable running one `Xla` computation (`comp`, of the function type
    `fn_type` its proto declares) with TFF's binding convention; the HLO module is
    compiled here, once per distinct module and process."""
    xla = comp.xla
    if xla.hlo_module.type_url != hlo.HLO_MODULE_TYPE_URL:
        raise ComputationError(
            f"an Xla computation's hlo_module must be an Any of `{hlo.HLO_MODULE_TYPE_URL}`, got "
            f"`{xla.hlo_module.type_url}`"
        )
    if not isinstance(fn_type, federated_language.FunctionType):
        raise ComputationError(f"an Xla computation must have a function type, got {fn_type}")
    exe = executable(xla.hlo_module.value)
    has_param = xla.HasField("parameter")
    if has_param != (fn_type.parameter is not None):
        raise ComputationError(
            f"the Xla computation of type {fn_type} "
            f"{'has' if has_param else 'lacks'} a parameter binding"
        )
    param_indices = _count_tensors(xla.parameter, "parameter") if has_param else []
    if sorted(param_indices) != list(range(len(exe.parameters))):
        raise ComputationError(
            f"the Xla parameter binding names HLO parameters {sorted(param_indices)}, but "
            f"the HLO module has {len(exe.parameters)} parameters"
        )
    if not xla.HasField("result"):
        raise ComputationError("the Xla computation has no result binding")
    result_indices = _count_tensors(xla.result, "result")
    if any(not 0 <= i < len(exe.results) for i in result_indices):
        raise ComputationError(
            f"the Xla result binding names outputs {result_indices}, but the HLO module "
            f"has {len(exe.results)} outputs"
        )
    n_params = len(exe.parameters)

    def run(arg=None):
        flat: dict[int, np.ndarray] = {}
        if has_param:
            _flatten_arg(arg, xla.parameter, fn_type.parameter, "", flat)
        args = [flat[i] for i in range(n_params)]
        if any(hlo.is_traced(a) for a in args):  # inside `client_map`'s batched function
            outputs = exe.call_traced(args)
        else:
            outputs = exe(args)
        return _pack_result(outputs, xla.result, fn_type.result)

    return run
