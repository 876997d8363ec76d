"""A round's values as Flower records: broadcasts, client ids and exact partials.

Everything a round sends through Flower is an `ArrayRecord` of numpy arrays (so Flower's
mods see arrays, never opaque bytes) beside a `ConfigRecord` of what the arrays alone
do not say (dtype names, shapes, limb bases) and a `MetricRecord` of counts:

- the broadcast: its tensors depth first, keys "0", "1", ...;
- a node's clients: one int64 array of population ids, key "ids";
- a node's partials: for aggregation j and tensor i, `aJ.vI.doubles` (float64, an exact
  sum that float64 holds), `aJ.vI.limbs` (int64 [limbs, size], the fleet's exact
  limbs) with `aJ.vI.flags` (uint8, non-finite addends), or `aJ.vI.extreme` (a min or
  max); `aJ.w.*` the same for a weighted mean's weights.

Partials are the fleet's (`fleet.partials`): a node builds its `AggregateResponse` with
`partials.to_message` and `to_records` lays its fields out as arrays; the server reads
them back into an `AggregateResponse` with `from_records` and checks it with
`validate.check_partial`, exactly as the coordinator checks a device's answer.
"""

from __future__ import annotations

import numpy as np

from fax_bridge.errors import FleetError
from fax_bridge.fleet import wire
from fax_bridge.v1 import device_pb2 as pb

BROADCAST = "broadcast"
IDS = "ids"
ROUND = "round"
PARTIALS = "partials"
LAYOUT = "layout"
METRICS = "metrics"


def array(value: np.ndarray):
    """A Flower `Array` of `value` (dtypes numpy cannot save, e.g. bfloat16, as bytes)."""
    from flwr.app import Array

    value = np.asarray(value)
    if not value.flags.c_contiguous:  # (np.ascontiguousarray would make a scalar 1-d)
        value = value.copy(order="C")
    if value.dtype.kind == "V" or value.dtype.name != np.dtype(value.dtype.str).name:
        value = value.view(np.uint8)  # an ml_dtypes array; its dtype travels by name
    return Array(value)


def numpy_of(item, dtype: np.dtype, shape, where: str) -> np.ndarray:
    """The numpy array a Flower `Array` holds, as `dtype` and `shape` (checked)."""
    try:
        value = item.numpy()
    except Exception as e:  # noqa: BLE001 - whatever numpy or Flower raise on bad bytes
        raise FleetError(f"{where}: the array cannot be read ({type(e).__name__}: {e})") \
            from None
    dtype, shape = np.dtype(dtype), tuple(int(d) for d in shape)
    if value.dtype != dtype:
        if value.dtype != np.uint8 or value.size != int(np.prod(shape)) * dtype.itemsize:
            raise FleetError(f"{where}: an array of {value.dtype}{list(value.shape)}; "
                             f"expected {dtype.name}{list(shape)}")
        value = value.view(dtype)
    if value.size != int(np.prod(shape)):
        raise FleetError(f"{where}: an array of {value.size} elements; expected shape "
                         f"{list(shape)}")
    return value.reshape(shape)


# ---------------------------------------------------------------------------------------
# Broadcast and ids


def tensors_to_record(tensors: list):
    """(ArrayRecord, ConfigRecord) of a list of tensors (the broadcast's, depth first)."""
    from flwr.app import ArrayRecord, ConfigRecord

    arrays, layout = {}, {}
    for i, t in enumerate(tensors):
        t = np.asarray(t)
        arrays[str(i)] = array(t)
        layout[f"{i}.dtype"] = wire.dtype_name(t.dtype)
        layout[f"{i}.shape"] = [int(d) for d in t.shape]
    layout["count"] = len(tensors)
    return ArrayRecord(arrays), ConfigRecord(layout)


def tensors_from_record(arrays, layout, where: str) -> list:
    """The tensors `tensors_to_record` laid out."""
    count = int(layout.get("count", -1))
    if count < 0 or len(arrays) != count:
        raise FleetError(f"{where}: {len(arrays)} broadcast arrays; expected {count}")
    out = []
    for i in range(count):
        key = str(i)
        if key not in arrays:
            raise FleetError(f"{where}: broadcast array {key} is missing")
        out.append(numpy_of(arrays[key], wire.dtype_from_name(str(layout[f"{i}.dtype"])),
                            layout[f"{i}.shape"], f"{where}, broadcast array {key}"))
    return out


def ids_to_record(ids: np.ndarray):
    """The population ids of a node's clients in the round, as an ArrayRecord."""
    from flwr.app import ArrayRecord

    return ArrayRecord({IDS: array(np.asarray(ids, np.int64))})


def ids_from_record(arrays, where: str) -> np.ndarray:
    if IDS not in arrays:
        raise FleetError(f"{where}: the message names no clients (no {IDS!r} array)")
    ids = arrays[IDS].numpy()
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise FleetError(f"{where}: client ids must be one int64 vector, got "
                         f"{ids.dtype}{list(ids.shape)}")
    return ids


# ---------------------------------------------------------------------------------------
# Partials


