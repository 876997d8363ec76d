"""A round's values as Flower records: broadcasts, client ids and exact partials.

Everything a round sends through Flower is an `ArrayRecord` of numpy arrays (so Flower's
mods see arrays, never opaque bytes) beside a `ConfigRecord` of what the arrays alone
do not say (dtype names, shapes, limb bases) and a `MetricRecord` of counts:

- the broadcast: its tensors depth first, keys "0", "1", ...;
- a node's clients: one int64 array of population ids, key "ids";
- a node's partials: for aggregation j and tensor i, `aJ.vI.addend` (in the value's
  own dtype: a node of one client sends its addend, 4 bytes an element for float32,
  as Flower's own apps do; a round of rounded partials sends each float sum so),
  `aJ.vI.doubles` (float64, an exact sum that float64 holds; the few elements it
  would not hold exactly are +0.0 there, their positions in `aJ.vI.spilled`, int64,
  and their sums in limbs over those positions alone), `aJ.vI.limbs` (int64 [limbs,
  size], the fleet's exact limbs) with `aJ.vI.flags` (uint8, non-finite addends), or
  `aJ.vI.extreme` (a min or max); `aJ.w.*` the same for a weighted mean's weights;
  every field of the fleet's `LeafPartial` is carried, and a leaf with a field a
  record has no place for is refused, never sent without it;
- what computed a node's answer: a `ConfigRecord` "served" of "client-runtime" (a name
  of `rounds.client_runtime.NAMES`) and "model-sha256" (the LiteRT model's, 64 hex
  digits; "" for XLA), read by `served_of`;
- digests of what was sent, checked where it arrives: `aJ.vI.sha256` in a node's layout
  (`leaf_sha256` of each partial tensor as the fleet's message held it before it was
  laid out), and `RECEIVED` (`tensors_sha256` of the broadcast and ids the node
  received); a difference is a `TransferError` (`from_layout`, `check_received`).

Partials are the fleet's (`rounds.partials`): a node builds its `AggregateResponse` with
`partials.to_message` and `partials_layout` lays its fields out as arrays; the server
reads them back into an `AggregateResponse` with `from_layout` and checks it with
`validate.check_partial`, exactly as the coordinator checks a device's answer. Reading
works on plain dicts of numpy arrays (`numpy_dict` of an ArrayRecord), so a warm worker
and the ClientApp's own process decode the same way. The record names are `relay`'s.
"""

from __future__ import annotations

import hashlib
import math

import numpy as np

from fax_bridge.errors import FleetError, TransferError
from fax_bridge.rounds import wire
from fax_bridge.flower.relay import (BROADCAST, IDS, LAYOUT, METRICS, PARTIALS, ROUND,
                                    SERVED, array_view, c_order)
from fax_bridge.v1 import device_pb2 as pb

__all__ = ["BROADCAST", "IDS", "LAYOUT", "METRICS", "PARTIALS", "ROUND", "SERVED"]


def savable(value: np.ndarray) -> np.ndarray:
    """`value` C-contiguous, as its bytes (uint8, flat) when numpy cannot save its dtype
    (an ml_dtypes one such as bfloat16, whose name and shape travel beside it)."""
    value = c_order(value)
    if value.dtype.kind == "V" or value.dtype.name != np.dtype(value.dtype.str).name:
        value = value.reshape(-1).view(np.uint8)  # flat: a 0-d array has no bytes view
    return value


def array(value: np.ndarray):
    """A Flower `Array` of `value` (`savable`)."""
    from flwr.app import Array

    return Array(savable(value))


def numpy_dict(record, where: str) -> dict:
    """{key: numpy array} of a Flower ArrayRecord (read-only views of its bytes)."""
    out = {}
    for key, item in record.items():
        try:
            out[key] = array_view(item)
        except Exception as e:  # noqa: BLE001 - whatever numpy or Flower raise on bad bytes
            raise FleetError(f"{where}: array {key!r} cannot be read "
                             f"({type(e).__name__}: {e})") from None
    return out


