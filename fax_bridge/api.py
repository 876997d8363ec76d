"""The public federated building blocks (FAX names) and the `program` decorator.

Inside a function decorated with `@fax_bridge.program(clients=N)` (or
`placements={'workers': N}`, any placement name):

- SERVER values are plain arrays (pytrees of them);
- placed values (CLIENTS) carry a leading axis of size N on every leaf;
- `federated_broadcast` sends SERVER to CLIENTS; `federated_sum`, `federated_mean`,
  `federated_weighted_mean` aggregate CLIENTS to SERVER; `federated_decode_sum(decode,
  value)` sums members decoded at the server (what crosses is the encoded member);
- `federated_map_clients(fn, arg)` applies `fn` to each client's member,
  `federated_map_server(fn, arg)` applies it at the server; a tuple `arg` is unpacked
  into `fn`.

Programs nest: a program over `workers` called inside a `federated_map_clients` function
of a program over `clients` places values at the workers of each client. The innermost
program decides the placement the operations use.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from typing import Any, Callable, Iterator, Mapping, Optional

import jax
import jax.numpy as jnp
import numpy as np

from fax_bridge.local import chunking
from fax_bridge.local import jit as _local
from fax_bridge.language import primitives as P
from fax_bridge.language import pytree_names
from fax_bridge.errors import ArgumentError, PlacementError, ProgramError, WeightError
from fax_bridge.errors import user_location  # noqa: F401 (fax_bridge.api.user_location)
from fax_bridge.local.execution import ClientsPerStep, is_unchunked
from fax_bridge.local.execution import validate as validate_clients_per_step
from fax_bridge.language.placements import (
    aggregate_refusal, declared_members, declared_placement_name, weights_refusal)

# The enclosing programs, outermost first: (placement name, number of members).
_PROGRAMS: contextvars.ContextVar[tuple] = contextvars.ContextVar(
    "fax_bridge_programs", default=())


def current_placement(op: str) -> tuple[str, int]:
    """(name, members) of the innermost enclosing program; a clear error outside of one."""
    programs = _PROGRAMS.get()
    if not programs:
        raise PlacementError(
            f"{op} was called outside a federated program (at {user_location()}). Decorate "
            "the function with @fax_bridge.program(clients=N) so the number of clients is "
            "known.")
    return programs[-1]


def current_clients(op: str) -> int:
    """The cardinality of the enclosing program; a clear error outside of one."""
    return current_placement(op)[1]


class Program:
    """A federated program: a function whose federated operations use `clients` members
    of the placement named `placement`, run `clients_per_step` members at a time when
    given (`fax_bridge.local.chunking`)."""

    def __init__(self, fn: Callable, clients: int, placement: str = P.CLIENTS,
                 clients_per_step: ClientsPerStep = None, progress: bool = False):
        self.fn = fn
        self.clients = clients
        self.placement = placement
        self.clients_per_step = validate_clients_per_step(clients_per_step, placement)
        if not isinstance(progress, bool):
            raise ProgramError(f"progress must be True or False, got {progress!r}.")
        self.progress = progress
        # fn's name and docstring, not its attributes (a program's would replace these)
        functools.update_wrapper(self, fn, updated=())

    def with_clients_per_step(self, clients_per_step: ClientsPerStep,
                              progress: Optional[bool] = None) -> "Program":
        """The same program run `clients_per_step` members at a time (None: all at once;
        "auto": the most that fit the device), showing a progress bar of each chunked
        trip with `progress=True` (None: as this program declares). The program object
        itself is left as it is; `fb.program(this, clients_per_step=k)` is the same.

        Example:
          >>> import fax_bridge as fb
          >>> total = fb.program(clients=4)(lambda x: fb.federated_sum(x))
          >>> total.with_clients_per_step(2)
          <fax_bridge.Program <lambda> clients=4 clients_per_step=2>
        """
        return Program(self.fn, self.clients, self.placement, clients_per_step,
                       self.progress if progress is None else progress)

    def chunk_size(self, *args, memory_bytes: Optional[int] = None, **kwargs) -> Optional[int]:
        """The members a step this program runs with these arguments (None: all at once):
        its `clients_per_step`, "auto" resolved (`fax_bridge.local.chunk_size`) against the
        device's memory or `memory_bytes`."""
        k = self.clients_per_step
        if k == "auto":
            k = chunking.fitting_chunk(self, args, kwargs, memory_bytes)
        return None if k is None or k >= self.clients else k

    def __call__(self, *args, **kwargs):
        with placement_context(self):
            k = self.clients_per_step
            if k is None or is_unchunked():
                return self.fn(*args, **kwargs)
            if k == "auto":
                k = chunking.fitting_chunk(self, args, kwargs)
            if k >= self.clients:
                return self.fn(*args, **kwargs)
            return chunking.run(self.fn, self.clients, self.placement, k, args, kwargs,
                                self.progress)

    def __repr__(self) -> str:
        step = "" if self.clients_per_step is None else \
            f" clients_per_step={self.clients_per_step}"
        return (f"<fax_bridge.Program {getattr(self.fn, '__name__', '?')} "
                f"{self.placement}={self.clients}{step}>")


