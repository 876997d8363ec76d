"""The local accelerator path: jit a federated program, sharding placed values over a mesh.

A placed value (CLIENTS, or any placement name a program declares) is constrained on its
leading axis only: split over the mesh axis named like the placement, when the mesh has
one, while every other dimension keeps the sharding it has (a model sharded over a
`model` axis stays sharded inside every client's copy). The mesh comes from, in order:
`mesh=` on a federated operation, `clients_mesh(mesh)` / `jit_program`, `jax.set_mesh`
. Meshes with `Auto` axes get sharding constraints that leave the other
dimensions to propagation; `Explicit` axes (the default of `jax.make_mesh`) carry the
sharding in the types and get `jax.sharding.reshard`. `to_hlo` gives the HLO text of a
whole program.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Optional, Union

import jax
from jax.sharding import AbstractMesh, AxisType, Mesh, NamedSharding, PartitionSpec

from fax_bridge.errors import ArgumentError, MeshError, PlacementError
from fax_bridge.language.placements import Placement, broadcast_placements
from fax_bridge.language.tracing import check_placements

CLIENTS_AXIS = "clients"

AnyMesh = Union[Mesh, AbstractMesh]

_MESH: contextvars.ContextVar[Optional[Mesh]] = contextvars.ContextVar(
    "fax_bridge_clients_mesh", default=None)


def _check_mesh(mesh: Mesh, axis: str = CLIENTS_AXIS) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise ArgumentError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if axis not in mesh.axis_names:
        raise MeshError(
            f"the mesh has axes {mesh.axis_names} but no {axis!r} axis; build it as "
            f"jax.make_mesh((jax.device_count(),), ({axis!r},)).")
    return mesh


@contextlib.contextmanager
def clients_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Within this context, placed values are split along `mesh`'s axis of their placement.

    For a mesh with Explicit axes, also make it jax's mesh (`jax.set_mesh`), as
    `jit_program` does, so the types carry its shardings.

    Args:
      mesh: a `jax.sharding.Mesh`; an axis named like a placement splits its members.

    Yields:
      `mesh`.

    Example:
      >>> import jax, jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> with fb.clients_mesh(jax.make_mesh((1,), ("clients",))):
      ...     print(jax.jit(total)(jnp.array([2.0, 3.0])))
      5.0
    """
    if not isinstance(mesh, Mesh):
        raise ArgumentError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}.")
    token = _MESH.set(mesh)
    try:
        yield mesh
    finally:
        _MESH.reset(token)


def _jax_mesh(mesh: Mesh):
    """`jax.set_mesh(mesh)` for meshes with Explicit axes (their types need it; call it
    outside of jit)."""
    if any(t == AxisType.Explicit for t in mesh.axis_types):
        return jax.set_mesh(mesh)
    return contextlib.nullcontext()


def current_mesh() -> Optional[Mesh]:
    """The mesh set by the innermost `clients_mesh`, or None."""
    return _MESH.get()


def ambient_mesh() -> Optional[AnyMesh]:
    """The mesh federated operations use when given none: `clients_mesh`, then jax's."""
    mesh = _MESH.get()
    if mesh is not None:
        return mesh
    abstract = jax.sharding.get_abstract_mesh()
    return None if abstract is None or abstract.empty else abstract


def axis_is_explicit(mesh: Optional[AnyMesh], axis: str) -> bool:
    """True when `mesh` has an `Explicit` axis named `axis`."""
    if mesh is None or axis not in mesh.axis_names:
        return False
    return dict(zip(mesh.axis_names, mesh.axis_types))[axis] == AxisType.Explicit


def resolve_mesh(op: str, axis: str, clients: int, mesh: Optional[AnyMesh] = None,
                 where: str = "") -> Optional[AnyMesh]:
    """The mesh a federated operation on placement `axis` constrains to, or None.

    A mesh the user names (`mesh=`) must have the placement's axis; an ambient one
    without it leaves placed values to the compiler. `clients` must split evenly over
    the axis.
    """
    given = mesh is not None
    if not given:
        mesh = ambient_mesh()
    if mesh is None:
        return None
    if not isinstance(mesh, (Mesh, AbstractMesh)):
        raise PlacementError(f"{op}: mesh= must be a jax.sharding.Mesh, got "
                             f"{type(mesh).__name__}{where}.")
    if axis not in mesh.axis_names:
        if given:
            raise PlacementError(
                f"{op}: the mesh has axes {tuple(mesh.axis_names)} but no {axis!r} axis for "
                f"the {axis!r} placement{where}. Add an axis named {axis!r} to the mesh, or "
                "name the placement after one of its axes.")
        return None
    size = mesh.shape[axis]
    if clients % size:
        raise PlacementError(
            f"{op}: {clients} members of placement {axis!r} do not split evenly over the "
            f"{size} devices of mesh axis {axis!r}{where}. Use a number of {axis} that is a "
            f"multiple of {size}, or a mesh whose {axis!r} axis divides {clients}.")
    return mesh


