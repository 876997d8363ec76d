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


def _accepted(name: str | None) -> str:
    names = ["'server'", "'clients'"] + (
        [repr(name)] if name and name.lower() not in ("server", "clients") else [])
    return ", ".join(names[:-1]) + " or " + names[-1]


def parse_placement(value: Any, where: str = "", name: str | None = None) -> Placement:
    """Accepts "server"/"clients" (any case), a Placement, or `name`, the program's own
    placement (e.g. "workers" for `program(placements={"workers": 8})`): the outermost
    placement of a program is TFF's CLIENTS whatever the program calls it."""
    if isinstance(value, Placement) and value is not Placement.UNPLACED:
        return value
    if isinstance(value, str) and value.lower() in ("server", "clients"):
        return Placement(value.lower())
    if isinstance(value, str) and name and value.lower() == name.lower():
        return Placement.CLIENTS
    own = (f" ({name!r} is this program's placement, TFF's CLIENTS)"
           if name and name.lower() not in ("server", "clients") else "")
    raise ProgramError(
        f"placement{(' of ' + where) if where else ''} must be {_accepted(name)}{own}, got "
        f"{value!r}.")


def broadcast_placements(placements: Any, args: tuple,
                         name: str | None = None) -> list[Placement]:
    """Expands a pytree prefix of placements to one Placement per leaf of `args`.

    `placements` is None (every argument at the server), a single string for all
    arguments, or a tuple/list with one entry per positional argument, each of which is
    a string or a pytree prefix of that argument. Strings are "server", "clients" or
    `name`, the program's own placement (see `parse_placement`).
    """
    if placements is None:
        return [Placement.SERVER] * len(jax.tree_util.tree_leaves(args))
    if isinstance(placements, (str, Placement)):
        p = parse_placement(placements, name=name)
        return [p] * len(jax.tree_util.tree_leaves(args))
    if not isinstance(placements, (tuple, list)) or len(placements) != len(args):
        raise ProgramError(
            f"placements must have one entry per argument ({len(args)} arguments), got "
            f"{placements!r}; e.g. placements=('server', 'clients').")
    out: list[Placement] = []
    for i, (prefix, arg) in enumerate(zip(placements, args)):
        try:
            expanded = jax.tree_util.tree_map(
                lambda p, sub, _i=i: [parse_placement(p, f"argument {_i}", name)] * len(
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

    One rule for every path (jit, export, runtime, fleet): a mean needs floating-point
    values (an integer mean would truncate: [1, 2, 4] would give 2), a sum needs numbers
    (a sum of bools is a count, not a bool), and no aggregation takes complex values
    (the runtime and the fleet sum integer and float tensors only, so jit would accept
    what they refuse). Checked when the program is traced; the runtime
    applies it again to protos written elsewhere.
    """
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return (f"{name} of typed PRNG keys ({dtype}) is undefined: keys are not numbers; "
                "aggregate numbers drawn with them, or their jax.random.key_data.")
    dtype = np.dtype(dtype)
    if name in ("federated_mean", "federated_weighted_mean") and dtype.kind not in "fcV":
        return (f"{name} needs floating-point values: a mean of {dtype} values would "
                "truncate to an integer; cast them first (x.astype(jnp.float32)), or sum "
                "them with federated_sum and divide.")
    if name == "federated_sum" and dtype == np.bool_:
        return ("federated_sum of bool values is undefined (a count is not a bool); cast "
                "them first (x.astype(jnp.int32)).")
    if dtype.kind == "c":
        return (f"{name} of {dtype} values is not supported: the runtime and the fleet "
                "aggregate integer and floating-point tensors only; aggregate the real and "
                "imaginary parts as two float values (jnp.real(x), jnp.imag(x)) and "
                "rebuild the complex value at the server.")
    return None


def secure_sum_refusal(name: str, bound_name: str, bound: int, top: int, clients: int,
                       dtype: Any) -> str | None:
    """Why a secure sum whose clients each add at most `top` cannot be held by `dtype`.

    TFF's `federated_secure_sum_bitwidth` and `federated_secure_sum` are typed
    `<{V}@CLIENTS, B> -> V@SERVER`: the sum has the values' dtype and is not reduced
    modulo anything, so `clients * top` must fit that dtype or the result would wrap
    (four int32 clients at bitwidth 31 would give -4). One rule for every path (jit,
    export, the runtime, the fleet); `bound_name`/`bound` name the declared bound
    (bitwidth 31, max_input 1000) in the message.
    """
    dtype = np.dtype(dtype)
    if dtype.kind not in "iu":
        return None  # refused elsewhere: secure sums add integers
    most = int(np.iinfo(dtype).max)
    if clients * top <= most:
        return None
    fit = most // max(clients, 1)
    bits = (fit + 1).bit_length() - 1  # the largest b with 2**b - 1 <= fit
    if bound_name == "bitwidth":
        largest = f"a bitwidth of at most {bits}"
    elif bound_name == "modulus":
        largest = f"a modulus of at most {2 ** bits}"
    else:
        largest = f"max_input at most {fit}"
    who = f"{clients} client{'s' if clients != 1 else ''}"
    return (f"{name}: {who} each adding up to {top} ({bound_name} {bound}) can sum to "
            f"{clients * top}, more than {dtype.name} holds ({most}), so the sum would "
            f"wrap; declare {largest} for {who} of {dtype.name}, use fewer clients per "
            "program, or cast the values to a wider integer dtype first.")


def weights_refusal(least: float, total_is_zero: bool) -> str | None:
    """Why weights whose smallest is `least` cannot weight a mean, or None.

    The rule of `federated_weighted_mean` wherever the weights are concrete (eager calls,
    the runtime, the fleet): every client's weight is >= 0 (a negative weight makes the
    result an extrapolation, not a mean) and the weights do not all sum to zero (0/0
    would give nan or inf). Under `jit` the weights are traced and not checked.
    """
    if least < 0:
        return (f"federated_weighted_mean: a client's weight is negative ({least}); a "
                "weighted mean takes weights >= 0 (clip them, e.g. jnp.maximum(w, 0), or "
                "give the sign to the value instead).")
    if total_is_zero:
        return ("federated_weighted_mean: the clients' weights sum to zero, so the mean "
                "is 0/0; give at least one client a positive weight (e.g. skip the "
                "round, or fall back to federated_mean).")
    return None


_GRAD_FIX = ("To differentiate, sum decoded values: federated_sum(federated_map_clients("
             "decode, value)) is the same sum; or jax.lax.stop_gradient what clients encode.")
_DECODE_SUM_REFUSALS = {
    "jvp": "is not differentiable: it decodes at the server what clients send (codes). "
           + _GRAD_FIX,
    "transpose": "has no transpose: it is not linear in the codes it decodes. " + _GRAD_FIX,
    "batch": "cannot be vmapped over its operands: a member is decoded as it was sent. vmap "
             "the program with in_axes=None for the values given to federated_decode_sum "
             "(the codes), or run it once per batch element (jax.lax.map).",
}


def decode_sum_refusal(rule: str, name: str) -> str:
    """Why `federated_decode_sum` with decoder `name` refuses jax's `rule` ("jvp",
    "transpose" or "batch": of operands the vmap batches), and the fix."""
    return f"federated_decode_sum ({name}) {_DECODE_SUM_REFUSALS[rule]}"


def declared_members(clients: Any, name: str = "clients") -> int:
    """The number of members a program declares, checked: a positive integer."""
    if isinstance(clients, bool) or not isinstance(clients, (int, np.integer)) or clients < 1:
        raise ProgramError(
            f"the number of {name} must be a positive integer, got {clients!r}; write "
            f"@fax_bridge.program(clients=8) or placements={{{name!r}: 8}}.")
    return int(clients)


def declared_placement_name(name: Any) -> str:
    """The placement name a program declares, checked: an identifier, not SERVER."""
    if not isinstance(name, str) or not name.isidentifier():
        raise ProgramError(f"a placement name must be an identifier string, got {name!r}.")
    if name.lower() == "server":
        raise ProgramError(
            f"placements must not name {name!r}: SERVER has one member and needs no entry; "
            "name the placed members, e.g. placements={'clients': 8}.")
    return name
