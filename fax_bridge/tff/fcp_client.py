"""A round's client work lowered for Federated Compute's TFLite client.

FCP devices run a plan's client graph as TensorFlow Lite: TF's TFLite converter turns the
client work (TensorFlow holding one `XlaCallModule` per `Xla` part) into TFLite builtins,
with TensorFlow (Flex) ops only for what the device's runtime provides (datasets,
`tf.Example` parsing, checkpoints). Its legalization of StableHLO lacks a few things
everyday jax programs hold, so before the client parts are embedded in the FCP forms each
is rewritten (`fax_bridge.litert.builtin_rewrites`, exact):

- a scatter-add (the gradient of `jnp.take_along_axis` or of an index gather) as a
  one-hot sum;
- unsigned integers (`jax.random`'s threefry) as signed ones, and the 32-bit bitwise
  ops TFLite has no builtin for as arithmetic.

What the converter cannot take is refused here, each op with the fix: among them a
bfloat16 tensor (the converter has no bfloat16 type; FCP aggregates a bfloat16 client
result in float32 anyway) and a float converted to an unsigned integer.

`client_parts(proto)` finds the `Xla` parts a round maps at CLIENTS; `lower(hlo_module)`
gives a part's portable StableHLO artifact after the rewrites, or raises `ExportError`
naming each operation no rewrite covers (`LEFT`) with the user's source lines, at write
time; `write_artifacts` writes every client part's artifact for the TFF side.
"""

from __future__ import annotations

import hashlib
import os
import re

from federated_language.proto import computation_pb2

from fax_bridge.errors import ExportError
from fax_bridge.litert import builtin_rewrites, locations
from fax_bridge.litert.side_rewrites import walk
from fax_bridge.runtime import grammar, hlo
from fax_bridge.tff import xla as tff_xla

# Intrinsics whose function runs at each client.
_CLIENT_MAPS = ("federated_map", "federated_map_all_equal", "federated_eval_at_clients")

# Operations left after the rewrites that TF's TFLite converter has no builtin for, and
# what to write instead.
LEFT = {
    "stablehlo.scatter": "a scatter that does not add whole windows (x.at[i].set, a "
                         "window along an indexed dimension): use a one-hot product "
                         "(jax.nn.one_hot(i, n) * values) or jnp.where",
    "stablehlo.rng_bit_generator": "jax.random with the rbg PRNG: use the default "
                                   "threefry, or pass the noise in the client's data",
    "stablehlo.custom_call": "a custom call (jnp.linalg decompositions, callbacks): use "
                             "matmuls and elementwise ops, or compute it on the server",
}
_WIDE_BITWISE = ("stablehlo.and", "stablehlo.or", "stablehlo.xor", "stablehlo.not",
                 "stablehlo.shift_left", "stablehlo.shift_right_logical",
                 "stablehlo.shift_right_arithmetic")


def _is_client_map(call: computation_pb2.Call) -> bool:
    fn = call.function
    if fn.WhichOneof("computation") != "intrinsic" or fn.intrinsic.uri not in _CLIENT_MAPS:
        return False
    result = fn.type.function.result
    return result.WhichOneof("type") == "federated" and \
        result.federated.placement.value.uri == "clients"


def client_parts(proto: computation_pb2.Computation) -> list:
    """The `Xla` computations the round runs at each client (inside the function of a
    `federated_map` at CLIENTS), each once, depth-first."""
    found: dict = {}

    def xla_in(comp) -> None:
        if grammar.which(comp) == "xla":
            found.setdefault(tff_xla.hlo_module_bytes(comp), comp)
        for field, value in comp.ListFields():
            items = value if field.is_repeated else [value]
            for item in items:
                if isinstance(item, computation_pb2.Computation):
                    xla_in(item)
                elif hasattr(item, "ListFields") and field.message_type is not None and \
                        field.message_type.full_name.startswith("federated_language."):
                    visit_message(item)

    def visit_message(message) -> None:
        if isinstance(message, computation_pb2.Call) and _is_client_map(message):
            argument = message.argument
            if argument.WhichOneof("computation") == "struct" and argument.struct.element:
                xla_in(argument.struct.element[0].value)
        for field, value in message.ListFields():
            if field.message_type is None or \
                    not field.message_type.full_name.startswith("federated_language."):
                continue
            for item in (value if field.is_repeated else [value]):
                visit_message(item)

    visit_message(proto)
    return list(found.values())


