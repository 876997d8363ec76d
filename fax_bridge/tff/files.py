"""Computation protos on disk: the serialized bytes TFF reads and writes, nothing more."""

from __future__ import annotations

from federated_language.proto import computation_pb2
from google.protobuf.message import DecodeError

from fax_bridge.errors import ArgumentError, ExportError
from fax_bridge.runtime import grammar


def save_computation(proto: computation_pb2.Computation, path) -> None:
    """Writes the serialized proto bytes (the wire format TFF reads) to `path`.

    Args:
      proto: a `federated_language` `Computation` (anything else is an `ArgumentError`).
      path: the file to write.

    Example:
      >>> import os, tempfile, jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> proto = fb.export_tff(total, jnp.zeros(2), placements="clients")
      >>> with tempfile.TemporaryDirectory() as tmp:
      ...     fb.save_computation(proto, os.path.join(tmp, "total.pb"))
      ...     fb.load_computation(os.path.join(tmp, "total.pb")) == proto
      True
    """
    if not isinstance(proto, computation_pb2.Computation):
        raise ArgumentError(f"expected a federated_language Computation proto, got "
                            f"{type(proto).__name__}.")
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())


def load_computation(path) -> computation_pb2.Computation:
    """Reads a serialized `Computation` proto written by `save_computation` or by TFF.

    Args:
      path: the file to read.

    Returns:
      The `Computation`; a file that holds none is an `ExportError` naming it. Example:
      `save_computation`'s.
    """
    with open(path, "rb") as f:
        data = f.read()
    proto = computation_pb2.Computation()
    try:
        proto.ParseFromString(data)
    except DecodeError as e:
        raise ExportError(f"{path} is not a serialized Computation proto: {e}") from e
    if grammar.which(proto) is None:
        raise ExportError(f"{path} holds no computation (empty or not a Computation proto).")
    return proto
