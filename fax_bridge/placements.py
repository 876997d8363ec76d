"""Placements of federated values and how users name them per argument."""

from __future__ import annotations

import enum
from typing import Any

import jax
import numpy as np

from fax_bridge.errors import ProgramError


class Placement(enum.Enum):
    """Where a value lives: at the server, at the clients, or nowhere yet (a constant)."""

    SERVER = "server"
    CLIENTS = "clients"
    UNPLACED = "unplaced"

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"Placement.{self.name}"


def parse_placement(value: Any, where: str = "") -> Placement:
    """Accepts "server"/"clients" (any case) or a Placement."""
    if isinstance(value, Placement) and value is not Placement.UNPLACED:
        return value
    if isinstance(value, str) and value.lower() in ("server", "clients"):
        return Placement(value.lower())
    raise ProgramError(
        f"placement{(' of ' + where) if where else ''} must be 'server' or 'clients', got "
        f"{value!r}.")


def broadcast_placements(placements: Any, args: tuple) -> list[Placement]:
    """Expands a pytree prefix of placements to one Placement per leaf of `args`.

    `placements` is None (every argument at the server), a single string for all
    arguments, or a tuple/list with one entry per positional argument, each of which is
    a string or a pytree prefix of that argument.
    """
    if placements is None:
        return [Placement.SERVER] * len(jax.tree_util.tree_leaves(args))
    if isinstance(placements, (str, Placement)):
        p = parse_placement(placements)
        return [p] * len(jax.tree_util.tree_leaves(args))
    if not isinstance(placements, (tuple, list)) or len(placements) != len(args):
        raise ProgramError(
            f"placements must have one entry per argument ({len(args)} arguments), got "
            f"{placements!r}; e.g. placements=('server', 'clients').")
    out: list[Placement] = []
    for i, (prefix, arg) in enumerate(zip(placements, args)):
        try:
            expanded = jax.tree_util.tree_map(
                lambda p, sub, _i=i: [parse_placement(p, f"argument {_i}")] * len(
                    jax.tree_util.tree_leaves(sub)),
                prefix, arg, is_leaf=lambda x: isinstance(x, (str, Placement)))
        except ValueError as e:
            if "placement" in str(e):
                raise
            raise ProgramError(
                f"placements[{i}] = {prefix!r} is not a pytree prefix of argument {i} "
                f"(structure {jax.tree_util.tree_structure(arg)}).") from e
        for chunk in jax.tree_util.tree_leaves(
                expanded, is_leaf=lambda x: isinstance(x, list)):
            out.extend(chunk)
    return out


def aggregate_refusal(name: str, dtype: Any) -> str | None:
    """Why `name` (federated_sum/mean/weighted_mean) cannot aggregate `dtype` values, or None.

    One rule for every path (jit, export, runtime): a mean needs floating-point values
    (an integer mean would truncate: [1, 2, 4] would give 2), a sum needs numbers (a sum
    of bools is a count, not a bool). Checked when the program is traced.
    """
    dtype = np.dtype(dtype)
    if name in ("federated_mean", "federated_weighted_mean") and dtype.kind not in "fcV":
        return (f"{name} needs floating-point values: a mean of {dtype} values would "
                "truncate to an integer; cast them first (x.astype(jnp.float32)), or sum "
                "them with federated_sum and divide.")
    if name == "federated_sum" and dtype == np.bool_:
        return ("federated_sum of bool values is undefined (a count is not a bool); cast "
                "them first (x.astype(jnp.int32)).")
    return None
