"""Checkpoints of server state between rounds, so a coordinator can resume after a crash.

    save("ckpt/", round_index, state, meta)   # after each round
    saved = load("ckpt/")                     # None, or a Checkpoint(round, state, meta)

`FleetRounds.run_loop(..., checkpoint_dir=)` saves after every round and resumes from
the last saved one. The new state is written to `checkpoint_dir/state.npz` atomically (a
temporary file, fsync, `os.replace`), so a crash at any moment leaves the previous or
the new checkpoint, never a torn one. A rerun with the same `checkpoint_dir` starts at
the round after the saved one; because each round's cohort depends only on the seed
and the round number, and every aggregation is exact and in a fixed order, the resumed
run ends with the same bits as an uninterrupted one.

The file holds the state's arrays (in jax's leaf order) and a JSON description of its
pytree (dicts, lists, tuples, None, other registered nodes such as NamedTuples,
dataclasses and optax states by their fields) with the text of its treedef; it is read
with `allow_pickle=False`: nothing is ever unpickled, so no class is rebuilt from the
file. `load(dir, like=state)` gives the saved state the structure of `like` (the state
the run started from) when the treedefs agree; `run_loop` does so, and a resumed run
feeds the same NamedTuples and optax states to its rounds as an uninterrupted one. A file
that is truncated or corrupt gives a `CheckpointError` naming it.

`program_fingerprint(proto)` names what a program computes (its structure, literals and
HLO without source locations); `run_loop` stores it and refuses to resume a checkpoint
made by another program, even one of the same type (another learning rate, say).
`resume(dir, meta)` is that refusal, written once: `load`, and a `CheckpointError` when
the computation, program or policy differ (`FleetRounds.run_loop`, the Flower ServerApp).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import tempfile
from typing import Any, Optional

import jax
import numpy as np
from federated_language.proto import computation_pb2
from google.protobuf import message as message_pb

from fax_bridge.system import private_files
from fax_bridge.errors import CheckpointError, ExportError, FleetError
from fax_bridge.runtime import hlo
from fax_bridge.tff.types import named_children

FILE_NAME = "state.npz"
FORMAT = "fax_bridge.checkpoint.v1"


@dataclasses.dataclass
class Checkpoint:
    """The state after round `round` (0-based), and what run it belongs to."""

    round: int
    state: Any
    meta: dict


def _encode(tree: Any, leaves: list) -> Any:
    """The JSON description of `tree`; its arrays go to `leaves` in jax's leaf order."""
    if tree is None:
        return {"none": True}
    if type(tree) is dict:
        keys = list(tree)
        if not all(isinstance(k, str) for k in keys):
            raise FleetError(f"checkpoint: dict keys must be strings, got {keys[:5]}")
        keys = sorted(keys)  # jax's order, so the leaves follow the treedef
        return {"dict": keys, "items": [_encode(tree[k], leaves) for k in keys]}
    if type(tree) in (list, tuple):
        return {"list" if isinstance(tree, list) else "tuple":
                [_encode(v, leaves) for v in tree]}
    try:
        children = named_children(tree)  # one level of jax's flattening, names as TFF's
    except ExportError as e:
        raise FleetError(f"checkpoint: {e}") from None
    if children is not None:  # a NamedTuple, dataclass, optax state, ...
        node = {"node": type(tree).__qualname__,
                "items": [_encode(child, leaves) for _, child in children]}
        names = [name for name, _ in children]
        if names and all(names):
            node["names"] = names
        return node
    array = np.asarray(tree)
    if array.dtype.kind not in "biufc":
        raise FleetError(f"checkpoint: cannot store a {array.dtype} leaf; only numeric "
                         "arrays, in pytrees (dicts, lists, tuples, NamedTuples, registered "
                         "dataclasses)")
    leaves.append(array)
    return {"leaf": len(leaves) - 1}


def program_fingerprint(proto: computation_pb2.Computation) -> str:
    """Hex sha256 of what `proto` computes, equal across processes that build it.

    Each Xla part's HLO is replaced by its location-free StableHLO text; everything else
    (structure, types, intrinsics, literals) is hashed as it is.
    """
    copy = computation_pb2.Computation()
    copy.CopyFrom(proto)
    stack = [copy]
    while stack:
        message = stack.pop()
        if isinstance(message, computation_pb2.Xla):
            text = hlo.program_text(message.hlo_module.value)
            message.hlo_module.value = hashlib.sha256(text.encode()).digest()
            continue
        for field, value in message.ListFields():
            if field.message_type is None:
                continue
            if isinstance(value, message_pb.Message):
                stack.append(value)
            else:  # a repeated field of messages
                stack.extend(value)
    return hashlib.sha256(copy.SerializeToString(deterministic=True)).hexdigest()


