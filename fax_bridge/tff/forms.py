"""TFF's production forms from a fax_bridge round: DistributeAggregateForm and MapReduceForm.

Production cross-device systems run TFF's compiled forms, not arbitrary building-block
trees. A round `(server_state, client_data...) -> (new_state, output)` is

1. checked here for what one form cannot hold (a broadcast of a value computed from an
   aggregate, i.e. two server-client trips; state or results placed at CLIENTS;
   intrinsics outside the forms), each refusal naming the operations, their source
   lines and the fix;
2. exported with `round_form=True`, the type the forms want:
   `(<state@SERVER, data@CLIENTS> -> <state@SERVER, output@SERVER>)`;
3. handed to TFF 0.87 in its side environment (`tools/tff087/build_forms.py`), which
   builds the form with `form_utils`: the DistributeAggregateForm keeps the `Xla` parts;
   for the MapReduceForm every `Xla` part is first given as a portable StableHLO artifact
   (`runtime.hlo.portable_artifact`) that TFF's side wraps in a TensorFlow computation
   holding one `XlaCallModule` op.

The pieces come back as `federated_language` Computation protos (`Form`), written with a
manifest by `write_form`. `run_daf` runs a DistributeAggregateForm piece by piece on
fax_bridge's runtime (in process or on a fleet's backend).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import tempfile
from typing import Any, Callable, Iterable, Optional, Sequence

import federated_language
import jax
from federated_language.compiler import intrinsic_defs as defs
from federated_language.proto import computation_pb2
from jax._src import core

from fax_bridge.language import tracing
from fax_bridge.errors import ExportError
from fax_bridge.language.placements import Placement
from fax_bridge.language.primitive_facts import facts_of
from fax_bridge.runtime import grammar
from fax_bridge.tff import fcp, side_env
from fax_bridge.tff import xla as tff_xla
from fax_bridge.tff.export import argument_names, export_computation

Computation = computation_pb2.Computation

DAF_PIECES = ("server_prepare", "server_to_client_broadcast", "client_work",
              "client_to_server_aggregation", "server_result")
MRF_PIECES = ("prepare", "work", "zero", "accumulate", "merge", "report",
              "secure_sum_bitwidth", "secure_sum_max_input", "secure_modular_sum_modulus",
              "update")
FORMS = {"daf": ("DistributeAggregateForm", DAF_PIECES),
         "mrf": ("MapReduceForm", MRF_PIECES)}

# TFF's own intrinsic, which federated_language does not define (fax_bridge never emits it:
# its modular sum is a composition, see `secure.federated_secure_modular_sum`).
SECURE_MODULAR_SUM_URI = "federated_secure_modular_sum"

# Intrinsics TFF's form builders accept (form_utils' reducible intrinsics, plus the sums
# and means it rewrites into federated_aggregate).
FORM_INTRINSICS = frozenset({SECURE_MODULAR_SUM_URI} | {d.uri for d in (
    defs.FEDERATED_AGGREGATE, defs.FEDERATED_APPLY, defs.FEDERATED_BROADCAST,
    defs.FEDERATED_EVAL_AT_CLIENTS, defs.FEDERATED_EVAL_AT_SERVER, defs.FEDERATED_MAP,
    defs.FEDERATED_MAP_ALL_EQUAL, defs.FEDERATED_SECURE_SUM_BITWIDTH,
    defs.FEDERATED_SECURE_SUM, defs.FEDERATED_VALUE_AT_CLIENTS,
    defs.FEDERATED_VALUE_AT_SERVER, defs.FEDERATED_ZIP_AT_CLIENTS,
    defs.FEDERATED_ZIP_AT_SERVER, defs.FEDERATED_SUM, defs.FEDERATED_MEAN,
    defs.FEDERATED_WEIGHTED_MEAN)})

_FIX_TWO_TRIPS = (
    "One form has one broadcast before one aggregation. Compute the second trip's "
    "quantity at the server from this round's aggregate and carry it in the state to "
    "the next round's broadcast (as fax_bridge.algorithms.fed_sgd_one_trip and "
    "learned_server_lr_one_trip do), or split the round into two programs.")


# ---------------------------------------------------------------------------- refusals


def _name(eqn) -> str:
    return f"{eqn.primitive.name} at {tracing.eqn_location(eqn)}"


def _form_role(eqn) -> Optional[str]:
    """The form piece of `eqn`'s communication (its primitive's record), None for work."""
    facts = facts_of(eqn.primitive)
    return None if facts is None else facts.form_role


def client_state(comp: tracing.FederatedComputation) -> tuple[list, list]:
    """(argument paths, result paths) of the traced round's state kept at CLIENTS: the
    CLIENTS leaves of an argument that also has leaves elsewhere (a state), and the
    CLIENTS leaves of a `(new_state, output)` result."""
    tree = jax.tree_util.tree_unflatten(comp.in_tree, list(range(len(comp.in_avals))))
    arguments = []
    for sub in tree:
        leaves = jax.tree_util.tree_leaves(sub)
        if len({comp.in_placements[j] for j in leaves}) > 1:
            arguments += [comp.in_paths[j] for j in leaves
                          if comp.in_placements[j] is Placement.CLIENTS]
    out_tree = jax.tree_util.tree_unflatten(comp.out_tree, list(range(len(comp.out_avals))))
    if isinstance(out_tree, (tuple, list)) and len(out_tree) == 2:
        results = [comp.out_paths[j] for j in jax.tree_util.tree_leaves(out_tree)
                   if comp.out_placements[j] is Placement.CLIENTS]
    else:
        results = []
    return arguments, results


def second_trips(comp: tracing.FederatedComputation) -> list[str]:
    """One line per broadcast of the traced round that sends a value computed from an
    aggregation ("federated_broadcast at FILE:LINE (fn) sends a value computed from
    federated_sum at ..."), each once, in program order: the round's later trips."""
    depends: dict = {}  # var -> the first aggregate equation it depends on
    trips = []
    for eqn in comp.jaxpr.jaxpr.eqns:
        source = next((depends[v] for v in eqn.invars
                       if not isinstance(v, core.Literal) and v in depends), None)
        role = _form_role(eqn)
        if role == "server_to_client_broadcast" and source is not None:
            trips.append((eqn, source))
        if role == "client_to_server_aggregation" and source is None:
            source = eqn
        if source is not None:
            for v in eqn.outvars:
                depends[v] = source
    return list(dict.fromkeys(f"{_name(b)} sends a value computed from {_name(a)}"
                              for b, a in trips))


def check_round(comp: tracing.FederatedComputation) -> None:
    """Raises `ExportError` when the traced round cannot be one production form."""
    client_args, client_out = client_state(comp)
    if client_args or client_out:
        where = []
        if client_args:
            where.append(f"arguments {', '.join(client_args[:6])} are placed at CLIENTS")
        if client_out:
            where.append(f"results {', '.join(client_out[:6])} are placed at CLIENTS")
        raise ExportError(
            "the round keeps client state: " + "; ".join(where) + ". A production form "
            "keeps state only at the server (clients are stateless and sampled anew each "
            "round). Move it to the server (e.g. one entry per client slot in the server "
            "state, selected by a client id in the client data), or aggregate CLIENTS "
            "results into SERVER metrics.")
    lines = second_trips(comp)
    if lines:
        more = f" (and {len(lines) - 4} more)" if len(lines) > 4 else ""
        raise ExportError(
            "the round needs two server-client trips: " + "; ".join(lines[:4]) + more
            + ". " + _FIX_TWO_TRIPS)


def _walk(message, visit) -> None:
    """Calls `visit` on `message` and every federated_language message inside it,
    depth-first; `visit` returning True stops the descent below that message."""
    if visit(message):
        return
    for field, value in message.ListFields():
        if field.message_type is None or \
                not field.message_type.full_name.startswith("federated_language."):
            continue
        repeated = field.is_repeated if hasattr(field, "is_repeated") else \
            field.label == field.LABEL_REPEATED
        for item in (value if repeated else [value]):
            _walk(item, visit)


def intrinsic_uris(proto: Computation) -> list[str]:
    """Every intrinsic URI the proto calls, depth-first."""
    found: list[str] = []

    def visit(message) -> bool:
        if isinstance(message, computation_pb2.Intrinsic):
            found.append(message.uri)
            return True
        return False

    _walk(proto, visit)
    return found


def check_intrinsics(proto: Computation) -> None:
    """Raises `ExportError` naming the intrinsics no production form can hold."""
    bad = sorted({u for u in intrinsic_uris(proto) if u not in FORM_INTRINSICS})
    if bad:
        raise ExportError(
            f"the round calls {', '.join(bad)}, which no production form can hold (they "
            f"take only {', '.join(sorted(FORM_INTRINSICS))}). Express that step with "
            "broadcast, per-client or server maps and sums/means.")


# ---------------------------------------------------------------------------- export


def round_proto(fn: Callable, *args, placements: Any = None,
                clients: Optional[int] = None) -> tuple[Computation, tracing.FederatedComputation]:
    """The round's proto in the forms' type, after the refusal checks; also the trace."""
    comp = tracing.trace(fn, *args, placements=placements, clients=clients)
    check_round(comp)
    proto = export_computation(comp, argument_names(fn, len(args)), round_form=True)
    check_intrinsics(proto)
    return proto, comp


def xla_parts(proto: Computation) -> list[Computation]:
    """The `Xla` computations inside a proto, depth-first, each once (by HLO content)."""
    parts: dict = {}

    def visit(message) -> bool:
        if isinstance(message, Computation) and grammar.which(message) == "xla":
            parts.setdefault(tff_xla.hlo_module_bytes(message), message)
            return True
        return False

    _walk(proto, visit)
    return list(parts.values())


def write_artifacts(proto: Computation, folder: str) -> dict[str, str]:
    """Each Xla part's portable StableHLO artifact in `folder`: {sha256 of HLO: path}."""
    from fax_bridge.runtime import hlo

    os.makedirs(folder, exist_ok=True)
    out = {}
    for part in xla_parts(proto):
        module = tff_xla.hlo_module_bytes(part)
        key = hashlib.sha256(module).hexdigest()
        artifact, _, _ = hlo.portable_artifact(module)
        path = os.path.join(folder, f"{key[:16]}.mlirbc")
        with open(path, "wb") as f:
            f.write(artifact)
        out[key] = path
    return out


# ---------------------------------------------------------------------------- forms


@dataclasses.dataclass
class Form:
    """A production form built by TFF: each piece a `federated_language` Computation.

    `kind` is "daf" or "mrf"; `round` is the computation TFF re-derived from the pieces
    (`get_computation_for_*_form`), whose type equals the round's `type_signature`.
    """

    kind: str
    type_signature: str
    pieces: dict[str, Computation]
    piece_types: dict[str, str]
    round: Computation
    seconds: float
    input_round: Optional[Computation] = None  # the round in the forms' type TFF was given
    # For Federated Compute (`target="fcp"`): the client data's tf.Example features and,
    # per state leaf, the signed dtype an unsigned leaf is kept as (None: as it is).
    features: Optional[list] = None
    state_codes: Optional[list] = None

    @property
    def name(self) -> str:
        return FORMS[self.kind][0]


def _read(path: str) -> Computation:
    with open(path, "rb") as f:
        return Computation.FromString(f.read())


def form_from_result(kind: str, result: dict) -> Form:
    """A `Form` from one entry of `tools/tff087/build_forms.py`'s answer."""
    if "error" in result:
        raise ExportError(f"TFF could not build the {FORMS[kind][0]}: {result['error']}")
    if not result["same_type"]:
        raise ExportError(
            f"TFF re-derived the {FORMS[kind][0]} as {result['round_type']}, not the round's "
            "type; the form does not compute the round.")
    pieces = {name: _read(info["path"]) for name, info in result["pieces"].items()}
    types = {name: info["type"] for name, info in result["pieces"].items()}
    return Form(kind, result["round_type"], pieces, types, _read(result["round"]["path"]),
                result["seconds"])


def job(name: str, proto: Computation, forms: Iterable[str], folder: str,
        mrf_inputs: Optional[str] = None, artifacts: bool = False) -> dict:
    """One job for the side environment: writes the proto (and the Xla parts' artifacts
    for the MRF, or with `artifacts`: the Federated Compute forms need them too)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "round.pb")
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    forms = list(forms)
    entry = {"name": name, "proto": path, "forms": forms, "out": folder}
    if "mrf" in forms or artifacts:
        entry["artifacts"] = write_artifacts(proto, os.path.join(folder, "stablehlo"))
    if "mrf" in forms:
        if mrf_inputs:
            entry["run_mrf"] = {"inputs": mrf_inputs,
                                "outputs": os.path.join(folder, "mrf_outputs.npz")}
    return entry


def build_forms(jobs: Sequence[dict], folder: str, timeout_s: float = 600.0) -> dict:
    """Runs TFF's form builders on `jobs` in one side-environment process."""
    path = os.path.join(folder, "jobs.json")
    with open(path, "w") as f:
        json.dump({"jobs": list(jobs)}, f)
    return side_env.run_json(side_env.script("build_forms.py"), [path], timeout_s)


TARGETS = ("tff", "fcp")


def _to_form(kind: str, fn: Callable, args, placements, clients, target: str) -> Form:
    if target not in TARGETS:
        raise ExportError(f"target {target!r} is not one of {TARGETS}: 'tff' builds TFF's "
                          "form as it is, 'fcp' the form Federated Compute's plan builder "
                          "takes")
    proto, _ = round_proto(fn, *args, placements=placements, clients=clients)
    with tempfile.TemporaryDirectory(prefix="fax_bridge_forms_") as folder:
        if target == "tff":
            result = build_forms([job(kind, proto, [kind], folder)], folder)[kind]
            form = form_from_result(kind, result[kind])
        else:
            entry = fcp.with_fcp(job(kind, proto, [], folder, artifacts=True), proto, [kind])
            result = build_forms([entry], folder)[kind].get("fcp", {})
            fcp.check_result(kind, result)
            form = form_from_result(kind, result[kind])
            form.features = fcp.client_features(proto)
            form.state_codes = result["info"]["state_codes"]
    form.input_round = proto
    return form


def to_distribute_aggregate_form(fn: Callable, *args, placements: Any = None,
                                 clients: Optional[int] = None, target: str = "tff") -> Form:
    """The round `fn(state, *client_data) -> (new_state, output)` as TFF's
    DistributeAggregateForm (pieces with `Xla` parts), built by TFF 0.87.

    With `target="fcp"`, the form Federated Compute's plan builder takes
    (`fax_bridge.tff.fcp`): client data as serialized `tf.Example`s parsed in the client
    work, TensorFlow parts only, unsigned state leaves kept as signed bits, secure-sum
    bounds in the intermediate server state.

    Needs the TFF side environment (`make tff-venv`). Raises `ExportError` for rounds no
    form can hold (two trips, client state, other intrinsics), naming the fix.
    """
    return _to_form("daf", fn, args, placements, clients, target)


def to_map_reduce_form(fn: Callable, *args, placements: Any = None,
                       clients: Optional[int] = None, target: str = "tff") -> Form:
    """The round as TFF's MapReduceForm: TensorFlow pieces whose local work is one
    `XlaCallModule` op (version 8) per Xla part, built by TFF 0.87 (see
    `to_distribute_aggregate_form`, also for `target="fcp"`)."""
    return _to_form("mrf", fn, args, placements, clients, target)


def form_files(kind: str) -> list:
    """The files `write_form` writes for a form of `kind` ("daf" or "mrf") built by
    `to_distribute_aggregate_form` / `to_map_reduce_form`, before it is built."""
    pieces = FORMS[kind][1]
    return [f"{name}.pb" for name in pieces + ("round", "input_round")] + ["manifest.json"]


def write_form(form: Form, out_dir: str) -> dict:
    """Writes each piece as `PIECE.pb`, the re-derived round as `round.pb` and
    `manifest.json` (form, types, sizes, sha256 of each file); returns the manifest."""
    os.makedirs(out_dir, exist_ok=True)
    files = dict(form.pieces, round=form.round)
    if form.input_round is not None:
        files["input_round"] = form.input_round
    entries = {}
    for name, proto in files.items():
        data = proto.SerializeToString()
        path = os.path.join(out_dir, f"{name}.pb")
        with open(path, "wb") as f:
            f.write(data)
        entries[name] = {"file": f"{name}.pb", "bytes": len(data),
                         "sha256": hashlib.sha256(data).hexdigest(),
                         "type": form.piece_types.get(name, form.type_signature)}
        if name == "input_round":  # the round before any FCP wrapping: its own type
            entries[name]["type"] = str(federated_language.FunctionType.from_proto(
                proto.type))
    manifest = {"form": form.name, "type_signature": form.type_signature,
                "pieces": list(form.pieces), "files": entries,
                "tff_build_seconds": form.seconds}
    if form.features is not None:  # a Federated Compute form: what its examples hold
        manifest["for"] = "fcp"
        manifest["features"] = [{"name": f.name, "dtype": f.dtype.name,
                                 "shape": list(f.shape), "list": f.kind}
                                for f in form.features]
        manifest["state_codes"] = form.state_codes
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return manifest


# ---------------------------------------------------------------------------- running


def run_daf(form: Form, state: Any, client_data: Sequence[Any], backend=None):
    """One round of a DistributeAggregateForm on fax_bridge's runtime, piece by piece.

    `state` is the SERVER member (arrays/structs), `client_data` one member per client.
    `backend` is a `ClientsBackend` (e.g. a fleet's); default in process. Returns
    `(new_state, output)` as runtime values.
    """
    from fax_bridge.runtime.interpreter import evaluate

    if form.kind != "daf":
        raise ExportError(f"run_daf runs a DistributeAggregateForm, not a {form.name}")
    p = form.pieces
    n = len(client_data)
    prepared = evaluate(p["server_prepare"], state, backend, num_clients=n)
    sent = evaluate(p["server_to_client_broadcast"], prepared[0], backend, num_clients=n)
    work = evaluate(p["client_work"], [list(client_data), sent], backend)
    aggregated = evaluate(p["client_to_server_aggregation"], [prepared[1], work], backend)
    result = evaluate(p["server_result"], [prepared[1], aggregated], backend)
    return result[0], result[1]
