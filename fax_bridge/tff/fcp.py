"""Forms for Google's Federated Compute (FCP): what its plan builder takes.

FCP's artifact builder (`fcp/artifact_building/federated_compute_plan_builder.py`,
`build_plan`) turns a MapReduceForm or DistributeAggregateForm into a `Plan`: a client
phase a phone runs (a TensorFlow graph) and server phases that aggregate. It takes a
form only when

- the client work's data is `sequence<string>`: serialized `tf.Example`s, what the
  device's example store serves (its `ExternalDataset` op);
- every local part is TensorFlow (the DAF's too, not `Xla`);
- the server state and output (and the DAF's intermediate server state, a checkpoint
  between the server's two phases) hold only dtypes a TF checkpoint can hold (not
  uint16, uint32, uint64: a PRNG key);
- each secure sum's bound is a value selected from the server's intermediate state, not
  a literal;
- the client work converts to TensorFlow Lite, which devices run: its client parts are
  lowered into what TF's TFLite converter takes first (`fcp_client`).

`with_fcp(job, ...)` asks the TFF side (`tools/tff087/fcp_forms.py`) for such forms of a
round: the client data becomes one feature per leaf (`client_features`, named by the
leaf's path in the client data's type, as `fax_bridge.data.examples` writes them),
parsed inside the work; unsigned state leaves travel as the signed integers of the same
bits (`encode_state` / `decode_state`, exact); bounds are constant TensorFlow
computations. The forms come back checked against that contract (`contract`, empty).
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence

import jax
import ml_dtypes
import numpy as np
from federated_language.proto import computation_pb2

from fax_bridge.data.examples import Feature, feature_kind, write_population
from fax_bridge.errors import DataError, ExportError
from fax_bridge.tff import fcp_client

# Dtypes a TF (tensor-slice) checkpoint cannot hold, stored as a signed integer's bits.
CHECKPOINT_CODES = {np.dtype(np.uint16): np.dtype(np.int16),
                    np.dtype(np.uint32): np.dtype(np.int32),
                    np.dtype(np.uint64): np.dtype(np.int64),
                    np.dtype(ml_dtypes.bfloat16): np.dtype(np.int16)}
# What FCP's aggregation takes (its aggregation core's dtypes) for a client result.
FCP_AGGREGATES = tuple(np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64))
# Client results of other dtypes travel as these (an exact widening; uint64 as int64's
# bits, whose two's complement sum wraps as the program's uint64 sum does), the server
# casting the aggregate back once: a narrow float's sum or mean rounded once from float32,
# an integer sum wrapped to its dtype, as jit's sum over clients gives them.
AGGREGATED_AS = {np.dtype(d): np.dtype(c) for d, c in (
    (ml_dtypes.bfloat16, np.float32), (np.float16, np.float32), (np.int8, np.int64),
    (np.int16, np.int64), (np.uint8, np.int64), (np.uint16, np.int64),
    (np.uint32, np.int64), (np.uint64, np.int64))}
# The aggregations whose client results the FCP forms carry as AGGREGATED_AS says.
AGGREGATION_URIS = ("federated_sum", "federated_mean", "federated_weighted_mean",
                    "federated_min", "federated_max")
_OTHER_AGGREGATIONS = ("federated_aggregate", "federated_secure_sum_bitwidth",
                       "federated_secure_sum", "federated_secure_modular_sum")
# TF DataType numbers (federated_language's TensorType.dtype) of the dtypes that fit.
_DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 4: np.uint8, 5: np.int16, 6: np.int8,
           9: np.int64, 10: np.bool_, 14: "bfloat16", 17: np.uint16, 19: np.float16,
           22: np.uint32, 23: np.uint64}


def _dtype(number: int, where: str) -> np.dtype:
    if number not in _DTYPES:
        raise ExportError(f"{where} has TF dtype number {number}, which the FCP forms do "
                          "not carry; use a float, integer or bool leaf")
    found = _DTYPES[number]
    return np.dtype(ml_dtypes.bfloat16 if found == "bfloat16" else found)


def _leaves(t, path: list, where: str) -> list:
    """(path, dtype, shape) per tensor of a federated_language Type proto, depth-first."""
    kind = t.WhichOneof("type")
    if kind == "federated":
        return _leaves(t.federated.member, path, where)
    if kind == "struct":
        out = []
        for i, e in enumerate(t.struct.element):
            out += _leaves(e.value, path + [e.name or str(i)], where)
        return out
    if kind == "tensor":
        dims = tuple(int(d) for d in t.tensor.dims)
        if any(d < 0 for d in dims) or t.tensor.unknown_rank:
            raise ExportError(f"{where} {'/'.join(path)} has no fixed shape")
        return [("/".join(path) or "value", _dtype(t.tensor.dtype, where), dims)]
    raise ExportError(f"{where} holds a {kind}; the FCP forms take tensors and structs")


def client_features(proto: computation_pb2.Computation) -> list[Feature]:
    """The features of a round's client data (its proto in the forms' type): one per
    leaf, named by its path (element names, or indices where unnamed, joined by '/'),
    depth-first, the order jax flattens the client arguments in."""
    param = proto.type.function.parameter
    if param.WhichOneof("type") != "struct" or len(param.struct.element) != 2:
        raise ExportError("the round is not in the forms' type "
                          "(<state@SERVER, data@CLIENTS> -> ...); export it with round_form")
    out = []
    for name, dtype, shape in _leaves(param.struct.element[1].value, [], "client data"):
        try:
            feature_kind(dtype, f"client data leaf {name}")
        except DataError as e:  # no tf.Example list holds it exactly
            raise ExportError(str(e)) from None
        out.append(Feature(name, dtype, shape))
    return out


def state_leaves(proto: computation_pb2.Computation) -> list:
    """(path, dtype, shape) per leaf of the round's server state."""
    param = proto.type.function.parameter
    return _leaves(param.struct.element[0].value, [], "server state")


