"""The public federated building blocks (FAX names) and the `program` decorator.

Inside a function decorated with `@fax_bridge.program(clients=N)`:

- SERVER values are plain arrays (pytrees of them);
- CLIENTS values carry a leading axis of size N on every leaf;
- `federated_broadcast` sends SERVER to CLIENTS; `federated_sum`, `federated_mean`,
  `federated_weighted_mean` aggregate CLIENTS to SERVER; `federated_decode_sum(decode,
  value)` sums members decoded at the server (what crosses is the encoded member);
- `federated_map_clients(fn, arg)` applies `fn` to each client's member,
  `federated_map_server(fn, arg)` applies it at the server; a tuple `arg` is unpacked
  into `fn`.
"""

from __future__ import annotations

import contextvars
import functools
import os
import traceback
from typing import Any, Callable, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge import local as _local
from fax_bridge import primitives as P
from fax_bridge.errors import PlacementError

_CURRENT_CLIENTS: contextvars.ContextVar[Optional[int]] = contextvars.ContextVar(
    "fax_bridge_clients", default=None)

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))


def user_location() -> str:
    """`file:line (function)` of the innermost stack frame outside fax_bridge and jax."""
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path.startswith(_PACKAGE_DIR) or f"{os.sep}jax{os.sep}" in path \
                or f"{os.sep}jax_" in path or "contextlib" in path:
            continue
        return f"{frame.filename}:{frame.lineno} ({frame.name})"
    return "<unknown location>"


def current_clients(op: str) -> int:
    """The cardinality of the enclosing program; a clear error outside of one."""
    n = _CURRENT_CLIENTS.get()
    if n is None:
        raise PlacementError(
            f"{op} was called outside a federated program (at {user_location()}). Decorate "
            "the function with @fax_bridge.program(clients=N) so the number of clients is "
            "known.")
    return n


class Program:
    """A federated program: a function whose federated operations use `clients` members."""

    def __init__(self, fn: Callable, clients: int):
        self.fn = fn
        self.clients = clients
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        outer = _CURRENT_CLIENTS.get()
        if outer is not None and outer != self.clients:
            raise PlacementError(
                f"program {getattr(self.fn, '__name__', self.fn)!r} declares clients="
                f"{self.clients} but is called inside a program with clients={outer} (at "
                f"{user_location()}). Nested programs must use the same number of clients.")
        token = _CURRENT_CLIENTS.set(self.clients)
        try:
            return self.fn(*args, **kwargs)
        finally:
            _CURRENT_CLIENTS.reset(token)

    def __repr__(self) -> str:
        return f"<fax_bridge.Program {getattr(self.fn, '__name__', '?')} clients={self.clients}>"


def _validate_cardinality(clients: Any) -> int:
    if isinstance(clients, bool) or not isinstance(clients, (int, np.integer)) or clients < 1:
        raise ValueError(
            f"the number of clients must be a positive integer, got {clients!r}; write "
            "@fax_bridge.program(clients=8) or placements={'clients': 8}.")
    return int(clients)


def program(fn: Optional[Callable] = None, *, clients: Optional[int] = None,
            placements: Optional[Mapping[str, int]] = None):
    """Decorates a federated program: `@program(clients=N)` or `@program(placements={...})`."""
    if placements is not None:
        if clients is not None:
            raise ValueError("give either clients=N or placements={'clients': N}, not both.")
        unknown = set(placements) - {"clients"}
        if unknown or "clients" not in placements:
            raise ValueError(
                f"placements must be {{'clients': N}}; got keys {sorted(placements)}. "
                "SERVER has one member and needs no entry.")
        clients = placements["clients"]
    if clients is None:
        raise ValueError("program needs the number of clients: @fax_bridge.program(clients=N).")
    n = _validate_cardinality(clients)
    if fn is None:
        return lambda f: Program(f, n)
    return Program(fn, n)


# --------------------------------------------------------------------------- helpers


def _leaves_with_paths(tree, op: str, what: str):
    leaves, treedef = jax.tree_util.tree_flatten_with_path(tree)
    arrays = []
    for path, leaf in leaves:
        if isinstance(leaf, (jax.Array, np.ndarray, np.generic, int, float, complex, bool)) \
                or isinstance(leaf, jax.core.Tracer):
            arrays.append(jnp.asarray(leaf))
        else:
            raise PlacementError(
                f"{op}: {what}{jax.tree_util.keystr(path)} is a {type(leaf).__name__}, not "
                f"an array (at {user_location()}). Federated values are pytrees of arrays.")
    return [p for p, _ in leaves], arrays, treedef


def _check_clients_leaves(op: str, what: str, paths, arrays, n: int) -> None:
    for path, x in zip(paths, arrays):
        if x.ndim == 0 or x.shape[0] != n:
            raise PlacementError(
                f"{op}: {what}{jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, but a "
                f"CLIENTS value needs a leading axis of size {n} (the program's clients) (at "
                f"{user_location()}). If this is a SERVER value, send it to the clients with "
                "federated_broadcast first.")


# --------------------------------------------------------------------------- public API