@contextlib.contextmanager
def placement_context(program: Program) -> Iterator[None]:
    """Within this context federated operations use `program`'s placement and members
    (as inside a call of it); a nested program must agree on a shared placement name."""
    outer = _PROGRAMS.get()
    for name, n in outer:
        if name == program.placement and n != program.clients:
            raise PlacementError(
                f"program {getattr(program.fn, '__name__', program.fn)!r} declares "
                f"{program.placement}={program.clients} but is called inside a program with "
                f"{name}={n} (at {user_location()}). Nested programs must use the same "
                "number of members for one placement name; name the inner placement "
                "differently (e.g. placements={'workers': M}) to nest a new level.")
    token = _PROGRAMS.set(outer + ((program.placement, program.clients),))
    try:
        yield
    finally:
        _PROGRAMS.reset(token)


class _AsDeclared:
    """The default of an option of `program`: None / False for a new program, the
    existing value for a program given again."""

    def __repr__(self) -> str:
        return "<as declared>"


_AS_DECLARED: Any = _AsDeclared()


def program(fn: Optional[Callable] = None, *, clients: Optional[int] = None,
            placements: Optional[Mapping[str, int]] = None,
            clients_per_step: ClientsPerStep = _AS_DECLARED,
            progress: bool = _AS_DECLARED):
    """Decorates a federated program: `@program(clients=N)` or `@program(placements={name: N})`.

    The placement name is free (`clients`, `workers`, ...); a mesh axis of that name, when
    the mesh has one, splits its members over devices. One placement per program; nest
    programs for several levels.

    `fn` may be a program already (e.g. an algorithm's round, `alg.next`): the result is
    that program with the options given here applied and the others as it declared them
    (`clients` and `placements` may be left out; given, they must be its own).

    Args:
      fn: the function to decorate; omitted when the decorator is called with arguments.
      clients: the number of members of the `clients` placement.
      placements: instead of `clients`, one `{name: members}` entry naming the placement.
      clients_per_step: under `jax.jit`, run the members this many at a time (their
        aggregates accumulated chunk by chunk, so temporaries are those of this many
        members, `grad` included); "auto" picks the largest that fits the device's
        memory (`Program.chunk_size` says which); None (the default) all at once.
        Export is the same for every value; float sums may differ from the unchunked
        round's in the last bits (summation order). See `fax_bridge.local.chunking`.
      progress: show a tqdm bar of the members done in each chunked trip (off by default).

    Returns:
      A `Program` (or, without `fn`, a decorator making one): callable as the function,
      traceable, exportable. A bad count or name is a `ProgramError`.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> total
      <fax_bridge.Program total clients=3>
      >>> print(total(jnp.array([1.0, 2.0, 3.0])))
      6.0
    """
    if isinstance(fn, Program):
        return _redeclared(fn, clients, placements, clients_per_step, progress)
    name = P.CLIENTS
    if placements is not None:
        if clients is not None:
            raise ProgramError("give either clients=N or placements={'clients': N}, not both.")
        if not isinstance(placements, Mapping) or len(placements) != 1:
            raise ProgramError(
                f"placements must be one {{name: N}} entry, got {placements!r}. For several "
                "levels (clients, each with workers), call a program over "
                "placements={'workers': M} inside federated_map_clients of a program over "
                "placements={'clients': N}.")
        ((name, clients),) = placements.items()
        name = declared_placement_name(name)
    if clients is None:
        raise ProgramError("program needs the number of clients: @fax_bridge.program(clients=N).")
    n = declared_members(clients, name)
    if fn is None:
        return lambda f: program(f, placements={name: n}, clients_per_step=clients_per_step,
                                 progress=progress)
    return Program(fn, n, name, None if clients_per_step is _AS_DECLARED else clients_per_step,
                   False if progress is _AS_DECLARED else progress)


