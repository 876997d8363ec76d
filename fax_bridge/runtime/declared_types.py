"""Whether a computation proto's declared types are those of what it computes.

The interpreter places values by the types a proto declares, so a proto declaring
`f32@SERVER` for a body that computes an unplaced `f32` would run as something it is
not. `check` refuses such a proto with a `DeclaredTypeError` before it runs: the body's
type, as federated_language builds it from the proto's parts, must be assignable to the
declared one (placements included), and parts that compute local values (literals, Xla
and TensorFlow computations) must not declare placed types (a literal: one tensor). Checked once per distinct
proto, since a fleet runs the same round again and again.
"""

from __future__ import annotations

import hashlib
from typing import Optional

import federated_language
from federated_language.compiler import building_blocks
from federated_language.proto import computation_pb2

from fax_bridge.errors import DeclaredTypeError
from fax_bridge.runtime import grammar

_LOCAL_PARTS = ("literal", "xla", "tensorflow")
_CHECKED: dict = {}  # digests of the protos checked, a bounded set


def _placed(type_proto: computation_pb2.Type) -> bool:
    """Whether a type proto holds a federated type anywhere."""
    kind = type_proto.WhichOneof("type")
    if kind == "federated":
        return True
    if kind == "struct":
        return any(_placed(e.value) for e in type_proto.struct.element)
    if kind == "function":
        return _placed(type_proto.function.parameter) or _placed(type_proto.function.result)
    return kind == "sequence" and _placed(type_proto.sequence.element)


def _shown(type_proto: computation_pb2.Type) -> str:
    try:
        return str(federated_language.Type.from_proto(type_proto))
    except Exception:  # a malformed type: its proto text, on one line
        return " ".join(str(type_proto).split())[:200]


def check(proto: computation_pb2.Computation,
          declared: Optional[federated_language.Type]) -> None:
    """DeclaredTypeError unless `proto`'s declared type (`declared`, parsed) and those of
    its local parts are the types of what they compute (see the module docstring)."""
    key = hashlib.blake2b(proto.SerializeToString(deterministic=True),
                          digest_size=16).digest()
    if key in _CHECKED:
        return
    for part in grammar.walk(proto):
        kind = grammar.which(part)
        if kind in _LOCAL_PARTS and _placed(part.type) or (
                kind == "literal" and part.type.WhichOneof("type") not in (None, "tensor")):
            raise DeclaredTypeError(
                f"a {kind} part of the computation declares the type {_shown(part.type)}; "
                "it computes "
                f"{'one tensor' if kind == 'literal' else 'local values only'}: declare "
                "that type, and place its value with a federated intrinsic (e.g. "
                "federated_value_at_server)")
    try:
        body = building_blocks.ComputationBuildingBlock.from_proto(proto).type_signature
    except Exception:  # parts it cannot build: the interpreter refuses them as it runs
        body = None
    if body is not None and (declared is None or not declared.is_assignable_from(body)):
        raise DeclaredTypeError(
            f"the computation declares type {declared} but its body has type {body}; the "
            "declared type (placements included) must be the body's: fix the proto's "
            "`type` field, or the body (e.g. place an unplaced result at the server with "
            "federated_value_at_server)")
    if len(_CHECKED) >= 256:
        _CHECKED.clear()
    _CHECKED[key] = True