def _leaf_out(prefix: str, leaf: pb.LeafPartial, arrays: dict, layout: dict) -> None:
    shape = [int(d) for d in leaf.shape]
    if leaf.HasField("extreme"):
        value = wire.decode_tensor(leaf.extreme)
        arrays[f"{prefix}.extreme"] = array(value)
        layout[f"{prefix}.dtype"] = wire.dtype_name(value.dtype)
        layout[f"{prefix}.shape"] = [int(d) for d in value.shape]
        return
    layout[f"{prefix}.dtype"] = leaf.dtype
    layout[f"{prefix}.shape"] = shape
    if leaf.doubles:
        arrays[f"{prefix}.doubles"] = array(np.frombuffer(leaf.doubles, "<f8").reshape(shape))
        return
    layout[f"{prefix}.base"] = int(leaf.base_limb)
    size = int(np.prod(shape))
    arrays[f"{prefix}.limbs"] = array(
        np.frombuffer(leaf.limbs, "<i8").reshape((int(leaf.num_limbs), size)))
    if leaf.nonfinite:
        arrays[f"{prefix}.flags"] = array(np.frombuffer(leaf.nonfinite, np.uint8))


def to_records(answers: list) -> tuple:
    """(ArrayRecord, ConfigRecord, MetricRecord) of one `AggregateResponse` per
    aggregation (a node's answer for its clients)."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    arrays: dict = {}
    layout: dict = {"aggregations": len(answers)}
    counts = []
    for j, answer in enumerate(answers):
        layout[f"a{j}.leaves"] = len(answer.leaves)
        layout[f"a{j}.weights"] = len(answer.weight_leaves)
        counts.append(int(answer.num_clients))
        for i, leaf in enumerate(answer.leaves):
            _leaf_out(f"a{j}.v{i}", leaf, arrays, layout)
        for leaf in answer.weight_leaves:
            _leaf_out(f"a{j}.w", leaf, arrays, layout)
    return ArrayRecord(arrays), ConfigRecord(layout), MetricRecord({"num-clients": counts})


def _leaf_in(prefix: str, kind: str, arrays, layout, where: str) -> pb.LeafPartial:
    out = pb.LeafPartial()
    try:
        dtype = wire.dtype_from_name(str(layout[f"{prefix}.dtype"]))
        shape = [int(d) for d in layout[f"{prefix}.shape"]]
    except KeyError as e:
        raise FleetError(f"{where}: the partial's layout has no {e.args[0]!r}") from None
    if f"{prefix}.extreme" in arrays:
        wire.encode_tensor(numpy_of(arrays[f"{prefix}.extreme"], dtype, shape, where),
                           out.extreme)
        return out
    out.dtype = wire.dtype_name(dtype)
    out.shape.extend(shape)
    if f"{prefix}.doubles" in arrays:
        out.doubles = np.ascontiguousarray(
            numpy_of(arrays[f"{prefix}.doubles"], np.float64, shape, where), "<f8").tobytes()
        return out
    if f"{prefix}.limbs" not in arrays:
        raise FleetError(f"{where}: partial tensor {prefix} has neither doubles, limbs "
                         "nor an extreme")
    limbs = arrays[f"{prefix}.limbs"].numpy()
    if limbs.dtype != np.int64 or limbs.ndim != 2:
        raise FleetError(f"{where}: limbs of {prefix} must be an int64 matrix, got "
                         f"{limbs.dtype}{list(limbs.shape)}")
    out.base_limb = int(layout.get(f"{prefix}.base", 0))
    out.num_limbs = limbs.shape[0]
    out.limbs = np.ascontiguousarray(limbs, "<i8").tobytes()
    if f"{prefix}.flags" in arrays:
        out.nonfinite = np.ascontiguousarray(arrays[f"{prefix}.flags"].numpy(),
                                             np.uint8).tobytes()
    return out


def from_records(arrays, layout, metrics, kinds: list, where: str) -> list:
    """One `AggregateResponse` per aggregation (of `kinds`) from a node's records, for
    `validate.check_partial` to check."""
    if int(layout.get("aggregations", -1)) != len(kinds):
        raise FleetError(f"{where}: partials of {layout.get('aggregations')} aggregations; "
                         f"the round has {len(kinds)}")
    counts = list(metrics.get("num-clients", []))
    if len(counts) != len(kinds):
        raise FleetError(f"{where}: {len(counts)} client counts for {len(kinds)} "
                         "aggregations")
    out = []
    for j, kind in enumerate(kinds):
        answer = pb.AggregateResponse(num_clients=int(counts[j]))
        for i in range(int(layout.get(f"a{j}.leaves", 0))):
            answer.leaves.append(_leaf_in(f"a{j}.v{i}", kind, arrays, layout, where))
        if int(layout.get(f"a{j}.weights", 0)):
            answer.weight_leaves.append(_leaf_in(f"a{j}.w", "sum", arrays, layout, where))
        out.append(answer)
    return out


def payload_bytes(arrays) -> int:
    """Bytes of the arrays of an ArrayRecord (as Flower counts them)."""
    return int(arrays.count_bytes())
