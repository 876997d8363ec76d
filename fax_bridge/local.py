"""The local accelerator path: jit a federated program, sharding CLIENTS values over a mesh.

With `clients_mesh(mesh)` active (a `jax.sharding.Mesh` with a `clients` axis), every
CLIENTS value a federated operation produces or consumes is constrained to be split
along its leading axis over that mesh axis, so each device holds and computes on its own
slice of the clients. `jit_program` jits a program with matching input and output
shardings; `to_hlo` gives the HLO text of a whole program.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Callable, Iterator, Optional

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

CLIENTS_AXIS = "clients"

_MESH: contextvars.ContextVar[Optional[Mesh]] = contextvars.ContextVar(
    "fax_bridge_clients_mesh", default=None)


def _check_mesh(mesh: Mesh) -> Mesh:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"expected a jax.sharding.Mesh, got {type(mesh).__name__}.")
    if CLIENTS_AXIS not in mesh.axis_names:
        raise ValueError(
            f"the mesh has axes {mesh.axis_names} but no {CLIENTS_AXIS!r} axis; build it as "
            "jax.make_mesh((jax.device_count(),), ('clients',)).")
    return _auto_axes(mesh)


def _auto_axes(mesh: Mesh) -> Mesh:
    """The same devices and axes with sharding left to the compiler (GSPMD `Auto` axes).

    Federated primitives place CLIENTS values with sharding constraints, which need
    `Auto` axes; `jax.make_mesh` makes `Explicit` ones by default.
    """
    auto = (jax.sharding.AxisType.Auto,) * len(mesh.axis_names)
    if tuple(getattr(mesh, "axis_types", auto)) == auto:
        return mesh
    return Mesh(mesh.devices, mesh.axis_names, axis_types=auto)


@contextlib.contextmanager
def clients_mesh(mesh: Mesh) -> Iterator[Mesh]:
    """Within this context, CLIENTS values are sharded along `mesh`'s `clients` axis."""
    token = _MESH.set(_check_mesh(mesh))
    try:
        yield mesh
    finally:
        _MESH.reset(token)


def current_mesh() -> Optional[Mesh]:
    """The mesh set by the innermost `clients_mesh`, or None."""
    return _MESH.get()


def clients_sharding(mesh: Mesh) -> NamedSharding:
    """Sharding of a CLIENTS array: its leading axis split over the `clients` axis."""
    return NamedSharding(mesh, PartitionSpec(CLIENTS_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    """Sharding of a SERVER array: a full copy on every device of the mesh."""
    return NamedSharding(mesh, PartitionSpec())


def constrain_clients(x):
    """Constrains a CLIENTS array to the active clients mesh (a no-op without one)."""
    mesh = _MESH.get()
    if mesh is None:
        return x
    if x.shape[0] % mesh.shape[CLIENTS_AXIS]:
        return x  # not evenly divisible: leave the layout to XLA
    return jax.lax.with_sharding_constraint(x, clients_sharding(mesh))


def _placement_shardings(mesh: Mesh, placements: Any, args: tuple):
    from fax_bridge.placements import broadcast_placements, Placement

    flat = broadcast_placements(placements, args)
    treedef = jax.tree_util.tree_structure(args)
    shardings = [clients_sharding(mesh) if p is Placement.CLIENTS else replicated(mesh)
                 for p in flat]
    return jax.tree_util.tree_unflatten(treedef, shardings)


def jit_program(fn: Callable, mesh: Mesh, placements: Any = None, **jit_kwargs) -> Callable:
    """Jits `fn` so CLIENTS arguments are sharded over `mesh`'s clients axis.

    `placements` is a pytree prefix of "server"/"clients" per argument (default: all
    SERVER). Inside, every federated operation keeps CLIENTS values sharded the same way.
    """
    mesh = _check_mesh(mesh)

    def run(*args):
        shardings = _placement_shardings(mesh, placements, args)
        args = jax.device_put(args, shardings)
        with clients_mesh(mesh):
            return jitted(*args)

    def traced(*args):
        with clients_mesh(mesh):
            return fn(*args)

    jitted = jax.jit(traced, **jit_kwargs)
    run.lower = lambda *args: _lower(jitted, mesh, args)  # type: ignore[attr-defined]
    return run


def _lower(jitted, mesh, args):
    with clients_mesh(mesh):
        return jitted.lower(*args)


def to_hlo(fn: Callable, *args, **kwargs) -> str:
    """The HLO text of the whole program `fn` at these example arguments."""
    return jax.jit(fn).lower(*args, **kwargs).as_text(dialect="hlo")
