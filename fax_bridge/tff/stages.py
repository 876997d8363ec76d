"""Stage planning of the exporter: which equations run together, in which order.

A pure function of the traced jaxpr and each variable's placement (no proto is built
here; `export._Exporter` emits what the plan says). Every equation gets a depth, the
number of communications on its longest input path; each local equation then runs as
late as its consumers allow, so work at one placement that several depths could hold
lands in one stage. The plan lists, depth by depth, the communications (grouped by
kind, and by weights for weighted means) and then the SERVER and CLIENTS stages, each
with the variables that are needed outside it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Collection, Union

from jax._src import core

from fax_bridge.language.placements import Placement
from fax_bridge.language.primitive_facts import Batching, facts_of


@dataclasses.dataclass(frozen=True)
class Communicate:
    """Communication equations of one depth and kind, emitted together."""

    eqns: list


@dataclasses.dataclass(frozen=True)
class Stage:
    """Local equations of one placement and depth; `needed` are the outputs used later."""

    placement: Placement
    eqns: list
    needed: set


Step = Union[Communicate, Stage]


def plan(jaxpr: core.Jaxpr, placement_of: Callable[[core.Var], Placement],
         constants: Collection) -> list[Step]:
    """The steps that compute `jaxpr`, in order (see the module docstring)."""
    eqns = list(jaxpr.eqns)
    uses_after = _uses(eqns)
    earliest, comms, depth_count = _earliest_depths(eqns, placement_of, constants)
    program_outs = {v for v in jaxpr.outvars if not isinstance(v, core.Literal)}
    latest = _latest_depths(eqns, earliest, comms, uses_after, program_outs, depth_count)
    units: dict = {}
    for eqn in eqns:
        if id(eqn) in latest:
            (placement,) = {placement_of(v) for v in eqn.outvars}
            units.setdefault((placement, latest[id(eqn)]), []).append(eqn)
    stage_of = {id(e): key for key, es in units.items() for e in es}
    steps: list[Step] = []
    for level in range(depth_count + 1):
        steps.extend(Communicate(batch) for batch in _batches(comms.get(level, [])))
        for placement in (Placement.SERVER, Placement.CLIENTS):
            key = (placement, level)
            stage_eqns = units.get(key, [])
            if not stage_eqns:
                continue
            needed = {v for e in stage_eqns for v in e.outvars
                      if v in program_outs or any(stage_of.get(id(eqns[i])) != key
                                                  for i in uses_after.get(v, []))}
            steps.append(Stage(placement, stage_eqns, needed))
    return steps


def _uses(eqns: list) -> dict:
    """For each variable, the indices of the equations that read it."""
    uses: dict = {}
    for idx, eqn in enumerate(eqns):
        for v in eqn.invars:
            if not isinstance(v, core.Literal):
                uses.setdefault(v, []).append(idx)
    return uses


def _earliest_depths(eqns: list, placement_of, constants) -> tuple[dict, dict, int]:
    """(earliest depth of each local equation by id, communications by depth, max depth).

    Unplaced and constant equations get no stage (they are folded where used).
    """
    depth: dict = {}
    comms: dict = {}
    earliest: dict = {}
    for eqn in eqns:
        outs = {placement_of(v) for v in eqn.outvars}
        if outs == {Placement.UNPLACED} or all(v in constants for v in eqn.outvars):
            continue
        base = max([depth.get(v, 0) for v in eqn.invars if not isinstance(v, core.Literal)
                    and placement_of(v) is not Placement.UNPLACED] or [0])
        facts = facts_of(eqn.primitive)
        if facts is not None and facts.communicates:
            for v in eqn.outvars:
                depth[v] = base + 1
            comms.setdefault(base + 1, []).append(eqn)
        else:
            for v in eqn.outvars:
                depth[v] = base
            earliest[id(eqn)] = base
    return earliest, comms, max([0] + list(earliest.values()) + list(comms))


def _latest_depths(eqns: list, earliest: dict, comms: dict, uses_after: dict,
                   program_outs: set, max_depth: int) -> dict:
    """Each local equation's depth: as late as its consumers allow, never before its
    inputs; an equation computing a program output may wait until the last depth."""
    comm_level = {id(e): level for level, es in comms.items() for e in es}
    latest: dict = {}
    for eqn in reversed(eqns):
        if id(eqn) not in earliest:
            continue
        limit = max_depth if any(v in program_outs for v in eqn.outvars) else None
        for v in eqn.outvars:
            for i in uses_after.get(v, []):
                c = eqns[i]
                bound = comm_level[id(c)] - 1 if id(c) in comm_level else latest.get(id(c))
                if bound is not None:
                    limit = bound if limit is None else min(limit, bound)
        latest[id(eqn)] = earliest[id(eqn)] if limit is None else max(earliest[id(eqn)], limit)
    return latest


def _batches(eqns: list) -> list[list]:
    """Communication equations of one depth, grouped as their records' `Batching` says:
    by primitive, by primitive and weights, or each alone."""
    batches: dict = {}
    for e in eqns:
        batching = facts_of(e.primitive).batching
        key = (e.primitive, e.invars[1] if batching is Batching.WEIGHTS
               else id(e) if batching is Batching.ALONE else None)
        batches.setdefault(key, []).append(e)
    return list(batches.values())
