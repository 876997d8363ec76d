"""How many clients a round has: derived once per round from its inputs, checked once.

Two inputs decide it. The population a round samples from, counted where it comes
from: the CLIENTS arguments (their leading axis, a `PopulationRef`'s ids, or the store
it names) or a fleet's `num_clients=` (`population_of`), the SuperNodes' blocks of a
Flower run, the clients a round in process is given (`clients_of`). And the policy's
cohort size (`RoundPolicy.cohort_size`, Flower's run config `cohort-size`), none for
everyone. `Cohort.of` puts the two together and refuses a disagreement (`CohortError`)
naming both values, where each came from, and the fix, before any client work runs.
The round's plan (`policy.plan_round`) samples from that `Cohort`, and each transport
is handed the number of clients of its round (`Transport.num_clients`: the plan's
participants, or `clients_of` in process); none counts them again.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from fax_bridge.errors import CohortError, ComputationError
from fax_bridge.runtime.values import BoundArguments

__all__ = ["Cohort", "CohortError", "clients_of", "population_of"]


@dataclasses.dataclass(frozen=True)
class Cohort:
    """The clients a round samples from (`population`, counted from `source`) and how
    many it samples (`size`, the policy's `setting`, else every client)."""

    population: int
    size: int
    source: str = "the population"
    setting: str = "cohort_size"

    @classmethod
    def of(cls, cohort_size: Optional[int], population: int,
           source: str = "the population", setting: str = "cohort_size") -> "Cohort":
        """The cohort of a round: `cohort_size` (None: everyone) of `population` clients.
        `source`: where the population's count came from; `setting`: the name the user
        gave the cohort size; both name the values in the one refusal."""
        if population < 0:
            raise CohortError(f"{source} counts {population} clients; a population has 0 "
                              "or more")
        size = population if cohort_size is None else int(cohort_size)
        if size > population:
            raise CohortError(
                f"{setting}={size} exceeds the population of {population} clients "
                f"({source}); lower {setting} to at most {population} or place more "
                "clients")
        return cls(population, size, source, setting)

    @property
    def everyone(self) -> bool:
        """Whether every client of the population is sampled."""
        return self.size == self.population


# Where a fleet round's population comes from, in the words errors use.
FROM_ARGUMENTS = "the CLIENTS arguments' leading axis"
FROM_NUM_CLIENTS = "num_clients="
FROM_NOTHING = "no CLIENTS argument and no num_clients="


def population_of(bound: BoundArguments, num_clients: Optional[int] = None,
                  population_size: Optional[Callable[[Any], int]] = None
                  ) -> tuple[Optional[int], str]:
    """(The population a fleet round samples from, where its count came from): the
    clients its CLIENTS arguments hold (`BoundArguments.num_clients`; `population_size`
    counts a `PopulationRef` that names no ids), else `num_clients`, else None (no
    client takes part). CohortError when both are given and disagree."""
    counted = bound.num_clients(population_size)
    if counted is None:
        return (None, FROM_NOTHING) if num_clients is None else (
            int(num_clients), FROM_NUM_CLIENTS)
    if num_clients is not None and int(num_clients) != counted:
        raise CohortError(
            f"num_clients={num_clients} but {FROM_ARGUMENTS} holds {counted} clients; "
            f"drop num_clients= (the CLIENTS arguments fix the population) or give "
            f"{num_clients} clients")
    return counted, FROM_ARGUMENTS


def clients_of(split: Any, arg: Any) -> int:
    """The clients a round's runtime argument `arg` holds in the CLIENTS inputs of
    `split` (a `RoundSplit`): the ids a `PopulationRef` names, or the values' number of
    members. ComputationError when two inputs disagree."""
    counts = set()
    for i in split.client_inputs:
        n = getattr(arg[i], "num_clients", None)
        counts.add(int(n) if n is not None else len(arg[i]))
    if len(counts) != 1:
        raise ComputationError(
            f"CLIENTS inputs disagree on the number of clients: {sorted(counts)}")
    return counts.pop()
