"""The local path across processes: one jitted program over a `clients` axis spanning hosts.

Every process runs the same script:

    from fax_bridge.local import multihost
    multihost.initialize("10.0.0.1:1234", num_processes=P, process_id=i)
    mesh = multihost.global_clients_mesh()           # every device of every process
    rows = multihost.process_clients(N, mesh)         # the clients this process loads
    x = load_my_clients(rows)                         # shape (len(rows), ...)
    w, g = multihost.run_program_multihost(step, mesh, ("server", "clients"), w0, x)
    # w: a SERVER value, identical on every process; g: a global CLIENTS array,
    # `multihost.local_clients(g)` is this process's rows, `multihost.gather(g)` all rows.

Each process reads only its own clients: `global_clients_array` turns a process's block
into its part of one global `jax.Array` (`jax.make_array_from_process_local_data`), and
SERVER values become replicated global arrays. The program is then the same
`jit_program` as on one host; XLA inserts the cross-process collectives (on CPU through
gloo, jax's default CPU collectives on 0.10; `initialize` makes sure of it).

Clients are laid out in the mesh's device order: with `global_clients_mesh()` the
devices of process 0 hold the first block of clients, those of process 1 the next, and
so on, so `process_clients` is a contiguous range.

A model too large for one device splits over a second mesh axis: `global_mesh((2, 4),
("clients", "model"))` on 2 processes of 4 devices, the model made a global array with
`global_server_array(params, mesh, specs)` (e.g. `P(None, "model")` per weight); the
round keeps that split in every client's copy and in its result.
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from fax_bridge.errors import MeshError
from fax_bridge.system.addresses import parse_address
from fax_bridge.local.jit import CLIENTS_AXIS, clients_sharding, jit_program, replicated

_CPU_COLLECTIVES = "jax_cpu_collectives_implementation"


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               local_device_ids: Optional[Sequence[int]] = None,
               initialization_timeout_s: int = 120) -> None:
    """Joins this process to a multi-process JAX job (`jax.distributed.initialize`).

    Call it before any other JAX work. `coordinator_address` is HOST:PORT of process 0,
    reachable from every process. On CPU, cross-process collectives need an
    implementation; this selects gloo when none is set.
    """
    if num_processes < 1 or not 0 <= process_id < num_processes:
        raise MeshError(
            f"process_id={process_id} with num_processes={num_processes}: ids run from 0 "
            "to num_processes-1, one per process")
    parse_address(coordinator_address, "coordinator_address (the address of process 0)")
    if jax.config.values.get(_CPU_COLLECTIVES, "none") in (None, "none"):
        jax.config.update(_CPU_COLLECTIVES, "gloo")
    kwargs = {}
    if local_device_ids is not None:
        kwargs["local_device_ids"] = list(local_device_ids)
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=initialization_timeout_s, **kwargs)


def shutdown() -> None:
    """Leaves the multi-process job (`jax.distributed.shutdown`)."""
    jax.distributed.shutdown()


def global_clients_mesh(devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A one-axis `clients` mesh over every device of every process, in process order."""
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    return Mesh(np.array(devices), (CLIENTS_AXIS,),
                axis_types=(jax.sharding.AxisType.Auto,))


def global_mesh(shape: Sequence[int], axis_names: Sequence[str],
                devices: Optional[Sequence[Any]] = None) -> Mesh:
    """A mesh over every device of every process, in process order, e.g. shape (2, 4)
    with axes ("clients", "model") on 2 processes of 4 devices: the first axis spans the
    processes, so each process holds a contiguous block of clients and every model
    shard of them (Auto axes)."""
    devices = list(jax.devices() if devices is None else devices)
    devices.sort(key=lambda d: (d.process_index, d.id))
    if int(np.prod(shape)) != len(devices):
        raise MeshError(f"a mesh of shape {tuple(shape)} needs {int(np.prod(shape))} "
                        f"devices; there are {len(devices)}")
    return Mesh(np.array(devices).reshape(tuple(shape)), tuple(axis_names),
                axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


def _clients_sharding(mesh: Mesh) -> NamedSharding:
    if CLIENTS_AXIS not in mesh.axis_names:
        raise MeshError(
            f"the mesh has axes {mesh.axis_names} but no {CLIENTS_AXIS!r} axis; build it "
            "with fax_bridge.local.multihost.global_clients_mesh()")
    return clients_sharding(mesh)


def process_clients(num_clients: int, mesh: Mesh) -> range:
    """The global client indices whose data this process must load (a contiguous range).

    `num_clients` must split evenly over the mesh's `clients` axis.
    """
    size = mesh.shape[CLIENTS_AXIS]
    if num_clients % size:
        raise MeshError(
            f"{num_clients} clients do not split evenly over the {size} devices of the "
            "clients axis; pad the population (or sample a cohort) to a multiple of "
            f"{size}")
    index_map = _clients_sharding(mesh).addressable_devices_indices_map((num_clients,))
    rows = sorted((idx[0].start or 0, idx[0].stop if idx[0].stop is not None else num_clients)
                  for idx in index_map.values())
    if not rows:
        return range(0)
    start, stop = rows[0][0], rows[-1][1]
    covered = sorted({r for lo, hi in rows for r in range(lo, hi)})
    if covered != list(range(start, stop)):
        raise MeshError(
            "this process's devices do not hold one contiguous block of clients; order "
            "the mesh's devices by process (global_clients_mesh does)")
    return range(start, stop)


def global_clients_array(local_block: Any, mesh: Mesh, num_clients: Optional[int] = None):
    """This process's clients (leading axis) as its part of one global CLIENTS array.

    Every process calls it with its own block, `process_clients(num_clients, mesh)` rows
    long; `local_block` may be a pytree. `num_clients` defaults to the block size times
    the number of processes.
    """
    sharding = _clients_sharding(mesh)
    leaves = jax.tree_util.tree_leaves(local_block)
    if not leaves:
        raise MeshError("global_clients_array got an empty pytree; pass the client arrays")
    local_rows = {int(np.shape(leaf)[0]) for leaf in leaves}
    if len(local_rows) != 1:
        raise MeshError(
            f"the local client arrays disagree on their leading axis {sorted(local_rows)}; "
            "give every CLIENTS leaf one row per local client")
    rows = local_rows.pop()
    total = rows * jax.process_count() if num_clients is None else int(num_clients)
    expected = process_clients(total, mesh)
    if rows != len(expected):
        raise MeshError(
            f"process {jax.process_index()} passed {rows} clients but holds clients "
            f"{expected.start}..{expected.stop - 1} ({len(expected)}) of {total}; load "
            "exactly process_clients(num_clients, mesh)")

    def one(leaf):
        leaf = np.asarray(leaf)
        return jax.make_array_from_process_local_data(sharding, leaf,
                                                      (total,) + leaf.shape[1:])

    return jax.tree_util.tree_map(one, local_block)


def global_server_array(value: Any, mesh: Mesh, specs: Any = None):
    """A SERVER value (the same on every process) as a global array: replicated, or laid
    out by `specs` (a PartitionSpec, or a pytree of them matching `value`, e.g. a model
    split over a `model` axis); each process keeps only the pieces its devices hold."""
    if specs is None:
        specs = jax.sharding.PartitionSpec()

    def one(leaf, spec):
        leaf = np.asarray(leaf)
        sharding = NamedSharding(mesh, spec) if spec != jax.sharding.PartitionSpec() \
            else replicated(mesh)
        return jax.make_array_from_callback(leaf.shape, sharding, lambda idx: leaf[idx])

    if isinstance(specs, jax.sharding.PartitionSpec):
        return jax.tree_util.tree_map(lambda leaf: one(leaf, specs), value)
    return jax.tree_util.tree_map(one, value, specs,
                                  is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec))