_BFLOAT16 = ("a bfloat16 tensor, which TF's TFLite converter has no type for: compute "
             "and return the client's results in float32 (FCP aggregates a bfloat16 client "
             "result in float32) and cast to bfloat16 at the server")


def _unsigned_why(op, ir) -> str:
    """Why the unsigned rewrite refused `op`, and what to write instead."""
    if op.name == "stablehlo.convert" and builtin_rewrites.float_to_unsigned(op, ir):
        return ("a float converted to an unsigned integer, whose out-of-range values the "
                "signed convert does not give: convert the float to int32 first "
                "(x.astype(jnp.int32).astype(jnp.uint8))")
    return ("an op on unsigned integers whose meaning the rewrite to signed ones cannot "
            "keep (a divide, a remainder, a 64-bit unsigned converted to a float): compute "
            "it in int32 or float32")


def _left(module, ir) -> list:
    """(op, why) for each operation TFLite's converter cannot take after the rewrites."""
    out = []
    for op in walk(module.operation, []):
        if op.name != "func.func" and any(
                "bf16" in str(v.type) for v in list(op.operands) + list(op.results)):
            out.append((op, _BFLOAT16))
        elif op.name in LEFT:
            out.append((op, LEFT[op.name]))
        elif op.name in _WIDE_BITWISE and re.search(r"x(?:u?i64)>|<u?i64>",
                                                    str(op.results[0].type)):
            out.append((op, "a bitwise op on 64-bit integers, which TFLite has no builtin "
                            "for: keep the client's integer bit tricks in 32 bits"))
    return out


def lower(hlo_module: bytes, where: str = "the client work") -> tuple[bytes, dict]:
    """(the part's portable StableHLO artifact after the rewrites, {rewrite: count}).
    Raises `ExportError` naming each operation the TFLite converter cannot take."""
    bytecode, counts = rewritten(hlo_module, where)
    return hlo.stablehlo_artifact(bytecode), counts


def rewritten(hlo_module: bytes, where: str = "the client work") -> tuple[bytes, dict]:
    """`lower`'s module as StableHLO bytecode (what XLA compiles), and the counts."""
    from jax._src.interpreters import mlir
    from jax._src.lib.mlir import ir

    stablehlo = hlo.to_stablehlo(hlo_module)
    with mlir.make_ir_context(), ir.Location.unknown():
        module = ir.Module.parse(stablehlo)
        counts = {"scatter_adds": builtin_rewrites.scatter_adds(module, ir)}
        refused = [(op, _unsigned_why(op, ir))
                   for op in builtin_rewrites.unsigned_integers(module, ir)]
        counts["bitwise_ops"] = builtin_rewrites.bitwise_ops(module, ir)
        problems = refused or _left(module, ir)
        if problems:
            lines = locations.Lines(module)
            text = []
            for op, why in problems[:6]:
                at = lines.of(op)
                text.append(f"{op.name} at {', '.join(at[:3]) if at else 'an unknown line'}"
                            f" ({why})")
            raise ExportError(
                f"{where} cannot run as TFLite on Federated Compute's devices: "
                + "; ".join(text) + (f" (and {len(problems) - 6} more)"
                                     if len(problems) > 6 else ""))
        if not module.operation.verify():
            raise ExportError(f"{where}: the TFLite rewrites left an invalid module")
        return mlir.module_to_bytecode(module), counts


def write_artifacts(proto: computation_pb2.Computation, folder: str) -> dict:
    """Each client part's lowered artifact in `folder`: {sha256 of its HLO: path}."""
    os.makedirs(folder, exist_ok=True)
    out = {}
    for part in client_parts(proto):
        module = tff_xla.hlo_module_bytes(part)
        key = hashlib.sha256(module).hexdigest()
        artifact, _ = lower(module)
        path = os.path.join(folder, f"{key[:16]}.client.mlirbc")
        with open(path, "wb") as f:
            f.write(artifact)
        out[key] = path
    return out