def output_leaves(proto: computation_pb2.Computation) -> list:
    """(path, dtype, shape) per leaf of the round's output (its result's second element)."""
    return _leaves(proto.type.function.result.struct.element[1].value, [], "output")


def aggregated_dtype(dtype: Any, uri: str, where: str) -> np.dtype:
    """The dtype FCP's aggregation `uri` takes a client result of `dtype` in (itself when
    FCP aggregates it); `ExportError` naming the leaf `where` when none carries it
    exactly."""
    dtype = np.dtype(dtype)
    if dtype in FCP_AGGREGATES:
        return dtype
    carried = AGGREGATED_AS.get(dtype)
    if carried is None or (uri in ("federated_min", "federated_max")
                           and carried.itemsize == dtype.itemsize
                           and dtype.kind != carried.kind):
        raise ExportError(
            f"{uri} of {dtype} client results ({where}) has no FCP type that carries them "
            f"exactly (FCP aggregates {', '.join(d.name for d in FCP_AGGREGATES)}); cast "
            "them in the client work to one that holds them")
    return carried


def _intrinsic_types(message) -> list:
    """(uri, Type proto) of every intrinsic inside a federated_language message."""
    if isinstance(message, computation_pb2.Computation) and \
            message.WhichOneof("computation") == "intrinsic":
        return [(message.intrinsic.uri, message.type)]
    found = []
    for field, value in message.ListFields():
        if field.message_type is None or \
                not field.message_type.full_name.startswith("federated_language."):
            continue
        repeated = getattr(field, "is_repeated", None)
        repeated = field.label == field.LABEL_REPEATED if repeated is None else repeated
        for item in (value if repeated else [value]):
            found += _intrinsic_types(item)
    return found


def aggregation_codes(proto: computation_pb2.Computation) -> list:
    """(uri, leaf path, dtype, the dtype FCP aggregates it in) per client-result leaf of
    each aggregation the round calls that FCP does not take as it is (a weighted mean's
    weight leaves under `weight/`); refuses (`aggregated_dtype`) what none carries, and
    client results of other aggregations (`federated_aggregate`, secure sums) outside
    FCP's dtypes."""
    out = []
    for uri, t in _intrinsic_types(proto):
        if uri not in AGGREGATION_URIS + _OTHER_AGGREGATIONS:
            continue
        param = t.function.parameter
        parts = [("", param)]
        if param.WhichOneof("type") == "struct":
            parts = [(e.name or str(i), e.value) for i, e in enumerate(param.struct.element)]
            if uri == "federated_weighted_mean":
                parts = [("", parts[0][1]), ("weight/", parts[1][1])]
        for prefix, p in parts:
            if p.WhichOneof("type") != "federated" or \
                    p.federated.placement.value.uri != "clients":
                continue
            for path, dtype, _ in _leaves(p, [], f"{uri}'s client results"):
                where = f"{prefix}{path}" if prefix else path
                if uri not in AGGREGATION_URIS:
                    if dtype not in FCP_AGGREGATES:
                        raise ExportError(
                            f"{uri} of {dtype} client results ({where}): FCP aggregates "
                            f"{', '.join(d.name for d in FCP_AGGREGATES)}; cast them in "
                            "the client work")
                    continue
                carried = aggregated_dtype(dtype, uri, where)
                if carried != dtype:
                    out.append((uri, where, dtype, carried))
    return out


def encode_state(leaves: Sequence[Any]) -> list:
    """Flat state leaves as the FCP forms keep them: unsigned 16/32/64-bit leaves as the
    signed integers of the same bits (a uint32 PRNG key as int32)."""
    out = []
    for x in leaves:
        x = np.asarray(x)
        out.append(x.view(CHECKPOINT_CODES[x.dtype]) if x.dtype in CHECKPOINT_CODES else x)
    return out