def place_leading(x, axis: str, mesh: Optional[AnyMesh]):
    """Splits `x`'s leading axis over mesh axis `axis`; other dimensions keep theirs."""
    if mesh is None or axis not in mesh.axis_names or x.ndim == 0:
        return x
    if axis_is_explicit(mesh, axis):
        spec = tuple(jax.typeof(x).sharding.spec)
        spec = spec + (None,) * (x.ndim - len(spec))
        target = PartitionSpec(axis, *spec[1:])
        if spec == tuple(target):
            return x
        return jax.sharding.reshard(x, NamedSharding(mesh, target))
    spec = PartitionSpec(axis, *([PartitionSpec.UNCONSTRAINED] * (x.ndim - 1)))
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


def clients_sharding(mesh: Mesh, axis: str = CLIENTS_AXIS) -> NamedSharding:
    """Sharding of a placed array: its leading axis split over the placement's axis."""
    return NamedSharding(mesh, PartitionSpec(axis))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of a SERVER array: a full copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def _own_spec(leaf: Any, mesh: Mesh) -> Optional[tuple]:
    """The spec of an array already laid out over `mesh`, padded to its rank."""
    sharding = getattr(leaf, "sharding", None)
    if isinstance(sharding, NamedSharding) and sharding.mesh == mesh:
        spec = tuple(sharding.spec)
        return spec + (None,) * (leaf.ndim - len(spec))
    return None


def argument_sharding(mesh: Mesh, placed: bool, leaf: Any, axis: str = CLIENTS_AXIS):
    """The sharding `jit_program` gives an argument: placed ones split on the leading axis,
    the rest replicated, except that dimensions an array already shards over this mesh
    (a model axis) keep their sharding."""
    own = _own_spec(leaf, mesh)
    if placed:
        rest = own[1:] if own else ()
        return NamedSharding(mesh, PartitionSpec(axis, *rest))
    return NamedSharding(mesh, PartitionSpec(*own)) if own else replicated(mesh)


def _placement_shardings(mesh: Mesh, placements: Any, args: tuple, axis: str):
    flat = broadcast_placements(placements, args, axis)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    shardings = [argument_sharding(mesh, p is Placement.CLIENTS, leaf, axis)
                 for p, leaf in zip(flat, leaves)]
    return jax.tree_util.tree_unflatten(treedef, shardings)


def jit_program(fn: Callable, mesh: Mesh, placements: Any = None,
                clients_per_step: Any = None, **jit_kwargs) -> Callable:
    """Jits `fn` so its placed arguments are split over `mesh`'s axis of that placement.

    `placements` is a pytree prefix of "server"/"clients" (or the program's own
    placement name) per argument (default: all SERVER). Inside, every federated
    operation keeps placed values split the same way; SERVER values mixed with CLIENTS
    ones are refused as `fax_bridge.trace` refuses them.

    Args:
      fn: the program (a `fax_bridge.program`, or a function using federated operations).
      mesh: a mesh with an axis named like the program's placement (`clients`); its size
        must divide the number of clients.
      placements: a pytree prefix of placements per argument.
      clients_per_step: run the program's members this many at a time, over the whole
        mesh (a multiple of the axis size: each device runs its share of every chunk),
        as `fax_bridge.program(clients_per_step=...)` does; `fn` must be a program.
      **jit_kwargs: passed on to `jax.jit`.

    Returns:
      A function of the program's arguments that places them on `mesh` and runs the
      jitted program (`.lower(*args)` lowers it).

    Example:
      >>> import jax, jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def average(w, x):
      ...     return fb.federated_mean(fb.federated_broadcast(w) * x)
      >>> run = fb.jit_program(average, jax.make_mesh((1,), ("clients",)),
      ...                      placements=("server", "clients"))
      >>> print(run(jnp.float32(2.0), jnp.array([1.0, 3.0])))
      4.0
    """
    axis = getattr(fn, "placement", CLIENTS_AXIS)
    mesh = _check_mesh(mesh, axis)
    if clients_per_step is not None:
        if not hasattr(fn, "with_clients_per_step"):
            raise ArgumentError(
                "jit_program(clients_per_step=...) needs a fax_bridge.program; decorate "
                "the function with @fax_bridge.program(clients=N).")
        fn = fn.with_clients_per_step(clients_per_step)

    def run(*args):
        args = jax.device_put(args, _placement_shardings(mesh, placements, args, axis))
        with clients_mesh(mesh), _jax_mesh(mesh):
            return jitted(*args)

    def traced(*args):
        check_placements(fn, args, placements)
        with clients_mesh(mesh):
            return fn(*args)

    jitted = jax.jit(traced, **jit_kwargs)
    run.lower = lambda *args: _lower(jitted, mesh, args)  # type: ignore[attr-defined]
    return run


def _lower(jitted, mesh, args):
    with clients_mesh(mesh), _jax_mesh(mesh):
        return jitted.lower(*args)


def to_hlo(fn: Callable, *args, **kwargs) -> str:
    """The HLO text of the whole program `fn` at these example arguments.

    Args:
      fn: the program.
      *args: example arguments (arrays or `jax.ShapeDtypeStruct`s).
      **kwargs: keyword arguments of `fn`.

    Returns:
      The text of the HLO module `jax.jit(fn)` lowers to.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=2)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> fb.to_hlo(total, jnp.zeros(2)).splitlines()[0]
      'HloModule jit_total, entry_computation_layout={(f32[2]{0})->f32[]}'
    """
    return jax.jit(fn).lower(*args, **kwargs).as_text(dialect="hlo")
