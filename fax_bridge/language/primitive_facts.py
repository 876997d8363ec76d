"""One record per federated primitive: the facts tracing, export and the forms read.

As jax registers a primitive's rules beside its definition, each module that defines a
federated primitive (`primitives`, `secure`) calls `register` beside it with a
`PrimitiveFacts`: how it moves values between placements (tracing's placement rule),
which TFF intrinsic it exports to (federated_language's `intrinsic_defs`) and so which
runtime aggregation kind it runs, and how the exporter batches it at one depth (the
exporter's `tff/emitters` emits it). Tracing, `tff/stages`,
`tff/forms` and `tff/export` look records up here and keep no table of their own, so a
new primitive touches its own module and its tests.

`AGGREGATION_KINDS` is the one table from a TFF intrinsic to the runtime aggregation
kind it runs (`runtime.aggregation`), checked against `intrinsic_defs` when this module
loads: a record's `kind`, the runtime's intrinsic table (`runtime.intrinsics`) and the
round split (`rounds.round_split`) all read it.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Optional

from federated_language.compiler import intrinsic_defs
from jax._src import core

from fax_bridge.errors import ArgumentError
from fax_bridge.language.placements import Placement


class Movement(enum.Enum):
    """How a primitive moves values: its placement rule when a program is traced."""

    BROADCAST = "broadcast"  # SERVER operands -> CLIENTS results
    AGGREGATE = "aggregate"  # CLIENTS operands -> SERVER results
    MAP = "map"  # per-member work at params["placement"]: local work in a stage

    @property
    def takes(self) -> Optional[Placement]:
        """Where the operands must be (None: where the equation's params say)."""
        return {"broadcast": Placement.SERVER, "aggregate": Placement.CLIENTS}.get(self.value)

    @property
    def gives(self) -> Optional[Placement]:
        """Where the results are (None: where the equation's params say)."""
        return {"broadcast": Placement.CLIENTS, "aggregate": Placement.SERVER}.get(self.value)


class Batching(enum.Enum):
    """Which equations of one depth the exporter emits together."""

    KIND = "kind"  # all equations of this primitive
    WEIGHTS = "weights"  # those of this primitive sharing operand 1 (the weights)
    ALONE = "alone"  # each equation alone


# The DistributeAggregateForm piece a communication belongs to.
_FORM_ROLES = {Movement.BROADCAST: "server_to_client_broadcast",
               Movement.AGGREGATE: "client_to_server_aggregation"}


@dataclasses.dataclass(frozen=True)
class PrimitiveFacts:
    """The facts of one federated primitive.

    `intrinsic` is the TFF intrinsic its equations export to (None for the map, which is
    local work inside a stage's `federated_map`/`federated_apply`); `kind` (derived) the
    runtime aggregation kind that intrinsic runs (`AGGREGATION_KINDS`), None where it is
    no aggregation or the runtime runs the intrinsic's own functions
    (`federated_aggregate`).
    """

    primitive: core.Primitive
    movement: Movement
    intrinsic: Optional[intrinsic_defs.IntrinsicDef]
    batching: Optional[Batching] = None

    @property
    def kind(self) -> Optional[str]:
        """The runtime aggregation kind its intrinsic runs (None: no such kind)."""
        return AGGREGATION_KINDS.get(self.intrinsic)

    @property
    def communicates(self) -> bool:
        """Whether its equations cross placements (a step of their own when exported)."""
        return self.movement is not Movement.MAP

    @property
    def aggregates(self) -> bool:
        return self.movement is Movement.AGGREGATE

    @property
    def form_role(self) -> Optional[str]:
        """The DistributeAggregateForm piece its equations belong to (None: work)."""
        return _FORM_ROLES.get(self.movement)


# Every aggregation of `intrinsic_defs` but `federated_aggregate` (whose own zero,
# accumulate, merge and report the runtime runs) is one of the runtime's kinds. Min and
# max no primitive exports; the runtime runs them in protos written elsewhere.
AGGREGATION_KINDS: dict = {
    intrinsic_defs.FEDERATED_SUM: "sum",
    intrinsic_defs.FEDERATED_MEAN: "mean",
    intrinsic_defs.FEDERATED_WEIGHTED_MEAN: "weighted_mean",
    intrinsic_defs.FEDERATED_MIN: "min",
    intrinsic_defs.FEDERATED_MAX: "max",
    intrinsic_defs.FEDERATED_SECURE_SUM_BITWIDTH: "secure_sum_bitwidth",
    intrinsic_defs.FEDERATED_SECURE_SUM: "secure_sum",
}
KIND_OF_URI: dict = {d.uri: kind for d, kind in AGGREGATION_KINDS.items()}
SECURE_KINDS: tuple = tuple(kind for d, kind in AGGREGATION_KINDS.items()
                            if d.aggregation_kind is intrinsic_defs.AggregationKind.SECURE)


def kind_table_mismatches() -> list:
    """How `AGGREGATION_KINDS` disagrees with `intrinsic_defs` (empty when it agrees):
    the aggregations it names must be those `intrinsic_defs` marks as aggregations (but
    `federated_aggregate`), and exactly its secure ones secure kinds."""
    marked = {d for d in vars(intrinsic_defs).values()
              if isinstance(d, intrinsic_defs.IntrinsicDef) and d.aggregation_kind is not None}
    wrong = [f"{d.uri} is an aggregation of intrinsic_defs with no kind"
             for d in marked - set(AGGREGATION_KINDS) - {intrinsic_defs.FEDERATED_AGGREGATE}]
    wrong += [f"{d.uri} has a kind but is no aggregation of intrinsic_defs"
              for d in set(AGGREGATION_KINDS) - marked]
    wrong += [f"{d.uri}: kind {kind!r} but intrinsic_defs says {d.aggregation_kind}"
              for d, kind in AGGREGATION_KINDS.items() if d in marked
              and (d.aggregation_kind is intrinsic_defs.AggregationKind.SECURE)
              != kind.startswith("secure_")]
    return wrong


if kind_table_mismatches():  # a federated_language that moved an intrinsic
    raise ImportError("fax_bridge.language.primitive_facts.AGGREGATION_KINDS disagrees with this "
                      f"federated_language's intrinsic_defs: {kind_table_mismatches()}")


_REGISTRY: dict = {}


def register(facts: PrimitiveFacts) -> PrimitiveFacts:
    """Registers `facts` for `facts.primitive`, refusing an incomplete record."""
    if facts.communicates and (facts.intrinsic is None or facts.batching is None):
        raise ArgumentError(f"{facts.primitive.name}: a communication names its intrinsic and "
                        "its batching.")
    if not facts.communicates and (facts.batching is not None or facts.intrinsic is not None):
        raise ArgumentError(f"{facts.primitive.name}: local work has no batching or "
                            "intrinsic.")
    _REGISTRY[facts.primitive] = facts
    return facts


def facts_of(prim: core.Primitive) -> Optional[PrimitiveFacts]:
    """The record of `prim`, or None when it is no federated primitive."""
    return _REGISTRY.get(prim)


def registered() -> tuple:
    """Every registered record, in registration order."""
    return tuple(_REGISTRY.values())