def whole(value, what: str, where: str, low: int = 0, high: int = 2 ** 62) -> int:
    """`value` (a layout or metric entry another process sent) as an int in [low, high];
    FleetError naming `what` and `where` for anything else (a float, a string, a bool,
    a list, out of range)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or not low <= int(value) <= high:
        raise FleetError(f"{where}: {what} is {str(value)[:40]!r}; expected a whole number "
                         f"in [{low}, {high}]; {_FORGED}")
    return int(value)


def shape_of(value, what: str, where: str) -> tuple:
    """A shape another process sent: a list of whole dimensions, of a rank and a size
    the runtime's limits allow (`limits.tensor_bytes`, so no product overflows);
    FleetError naming `what` and `where` otherwise."""
    from fax_bridge.errors import ComputationError
    from fax_bridge.runtime import limits

    if not isinstance(value, (list, tuple)) or len(value) > limits.MAX_RANK:
        raise FleetError(f"{where}: {what} is {str(value)[:40]!r}; expected a list of at "
                         f"most {limits.MAX_RANK} dimensions; {_FORGED}")
    shape = tuple(whole(d, what, where, 0, 2 ** 62) for d in value)
    try:
        limits.tensor_bytes(shape, 1, f"{where}: {what}")
    except ComputationError as e:
        raise FleetError(str(e)) from None
    return shape


def dtype_of(value, what: str, where: str) -> np.dtype:
    """A dtype name another process sent (`wire.dtype_from_name`); FleetError naming
    `what` and `where` for a name that is not one."""
    if not isinstance(value, str):
        raise FleetError(f"{where}: {what} is {str(value)[:40]!r}, not a dtype name; "
                         f"{_FORGED}")
    try:
        return wire.dtype_from_name(value)
    except FleetError as e:
        raise FleetError(f"{where}: {what}: {e}") from None


_FORGED = "the message is corrupt or forged; check that the node runs this fax_bridge"


def numpy_of(value: np.ndarray, dtype: np.dtype, shape, where: str) -> np.ndarray:
    """`value` as `dtype` and `shape` (checked; bytes of an ml_dtypes array viewed)."""
    value = np.asarray(value)
    dtype, shape = np.dtype(dtype), shape_of(shape, "a shape", where)
    size = math.prod(shape)
    if value.dtype != dtype:
        if value.dtype != np.uint8 or value.size != size * dtype.itemsize:
            raise FleetError(f"{where}: an array of {value.dtype}{list(value.shape)}; "
                             f"expected {dtype.name}{list(shape)}")
        value = value.view(dtype)
    if value.size != size:
        raise FleetError(f"{where}: an array of {value.size} elements; expected shape "
                         f"{list(shape)}")
    return value.reshape(shape)


# ---------------------------------------------------------------------------------------
# Digests: what a side sent, checked where it arrives


def leaf_sha256(leaf: pb.LeafPartial) -> str:
    """The sha256 (hex) of a partial tensor as the fleet's message holds it: what a node
    computes before laying it out as records (`partials_layout`) and the ServerApp
    again on the message it reads back (`from_layout`)."""
    return hashlib.sha256(leaf.SerializeToString(deterministic=True)).hexdigest()


def tensors_sha256(tensors: list) -> str:
    """The sha256 (hex) of tensors in order: each one's dtype name, shape and bytes (C
    order). What the ServerApp sends a node (its broadcast, then the ids of its
    clients), and what the node computes on what it received and names in its answer
    (`RECEIVED`)."""
    digest = hashlib.sha256()
    for t in tensors:
        t = c_order(t)
        digest.update(f"{wire.dtype_name(t.dtype)}{list(t.shape)};".encode())
        digest.update(t.reshape(-1).view(np.uint8).data)
    return digest.hexdigest()


RECEIVED = "received.sha256"  # an answer's layout entry: `tensors_sha256` of the message


def _sha256_of(value, what: str, where: str) -> str:
    """A digest another process sent: 64 lowercase hex digits, else FleetError."""
    if not isinstance(value, str) or len(value) != 64 or \
            any(c not in "0123456789abcdef" for c in value):
        raise FleetError(f"{where}: {what} is {str(value)[:80]!r}, not a sha256 (64 hex "
                         f"digits); {_FORGED}")
    return value


def check_received(layout, sent: str, where: str) -> None:
    """TransferError naming `where` when a node's answer says it received other tensors
    than the ServerApp sent it (`sent`: their `tensors_sha256`); FleetError when the
    answer names none."""
    got = _sha256_of(layout.get(RECEIVED), "the digest of the message it received", where)
    if got != sent:
        raise TransferError(
            f"{where}: the round's message arrived at the node other than this ServerApp "
            f"sent it (sha256 {got[:16]}... received, {sent[:16]}... sent: its broadcast "
            "or its client ids were altered on the way); the round does not run on it. "
            "Check that the nodes and the ServerApp run the same fax_bridge")


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


def tensors_from_arrays(arrays: dict, layout, where: str, prefix: str = "") -> list:
    """The tensors `tensors_to_record` laid out (keys `prefix` + "0", "1", ...)."""
    count = whole(layout.get("count"), "the broadcast's count", where, 0, 1 << 20)
    found = sum(1 for k in arrays if k.startswith(prefix) and k[len(prefix):].isdigit())
    if found != count:
        raise FleetError(f"{where}: {found} broadcast arrays; expected {count}")
    out = []
    for i in range(count):
        key, at = f"{prefix}{i}", f"{where}, broadcast array {prefix}{i}"
        if key not in arrays:
            raise FleetError(f"{where}: broadcast array {key} is missing")
        out.append(numpy_of(arrays[key], dtype_of(layout.get(f"{i}.dtype"), "its dtype", at),
                            layout.get(f"{i}.shape"), at))
    return out


def ids_to_record(ids: np.ndarray):
    """The population ids of a node's clients in the round, as an ArrayRecord."""
    from flwr.app import ArrayRecord

    return ArrayRecord({IDS: array(np.asarray(ids, np.int64))})