def _redeclared(existing: Program, clients: Any, placements: Any,
                clients_per_step: Any, progress: Any) -> Program:
    """`program(existing, ...)`: `existing` with the options given applied; a cohort
    other than its own is refused, naming both and the fix."""
    if clients is not None or placements is not None:
        cohort = program(existing.fn, clients=clients, placements=placements)  # checked
        name, n = cohort.placement, cohort.clients
        if (name, n) != (existing.placement, existing.clients):
            raise ProgramError(
                f"{existing!r} is already a program, over {existing.placement}="
                f"{existing.clients}, but {name}={n} was given for it. The options of an "
                "existing program may change, its cohort may not: leave clients and "
                "placements out (e.g. fb.program(alg.next, clients_per_step=16)) or build "
                f"the program for {n} members (an algorithm: its builder's clients=).")
    return Program(existing.fn, existing.clients, existing.placement,
                   existing.clients_per_step if clients_per_step is _AS_DECLARED
                   else clients_per_step,
                   existing.progress if progress is _AS_DECLARED else progress)


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


def _check_clients_leaves(op: str, what: str, paths, arrays, n: int,
                          name: str = P.CLIENTS) -> None:
    for path, x in zip(paths, arrays):
        if x.ndim == 0 or x.shape[0] != n:
            raise PlacementError(
                f"{op}: {what}{jax.tree_util.keystr(path)} has shape {tuple(x.shape)}, but a "
                f"value placed at {name!r} needs a leading axis of size {n} (the program's "
                f"{name}) (at {user_location()}). If this is a SERVER value, send it to the "
                f"{name} with federated_broadcast first.")


def _refuse_dtypes(op: str, paths, arrays) -> None:
    for path, a in zip(paths, arrays):
        refusal = aggregate_refusal(op, a.dtype)
        if refusal:
            raise PlacementError(
                f"{op}: value{jax.tree_util.keystr(path)} has dtype {a.dtype}: {refusal} "
                f"(at {user_location()})")


def _params(op: str, mesh=None) -> dict:
    """The placement parameters every federated primitive of this program carries."""
    axis, n = current_placement(op)
    where = f" (at {user_location()})"
    return dict(clients=n, axis=axis,
                mesh=_local.resolve_mesh(op, axis, n, mesh, where=where))


def _pin(x, params: dict):
    """Repeats the leading-axis constraint of a concrete mesh in the program itself, so that
    `jax.jit` lays the whole computation out over that mesh's devices even when its
    arguments are not yet placed there (constraints inside lowerings do not tell it)."""
    mesh = params["mesh"]
    if isinstance(mesh, jax.sharding.Mesh):
        return _local.place_leading(x, params["axis"], mesh)
    return x


# --------------------------------------------------------------------------- public API