def decode_state(leaves: Sequence[Any], dtypes: Sequence[Any]) -> list:
    """`encode_state` undone: each leaf viewed back as its original dtype (exact)."""
    return [np.asarray(x).view(np.dtype(d)) if np.asarray(x).dtype != np.dtype(d)
            else np.asarray(x) for x, d in zip(leaves, dtypes)]


def client_values(features: Sequence[Feature], client_args: Any, clients: int) -> list:
    """Per client, {feature name: its data}, from the program's CLIENTS arguments (a
    leading clients axis on each leaf; several client arguments as a tuple)."""
    leaves = jax.tree_util.tree_leaves(client_args)
    if len(leaves) != len(features):
        raise ExportError(f"the client arguments have {len(leaves)} leaves, the round's "
                          f"client data {len(features)} features")
    for x, f in zip(leaves, features):
        x = np.asarray(x)
        if x.ndim == 0 or x.shape[0] != clients:
            raise ExportError(f"client leaf {f.name} has shape {list(x.shape)}, not a "
                              f"leading axis of the {clients} clients")
        if x.shape[1:] != tuple(f.shape) or x.dtype != f.dtype:
            raise ExportError(f"client leaf {f.name}: {x.dtype}{list(x.shape)} per cohort, "
                              f"but the round takes {f.dtype}{list(f.shape)} per client")
    return [{f.name: np.asarray(x)[j] for x, f in zip(leaves, features)}
            for j in range(clients)]


def with_fcp(job: dict, proto: computation_pb2.Computation, forms: Sequence[str],
             run: Optional[dict] = None, tf_examples: Optional[str] = None,
             tflite: bool = False, lower_client: bool = True) -> dict:
    """`job` (from `forms.job(..., artifacts=True)`) also asking the TFF side for the FCP
    forms `forms` ("mrf", "daf"); `run` as `make_run` gives it; with `tflite` the MRF's
    run is repeated with its client work converted to TFLite and run by TFLite's
    interpreter (`tools/tff087/tflite_client.py`). The client work is lowered for the
    devices' TFLite client (`fcp_client`), what it cannot take refused by name before
    `job` changes; `lower_client=False` keeps it as jax wrote it (forms whose
    aggregation and plan are checked in TensorFlow, which no TFLite client could run)."""
    entry: dict = {"forms": list(forms)}
    if run:
        entry["run"] = run
        entry["tflite"] = bool(tflite) and lower_client
    if tf_examples:
        entry["tf_examples"] = tf_examples
    client_features(proto)  # refuses client data no tf.Example holds, before TFF starts
    aggregation_codes(proto)  # refuses client results no FCP type carries, likewise
    entry["aggregated_as"] = {d.name: c.name for d, c in AGGREGATED_AS.items()}
    if "artifacts" not in job:
        raise ExportError("the job has no StableHLO artifacts of the round's Xla parts; "
                          "make it with forms.job(..., artifacts=True)")
    if lower_client:  # the client parts lowered for the devices' TFLite client
        entry["artifacts"] = fcp_client.write_artifacts(
            proto, os.path.join(job["out"], "fcp_client"))
    job["fcp"] = entry
    return job


def make_run(proto: computation_pb2.Computation, state: Any, client_args: Any,
             clients: int, folder: str, rounds: int) -> dict:
    """Writes what a plan-shaped run reads (the population as TFRecord files of
    `tf.Example`, the encoded initial state) and returns the job's `run` entry."""
    features = client_features(proto)
    population = os.path.join(folder, "examples")
    write_population(population, features, client_values(features, client_args, clients))
    flat = encode_state(jax.tree_util.tree_leaves(state))
    path = os.path.join(folder, "fcp_state.npz")
    np.savez(path, num_state=len(flat), **{f"state.{i}": v for i, v in enumerate(flat)})
    from fax_bridge.data.examples import ExamplePopulation

    return {"state": path, "examples": ExamplePopulation(population).paths,
            "rounds": rounds, "outputs": os.path.join(folder, "fcp_outputs.npz")}


def check_result(kind: str, result: dict) -> None:
    """Raises `ExportError` when the TFF side could not build the FCP `kind` form or
    the form breaks FCP's contract."""
    if "error" in result:
        raise ExportError(f"no FCP form of this round: {result['error']}")
    entry = result.get(kind)
    if entry is None or "error" in entry:
        raise ExportError(f"TFF could not build the FCP {kind.upper()}: "
                          f"{(entry or {}).get('error', 'not asked for')}")
    if not entry["same_type"]:
        raise ExportError(f"TFF re-derived the FCP {kind.upper()} as {entry['round_type']}, "
                          f"not the FCP round's type {result['type']}")
    if entry["contract"]:
        raise ExportError(f"the FCP {kind.upper()} breaks FCP's plan builder's contract: "
                          + "; ".join(entry["contract"]))