def ids_from_arrays(arrays: dict, where: str) -> np.ndarray:
    """The client ids `ids_to_record` sent (checked)."""
    if IDS not in arrays:
        raise FleetError(f"{where}: the message names no clients (no {IDS!r} array)")
    ids = np.asarray(arrays[IDS])
    if ids.dtype != np.int64 or ids.ndim != 1:
        raise FleetError(f"{where}: client ids must be one int64 vector, got "
                         f"{ids.dtype}{list(ids.shape)}")
    return ids


# ---------------------------------------------------------------------------------------
# Partials


# The fields of a `LeafPartial` a record carries; `_leaf_out` refuses a leaf with any
# other field set (a shared-memory span, a field added later) rather than drop it.
_CARRIED = frozenset({"dtype", "shape", "base_limb", "num_limbs", "limbs", "nonfinite",
                      "doubles", "spilled", "extreme", "addend"})


def _leaf_out(prefix: str, leaf: pb.LeafPartial, arrays: dict, layout: dict) -> None:
    """Lays out every field of one partial tensor: an `extreme` or `addend` tensor; or a
    sum's `doubles` (float64, the leaf's shape) with, where elements spilled, their
    positions (`spilled`, int64) and their sums' limbs over those positions alone; or
    the sum's limbs over every element."""
    other = sorted(f.name for f, _ in leaf.ListFields() if f.name not in _CARRIED)
    if other:
        raise FleetError(f"partial tensor {prefix} has field(s) {other}, which a Flower "
                         "record does not carry; only the fleet's shared-memory answers "
                         "set them")
    layout[f"{prefix}.sha256"] = leaf_sha256(leaf)  # checked by `from_layout`
    shape = [int(d) for d in leaf.shape]
    for field in ("extreme", "addend"):
        if not leaf.HasField(field):
            continue
        value = wire.decode_tensor(getattr(leaf, field))
        arrays[f"{prefix}.{field}"] = value
        layout[f"{prefix}.dtype"] = wire.dtype_name(value.dtype)
        layout[f"{prefix}.shape"] = [int(d) for d in value.shape]
        return
    layout[f"{prefix}.dtype"] = leaf.dtype
    layout[f"{prefix}.shape"] = shape
    size = math.prod(shape)
    if leaf.doubles:
        arrays[f"{prefix}.doubles"] = np.frombuffer(leaf.doubles, "<f8").reshape(shape)
        if not leaf.spilled:
            return
        arrays[f"{prefix}.spilled"] = np.frombuffer(leaf.spilled, "<i8")
        size = arrays[f"{prefix}.spilled"].size  # the limbs cover those elements alone
    layout[f"{prefix}.base"] = int(leaf.base_limb)
    arrays[f"{prefix}.limbs"] = np.frombuffer(leaf.limbs, "<i8").reshape(
        (int(leaf.num_limbs), size))
    if leaf.nonfinite:
        arrays[f"{prefix}.flags"] = np.frombuffer(leaf.nonfinite, np.uint8)


def partials_layout(answers: list) -> tuple:
    """(numpy arrays by key, layout, client counts) of one `AggregateResponse` per
    aggregation (a node's answer for its clients); arrays of dtypes numpy cannot save
    (bfloat16, ...) as their bytes, their dtype in the layout."""
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
    return {k: savable(v) for k, v in arrays.items()}, layout, counts


