"""Converts local values (numpy arrays, Structs of them) to and from fax_bridge.v1 messages.

A tensor's bytes travel in its `data` field, or, between a coordinator and the devices
it started on its host, in a shared-memory segment (`shared_memory`): encoding with a
`shared_memory.Writer` places large tensors there and leaves a span (`data_at`) in the
message; decoding with the mapped `shared_memory.Segment` reads them back.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError, FleetError
from fax_bridge.runtime import limits
from fax_bridge.runtime.backend import LocalValue
from fax_bridge.v1 import device_pb2 as pb



_NUMERIC_KINDS = "biufc"
_ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3b11fnuz",
              "float8_e4m3fnuz", "float8_e5m2fnuz", "int4", "uint4")
MAX_STRUCT_DEPTH = 64


@functools.lru_cache(maxsize=None)
def dtype_name(dtype) -> str:
    """`np.dtype(dtype).name`, kept: numpy works the name out again on every read."""
    return np.dtype(dtype).name


@functools.lru_cache(maxsize=64)  # names that raise are not kept
def dtype_from_name(name: str) -> np.dtype:
    """The numeric dtype a `Tensor.dtype` string names (ml_dtypes ones such as bfloat16 too).

    Only plain numeric and bool dtypes are accepted: object, string, structured and
    datetime dtypes never come off the wire.
    """
    if name in _ML_DTYPES:
        import ml_dtypes  # jax's extended floating-point types

        return np.dtype(getattr(ml_dtypes, name))
    try:
        dtype = np.dtype(name) if name.isidentifier() else None
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in _NUMERIC_KINDS or dtype.fields or dtype.subdtype:
        raise FleetError(
            f"unknown tensor dtype {name[:40]!r} on the wire; expected a numeric numpy or "
            "ml_dtypes dtype name such as 'float32', 'int32', 'bool' or 'bfloat16'")
    return dtype


def put_bytes(out, field: str, array: np.ndarray, writer=None) -> None:
    """Sets bytes field `field` of message `out` to `array`'s bytes (C order), or, when
    `writer` takes arrays of its size, its span in the writer's segment (`*_at`)."""
    if writer is not None and writer.takes(array.nbytes):
        writer.span(array, getattr(out, f"{field}_at"))
    else:
        setattr(out, field, np.ascontiguousarray(array).tobytes())


def field_bytes(message, field: str, segment, where: str):
    """A bytes field's content: from the segment when its `*_at` span is set (the field
    itself must then be empty), else the field (one copy)."""
    if not message.HasField(f"{field}_at"):
        return getattr(message, field)
    if segment is None:
        raise FleetError(f"{where}: a {field} payload refers to shared memory, but its "
                         "message names no segment")
    if len(getattr(message, field)):
        raise FleetError(f"{where}: a {field} payload refers to shared memory, but also "
                         "holds bytes: it is both in the message and in shared memory; "
                         "senders set one")
    return segment.bytes_of(getattr(message, f"{field}_at"), where)


def encode_tensor(array: np.ndarray, out: pb.Tensor, shared=None) -> None:
    """Fills `out` with `array`'s dtype, shape and raw little-endian bytes: in its
    `data`, or in the segment `shared` (a `shared_memory.Writer`) gathers when it takes
    arrays of this size (`data_at`)."""
    array = np.asarray(array)
    name = dtype_name(array.dtype)
    if array.dtype.kind in "OUSV" and name not in _ML_DTYPES:
        raise FleetError(
            f"cannot send a {array.dtype} array to a device; only numeric and bool tensors "
            "travel (encode strings as integer ids before placing them at CLIENTS)")
    if array.dtype.byteorder == ">":
        array = array.astype(array.dtype.newbyteorder("<"))
    out.dtype = name
    out.shape.extend(array.shape)
    put_bytes(out, "data", array, shared)


def decode_tensor(message: pb.Tensor, segment=None) -> np.ndarray:
    """The array a `Tensor` message holds (read-only, sharing the message's bytes, or
    the mapped `segment`'s, a `shared_memory.Segment`, where its `data_at` says)."""
    dtype = dtype_from_name(message.dtype)
    shape = tuple(int(d) for d in message.shape)
    try:
        expected = limits.tensor_bytes(shape, dtype.itemsize, "a tensor on the wire")
    except ComputationError as e:
        raise FleetError(str(e)) from None
    # read once: each read of the field copies its bytes
    data = field_bytes(message, "data", segment,
                                     f"tensor of dtype {message.dtype} and shape {shape}")
    if len(data) != expected:
        raise FleetError(
            f"tensor of dtype {message.dtype} and shape {shape} should hold {expected} "
            f"bytes but holds {len(data)}; sender and receiver disagree on the "
            "encoding (both must speak fax_bridge.v1)")
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def encode_value(value: LocalValue, out: pb.Value, shared=None) -> None:
    """Fills `out` with a local value: a tensor, or a Struct encoded element by element
    (`shared`: as in `encode_tensor`)."""
    if isinstance(value, structure.Struct):
        elements = out.struct.elements
        out.struct.SetInParent()
        for name, member in structure.iter_elements(value):
            element = elements.add()
            if name is not None:
                element.name = name
            encode_value(member, element.value, shared)
    else:
        encode_tensor(value, out.tensor, shared)


def to_message(value: LocalValue, shared=None) -> pb.Value:
    """A new `Value` message holding `value` (`shared`: as in `encode_tensor`)."""
    message = pb.Value()
    encode_value(value, message, shared)
    return message


def decode_value(message: pb.Value, depth: int = 0, segment=None) -> LocalValue:
    """The local value a `Value` message holds (`segment`: as in `decode_tensor`)."""
    kind = message.WhichOneof("kind")
    if kind == "tensor":
        return decode_tensor(message.tensor, segment)
    if kind == "struct":
        if depth >= MAX_STRUCT_DEPTH:
            raise FleetError(f"a Value message nests structs deeper than {MAX_STRUCT_DEPTH}")
        names = [e.name if e.HasField("name") else None for e in message.struct.elements]
        named = [n for n in names if n is not None]
        if len(set(named)) != len(named):
            raise FleetError(f"a Value struct repeats element names {sorted(named)[:8]}")
        return structure.Struct([
            (n, decode_value(e.value, depth + 1, segment))
            for n, e in zip(names, message.struct.elements)
        ])
    raise FleetError("a Value message holds neither a tensor nor a struct; the sender "
                     "left it empty")


def message_field(number: int, body: bytes) -> bytes:
    """Field `number` holding a message serialized as `body`, as protobuf writes it:
    appended to a serialized message without that field, it sets the field."""
    head, size = [(number << 3) | 2], len(body)
    while True:
        byte, size = size & 0x7F, size >> 7
        head.append(byte | (0x80 if size else 0))
        if not size:
            return bytes(head) + body


def payload_bytes(message: pb.Value) -> int:
    """Bytes of tensor data inside a `Value` (what the message carries, without framing),
    from each tensor's dtype and shape: reading the data field would copy it. For a
    message `decode_value` accepts (or one made by `encode_value`), that is the data's
    length."""
    kind = message.WhichOneof("kind")
    if kind == "tensor":
        tensor = message.tensor
        return math.prod(tensor.shape) * dtype_from_name(tensor.dtype).itemsize
    if kind == "struct":
        return sum(payload_bytes(e.value) for e in message.struct.elements)
    return 0


