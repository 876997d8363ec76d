"""Small federated computations built directly from federated_language building blocks.

They exercise the fleet (tests, benchmarks) without the exporter: Xla parts come from
`fax_bridge.tff.xla.typed_xla_computation`, the federated structure
from `building_blocks` Lambda/Call/Intrinsic nodes.
"""

from __future__ import annotations

from typing import Callable

import federated_language as fl
import jax
import jax.numpy as jnp
import numpy as np
from federated_language.compiler import building_blocks as bb
from federated_language.compiler import intrinsic_defs as defs
from federated_language.proto import computation_pb2

from fax_bridge.tff.xla import typed_xla_computation


def clients(t, all_equal: bool = False) -> fl.FederatedType:
    return fl.FederatedType(t, fl.CLIENTS, all_equal=all_equal)


def server(t) -> fl.FederatedType:
    return fl.FederatedType(t, fl.SERVER)


def _call(definition: defs.IntrinsicDef, arg: bb.ComputationBuildingBlock,
          result_type) -> bb.Call:
    return bb.Call(bb.Intrinsic(definition.uri,
                                fl.FunctionType(arg.type_signature, result_type)), arg)


def _map(fn: bb.CompiledComputation, value) -> bb.Call:
    return _call(defs.FEDERATED_MAP, bb.Struct([fn, value]), clients(fn.type_signature.result))


def scaled_aggregate(shape: tuple = (3,), kind: str = "sum",
                     dtype=np.float32) -> computation_pb2.Computation:
    """(x={T}@CLIENTS, s=T@SERVER) -> aggregate_kind(map(x * s, zip(x, broadcast(s))));
    kind "members" returns the mapped {T}@CLIENTS values themselves."""
    member = fl.TensorType(dtype, list(shape))
    param = fl.StructType([("x", clients(member)), ("s", server(member))])
    arg = bb.Reference("arg", param)
    bc = _call(defs.FEDERATED_BROADCAST, bb.Selection(arg, name="s"), clients(member, True))
    pair = fl.StructType([("x", member), ("s", member)])
    zipped = _call(defs.FEDERATED_ZIP_AT_CLIENTS,
                   bb.Struct([("x", bb.Selection(arg, name="x")), ("s", bc)]), clients(pair))
    scaled = _map(bb.CompiledComputation(typed_xla_computation(lambda x, s: x * s, pair)),
                  zipped)
    if kind == "members":
        return bb.Lambda("arg", param, scaled).to_proto()
    definition = {"sum": defs.FEDERATED_SUM, "mean": defs.FEDERATED_MEAN,
                  "min": defs.FEDERATED_MIN, "max": defs.FEDERATED_MAX}[kind]
    return bb.Lambda("arg", param, _call(definition, scaled, server(member))).to_proto()


def weighted_mean(shape: tuple = (3,), dtype=np.float32) -> computation_pb2.Computation:
    """(x={T}@CLIENTS, w={float32}@CLIENTS) -> federated_weighted_mean(x, w)."""
    member = fl.TensorType(dtype, list(shape))
    weight = fl.TensorType(np.float32)
    param = fl.StructType([("x", clients(member)), ("w", clients(weight))])
    arg = bb.Reference("arg", param)
    pair = bb.Struct([bb.Selection(arg, name="x"), bb.Selection(arg, name="w")])
    return bb.Lambda("arg", param, _call(defs.FEDERATED_WEIGHTED_MEAN, pair,
                                         server(member))).to_proto()


def linear_regression_step(features: int = 8, examples: int = 16,
                           lr: float = 0.1) -> computation_pb2.Computation:
    """One FedAvg-style round of least squares: each client takes a gradient step from the
    broadcast weights on its own (x, y); the server gets the example-weighted mean model,
    the mean loss and the clients' per-client losses stay at CLIENTS.

    Parameter <w=float32[F]@SERVER, x={float32[E,F]}@CLIENTS, y={float32[E]}@CLIENTS>,
    result <w=float32[F]@SERVER, loss=float32@SERVER, losses={float32}@CLIENTS>.
    """
    f32 = np.float32
    w_t = fl.TensorType(f32, [features])
    x_t = fl.TensorType(f32, [examples, features])
    y_t = fl.TensorType(f32, [examples])
    param = fl.StructType([("w", server(w_t)), ("x", clients(x_t)), ("y", clients(y_t))])
    arg = bb.Reference("arg", param)
    bc = _call(defs.FEDERATED_BROADCAST, bb.Selection(arg, name="w"), clients(w_t, True))
    data = fl.StructType([("w", w_t), ("x", x_t), ("y", y_t)])
    zipped = _call(defs.FEDERATED_ZIP_AT_CLIENTS,
                   bb.Struct([("w", bc), ("x", bb.Selection(arg, name="x")),
                              ("y", bb.Selection(arg, name="y"))]), clients(data))

    def local_step(w, x, y):
        residual = x @ w - y
        loss = (residual * residual).mean()
        grad = 2.0 * x.T @ residual / examples
        return {"w": w - lr * grad, "loss": loss}

    step = bb.CompiledComputation(typed_xla_computation(local_step, data))
    stepped = _map(step, zipped)
    out_t = step.type_signature.result
    names = [n for n, _ in out_t.items()]

    def pick(name: str) -> bb.CompiledComputation:
        index = names.index(name)  # a struct parameter arrives as positional arguments
        return bb.CompiledComputation(typed_xla_computation(lambda *parts: parts[index], out_t))

    new_w = _map(pick("w"), stepped)
    losses = _map(pick("loss"), stepped)
    result = bb.Struct([
        ("w", _call(defs.FEDERATED_MEAN, new_w, server(w_t))),
        ("loss", _call(defs.FEDERATED_MEAN, losses, server(fl.TensorType(f32)))),
        ("losses", losses),
    ])
    return bb.Lambda("arg", param, result).to_proto()


def make(name: str, **kwargs) -> computation_pb2.Computation:
    """A sample computation by name (see this module's functions)."""
    builders: dict[str, Callable] = {"scaled_aggregate": scaled_aggregate,
                                     "weighted_mean": weighted_mean,
                                     "linear_regression_step": linear_regression_step}
    return builders[name](**kwargs)


def conv_weight_gradient(dimension_numbers: tuple) -> Callable:
    """`(k, x) ->` the gradient in the kernel `k` of sum(tanh(conv(x, k))**2), a VALID
    convolution with `dimension_numbers`: jax writes the gradient as a convolution in a
    non-canonical dimension order."""
    def gradient(k, x):
        def loss(k):
            z = jax.lax.conv_general_dilated(x, k, (1, 1), "VALID",
                                             dimension_numbers=dimension_numbers)
            return jnp.sum(jnp.tanh(z) ** 2)
        return jax.grad(loss)(k)
    return gradient
