"""What a traced program must satisfy before it is exported as a TFF Computation.

TFF has no loop or branch over federated values, no cross-client work outside its
intrinsics, and no typed PRNG keys in its types: each refusal is an `ExportError` naming
the equation, the user's source line and the fix.
"""

from __future__ import annotations

from typing import NoReturn, Optional, Sequence

import jax
from jax._src import core

from fax_bridge.language import tracing
from fax_bridge.errors import ExportError
from fax_bridge.language.primitive_facts import Movement, facts_of
from fax_bridge.tff import types as tff_types


def fix_hint(v: tracing.Violation) -> str:
    """How to rewrite the cross-client work `v` so that it can be exported."""
    name = v.eqn.primitive.name
    if name in ("slice", "gather", "dynamic_slice", "squeeze", "index_in_dim"):
        return ("it reads the slice of particular clients. Compute per client inside "
                "federated_map_clients, or aggregate with federated_mean/federated_sum.")
    if name.startswith("reduce_") or name in ("argmax", "argmin"):
        return ("it reduces over the clients axis. Use federated_sum, federated_mean or "
                "federated_weighted_mean to aggregate.")
    return ("cross-client work must go through the federated primitives; compute per "
            "client inside federated_map_clients and aggregate with federated_sum/mean.")


def _fail(eqn, message: str) -> NoReturn:
    raise ExportError(f"{eqn.primitive.name} at {tracing.eqn_location(eqn)}: {message}")


def check_exportable(comp: tracing.FederatedComputation,
                     arg_names: Sequence[Optional[str]]) -> None:
    """Raises `ExportError` for the first part of `comp` TFF cannot express.

    `arg_names` name the arguments as the user wrote them, for the typed-key message.
    """
    if comp.violations:
        v = comp.violations[0]
        raise ExportError(
            f"cannot export: {v.eqn.primitive.name} at {v.location} {v.reason}; "
            f"{fix_hint(v)}")
    args = jax.tree_util.tree_unflatten(comp.in_tree, list(comp.in_avals))
    tff_types.refuse_typed_keys(args, arg_names)  # named as the user wrote them
    for path, aval in zip(comp.out_paths, comp.out_avals):
        if tff_types.is_typed_key(aval):
            raise ExportError(f"result {path} is a typed PRNG key ({aval.dtype}); "
                              f"{tff_types.TYPED_KEY_FIX}")
    for eqn in comp.jaxpr.jaxpr.eqns:
        facts = facts_of(eqn.primitive)
        if facts is not None and any(
                tff_types.is_typed_key(v.aval) for v in [*eqn.invars, *eqn.outvars]):
            _fail(eqn, "a typed PRNG key crosses placements; "
                       f"{tff_types.TYPED_KEY_FIX}")
        if facts is not None and facts.movement is Movement.MAP:
            continue
        for sub in core.jaxprs_in_params(eqn.params):
            if tracing._clients_from_jaxpr(sub):
                _fail(eqn, (
                    "federated operations inside control flow cannot be exported: TFF "
                    "has no loop or branch over federated values. Export one round and "
                    "loop in Python around the runtime, or unroll the loop."))
