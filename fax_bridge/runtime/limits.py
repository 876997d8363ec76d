"""Caps on the memory a computation or a message may ask for, checked before allocating.

A type (from a proto), a tensor on the wire or an HLO signature names shapes; a hostile
or broken sender can name a dimension of 2^40. Every such size is computed with python
integers (no overflow) and compared with these caps first:

- `max_tensor_bytes`: one tensor (default 4 GiB);
- `max_value_bytes`: all tensors of one type together (default 16 GiB);
- `max_eval_steps`: the steps one evaluation may take (calls of functions, Structs built,
  struct elements rebuilt along an intrinsic's parameter type, parts of values copied
  into protos; default 10^6; counted by `runtime/evaluator.py`). Values share their parts, so
  a tiny proto cannot make the runtime copy exponentially much; this cap refuses the
  remaining case, a tiny proto asking for exponentially many calls;
- `max_proto_bytes`: one proto the interpreter builds for the devices (a per-client
  function with its captured values; default 256 MiB).

`FAX_BRIDGE_MAX_TENSOR_BYTES`, `FAX_BRIDGE_MAX_VALUE_BYTES`, `FAX_BRIDGE_MAX_EVAL_STEPS` and
`FAX_BRIDGE_MAX_PROTO_BYTES` set them per process (read when first used, `env_settings`);
`set_limits` changes them at run time (a device and a coordinator each have their own).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import federated_language
import numpy as np

from fax_bridge.errors import ComputationError

MAX_RANK = 64


@dataclasses.dataclass
class Limits:
    max_tensor_bytes: int
    max_value_bytes: int
    max_eval_steps: int
    max_proto_bytes: int


def __getattr__(name: str) -> Limits:
    """`LIMITS`, read from the environment when first used (`env_settings`: never on
    import, so a bad value is one named error where it is used, not an import's)."""
    if name == "LIMITS":
        from fax_bridge.system.env_settings import whole_number

        globals()[name] = value = Limits(
            max_tensor_bytes=whole_number("FAX_BRIDGE_MAX_TENSOR_BYTES"),
            max_value_bytes=whole_number("FAX_BRIDGE_MAX_VALUE_BYTES"),
            max_eval_steps=whole_number("FAX_BRIDGE_MAX_EVAL_STEPS"),
            max_proto_bytes=whole_number("FAX_BRIDGE_MAX_PROTO_BYTES"))
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _limits() -> Limits:
    found = globals().get("LIMITS")
    return __getattr__("LIMITS") if found is None else found


def set_limits(max_tensor_bytes: Optional[int] = None,
               max_value_bytes: Optional[int] = None,
               max_eval_steps: Optional[int] = None,
               max_proto_bytes: Optional[int] = None) -> Limits:
    """Changes the caps of this process; returns the previous ones."""
    before = dataclasses.replace(_limits())
    if max_tensor_bytes is not None:
        _limits().max_tensor_bytes = int(max_tensor_bytes)
    if max_value_bytes is not None:
        _limits().max_value_bytes = int(max_value_bytes)
    if max_eval_steps is not None:
        _limits().max_eval_steps = int(max_eval_steps)
    if max_proto_bytes is not None:
        _limits().max_proto_bytes = int(max_proto_bytes)
    return before


def too_many_steps(what: str) -> ComputationError:
    """The error for an evaluation that ran past `max_eval_steps`."""
    return ComputationError(
        f"{what} took more than {_limits().max_eval_steps} steps "
        "(FAX_BRIDGE_MAX_EVAL_STEPS); "
        "a small proto that calls its functions exponentially often is refused here. "
        "Raise the cap if the computation is really that large")


def tensor_bytes(shape, itemsize: int, what: str) -> int:
    """Bytes of a dense tensor of `shape` (unknown dims count as 0); checked against the cap."""
    dims = list(shape or ())
    if len(dims) > MAX_RANK:
        raise ComputationError(f"{what}: rank {len(dims)} exceeds the limit of {MAX_RANK}")
    count = 1
    span = 1  # product of the non-zero dimensions: numpy needs it to fit even when empty
    for d in dims:
        if d is None:
            count = 0
            continue
        d = int(d)
        if d < 0:
            raise ComputationError(f"{what}: negative dimension {d} in shape {dims}")
        count *= d
        span *= max(d, 1)
    size = count * int(itemsize)
    if max(size, span * int(itemsize)) > _limits().max_tensor_bytes:
        raise ComputationError(
            f"{what}: a tensor of shape {dims} needs {size} bytes (its non-zero "
            f"dimensions span {span * int(itemsize)}), above the cap of "
            f"{_limits().max_tensor_bytes} bytes (FAX_BRIDGE_MAX_TENSOR_BYTES); the shape is "
            "likely corrupt, or raise the cap")
    return size


def type_bytes(type_, what: str = "a type") -> int:
    """Bytes the tensors of a federated_language type need (per member); checked."""
    total = 0
    stack = [type_]
    seen = 0
    while stack:
        t = stack.pop()
        seen += 1
        if seen > 1_000_000:
            raise ComputationError(f"{what}: the type has more than 10^6 parts")
        if isinstance(t, federated_language.TensorType):
            total += tensor_bytes(t.shape, np.dtype(t.dtype).itemsize, what)
        elif isinstance(t, federated_language.StructType):
            stack.extend(tt for _, tt in t.items())
        elif isinstance(t, federated_language.FederatedType):
            stack.append(t.member)
        elif isinstance(t, federated_language.FunctionType):
            if t.parameter is not None:
                stack.append(t.parameter)
            stack.append(t.result)
        elif isinstance(t, federated_language.SequenceType):
            stack.append(t.element)
    if total > _limits().max_value_bytes:
        raise ComputationError(
            f"{what}: its tensors need {total} bytes together, above the cap of "
            f"{_limits().max_value_bytes} bytes (FAX_BRIDGE_MAX_VALUE_BYTES)")
    return total