def _decode(node: Any, leaves: dict) -> Any:
    if not isinstance(node, dict):
        raise FleetError("checkpoint: malformed tree description")
    if "dict" in node:
        return {k: _decode(v, leaves) for k, v in zip(node["dict"], node["items"])}
    if "list" in node:
        return [_decode(v, leaves) for v in node["list"]]
    if "tuple" in node:
        return tuple(_decode(v, leaves) for v in node["tuple"])
    if "node" in node:  # without its class: a dict of its named fields, else a tuple
        items = [_decode(v, leaves) for v in node["items"]]
        names = node.get("names")
        return dict(zip(names, items)) if names else tuple(items)
    if "none" in node:
        return None
    key = f"leaf_{int(node['leaf'])}"
    if key not in leaves:
        raise FleetError(f"checkpoint: the tree names {key}, which the file lacks")
    return leaves[key]


def save(directory: "os.PathLike | str", round_index: int, state: Any,
         meta: Optional[dict] = None) -> pathlib.Path:
    """Writes the state after `round_index` atomically; returns the file's path.
    `directory` must be ours alone to write (`private_files.private_dir`): a resumed
    run reads back what another user could otherwise have swapped in."""
    directory = pathlib.Path(private_files.private_dir(directory, 0o755))
    leaves: list = []
    tree = _encode(state, leaves)
    header = {"format": FORMAT, "round": int(round_index), "tree": tree,
              "structure": str(jax.tree_util.tree_structure(state)),
              "meta": dict(meta or {})}
    arrays = {f"leaf_{i}": a for i, a in enumerate(leaves)}
    arrays["header"] = np.frombuffer(json.dumps(header).encode(), np.uint8)
    fd, tmp = tempfile.mkstemp(prefix=".state-", suffix=".npz", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        target = directory / FILE_NAME
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return target


def load(directory: "os.PathLike | str", like: Any = None) -> Optional[Checkpoint]:
    """The checkpoint in `directory`, or None when there is none yet.

    `like`: a state of the same pytree structure (e.g. the one a run started from); the
    saved state then comes back with exactly that structure (NamedTuples, dataclasses,
    optax states). Without it, or when the structures differ, it comes back in the
    generic one (dicts, lists, tuples, None; other nodes as dicts of their named fields,
    else tuples), which a computation takes all the same.
    """
    path = pathlib.Path(directory) / FILE_NAME
    if not path.exists():
        return None
    try:  # a regular file (a FIFO never blocks), headers checked before any allocation
        from fax_bridge.system import npz_files

        arrays = npz_files.read_npz(path, what="checkpoint")
        header = private_files.parse_json(bytes(arrays.pop("header")), str(path),
                                          max_depth=512)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
    except Exception as e:  # noqa: BLE001 - any failure to parse the file's bytes
        # numpy and zipfile raise many kinds for damaged bytes (BadZipFile, an unknown zip
        # version's NotImplementedError, a flipped flag's "encrypted" RuntimeError, ...)
        raise CheckpointError(
            f"checkpoint {path} is truncated or corrupt and cannot be read "
            f"({type(e).__name__}: {e}); delete it to start over") from None
    if header.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {header.get('format')!r}; "
                              f"expected {FORMAT}")
    try:
        state = _decode(header["tree"], arrays)
        if like is not None:
            wanted = jax.tree_util.tree_structure(like)
            if str(wanted) == header.get("structure"):
                state = jax.tree_util.tree_unflatten(
                    wanted, [arrays[f"leaf_{i}"] for i in range(wanted.num_leaves)])
        round_index = int(header["round"])
        meta = dict(header.get("meta", {}))
    except FleetError as e:
        raise CheckpointError(f"checkpoint {path}: {e}") from None
    except (KeyError, TypeError, ValueError, RecursionError) as e:
        raise CheckpointError(
            f"checkpoint {path} has a malformed header ({type(e).__name__}: {e}); delete "
            "it to start over") from None
    return Checkpoint(round=round_index, state=state, meta=meta)


RUN_KEYS = ("computation", "program", "policy")  # what a resumed run must share


def resume(directory: "os.PathLike | str", meta: dict, like: Any = None,
           setting: str = "checkpoint_dir") -> Optional[Checkpoint]:
    """The checkpoint in `directory` (`load`), or None when there is none yet; a
    `CheckpointError` when it belongs to another run: `meta` (the run's, as `save`
    stores it) and the checkpoint's differ in one of `RUN_KEYS`. `setting`: how the user
    names the directory, for the message."""
    saved = load(directory, like=like)
    if saved is not None:
        for key in RUN_KEYS:
            if saved.meta.get(key) != meta.get(key):
                raise CheckpointError(
                    f"checkpoint in {directory} belongs to another run (its {key} "
                    f"differs); use a fresh {setting} or delete the old one")
    return saved
