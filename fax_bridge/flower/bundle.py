"""A round for Flower: built from a program, kept as `round.json` inside a Flower app.

`build_round(fn, *args, placements=...)` exports a round `(state, client_data) ->
(new_state, output)` in the production forms' type (`tff.forms.round_proto`, which
refuses two server-client trips, client state and intrinsics no form holds, by name)
and splits it with `rounds.round_split.split_round(secure=True)`; a round that cannot
be split is refused too. Its secure sums (`federated_secure_sum_bitwidth`,
`federated_secure_sum`, and so `federated_secure_modular_sum` and
`federated_secure_mean`, built on the bitwidth sum) are aggregations of the split that
Flower's SecAgg+ sums (`flower/secagg.py`); one that SecAgg+ cannot carry exactly
however the example's clients are split over SuperNodes is refused by name
(`secagg.check_build`). `FlowerRound` holds the round, its split and the initial server
state (the example state's tensors, depth first over the state's type).

A Flower app bundle carries only text files (.py, .toml, .md, .yaml, .json) up to
10 MB, so `round.json` holds the proto base64-encoded and the state's tensors likewise.
`read_round(folder)` reads it back where the ServerApp and ClientApps run. Flower hands
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
import json
import os
from typing import Any, Callable, Optional

import numpy as np
from federated_language.common_libs import structure

from fax_bridge import private_files
from fax_bridge.errors import ExportError
from fax_bridge.rounds import round_split
from fax_bridge.rounds import wire
from fax_bridge.runtime import backend, interpreter, values

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

    proto, _ = forms.round_proto(fn, *args, placements=placements, clients=clients)
    prepared = interpreter.prepare(proto)
    bound = values.bind_arguments(prepared.parameter, args, {})
    state = bound.runtime_value()[0]
    made = FlowerRound(proto=proto, state=backend.leaves(backend.as_numpy(state)))
    made.split  # refuses what cannot be split, here rather than on the nodes
    from fax_bridge.flower import secagg

    secagg.check_build(made.split, bound.num_clients() or 0)  # what SecAgg+ cannot carry
    return made


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
        if value.dtype.name != np.dtype(value.dtype.str).name or value.dtype.kind == "V":
            arrays[key] = value.reshape(value.shape + (1,)).view(np.uint8)
    private_files.private_dir(os.path.dirname(os.path.abspath(path)), 0o755)
    with private_files.atomic_file(path, 0o644) as f:
        np.savez(f, dtypes=np.array(names), **arrays)
    return path


def read_state(path: str, like: list) -> list:
    """The tensors `write_state` wrote at `path`, checked against the dtypes and shapes
    of `like` (the state's tensors as the round expects them)."""
    try:
        with np.load(path, allow_pickle=False) as f:
            names = [str(n) for n in f["dtypes"]]
            found = []
            for i, name in enumerate(names):
                value = np.asarray(f[str(i)])
                dtype = wire.dtype_from_name(name)
                if value.dtype != dtype:
                    value = value.view(dtype).reshape(value.shape[:-1])
                found.append(value)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"initial-state {path} cannot be read as a round's initial state "
                          f"({type(e).__name__}: {e}); write it with `fax-bridge flower` "
                          "(initial_state.npz beside the app)") from None
    want = [(wire.dtype_name(t.dtype), tuple(t.shape)) for t in like]
    got = [(wire.dtype_name(t.dtype), tuple(t.shape)) for t in found]
    if got != want:
        raise ExportError(f"initial-state {path} holds tensors {got[:8]}; the round's state "
                          f"is {want[:8]}; it was written for another round")
    return found


def state_in_bundle(made: FlowerRound) -> bool:
    """Whether the app carries `made`'s initial state in its bundle: only a state of at
    most `MAX_STATE_IN_BUNDLE_BYTES`; a larger one goes to an .npz (`write_state`)."""
    return sum(np.asarray(t).nbytes for t in made.state) <= MAX_STATE_IN_BUNDLE_BYTES


def write_round(made: FlowerRound, folder: str, state_path: Optional[str] = None) -> str:
    """Writes `round.json` into `folder`; returns its path. With `state_path`, the
    initial state goes to that .npz instead (`write_state`) and `round.json` holds only
    its tensors' dtypes and shapes. Refuses a round whose file would not fit in a Flower
    app bundle."""
    from fax_bridge.rounds import checkpoint

    text = json.dumps({
        "format": FORMAT,
        "type": str(made.prepared.type),
        "program": checkpoint.program_fingerprint(made.proto),
        "round": base64.b64encode(made.proto.SerializeToString(deterministic=True)).decode(),
        "state": [_tensor_json(t) for t in made.state] if state_path is None else None,
        "state-layout": [[wire.dtype_name(np.asarray(t).dtype), list(np.shape(t))]
                         for t in made.state],
    })
    if len(text) > MAX_BUNDLE_BYTES:
        raise ExportError(
            f"the round and its initial state take {len(text)} bytes as {FILE_NAME}, over "
            f"the {MAX_BUNDLE_BYTES} bytes a Flower app bundle may hold; make the state "
            "smaller or load it on the server from a file of its own (write_round's "
            "state_path; `fax-bridge flower` does so by itself)")
    if state_path is not None:
        write_state(made.state, state_path)
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
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExportError(f"{path} is not a fax_bridge Flower round ({e}); write it again "
                          "with `fax-bridge flower`") from None
    return FlowerRound(proto=proto, state=state, state_outside=outside)
