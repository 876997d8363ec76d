"""DrJAX's API on fax_bridge: a DrJAX program ports by changing one import.

    import drjax                       ->   from fax_bridge import drjax

    @drjax.program(placements={"clients": 8})
    def round(model, data):
        local = drjax.map_fn(train, (drjax.broadcast(model), data))
        return drjax.reduce_mean(local)

The names, signatures and results are DrJAX 0.2.1's (`program`, `broadcast`, `map_fn`,
`reduce_sum`, `reduce_mean`, `reduce_weighted_mean`, `mesh=` on `broadcast` and
`map_fn`); the decorated function is a `fax_bridge.Program`, so it also exports to TFF
(`fax_bridge.export_tff`), runs on a fleet and checks parity. Dtypes follow DrJAX's
(`jnp.sum` / `jnp.mean` / true division): a mean of integers is a float mean and a sum
of bools counts them; the values are cast before they reach fax_bridge's federated
operations, which refuse to truncate.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

from fax_bridge import api as _api
from fax_bridge.errors import PlacementError, ProgramError

__all__ = ["OperatorUndefinedError", "broadcast", "map_fn", "program", "reduce_mean",
           "reduce_sum", "reduce_weighted_mean"]


class OperatorUndefinedError(PlacementError):
    """A DrJAX operator was called outside a `drjax.program`."""


def _inside(name: str) -> None:
    if not _api._PROGRAMS.get():
        raise OperatorUndefinedError(
            f"The DrJAX operator {name} is only defined in the context of a DrJAX program "
            "decorator; decorate the function with @drjax.program(placements={'clients': N}).")


def program(**kwargs: Any) -> Callable[[Callable], _api.Program]:
    """`@program(placements={name: n})` or `@program(name=n)`: one placement per program.

    `use_abstract_mesh` is accepted as DrJAX accepts it; fax_bridge always uses jax's
    current mesh (`jax.set_mesh`) when no other is given.
    """
    kwargs.pop("use_abstract_mesh", None)
    try:
        [(placement, value)] = kwargs.items()
    except ValueError as e:
        raise ProgramError(
            f"The program API expects a single keyword argument but got {kwargs=}.") from e
    if placement == "placements":
        if not isinstance(value, Mapping):
            raise ProgramError(
                f"When using the `placements` argument, value must be a mapping but got "
                f"{type(value)=}. `placements` is a reserved name and not a valid placement "
                "name.")
        if len(value) != 1:
            raise ProgramError(
                f"Expected a single-element dict for placements. Got placements={dict(value)}")
        placements = dict(value)
    else:
        placements = {placement: value}
    return lambda fn: _api.program(fn, placements=placements)


def broadcast(x: Any, *, mesh: Optional[Any] = None) -> Any:
    """Broadcasts `x` to every member of the active placement (leading axis inserted)."""
    _inside("broadcast")
    return _api.federated_broadcast(x, mesh=mesh)


def map_fn(fn: Callable[..., Any], arg: Any, *, mesh: Optional[Any] = None) -> Any:
    """Maps `fn` over the placed (leading) axis of `arg`; a tuple `arg` is unpacked."""
    _inside("map_fn")
    return _api.federated_map_clients(fn, arg, mesh=mesh)


def _reduced_dtype(reduce: Callable, dtype) -> jnp.dtype:
    return jax.eval_shape(lambda a: reduce(a, axis=0),
                          jax.ShapeDtypeStruct((1,), dtype)).dtype


def _cast_for(reduce: Callable, x: Any) -> Any:
    return jax.tree_util.tree_map(
        lambda a: jnp.asarray(a).astype(_reduced_dtype(reduce, jnp.asarray(a).dtype)), x)


def reduce_sum(x: Any) -> Any:
    """The sum over the placed axis, in `jnp.sum`'s dtype (bools are counted)."""
    _inside("reduce_sum")
    return _api.federated_sum(_cast_for(jnp.sum, x))


def reduce_mean(x: Any) -> Any:
    """The unweighted mean over the placed axis, in `jnp.mean`'s dtype."""
    _inside("reduce_mean")
    return _api.federated_mean(_cast_for(jnp.mean, x))


def reduce_weighted_mean(x: Any, w: Any) -> Any:
    """sum(x * w) / sum(w) over the placed axis, leaf by leaf (`w` matches `x`'s structure;
    each member's weight broadcasts against its value)."""
    _inside("reduce_weighted_mean")

    def dtype_of(a, b):
        return jax.eval_shape(lambda p, q: (p * q) / q, jax.ShapeDtypeStruct((), a.dtype),
                              jax.ShapeDtypeStruct((), b.dtype)).dtype

    x_leaves, treedef = jax.tree_util.tree_flatten(x)
    try:
        w_leaves = treedef.flatten_up_to(w)
    except (ValueError, TypeError) as e:
        raise PlacementError(
            f"reduce_weighted_mean: the weights have structure "
            f"{jax.tree_util.tree_structure(w)} but the values have structure {treedef}; "
            "give a weight for every value leaf.") from e
    pairs = [(jnp.asarray(a), jnp.asarray(b)) for a, b in zip(x_leaves, w_leaves)]
    xs = [a.astype(dtype_of(a, b)) for a, b in pairs]
    ws = [b.astype(dtype_of(a, b)) for a, b in pairs]
    return _api.federated_weighted_mean(jax.tree_util.tree_unflatten(treedef, xs),
                                        jax.tree_util.tree_unflatten(treedef, ws))