def _leaf_in(prefix: str, arrays, layout, where: str, out: pb.LeafPartial) -> None:
    """Fills `out` (a new element of a repeated field: appending a filled message would
    copy its bytes) with the partial tensor `prefix` of a node's answer, then checks it
    is what the node sent: its sha256 the one the node computed before laying it out
    (TransferError naming the tensor otherwise)."""
    _fill_leaf(prefix, arrays, layout, where, out)
    sent = _sha256_of(layout.get(f"{prefix}.sha256"), f"partial tensor {prefix}'s sha256",
                      where)
    got = leaf_sha256(out)
    if got != sent:
        raise TransferError(
            f"{where}: partial tensor {prefix} arrived other than the node sent it (sha256 "
            f"{got[:16]}... here, {sent[:16]}... at the node): its answer was altered "
            "between the node's fax_bridge and this ServerApp (their records' conversion, "
            "the relay or the transport), so the round does not run on it. Check that "
            "the nodes and the ServerApp run the same fax_bridge")


def _fill_leaf(prefix: str, arrays, layout, where: str, out: pb.LeafPartial) -> None:
    """`_leaf_in`'s filling of `out`, every field `_leaf_out` laid out."""
    for key in (f"{prefix}.dtype", f"{prefix}.shape"):
        if key not in layout:
            raise FleetError(f"{where}: the partial's layout has no {key!r}")
    dtype = dtype_of(layout[f"{prefix}.dtype"], f"partial tensor {prefix}'s dtype", where)
    shape = list(shape_of(layout[f"{prefix}.shape"], f"partial tensor {prefix}'s shape",
                          where))
    for field in ("extreme", "addend"):
        if f"{prefix}.{field}" in arrays:
            wire.encode_tensor(numpy_of(arrays[f"{prefix}.{field}"], dtype, shape, where),
                               getattr(out, field))
            return
    out.dtype = wire.dtype_name(dtype)
    out.shape.extend(shape)
    if f"{prefix}.doubles" in arrays:
        out.doubles = np.ascontiguousarray(
            numpy_of(arrays[f"{prefix}.doubles"], np.float64, shape, where), "<f8").tobytes()
        if f"{prefix}.spilled" not in arrays:
            return
        cols = np.asarray(arrays[f"{prefix}.spilled"])
        if cols.dtype != np.int64 or cols.ndim != 1:
            raise FleetError(f"{where}: spilled positions of {prefix} must be one int64 "
                             f"vector, got {cols.dtype}{list(cols.shape)}")
        out.spilled = np.ascontiguousarray(cols, "<i8").tobytes()  # checked by validate
    elif f"{prefix}.spilled" in arrays:
        raise FleetError(f"{where}: partial tensor {prefix} has spilled positions but no "
                         f"doubles; {_FORGED}")
    if f"{prefix}.limbs" not in arrays:
        raise FleetError(f"{where}: partial tensor {prefix} has neither doubles, limbs "
                         "nor an extreme" + (" (its spilled elements' limbs are missing)"
                                             if f"{prefix}.spilled" in arrays else ""))
    limbs = np.asarray(arrays[f"{prefix}.limbs"])
    if limbs.dtype != np.int64 or limbs.ndim != 2:
        raise FleetError(f"{where}: limbs of {prefix} must be an int64 matrix, got "
                         f"{limbs.dtype}{list(limbs.shape)}")
    out.base_limb = whole(layout.get(f"{prefix}.base"), f"partial tensor {prefix}'s "
                          "base limb", where, 0, 1 << 20)
    out.num_limbs = limbs.shape[0]
    out.limbs = np.ascontiguousarray(limbs, "<i8").tobytes()
    if f"{prefix}.flags" in arrays:
        out.nonfinite = np.ascontiguousarray(arrays[f"{prefix}.flags"], np.uint8).tobytes()


def from_layout(arrays: dict, layout, counts: list, kinds: list, where: str) -> list:
    """One `AggregateResponse` per aggregation (of `kinds`) from a node's partials
    (`partials_layout`'s three parts), for `validate.check_partial` to check."""
    if whole(layout.get("aggregations"), "the partials' aggregations", where,
             0, 1 << 20) != len(kinds):
        raise FleetError(f"{where}: partials of {layout.get('aggregations')} aggregations; "
                         f"the round has {len(kinds)}")
    if not isinstance(counts, (list, tuple)) or len(counts) != len(kinds):
        raise FleetError(f"{where}: client counts {str(counts)[:40]} for {len(kinds)} "
                         "aggregations; a node sends one count per aggregation")
    out = []
    for j in range(len(kinds)):
        answer = pb.AggregateResponse(num_clients=whole(
            counts[j], f"the client count of aggregation {j}", where, 0, 2 ** 62))
        for i in range(whole(layout.get(f"a{j}.leaves"), f"aggregation {j}'s tensors",
                             where, 0, 1 << 20)):
            _leaf_in(f"a{j}.v{i}", arrays, layout, where, answer.leaves.add())
        if whole(layout.get(f"a{j}.weights"), f"aggregation {j}'s weights", where, 0, 1):
            _leaf_in(f"a{j}.w", arrays, layout, where, answer.weight_leaves.add())
        out.append(answer)
    return out


