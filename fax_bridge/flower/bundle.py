"""A round for Flower: built from a program, kept as `round.json` inside a Flower app.

`build_round(fn, *args, placements=...)` exports a round `(state, client_data) ->
(new_state, output)` in the production forms' type (`tff.forms.round_proto`, which
refuses intrinsics no form holds by name) and splits it with
`rounds.round_split.split_round(secure=True)`; a round that cannot be split is refused
too. A round that asks its clients more than once or keeps state at them is refused by
`refuse_phased`, naming the trips, what each client keeps between them, the CLIENTS
state, why a SuperNode cannot hold them (a Flower round here is one message per node,
and Flower keeps a node's `context.state` in its memory alone) and the fleet or
in-process run to use instead. The round's tensors as a LiteRT model are named by
pytree path (`aggregands`, `argument_names`: `carried.pack`). Its secure sums (`federated_secure_sum_bitwidth`,
`federated_secure_sum`, and so `federated_secure_modular_sum` and
`federated_secure_mean`, built on the bitwidth sum) are aggregations of the split that
Flower's SecAgg+ sums (`flower/secagg.py`); one that SecAgg+ cannot carry exactly
however the example's clients are split over SuperNodes is refused by name
(`secagg.check_build`). A program of other than two arguments (an algorithm's
`next(state, data, mask)`) is refused before it is exported (`refuse_arity`), naming
its parameters and the round of two arguments that wraps it (its CLIENTS arguments
folded into the client data, its other SERVER arguments into the state, which carries
them to the next round). `FlowerRound` holds the round, its split and the initial server
state (the example state's tensors, depth first over the state's type).

A Flower app bundle carries only text files (.py, .toml, .md, .yaml, .json) up to
10 MB, so `round.json` holds the proto base64-encoded and the state's tensors likewise.
`read_round(folder)` reads it back where the ServerApp and ClientApps run. It also
records the program's output treedef, as jit gives it (`result_structure.
structure_to_json`), which `flower_results.load_result` rebuilds the run's result with. Flower hands
the whole bundle to every ClientApp process it starts (one a message), which hashes,
unpacks and checks it before running, and the ClientApps never use the state; so a
state over `MAX_STATE_IN_BUNDLE_BYTES` (`state_in_bundle`: a model of more than 16k
float32 parameters) is written to an .npz of its own instead (`write_round(...,
state_path=...)`, `write_state`), which the ServerApp reads from the path its run
config names (`initial-state`, `read_state`); the nodes never receive it.
"""

from __future__ import annotations

import base64
import dataclasses
import functools
import hashlib
import io
import json
import math
import os
from typing import Any, Callable, Optional, Sequence

import numpy as np
from federated_language.common_libs import structure

from fax_bridge import private_files
from fax_bridge.errors import ComputationError, ExportError
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
    # it) and the run config's initial-state names the file (`read_state`)
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

    from fax_bridge import pytree_names
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
                       result_structure=comp.out_tree)
    made.split  # refuses what cannot be split, here rather than on the nodes
    from fax_bridge.flower import secagg

    secagg.check_build(made.split, bound.num_clients() or 0)  # what SecAgg+ cannot carry
    return made


def _element_names(fn: Callable, comp) -> list:
    """The names of a forms-type round's `<server_state, client_data>`: the program's
    SERVER argument and CLIENTS argument, each where it is the only one so placed, else
    `server_state` / `client_data` (its members then positional)."""
    import jax

    from fax_bridge.placements import Placement
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


def refuse_arity(fn: Callable, args: tuple, placements: Any = None) -> None:
    """Raises `ExportError` where `args` are not the two arguments `(state,
    client_data)` of a Flower round, naming the program's parameters, their placements
    and the round of two arguments that wraps it; returns otherwise."""
    if len(args) == 2:
        return
    from fax_bridge.tff import export

    names = [n or f"arg{i}" for i, n in enumerate(export.argument_names(fn, len(args)))]
    if isinstance(placements, (list, tuple)) and len(placements) == len(args):
        where = [str(getattr(p, "name", p)).upper() for p in placements]
        shown = ", ".join(f"{n}@{w}" for n, w in zip(names, where))
    else:
        where, shown = [], ", ".join(names)
    extra = names[1:]
    clients = [n for n, w in zip(names[1:], where[1:]) if w == "CLIENTS"] or extra
    others = [n for n in extra if n not in clients]
    name = _program_name(fn)
    head = (f"a Flower app runs rounds (state, client_data) -> (new_state, output): two "
            f"arguments, the server state and the clients' data; {name} takes "
            f"{len(args)} ({shown or 'none'})")
    if len(args) < 2:
        raise ExportError(head + "; give it the clients' data as its second argument, "
                          "placed at CLIENTS")
    raise ExportError(head + ". " + _wrapper_text(names, clients, others, name))