def federated_broadcast(x, *, mesh=None):
    """SERVER -> CLIENTS: every client receives the same value (all_equal).

    The result's leading axis is split over the mesh axis named like the placement
    (`mesh=`, else the active mesh); its other dimensions keep `x`'s sharding.

    Args:
      x: a SERVER value (a pytree of arrays).
      mesh: the mesh to split the result over; default the active one, if any.

    Returns:
      The CLIENTS value: every leaf with a leading axis of the program's members.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def send(w):
      ...     return fb.federated_broadcast(w)
      >>> print(send(jnp.float32(2.0)))
      [2. 2.]
    """
    params = _params("federated_broadcast", mesh)
    paths, arrays, treedef = _leaves_with_paths(x, "federated_broadcast", "value")
    pytree_names.note_broadcast(paths)
    out = [_pin(P.federated_broadcast_p.bind(a, **params), params) for a in arrays]
    return jax.tree_util.tree_unflatten(treedef, out)


def _aggregate(prim, op: str, x):
    params = _params(op)
    paths, arrays, treedef = _leaves_with_paths(x, op, "value")
    _check_clients_leaves(op, "value", paths, arrays, params["clients"], params["axis"])
    _refuse_dtypes(op, paths, arrays)
    pytree_names.note_aggregand(op, paths)
    return jax.tree_util.tree_unflatten(treedef, [prim.bind(a, **params) for a in arrays])


def federated_sum(x):
    """CLIENTS -> SERVER: the sum over clients of each leaf (numbers, not bools).

    Args:
      x: a CLIENTS value (a pytree of arrays with a leading clients axis).

    Returns:
      The SERVER value, each leaf's sum over its leading axis in the leaf's dtype. A
      bool or complex leaf is a `PlacementError`.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> print(total(jnp.array([1, 2, 3])))
      6
    """
    return _aggregate(P.federated_sum_p, "federated_sum", x)


def federated_mean(x):
    """CLIENTS -> SERVER: the unweighted mean over clients of each floating-point leaf.

    Args:
      x: a CLIENTS value of floating-point leaves (an integer, bool or complex leaf is a
        `PlacementError`: cast to float first).

    Returns:
      The SERVER value, each leaf's mean over its leading axis.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=4)
      ... def average(x):
      ...     return fb.federated_mean(x)
      >>> print(average(jnp.array([1.0, 2.0, 3.0, 6.0])))
      3.0
    """
    return _aggregate(P.federated_mean_p, "federated_mean", x)


def _weight_leaves(op: str, weights, treedef, n: int):
    """One weight array per value leaf: a single weight array serves every leaf, a pytree
    of weights must have the value's structure."""
    w_paths, w_arrays, w_tree = _leaves_with_paths(weights, op, "weights")
    if jax.tree_util.treedef_is_leaf(w_tree) and w_arrays:
        return [w_arrays[0]] * treedef.num_leaves
    if w_tree != treedef:
        raise PlacementError(
            f"{op}: weights have structure {w_tree} but the value has structure {treedef} "
            f"(at {user_location()}). Give one weight array for every leaf, or a pytree of "
            "weights with the value's structure.")
    return w_arrays


def _check_concrete_weights(w) -> None:
    """`placements.weights_refusal` of weights that are concrete (an eager call); traced
    weights (under jit) cannot be read and pass as they are."""
    if isinstance(w, jax.core.Tracer) or not w.size:
        return
    w = np.asarray(w)  # read on the host: a jnp op here would be staged into a jit trace
    refusal = weights_refusal(float(np.min(w)), bool(np.any(np.sum(w, axis=0) == 0)))
    if refusal:
        raise WeightError(f"{refusal} (at {user_location()})")