def federated_broadcast(x):
    """SERVER -> CLIENTS: every client receives the same value (all_equal)."""
    n = current_clients("federated_broadcast")
    paths, arrays, treedef = _leaves_with_paths(x, "federated_broadcast", "value")
    out = [_local.constrain_clients(P.federated_broadcast_p.bind(a, clients=n)) for a in arrays]
    return jax.tree_util.tree_unflatten(treedef, out)


def _aggregate(prim, op: str, x):
    n = current_clients(op)
    paths, arrays, treedef = _leaves_with_paths(x, op, "value")
    _check_clients_leaves(op, "value", paths, arrays, n)
    return jax.tree_util.tree_unflatten(treedef, [prim.bind(a, clients=n) for a in arrays])


def federated_sum(x):
    """CLIENTS -> SERVER: the sum over clients of each leaf."""
    return _aggregate(P.federated_sum_p, "federated_sum", x)


def federated_mean(x):
    """CLIENTS -> SERVER: the unweighted mean over clients of each leaf."""
    return _aggregate(P.federated_mean_p, "federated_mean", x)


def federated_weighted_mean(x, weights):
    """CLIENTS -> SERVER: sum_i w_i x_i / sum_i w_i per leaf; `weights` has shape (clients,)."""
    op = "federated_weighted_mean"
    n = current_clients(op)
    paths, arrays, treedef = _leaves_with_paths(x, op, "value")
    _check_clients_leaves(op, "value", paths, arrays, n)
    w = jnp.asarray(weights)
    if w.shape != (n,):
        raise PlacementError(
            f"{op}: weights have shape {tuple(w.shape)}, expected ({n},): one weight per "
            f"client (at {user_location()}).")
    if not jnp.issubdtype(w.dtype, jnp.floating):
        w = w.astype(jnp.result_type(float))
    out = []
    for path, a in zip(paths, arrays):
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise PlacementError(
                f"{op}: value{jax.tree_util.keystr(path)} has dtype {a.dtype}; a weighted mean "
                f"needs floating-point values (at {user_location()}). Cast with .astype().")
        out.append(P.federated_weighted_mean_p.bind(a, w, clients=n))
    return jax.tree_util.tree_unflatten(treedef, out)


def federated_decode_sum(decode: Callable, value):
    """CLIENTS -> SERVER: the sum over clients of `decode(member)`, decoded at the server.

    Each client's member of `value` (e.g. packed integer codes and their scales) crosses
    to the server unchanged; the server decodes every member with `decode` (a function
    of the member alone, tuples unpacked) and sums the decoded pytrees. Exported as TFF
    `federated_aggregate`. Not differentiable.
    """
    op = "federated_decode_sum"
    n = current_clients(op)
    if not callable(decode):
        raise TypeError(f"{op}: the first argument must be a function, got "
                        f"{type(decode).__name__}.")
    unpack = isinstance(value, tuple)
    paths, arrays, treedef = _leaves_with_paths(value, op, "value")
    _check_clients_leaves(op, "value", paths, arrays, n)
    out_store = {}

    def flat_decode(*member_leaves):
        member = jax.tree_util.tree_unflatten(treedef, list(member_leaves))
        result = decode(*member) if unpack else decode(member)
        _, out_arrays, out_tree = _leaves_with_paths(result, op, "decoded value")
        out_store["tree"] = out_tree
        return out_arrays

    outs = P.decode_sum_bind(flat_decode, [_local.constrain_clients(a) for a in arrays], n,
                             name=getattr(decode, "__name__", type(decode).__name__))
    return jax.tree_util.tree_unflatten(out_store["tree"], outs)


def _federated_map(fn: Callable, arg, placement: str, op: str):
    n = current_clients(op)
    if not callable(fn):
        raise TypeError(f"{op}: the first argument must be a function, got {type(fn).__name__}.")
    unpack = isinstance(arg, tuple)
    paths, arrays, treedef = _leaves_with_paths(arg, op, "arg")
    if placement == P.CLIENTS:
        _check_clients_leaves(op, "arg", paths, arrays, n)
        arrays = [_local.constrain_clients(a) for a in arrays]
    out_store = {}

    def flat_member_fn(*member_leaves):
        member = jax.tree_util.tree_unflatten(treedef, list(member_leaves))
        result = fn(*member) if unpack else fn(member)
        out_paths, out_arrays, out_tree = _leaves_with_paths(result, op, "result")
        out_store["tree"] = out_tree
        return out_arrays

    name = getattr(fn, "__name__", type(fn).__name__)
    outs = P.map_bind(flat_member_fn, arrays, placement, n, name=name)
    if placement == P.CLIENTS:
        outs = [_local.constrain_clients(o) for o in outs]
    return jax.tree_util.tree_unflatten(out_store["tree"], outs)


def federated_map_clients(fn: Callable, arg):
    """Applies `fn` to each client's member of the CLIENTS value `arg` (tuples unpacked)."""
    return _federated_map(fn, arg, P.CLIENTS, "federated_map_clients")


def federated_map_server(fn: Callable, arg):
    """Applies `fn` at the server to the SERVER value `arg` (tuples unpacked)."""
    return _federated_map(fn, arg, P.SERVER, "federated_map_server")