def _wrapper_text(names: list, clients: list, others: list, name: str) -> str:
    """`refuse_arity`'s advice: a round of two arguments that calls the program named
    `name` (parameters `names`, the first its state), its CLIENTS arguments `clients`
    folded into client_data and its other SERVER arguments `others` into the state
    (carried unchanged from round to round), with the example arguments it takes."""
    state = names[0]
    unpack = ", ".join(clients) + ("," if len(clients) == 1 else "")
    call = f"program({', '.join(names)})"
    text = ("Wrap it in a round of two arguments whose client_data holds its CLIENTS "
            f"arguments ({', '.join(clients)}: a tuple, or a dict)")
    if not others:
        return (text + f", e.g.\n    def flower_round({state}, client_data):\n"
                f"        {unpack} = client_data\n        return {call}\nwith program = "
                f"{name}, example arguments ({state}, ({unpack})) and placements "
                "(\"server\", \"clients\")")
    carried = next(c for c in ("server_state", "carried", "folded") if c not in names)
    new = next(c for c in (f"new_{state}", "new_state", "updated") if c not in names)
    folded = ", ".join([state, *others])
    kept = ", ".join(others)
    return (text + f" and whose state holds its SERVER arguments ({folded}): the "
            f"round returns {kept} beside the program's new {state}, so the next round "
            "gets them unchanged, e.g.\n"
            f"    def flower_round({carried}, client_data):\n"
            f"        {folded} = {carried}\n"
            f"        {unpack} = client_data\n"
            f"        {new}, output = {call}\n"
            f"        return ({new}, {kept}), output\n"
            f"with program = {name}, example arguments (({folded}), ({unpack})) and "
            "placements (\"server\", \"clients\")")


ELSEWHERE = (
    "Run it where each trip's client computation runs phase by phase (one LiteRT model "
    "per trip under client_runtime=\"litert\") and the clients' values stay on the "
    "devices that hold the clients: the gRPC fleet (`fax_bridge.LocalFleet(devices=N, "
    "client_runtime=\"xla\" or \"litert\")`, or `fax-bridge parity TARGET --devices N "
    "[--litert]`), or in process (`fax_bridge.in_process.run_computation(..., "
    "client_runtime=\"litert\")`)")


def _program_name(fn: Callable) -> str:
    """A round program's qualified name, led by the algorithm that made it
    (`fed_sgd.next_fn` for `fed_sgd.<locals>.next_fn`)."""
    fn = getattr(fn, "fn", fn)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return name.replace(".<locals>.", ".")