def local_clients(x: Any) -> Any:
    """This process's rows of global CLIENTS arrays, as numpy, in client order (pieces
    split over other mesh axes, e.g. `model`, are put back together)."""

    def one(leaf):
        n = leaf.shape[0]
        starts = sorted({s.index[0].start or 0 for s in leaf.addressable_shards})
        stops = sorted({s.index[0].stop if s.index[0].stop is not None else n
                        for s in leaf.addressable_shards})
        first = starts[0]
        out = np.empty((stops[-1] - first,) + leaf.shape[1:], leaf.dtype)
        for shard in leaf.addressable_shards:
            rows = shard.index[0]
            local = slice((rows.start or 0) - first,
                          (rows.stop if rows.stop is not None else n) - first)
            out[(local,) + tuple(shard.index[1:])] = np.asarray(shard.data)
        return out

    return jax.tree_util.tree_map(one, x)


def server_value(x: Any) -> Any:
    """A SERVER global array as numpy on every process: read locally when replicated,
    gathered when split over a mesh axis (e.g. a model-parallel parameter)."""
    from jax.experimental import multihost_utils

    def one(leaf):
        if leaf.is_fully_replicated:
            return np.asarray(leaf.addressable_data(0))
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))

    return jax.tree_util.tree_map(one, x)


def gather(x: Any) -> Any:
    """Every client's rows of global CLIENTS arrays on every process (an all-gather)."""
    from jax.experimental import multihost_utils

    return jax.tree_util.tree_map(
        lambda leaf: np.asarray(multihost_utils.process_allgather(leaf, tiled=True)), x)


def _is_global(leaf: Any, mesh: Mesh) -> bool:
    """An argument already laid out over `mesh` (e.g. by `global_server_array` with specs)."""
    sharding = getattr(leaf, "sharding", None)
    return isinstance(leaf, jax.Array) and isinstance(sharding, NamedSharding) \
        and sharding.mesh == mesh


def run_program_multihost(fn: Callable, mesh: Mesh, placements: Any, *args: Any,
                          num_clients: Optional[int] = None, **jit_kwargs: Any):
    """Runs a federated program once over a mesh that spans processes.

    `placements` says "server" or "clients" per argument (as for `jit_program`). CLIENTS
    arguments are this process's blocks (see `process_clients`), SERVER arguments the
    full value, equal on every process; arguments already laid out over `mesh` (from
    `global_server_array(value, mesh, specs)`, a model split over a `model` axis of a 2-D
    mesh from `global_mesh`) are used as they are, and keep that layout through the
    program. Returns the program's outputs as global arrays:
    read SERVER ones with `server_value`, CLIENTS ones with `local_clients` or `gather`.
    """
    from fax_bridge.language.placements import Placement, broadcast_placements

    flat_placements = broadcast_placements(placements, args, getattr(fn, "placement", None))
    leaves, treedef = jax.tree_util.tree_flatten(args)
    placed = [leaf if _is_global(leaf, mesh)
              else global_clients_array(leaf, mesh, num_clients) if p is Placement.CLIENTS
              else global_server_array(leaf, mesh)
              for p, leaf in zip(flat_placements, leaves)]
    global_args = jax.tree_util.tree_unflatten(treedef, placed)
    return jit_program(fn, mesh, placements, **jit_kwargs)(*global_args)
