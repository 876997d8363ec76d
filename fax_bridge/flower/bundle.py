"""A round for Flower: built from a program, kept as `round.json` inside a Flower app.

`build_round(fn, *args, placements=...)` exports a round `(state, client_data) ->
(new_state, output)` in the production forms' type (`tff.forms.round_proto`, which
refuses intrinsics no form holds by name) and splits it with
`rounds.round_split.split_round(secure=True)`; a round that cannot be split is refused
too, and so are a round that asks its clients more than once or keeps state at them
and a program of other than two arguments (`flower.round_refusals`: `refuse_phased`,
`refuse_arity`), each named with the fix. The round's tensors as a LiteRT model are
named by pytree path (`aggregands`, `argument_names`: `carried.pack`). Its secure sums
(`federated_secure_sum_bitwidth`, `federated_secure_sum`, and so
`federated_secure_modular_sum` and `federated_secure_mean`, built on the bitwidth sum)
are aggregations of the split that Flower's SecAgg+ sums (`flower/secagg.py`); one that
SecAgg+ cannot carry exactly however the example's clients are split over SuperNodes is
refused by name (`secagg.check_build`). `FlowerRound` holds the round, its split and the
initial server state (the example state's tensors, depth first over the state's type).

A Flower app bundle carries only text files (.py, .toml, .md, .yaml, .json) up to
10 MB, so `round.json` holds the proto base64-encoded and the state's tensors likewise.
`read_round(folder)` reads it back where the ServerApp and ClientApps run, as a file
another party may have written (a regular file within the bundle's size, bounded JSON,
every field checked and named in a refusal), parsed once per content. It also
records the program's output treedef, as jit gives it (`result_structure.
structure_to_json`), which `flower_results.load_result` rebuilds the run's result with. Flower hands
the whole bundle to every ClientApp process it starts (one a message), which hashes,
unpacks and checks it before running, and the ClientApps never use the state; so a
state over `MAX_STATE_IN_BUNDLE_BYTES` (`state_in_bundle`: a model of more than 16k
float32 parameters) is written to an .npz of its own instead (`write_round(...,
state_path=...)`, `write_state`), which the ServerApp reads from the path its run
config's `app-state` names (`read_state`; a state of the user's own is named by
`initial-state` instead); the nodes never receive it.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
import threading
from typing import Any, Callable, Optional, Sequence

import numpy as np
from federated_language.common_libs import structure

from fax_bridge.system import private_files
from fax_bridge.errors import ComputationError, ExportError, FleetError
from fax_bridge.flower.round_refusals import refuse_arity, refuse_phased
from fax_bridge.rounds import round_split
from fax_bridge.rounds import wire
from fax_bridge.runtime import backend, interpreter, result_structure, values

FORMAT = "fax_bridge.flower.round.v1"
FILE_NAME = "round.json"
LITERT_DIR = "litert"  # beside round.json: the LiteRT models the app carries (`carried`)
MAX_BUNDLE_BYTES = 10 * 1024 * 1024  # what Flower accepts in an app bundle
# the largest state (its tensors' bytes) an app carries in its bundle: a larger one
# would only slow every ClientApp's start, so it goes beside the app (module docstring)
MAX_STATE_IN_BUNDLE_BYTES = 64 * 1024


@dataclasses.dataclass
class FlowerRound:
    """A round computation, its split and its initial server state."""

    proto: Any
    state: list  # the initial state's tensors, depth first
    # True when round.json holds only the state's layout (`state` then holds zeros of
    # it) and the run config's app-state names the file (`read_state`)
    state_outside: bool = False
    state_sha256: Optional[str] = None  # that file's, as written with the app
    # {file name: sha256} of the LiteRT models written with the app (`carried.find`
    # refuses any other); None for a round not read from an app
    litert_models: Optional[dict] = None
    # the aggregands' leaf paths as the program passed them (`pytree_names.
    # recording_aggregands`), which name the carried model's outputs; None when read
    aggregands: Optional[list] = None
    # the names of the round parameter's two elements (the program's state argument and
    # client data argument, each where it is one argument), which name the carried
    # model's inputs; None when read
    argument_names: Optional[list] = None
    # the jax treedef of the program's output as jit gives it (`build_round`), or as
    # round.json recorded it (`result_structure.structure_from_json`); None for an app
    # written before round.json recorded it
    result_structure: Optional[Any] = None
    # the traced program (`tracing.trace`) the round was built from, which parity checks
    # bound the rounding of (`parity.rounding.evaluation_bounds`); None when read
    traced: Optional[Any] = None

    @functools.cached_property
    def prepared(self) -> interpreter.Prepared:
        return interpreter.prepare(self.proto)

    @functools.cached_property
    def split(self) -> round_split.RoundSplit:
        split = round_split.split_round(self.proto, secure=True)
        if split is None:
            raise ExportError(
                f"the round {self.prepared.type} cannot be split into one broadcast, one "
                "client part and aggregations (sum, mean, weighted mean, min, max, secure "
                "sums with a literal bound) whose inputs come from the clients, so no "
                "Flower round can run it; express its aggregations with those")
        if len(self.parameter_items) != 2 or split.client_inputs != [1]:
            raise ExportError(
                f"a Flower round takes (server_state, client_data), but this one has the "
                f"parameter {self.prepared.parameter}")
        return split

    @property
    def parameter_items(self) -> list:
        return list(self.prepared.parameter.items())

    @property
    def state_type(self):
        """The member type of the server state (the parameter's first element)."""
        return self.parameter_items[0][1].member

    def state_value(self, tensors: list) -> Any:
        """The state as a runtime value, from its tensors (depth first)."""
        return backend.from_leaves(self.state_type, [np.asarray(t) for t in tensors])

    def server_arg(self, state: Any) -> structure.Struct:
        """The round's runtime argument on the server: the state, no client values."""
        (state_name, _), (data_name, _) = self.parameter_items
        return structure.Struct([(state_name, state), (data_name, None)])

    @functools.cached_property
    def sent_type(self):
        """The type of the broadcast values the client part receives: a struct of the
        members of the server locals the round broadcasts."""
        import federated_language

        from fax_bridge.runtime import local_eval

        server = dict(self.split.server_locals)
        members = []
        for name in self.split.broadcasts:
            type_ = local_eval.parse_type(server[name].type)
            if isinstance(type_, federated_language.FederatedType):
                type_ = type_.member
            members.append((None, type_))
        return federated_language.StructType(members)


def build_round(fn: Callable, *args: Any, placements: Any = None,
                clients: Optional[int] = None) -> FlowerRound:
    """The Flower round of a program and its example arguments (module docstring)."""
    from fax_bridge.tff import forms

    from fax_bridge.language import pytree_names
    from fax_bridge.litert import manifest

    if len(args) > 2:  # several trips or client state first: it runs elsewhere
        refuse_phased(fn, args, placements, clients)
    refuse_arity(fn, args, placements)
    try:
        with pytree_names.recording_aggregands() as record:
            proto, comp = forms.round_proto(manifest.fresh(fn), *args,
                                            placements=placements, clients=clients)
    except ExportError:
        refuse_phased(fn, args, placements, clients)  # several trips, client state
        raise
    prepared = interpreter.prepare(proto)
    bound = values.bind_arguments(prepared.parameter, args, {})
    state = bound.runtime_value()[0]
    made = FlowerRound(proto=proto, state=backend.leaves(backend.as_numpy(state)),
                       aggregands=record, argument_names=_element_names(fn, comp),
                       result_structure=comp.out_tree, traced=comp)
    made.split  # refuses what cannot be split, here rather than on the nodes
    from fax_bridge.flower import secagg

    secagg.check_build(made.split, bound.num_clients() or 0)  # what SecAgg+ cannot carry
    return made


def _element_names(fn: Callable, comp) -> list:
    """The names of a forms-type round's `<server_state, client_data>`: the program's
    SERVER argument and CLIENTS argument, each where it is the only one so placed, else
    `server_state` / `client_data` (its members then positional)."""
    import jax

    from fax_bridge.language.placements import Placement
    from fax_bridge.tff import export

    tree = jax.tree_util.tree_unflatten(comp.in_tree, list(range(len(comp.in_avals))))
    names = export.argument_names(fn, len(tree))
    out = []
    for placement, default in ((Placement.SERVER, "server_state"),
                               (Placement.CLIENTS, "client_data")):
        mine = [names[i] for i, sub in enumerate(tree) if any(
            comp.in_placements[j] is placement for j in jax.tree_util.tree_leaves(sub))]
        out.append(mine[0] if len(mine) == 1 and mine[0] else default)
    return out


def _tensor_json(t: np.ndarray) -> dict:
    t = np.asarray(t)
    return {"dtype": wire.dtype_name(t.dtype), "shape": list(t.shape),
            "base64": base64.b64encode(t.tobytes()).decode()}


def _tensor_from_json(entry: Any, where: str, data: bool = True) -> np.ndarray:
    """A tensor `_tensor_json` wrote, read from the field `where` names: its dtype a
    number type, its shape whole numbers, its bytes exactly the shape's; with `data`
    False the entry is [dtype, shape] (`state-layout`) and the tensor zeros of it
    (a read-only view, whatever the shape claims, never allocated)."""
    j = private_files
    if data:
        j.json_value(entry, "object", where)
        name, shape = (j.json_field(entry, "dtype", "str", where),
                       j.json_field(entry, "shape", "list", where))
    else:
        if not (isinstance(entry, list) and len(entry) == 2):
            raise j.HandedFileError(f"{where} is {j.shown_json(entry)}, expected "
                                    "[dtype, shape]")
        name, shape = (j.json_value(entry[0], "str", f"{where}'s dtype"),
                       j.json_value(entry[1], "list", f"{where}'s shape"))
    try:
        dtype = wire.dtype_from_name(name)
    except FleetError as e:
        raise j.HandedFileError(f"{where}: {e}") from None
    if len(shape) > 32:
        raise j.HandedFileError(f"{where}'s shape has {len(shape)} dimensions, over 32")
    shape = tuple(j.json_value(d, "int", f"{where}'s shape", low=0, high=1 << 62)
                  for d in shape)
    if not data:
        return np.broadcast_to(np.zeros((), dtype), shape)
    raw = j.json_field(entry, "base64", "str", where)
    try:
        raw = base64.b64decode(raw, validate=True)
    except ValueError:
        raise j.HandedFileError(f"{where}'s base64 is not base64") from None
    if len(raw) != math.prod(shape) * dtype.itemsize:
        raise j.HandedFileError(f"{where} holds {len(raw)} bytes, where {dtype.name}"
                                f"{list(shape)} takes {math.prod(shape) * dtype.itemsize}")
    return np.frombuffer(raw, dtype).reshape(shape).copy()


def write_state(tensors: list, path: str) -> str:
    """Writes a state's tensors (depth first) as an .npz (keys "0", "1", ...; dtypes
    numpy cannot save as their bytes, their names in "dtypes"); returns its path."""
    arrays = {str(i): np.asarray(t) for i, t in enumerate(tensors)}
    names = [wire.dtype_name(np.asarray(t).dtype) for t in tensors]
    for key, value in arrays.items():
        if _needs_bytes(value.dtype):
            arrays[key] = value.reshape(value.shape + (1,)).view(np.uint8)
    buffer = io.BytesIO()
    np.savez(buffer, dtypes=np.array(names), **arrays)
    private_files.private_dir(os.path.dirname(os.path.abspath(path)), 0o755)
    return private_files.write_file(path, buffer.getvalue(), 0o644)


def state_sha256(path: str) -> str:
    """The sha256 of the state file `write_state` wrote at `path`, read back through
    `private_files` (a regular file of ours, never through a link)."""
    from fax_bridge.runtime import npz_keys

    return hashlib.sha256(private_files.read_regular(
        path, npz_keys.MAX_NPZ_FILE_BYTES, ours=True, what="the state file")).hexdigest()


def _needs_bytes(dtype: np.dtype) -> bool:
    """Whether `write_state` keeps tensors of `dtype` as their bytes (uint8, one more
    axis): a dtype numpy cannot save as itself (bfloat16, float8 and such)."""
    return dtype.name != np.dtype(dtype.str).name or dtype.kind == "V"


def read_state(path: str, like: list, sha256: Optional[str] = None,
               key: str = "initial-state") -> list:
    """The tensors `write_state` wrote at `path`, checked against the dtypes and shapes
    of `like` (the state's tensors as the round expects them).

    The file must be a regular file (a link is not followed, a FIFO never waited on),
    its arrays no larger than `like`'s (checked from each header before anything is
    allocated: `npz_keys.read_npz`), and each entry the dtype and shape the round
    expects: a tensor is taken as its bytes only where `write_state` writes it so
    (uint8 of its dtype's width), never another dtype relabelled. `sha256`: the digest
    `write_round` recorded for the file, checked first. `key`: the run config's key that
    named the file (`initial-state`, a state of the user's own, or `app-state`, the one
    written with the app), which every refusal names. A refusal names the entry, what
    the round expects and what the file holds.
    """
    from fax_bridge.runtime import npz_keys

    fix = ("write it with `fax-bridge flower` (initial_state.npz beside the app), and "
           f"name that file in the run config's {key}")
    want = [(np.asarray(t).dtype, tuple(np.shape(t))) for t in like]
    room = sum(math.prod(shape) * max(dtype.itemsize, 1) for dtype, shape in want)
    room += 64 * (len(want) + 1)  # the dtypes' names
    try:
        arrays = npz_keys.read_npz(path, what=key, follow_links=False,
                                   max_bytes=room, sha256=sha256, fix=fix)
    except FileNotFoundError:
        raise ExportError(f"{key} {path}: no such file; {fix}") from None
    except (ComputationError, PermissionError) as e:
        raise ExportError(str(e)) from None
    keys = ["dtypes"] + [str(i) for i in range(len(want))]
    if sorted(arrays) != sorted(keys):
        raise ExportError(f"{key} {path} holds the entries {sorted(arrays)[:12]}; "
                          f"the round's state has {len(want)} tensors (entries "
                          f"{keys[:12]}): it was written for another round; {fix}")
    names = arrays["dtypes"]
    if names.dtype.kind != "U" or names.shape != (len(want),):
        raise ExportError(f"{key} {path}: entry 'dtypes' is {names.dtype.name}"
                          f"{list(names.shape)}, expected {len(want)} dtype names; {fix}")
    found = []
    for i, ((dtype, shape), name) in enumerate(zip(want, names)):
        value = arrays[str(i)]
        expected = f"{wire.dtype_name(dtype)}{list(shape)}"
        held = f"{str(name)!r} labelling {value.dtype.name}{list(value.shape)}"
        if str(name) != wire.dtype_name(dtype):
            raise ExportError(f"{key} {path}: entry '{i}' is {held}, but the "
                              f"round's state expects {expected} there: it was written "
                              f"for another round; {fix}")
        if value.dtype == dtype and value.shape == shape:
            found.append(value)
        elif (_needs_bytes(dtype) and value.dtype == np.uint8
              and value.shape == shape + (dtype.itemsize,)):
            found.append(value.view(dtype).reshape(shape))
        else:
            raise ExportError(f"{key} {path}: entry '{i}' is {held}, but the "
                              f"round's state expects {expected} there (never "
                              f"reinterpreted): it was written for another round; {fix}")
    return found


def state_in_bundle(made: FlowerRound) -> bool:
    """Whether the app carries `made`'s initial state in its bundle: only a state of at
    most `MAX_STATE_IN_BUNDLE_BYTES`; a larger one goes to an .npz (`write_state`)."""
    return sum(np.asarray(t).nbytes for t in made.state) <= MAX_STATE_IN_BUNDLE_BYTES


def write_round(made: FlowerRound, folder: str, state_path: Optional[str] = None,
                models: Sequence = ()) -> str:
    """Writes `round.json` into `folder`; returns its path. With `state_path`, the
    initial state goes to that .npz instead (`write_state`) and `round.json` holds only
    its tensors' dtypes and shapes and the file's sha256. `models`: the LiteRT models
    the app carries (`carried.pack`'s pairs), whose sha256 `round.json` records. Refuses
    a round whose file would not fit in a Flower app bundle."""
    from fax_bridge.rounds import checkpoint

    text = json.dumps({
        "format": FORMAT,
        "type": str(made.prepared.type),
        "program": checkpoint.program_fingerprint(made.proto),
        "round": base64.b64encode(made.proto.SerializeToString(deterministic=True)).decode(),
        "state": [_tensor_json(t) for t in made.state] if state_path is None else None,
        "state-layout": [[wire.dtype_name(np.asarray(t).dtype), list(np.shape(t))]
                         for t in made.state],
        "litert-models": {name: hashlib.sha256(model.encode()).hexdigest()
                          for name, model in models},
        "result-structure": None if made.result_structure is None else
        result_structure.structure_to_json(made.result_structure),
    })
    if len(text) + 90 > MAX_BUNDLE_BYTES:  # with the state file's sha256
        raise ExportError(
            f"the round and its initial state take {len(text)} bytes as {FILE_NAME}, over "
            f"the {MAX_BUNDLE_BYTES} bytes a Flower app bundle may hold; make the state "
            "smaller or load it on the server from a file of its own (write_round's "
            "state_path; `fax-bridge flower` does so by itself)")
    if state_path is not None:
        data = json.loads(text)
        data["state-sha256"] = state_sha256(write_state(made.state, state_path))
        text = json.dumps(data)
    private_files.private_dir(folder, 0o755)
    return private_files.write_file(os.path.join(folder, FILE_NAME), text, 0o644)


def models_dir(folder: str) -> str:
    """Where the app whose `round.json` is in `folder` carries its LiteRT models
    (`fax_bridge.litert.carried`; `fax-bridge flower ... --litert` writes them)."""
    return os.path.join(folder, LITERT_DIR)


_READ: "collections.OrderedDict[str, FlowerRound]" = collections.OrderedDict()
_READ_LIMIT = 4
_read_lock = threading.Lock()


def read_round(folder: str) -> FlowerRound:
    """The round `write_round` wrote into `folder`. The file is read as another
    party's (`private_files.read_json`: a regular file of at most `MAX_BUNDLE_BYTES`,
    bounded JSON), each field checked (`_round_from_json`); an `ExportError` names the
    file and the field. The file is read on every call and its round parsed once per
    content (kept by the bytes' sha256, the last 4), so a file written again is read
    again."""
    path = os.path.join(folder, FILE_NAME)
    fix = "write it again with `fax-bridge flower`"
    try:
        raw = private_files.read_regular(path, MAX_BUNDLE_BYTES, what="the Flower round",
                                         fix=fix)
    except OSError as e:
        raise ExportError(f"{path} is not a fax_bridge Flower round ({e}); {fix}") from None
    digest = hashlib.sha256(raw).hexdigest()
    with _read_lock:
        if digest in _READ:
            _READ.move_to_end(digest)
            return _READ[digest]
    try:
        made = _round_from_json(private_files.parse_json(
            raw, path, result_structure.MAX_JSON_DEPTH + 4, fix), path)
    except (ValueError, TypeError) as e:  # HandedFileError and the proto's own refusals
        raise ExportError(f"{path} is not a fax_bridge Flower round ({e}); {fix}") from None
    with _read_lock:
        _READ[digest] = made
        while len(_READ) > _READ_LIMIT:
            _READ.popitem(last=False)
    return made


read_round.cache_clear = _READ.clear  # as a functools cache offers it


def _round_from_json(data: Any, path: str) -> FlowerRound:
    """The round of `round.json`'s JSON `data` read from `path`, each field checked."""
    j = private_files
    j.json_value(data, "object", path)
    if j.json_field(data, "format", "str", path) != FORMAT:
        raise ValueError(f"field 'format' is {j.shown_json(data['format'])}, expected "
                         f"{FORMAT!r}")
    encoded = j.json_field(data, "round", "str", path)
    try:
        proto = interpreter.as_proto(base64.b64decode(encoded, validate=True))
    except Exception as e:  # noqa: BLE001 - base64's and the proto parser's refusals
        raise ValueError(f"field 'round' holds no computation proto ({str(e)[:200]})") \
            from None
    stored = j.json_field(data, "state", "list", path, none=True)
    if stored is None:  # outside the bundle: its layout, for read_state
        layout = j.json_field(data, "state-layout", "list", path)
        state = [_tensor_from_json(e, f"{path}: field 'state-layout'[{i}]", data=False)
                 for i, e in enumerate(layout)]
    else:
        state = [_tensor_from_json(e, f"{path}: field 'state'[{i}]")
                 for i, e in enumerate(stored)]
    models = j.json_field(data, "litert-models", "object", path, default={})
    for name, digest in models.items():
        j.json_value(digest, "str", f"{path}: field 'litert-models' entry {name[:80]!r}")
    state_sha256 = j.json_field(data, "state-sha256", "str", path, none=True, default=None)
    recorded = j.json_field(data, "result-structure", "object", path, none=True,
                            default=None)
    try:
        treedef = None if recorded is None else \
            result_structure.structure_from_json(recorded)
    except ValueError as e:
        raise ValueError(f"field 'result-structure': {e}") from None
    return FlowerRound(proto=proto, state=state, state_outside=stored is None,
                       state_sha256=state_sha256, litert_models=models,
                       result_structure=treedef)