def answer_of(content, kinds: list, where: str, sent: str = "") -> tuple:
    """(one `AggregateResponse` per aggregation of `kinds`, the node's compute seconds)
    from the content of a node's answer to a `train` message; FleetError naming `where`
    when a record is missing or malformed. TransferError when the answer is not what
    the node sent (a partial tensor's sha256, `from_layout`) or says the node received
    other than `sent` (the `tensors_sha256` of the message sent it; "": not checked)."""
    missing = [name for name in (PARTIALS, LAYOUT, METRICS) if name not in content]
    if missing:
        raise FleetError(f"{where}: its answer has no {', '.join(missing)} record; "
                         f"{_FORGED}")
    metrics = content[METRICS]
    seconds = metrics.get("compute-s", 0.0)
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or \
            not 0.0 <= seconds < float("inf"):
        raise FleetError(f"{where}: its compute time is {str(seconds)[:40]!r}, not seconds; "
                         f"{_FORGED}")
    if sent:
        check_received(content[LAYOUT], sent, where)
    answers = from_layout(numpy_dict(content[PARTIALS], where), content[LAYOUT],
                          metrics.get("num-clients", []), kinds, where)
    return answers, float(seconds)


SERVED_KEYS = ("client-runtime", "model-sha256")


def served_of(content, where: str) -> tuple:
    """(client runtime name, sha256 of the LiteRT model or None for XLA) that a node's
    answer names in its `SERVED` record; FleetError naming `where` for a record missing
    or with other keys, a runtime not in `rounds.client_runtime.NAMES`, a digest that is
    not 64 lowercase hex digits, a LiteRT answer without one or an XLA answer with one."""
    from fax_bridge.rounds.client_runtime import NAMES

    if SERVED not in content:
        raise FleetError(f"{where}: its answer has no {SERVED} record (which client "
                         f"runtime computed it); {_FORGED}")
    served = content[SERVED]
    keys = list(served.keys()) if hasattr(served, "keys") else None
    if keys is None or len(keys) != len(SERVED_KEYS) or set(keys) != set(SERVED_KEYS):
        raise FleetError(f"{where}: its {SERVED} record has keys {str(keys)[:80]}; "
                         f"expected {list(SERVED_KEYS)}; {_FORGED}")
    runtime, digest = served["client-runtime"], served["model-sha256"]
    if not isinstance(runtime, str) or runtime not in NAMES:
        raise FleetError(f"{where}: its client runtime is {str(runtime)[:40]!r}; expected "
                         f"one of {list(NAMES)}; {_FORGED}")
    if not isinstance(digest, str) or (digest and (
            len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest))):
        raise FleetError(f"{where}: its model sha256 is {str(digest)[:80]!r}, not 64 hex "
                         f"digits; {_FORGED}")
    if (runtime == "litert") != bool(digest):
        raise FleetError(f"{where}: a {runtime} answer " + (
            "names no LiteRT model" if digest == "" else "names a LiteRT model") +
            f"; {_FORGED}")
    return runtime, digest or None


def payload_bytes(arrays) -> int:
    """Bytes of the arrays of an ArrayRecord (as Flower counts them)."""
    return int(arrays.count_bytes())


def content_bytes(content) -> int:
    """Bytes of every record of a message's content, what a round's report counts as
    `bytes_*` on Flower: arrays as Flower counts them, and each metric or config entry
    as its key and value (8 bytes a number, the length of a string or bytes)."""
    def size(value) -> int:
        if isinstance(value, (list, tuple)):
            return sum(size(v) for v in value)
        return len(value) if isinstance(value, (str, bytes)) else 8

    total = sum(record.count_bytes() for record in content.array_records.values())
    for records_ in (content.metric_records, content.config_records):
        total += sum(len(key) + size(value) for record in records_.values()
                     for key, value in record.items())
    return int(total)