def _takes(fn: Callable, count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments (True where its
    signature cannot be read: tracing then says)."""
    import inspect

    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def refuse_phased(fn: Callable, args: tuple, placements: Any = None,
                  clients: Optional[int] = None) -> None:
    """Raises `ExportError` naming why the round of `fn` cannot run on Flower when it
    asks its clients more than once or keeps state at them (the trips and what each
    client keeps between them, the CLIENTS state, why a SuperNode cannot hold it, and
    where the round runs instead); returns for any other round."""
    from fax_bridge import tracing
    from fax_bridge.tff import export, forms

    if not _takes(fn, len(args)):  # nothing to trace: the caller's arity refusal names it
        return
    comp = tracing.trace(fn, *args, placements=placements, clients=clients)
    state_in, state_out = forms.client_state(comp)
    lines = forms.second_trips(comp)
    if not (state_in or state_out or lines):
        return
    proto = export.export_computation(comp, export.argument_names(fn, len(args)))
    maps = [m for m in round_split.client_maps(proto) if m.computes]
    why = []
    if lines or len(maps) > 1:
        trips = max((m.trip for m in maps), default=2)
        kept = [f"trip {m.trip}'s client computation ({m.local}) reads what each client "
                f"computed in trip {', '.join(map(str, m.kept_from))}"
                for m in maps if m.kept_from]
        why.append(
            f"its round asks the clients {trips} times ({'; '.join(lines[:3])}"
            f"{'; ...' if len(lines) > 3 else ''})" + (f", and {'; '.join(kept)}" if kept
                                                       else "") +
            ". A Flower round of this app is one `train` message to each SuperNode (one "
            "broadcast, one client part, its partials), and a SuperNode starts a new "
            "ClientApp process for every message: values a client keeps from one trip to "
            "the next could wait only in the node's `context.state`, which Flower holds "
            "in the SuperNode's memory alone, so this app carries no round over several "
            "messages")
    if state_in or state_out:
        named = ", ".join((state_in or state_out)[:4])
        more = len(state_in or state_out) - 4
        why.append(
            f"its round keeps state at the clients from round to round ({named}"
            f"{f' and {more} more' if more > 0 else ''} placed at CLIENTS, argument and "
            "result): each client's own values, computed from its private data. Returned "
            "as the round's result they would leave the SuperNode unaggregated, which a "
            "node of this app never does (only exact partials of aggregations leave it); "
            "kept at the node they would live in `context.state`, which Flower holds in "
            "the SuperNode's memory for one run only (gone when the node restarts, never "
            "in the run's result or checkpoint), so the round's result, which includes "
            "them, could be neither returned nor resumed")
    raise ExportError(
        f"the round {_program_name(fn)} cannot run on Flower: " + "; and ".join(why) + ". "
        + ELSEWHERE + (". Or use a one-trip variant where there is one "
                       "(fax_bridge.algorithms.fed_sgd_one_trip, "
                       "learned_server_lr_one_trip), which a Flower app runs written as "
                       "a round (state, client_data)"
                       if lines and not (state_in or state_out) else "") + ".")


def _tensor_json(t: np.ndarray) -> dict:
    t = np.asarray(t)
    return {"dtype": wire.dtype_name(t.dtype), "shape": list(t.shape),
            "base64": base64.b64encode(t.tobytes()).decode()}


def _tensor_from_json(entry: dict) -> np.ndarray:
    dtype = wire.dtype_from_name(entry["dtype"])
    shape = tuple(int(d) for d in entry["shape"])
    return np.frombuffer(base64.b64decode(entry["base64"]), dtype).reshape(shape).copy()


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


def read_state(path: str, like: list, sha256: Optional[str] = None) -> list:
    """The tensors `write_state` wrote at `path`, checked against the dtypes and shapes
    of `like` (the state's tensors as the round expects them).

    The file must be a regular file (a link is not followed, a FIFO never waited on),
    its arrays no larger than `like`'s (checked from each header before anything is
    allocated: `npz_keys.read_npz`), and each entry the dtype and shape the round
    expects: a tensor is taken as its bytes only where `write_state` writes it so
    (uint8 of its dtype's width), never another dtype relabelled. `sha256`: the digest
    `write_round` recorded for the file, checked first. A refusal names the entry, what
    the round expects and what the file holds.
    """
    from fax_bridge.runtime import npz_keys

    fix = ("write it with `fax-bridge flower` (initial_state.npz beside the app), and "
           "name that file in the run config's initial-state")
    want = [(np.asarray(t).dtype, tuple(np.shape(t))) for t in like]
    room = sum(math.prod(shape) * max(dtype.itemsize, 1) for dtype, shape in want)
    room += 64 * (len(want) + 1)  # the dtypes' names
    try:
        arrays = npz_keys.read_npz(path, what="initial-state", follow_links=False,
                                   max_bytes=room, sha256=sha256, fix=fix)
    except FileNotFoundError:
        raise ExportError(f"initial-state {path}: no such file; {fix}") from None
    except (ComputationError, PermissionError) as e:
        raise ExportError(str(e)) from None
    keys = ["dtypes"] + [str(i) for i in range(len(want))]
    if sorted(arrays) != sorted(keys):
        raise ExportError(f"initial-state {path} holds the entries {sorted(arrays)[:12]}; "
                          f"the round's state has {len(want)} tensors (entries "
                          f"{keys[:12]}): it was written for another round; {fix}")
    names = arrays["dtypes"]
    if names.dtype.kind != "U" or names.shape != (len(want),):
        raise ExportError(f"initial-state {path}: entry 'dtypes' is {names.dtype.name}"
                          f"{list(names.shape)}, expected {len(want)} dtype names; {fix}")
    found = []
    for i, ((dtype, shape), name) in enumerate(zip(want, names)):
        value = arrays[str(i)]
        expected = f"{wire.dtype_name(dtype)}{list(shape)}"
        held = f"{str(name)!r} labelling {value.dtype.name}{list(value.shape)}"
        if str(name) != wire.dtype_name(dtype):
            raise ExportError(f"initial-state {path}: entry '{i}' is {held}, but the "
                              f"round's state expects {expected} there: it was written "
                              f"for another round; {fix}")
        if value.dtype == dtype and value.shape == shape:
            found.append(value)
        elif (_needs_bytes(dtype) and value.dtype == np.uint8
              and value.shape == shape + (dtype.itemsize,)):
            found.append(value.view(dtype).reshape(shape))
        else:
            raise ExportError(f"initial-state {path}: entry '{i}' is {held}, but the "
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


@functools.lru_cache(maxsize=4)
def read_round(folder: str) -> FlowerRound:
    """The round `write_round` wrote into `folder` (read once per process)."""
    path = os.path.join(folder, FILE_NAME)
    try:
        with open(path) as f:
            data = json.load(f)
        if data.get("format") != FORMAT:
            raise ValueError(f"format {data.get('format')!r}, expected {FORMAT}")
        proto = interpreter.as_proto(base64.b64decode(data["round"]))
        if data["state"] is None:  # outside the bundle: its layout, for read_state
            state = [np.zeros(tuple(int(d) for d in shape), wire.dtype_from_name(name))
                     for name, shape in data["state-layout"]]
            outside = True
        else:
            state = [_tensor_from_json(e) for e in data["state"]]
            outside = False
        models = data.get("litert-models", {})
        if not isinstance(models, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in models.items()):
            raise ValueError("litert-models is not a map of file names to sha256")
        state_sha256 = data.get("state-sha256")
        if state_sha256 is not None and not isinstance(state_sha256, str):
            raise ValueError("state-sha256 is not a string")
        recorded = data.get("result-structure")
        treedef = None if recorded is None else \
            result_structure.structure_from_json(recorded)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{path} is not a fax_bridge Flower round ({e}); write it again "
                          "with `fax-bridge flower`") from None
    return FlowerRound(proto=proto, state=state, state_outside=outside,
                       state_sha256=state_sha256, litert_models=models,
                       result_structure=treedef)