def federated_weighted_mean(x, weights):
    """CLIENTS -> SERVER: sum_i w_i x_i / sum_i w_i per leaf.

    `weights` is a CLIENTS value: one array for every leaf or a pytree matching `x`. Each
    client's weight is a scalar (shape (clients,)), or an array of the client's value
    shape (element-wise), or any shape that broadcasts to it.

    Weights must be >= 0 and must not sum to zero (`WeightError`, a ValueError). That is
    checked wherever they are concrete: an eager call of the program, and the runtime
    and the fleet for weights of one scalar per client (TFF's `federated_weighted_mean`).
    Under `jit` the weights are traced values and are not checked: a zero total gives
    nan or inf and negative weights are used as given, as `jnp` division would; call
    the program without `jit`, or run its export, for the checked rule.

    Args:
      x: a CLIENTS value of floating-point leaves.
      weights: a CLIENTS value: one array for every leaf, or a pytree matching `x`.

    Returns:
      The SERVER value, each leaf's weighted mean over clients.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def weighted(x, n):
      ...     return fb.federated_weighted_mean(x, n)
      >>> print(weighted(jnp.array([1.0, 4.0]), jnp.array([3.0, 1.0])))
      1.75
    """
    op = "federated_weighted_mean"
    params = _params(op)
    n, name = params["clients"], params["axis"]
    paths, arrays, treedef = _leaves_with_paths(x, op, "value")
    _check_clients_leaves(op, "value", paths, arrays, n, name)
    _refuse_dtypes(op, paths, arrays)
    pytree_names.note_aggregand(op, paths)
    out = []
    for path, a, w in zip(paths, arrays, _weight_leaves(op, weights, treedef, n)):
        member_x = tuple(a.shape[1:])
        member_w = tuple(w.shape[1:]) if w.ndim and w.shape[0] == n else None
        if member_w is not None:
            try:
                fits = np.broadcast_shapes(member_w, member_x) == member_x
            except ValueError:
                fits = False
        if member_w is None or not fits:
            raise PlacementError(
                f"{op}: weights for value{jax.tree_util.keystr(path)} have shape "
                f"{tuple(w.shape)}, but the value has shape {tuple(a.shape)} (at "
                f"{user_location()}). Weights need a leading axis of {n} (one per member of "
                f"{name!r}) followed by () for one weight per client, or by the value's own "
                f"shape {member_x} (or one that broadcasts to it) for element-wise weights.")
        if not jnp.issubdtype(w.dtype, jnp.floating):
            w = w.astype(a.dtype)
        _check_concrete_weights(w)
        if not member_w:
            out.append(P.federated_weighted_mean_p.bind(a, w, **params))
            continue
        (weighted,) = P.map_bind(lambda ai, wi: [ai * wi.astype(ai.dtype)], [a, w],
                                 P.CLIENTS, name="weight", **params)
        total = P.federated_sum_p.bind(w.astype(a.dtype), **params)
        out.append(P.federated_sum_p.bind(weighted, **params) / total)
    return jax.tree_util.tree_unflatten(treedef, out)


def federated_decode_sum(decode: Callable, value):
    """CLIENTS -> SERVER: the sum over clients of `decode(member)`, decoded at the server.

    Each client's member of `value` (e.g. packed integer codes and their scales) crosses
    to the server unchanged; the server decodes every member with `decode` (a function
    of the member alone, tuples unpacked) and sums the decoded pytrees. Exported as TFF
    `federated_aggregate`. Not differentiable.

    Args:
      decode: a function of one client's member (tuples unpacked into its arguments).
      value: a CLIENTS value: what each client sends.

    Returns:
      The SERVER value: the sum over clients of `decode(member)`.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def decoded(codes, scale):
      ...     return fb.federated_decode_sum(lambda c, s: c.astype(jnp.float32) * s,
      ...                                    (codes, scale))
      >>> print(decoded(jnp.array([[1, 2], [3, 4]], jnp.int8), jnp.array([0.5, 1.0])))
      [3.5 5. ]
    """
    op = "federated_decode_sum"
    params = _params(op)
    if not callable(decode):
        raise ArgumentError(f"{op}: the first argument must be a function, got "
                        f"{type(decode).__name__}.")
    unpack = isinstance(value, tuple)
    paths, arrays, treedef = _leaves_with_paths(value, op, "value")
    _check_clients_leaves(op, "value", paths, arrays, params["clients"], params["axis"])
    flat_decode, out_tree = _flat_member_fn(decode, treedef, unpack, op, "decoded value")
    outs = P.decode_sum_bind(flat_decode, [_pin(a, params) for a in arrays],
                             name=getattr(decode, "__name__", type(decode).__name__), **params)
    return jax.tree_util.tree_unflatten(out_tree(), outs)


def _flat_member_fn(fn: Callable, treedef, unpack: bool, op: str, what: str):
    """`fn` on one member, as a function of its flat leaves returning flat leaves (tuples
    unpacked into `fn`'s arguments), and a getter of the result's tree once it has run."""
    store = {}

    def flat(*member_leaves):
        member = jax.tree_util.tree_unflatten(treedef, list(member_leaves))
        result = fn(*member) if unpack else fn(member)
        _, out_arrays, store["tree"] = _leaves_with_paths(result, op, what)
        return out_arrays

    return flat, lambda: store["tree"]


def _federated_map(fn: Callable, arg, placement: str, op: str, mesh=None):
    params = _params(op, mesh if placement == P.CLIENTS else None)
    if placement != P.CLIENTS:
        params["mesh"] = None
    if not callable(fn):
        raise ArgumentError(
            f"{op}: the first argument must be a function, got {type(fn).__name__}.")
    unpack = isinstance(arg, tuple)
    paths, arrays, treedef = _leaves_with_paths(arg, op, "arg")
    if placement == P.CLIENTS:
        _check_clients_leaves(op, "arg", paths, arrays, params["clients"], params["axis"])
    flat_member_fn, out_tree = _flat_member_fn(fn, treedef, unpack, op, "result")

    name = getattr(fn, "__name__", type(fn).__name__)
    if placement == P.CLIENTS:
        arrays = [_pin(a, params) for a in arrays]
    outs = P.map_bind(flat_member_fn, arrays, placement, name=name, **params)
    if placement == P.CLIENTS:
        outs = [_pin(o, params) for o in outs]
    return jax.tree_util.tree_unflatten(out_tree(), outs)


def federated_map_clients(fn: Callable, arg, *, mesh=None):
    """Applies `fn` to each client's member of the CLIENTS value `arg` (tuples unpacked).

    The clients axis is an SPMD axis of the mesh inside `fn`: its sharding constraints
    and `shard_map`s keep it split.

    Args:
      fn: a function of one client's member (no clients axis); a tuple `arg` is unpacked
        into its arguments.
      arg: a CLIENTS value, or a tuple of them.
      mesh: the mesh to split the clients over; default the active one, if any.

    Returns:
      The CLIENTS value of `fn`'s results, stacked on a leading clients axis.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def step(w, x):
      ...     return fb.federated_map_clients(lambda w, x: w * x,
      ...                                     (fb.federated_broadcast(w), x))
      >>> print(step(jnp.float32(3.0), jnp.array([1.0, 2.0])))
      [3. 6.]
    """
    return _federated_map(fn, arg, P.CLIENTS, "federated_map_clients", mesh)


def federated_map_server(fn: Callable, arg):
    """Applies `fn` at the server to the SERVER value `arg` (tuples unpacked).

    Args:
      fn: a function of the SERVER value (a tuple `arg` is unpacked into its arguments).
      arg: a SERVER value, or a tuple of them; a CLIENTS value is a `PlacementError`.

    Returns:
      The SERVER value `fn(arg)`.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def scaled_mean(x):
      ...     return fb.federated_map_server(lambda m: 10 * m, fb.federated_mean(x))
      >>> print(scaled_mean(jnp.array([1.0, 2.0])))
      15.0
    """
    return _federated_map(fn, arg, P.SERVER, "federated_map_server")
