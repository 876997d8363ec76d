"""Who takes part in a round: seeded cohort sampling, dropout, stragglers and a deadline.

`plan_round` is a pure function of the policy, the population size and the round
number, so a rerun with the same seed makes the same choices. Clients that drop out or
whose emulated delay exceeds the round deadline do not report; the round runs on the
rest (the participants), in ascending population order. `RoundReport` records what
happened. Plans and reports hold their clients as `ids.ClientIds` (ranges or one array)
and delays as `ids.ClientDelays` (one array), never as per-client Python objects.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

import numpy as np

from fax_bridge.data import sampling
from fax_bridge.errors import ArgumentError, CohortError, FleetError
from fax_bridge.rounds.cohort import Cohort
from fax_bridge.rounds.ids import ClientDelays, ClientIds


@dataclasses.dataclass
class Traffic:
    """Bytes and RPCs between the coordinator and its devices.

    `down`: coordinator to devices (placing data, broadcasts, computations, requests);
    `up`: devices to coordinator (results, partials, acknowledgements). `bytes_*`
    counts gRPC messages as framed on the wire; `payload_*` counts the array data a
    round moved, in those messages or through shared memory; `shared_*` counts the
    part of the payload that went through shared-memory segments instead of the wire
    (`shared_memory`: a segment's data bytes, once per device that read or wrote it).
    """

    bytes_down: int = 0
    bytes_up: int = 0
    payload_down: int = 0
    payload_up: int = 0
    rpcs: int = 0
    compute_seconds: float = 0.0
    shared_down: int = 0
    shared_up: int = 0

    def __sub__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(getattr(self, f.name) - getattr(other, f.name)
                         for f in dataclasses.fields(self)))

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RoundPolicy:
    """Per-round behaviour of a simulated fleet.

    Attributes:
      cohort_size: clients sampled (without replacement) from the population each round;
        None takes everyone.
      dropout: probability that a sampled client drops out (does not report).
      straggler_delay_s: mean of the exponential delay each sampled client adds before
        it reports; 0 for none.
      round_deadline_s: clients whose delay exceeds this are late and do not report;
        None waits for everyone.
      min_clients: the round fails (FleetError) when fewer clients report.
      seed: seeds every random choice, together with the round number.
      emulate_delays: devices really wait for their slowest reporting client's delay.
      rounded_partials: each device or node sends its float sums rounded once to the
        value's dtype (4 bytes an element for float32, the bytes Flower's own apps
        send) instead of exact partials (about 8): the round's result then agrees with
        the exact one within the rounding of those partials, not bit for bit. A holder
        of one client sends its exact addend either way (the same 4 bytes); float16 and
        bfloat16 sums travel exact (they round once, at the end).
    """

    cohort_size: Optional[int] = None
    dropout: float = 0.0
    straggler_delay_s: float = 0.0
    round_deadline_s: Optional[float] = None
    min_clients: int = 1
    seed: int = 0
    emulate_delays: bool = True
    rounded_partials: bool = False

    def __post_init__(self):
        if not 0.0 <= self.dropout < 1.0:
            raise FleetError(f"dropout={self.dropout} must lie in [0, 1)")
        if self.cohort_size is not None and (
                isinstance(self.cohort_size, bool)
                or not isinstance(self.cohort_size, (int, np.integer)) or self.cohort_size < 1):
            raise FleetError(f"cohort_size={self.cohort_size!r} must be a whole number of "
                             "at least 1 (or None: every client)")
        if self.straggler_delay_s < 0:
            raise FleetError(f"straggler_delay_s={self.straggler_delay_s} must be >= 0")
        if self.round_deadline_s is not None and self.round_deadline_s <= 0:
            raise FleetError(f"round_deadline_s={self.round_deadline_s} must be > 0 (or None)")
        if self.min_clients < 0:
            raise FleetError(f"min_clients={self.min_clients} must be >= 0")


# Keywords that picked an implementation once: the computation's shape picks it now.
_NO_SWITCH = {
    "preaggregate": "devices always reduce their own clients first (the same bits)",
    "round_plans": "a round-shaped computation always runs as one request per device",
}


def resolve_policy(policy: Optional[RoundPolicy], fields: dict, owner: str) -> RoundPolicy:
    """The policy of a fleet given `policy=` or the policy's fields as keywords."""
    known = {f.name for f in dataclasses.fields(RoundPolicy)}
    unknown = sorted(set(fields) - known)
    if unknown:
        gone = "".join(f"; {_NO_SWITCH[k]}" for k in unknown if k in _NO_SWITCH)
        raise ArgumentError(
            f"{owner}() got unexpected keyword arguments {unknown}; the round policy's "
            f"fields are {sorted(known)}{gone}")
    if policy is not None and fields:
        raise ArgumentError(
            f"{owner}() got policy= and also {sorted(fields)}; put them in the RoundPolicy")
    if policy is not None and not isinstance(policy, RoundPolicy):
        raise ArgumentError(f"{owner}(policy=...) needs a RoundPolicy, got "
                            f"{type(policy).__name__}")
    return policy if policy is not None else RoundPolicy(**fields)


@dataclasses.dataclass
class RoundPlan:
    """The clients of one round, as population indices (ascending)."""

    cohort: ClientIds
    dropped: ClientIds
    late: ClientIds
    participants: ClientIds
    delays_s: ClientDelays  # population index -> emulated delay, for every cohort client


# The report's names for its traffic counters (`compute_s` is `Traffic.compute_seconds`).
_COUNTERS = ("compute_s", "bytes_down", "bytes_up", "payload_down", "payload_up", "rpcs",
             "shared_down", "shared_up")


def _counter(name: str) -> property:
    """A read-only attribute of a report giving its `Traffic` counter `name`."""
    return property(lambda self: getattr(self.traffic, name),
                    doc=f"`traffic.{name}`: the round's total over its tries.")


@dataclasses.dataclass
class RoundReport:
    """What happened in one round on the fleet.

    `traffic` holds the bytes, RPCs and device compute of every try of the round
    (`Traffic`), also read as `bytes_down`, `bytes_up` (gRPC messages),
    `payload_down`, `payload_up` (array data, however it went), `shared_down`,
    `shared_up` (the payload that went through shared memory instead of gRPC), `rpcs`
    and `compute_s` (its `compute_seconds`).
    `lost_devices` are devices that stopped answering during the round (each its
    address or node name, then why: what its call ended with, such as a deadline);
    `lost_clients` the participants they held, which the round then finished without.
    `served`: {holder name: {"client_runtime": its name, "model_sha256": the LiteRT
    model's sha256 or None}} (`client_runtime.served`) of each holder whose answer says
    what computed it: a fleet's device (by address) and a Flower node (by name), in a
    round that runs by split; empty for a round run phase by phase.
    `bytes_up_per_client`, `bytes_down_per_client`: the round's bytes over its
    participants (what one client's share of the uplink and downlink cost).
    """

    round: int
    population: int
    cohort: ClientIds
    dropped: ClientIds
    late: ClientIds
    participants: ClientIds
    delays_s: ClientDelays
    devices: int
    wall_s: float = 0.0
    traffic: Traffic = dataclasses.field(default_factory=Traffic)
    error: Optional[str] = None
    lost_devices: list = dataclasses.field(default_factory=list)
    lost_clients: ClientIds = dataclasses.field(default_factory=ClientIds)
    served: dict = dataclasses.field(default_factory=dict)

    # The round's traffic counters, read as the report's own attributes.
    bytes_down = _counter("bytes_down")
    bytes_up = _counter("bytes_up")
    payload_down = _counter("payload_down")
    payload_up = _counter("payload_up")
    rpcs = _counter("rpcs")
    compute_s = _counter("compute_seconds")
    shared_down = _counter("shared_down")
    shared_up = _counter("shared_up")

    @property
    def bytes_up_per_client(self) -> float:
        """`bytes_up` over the participants (0 when none reported)."""
        return self.bytes_up / len(self.participants) if len(self.participants) else 0.0

    @property
    def bytes_down_per_client(self) -> float:
        """`bytes_down` over the participants (0 when none reported)."""
        return self.bytes_down / len(self.participants) if len(self.participants) else 0.0

    def as_dict(self) -> dict:
        """The report as plain Python values (id sets as lists, delays as a dict, the
        traffic counters under the report's names)."""
        out = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Traffic):
                out.update((name, getattr(self, name)) for name in _COUNTERS)
                out["bytes_up_per_client"] = self.bytes_up_per_client
                out["bytes_down_per_client"] = self.bytes_down_per_client
                continue
            if isinstance(value, ClientIds):
                value = list(value)
            elif isinstance(value, ClientDelays):
                value = dict(zip(value.cohort, value.of(value.cohort.array()).tolist()))
            elif isinstance(value, (list, dict)):
                value = type(value)(value)
            out[field.name] = value
        return out

    def add_traffic(self, spent: Traffic) -> None:
        """Adds the wire and compute costs of one try (a `Traffic` difference)."""
        for field in dataclasses.fields(Traffic):
            setattr(self.traffic, field.name,
                    getattr(self.traffic, field.name) + getattr(spent, field.name))

    def summary(self) -> str:
        lost = (f", {len(self.lost_clients)} lost with {len(self.lost_devices)} unreachable "
                "devices" if self.lost_devices else "")
        return (f"round {self.round}: {len(self.participants)}/{len(self.cohort)} clients "
                f"reported ({len(self.dropped)} dropped, {len(self.late)} late{lost}) in "
                f"{self.wall_s:.3f}s; {self.bytes_down} B down, {self.bytes_up} B up "
                f"({self.bytes_down_per_client:.0f} B down, {self.bytes_up_per_client:.0f}"
                " B up a client)"
                + (f" over gRPC, {self.shared_down} B down and {self.shared_up} B up "
                   "through shared memory" if self.shared_down or self.shared_up else ""))


def plan_round(policy: RoundPolicy, population: Union[int, Cohort],
               round_index: int) -> RoundPlan:
    """Samples the cohort and decides dropouts and delays of round `round_index`.
    `population`: the round's `Cohort` (`Cohort.of`, which checks the policy's cohort
    size against the population), or the population's size to derive it from."""
    counted = (population if isinstance(population, Cohort)
               else Cohort.of(policy.cohort_size, population))
    if counted.size != (policy.cohort_size or counted.population):
        raise CohortError(f"a cohort of {counted.size} clients planned with a policy of "
                          f"cohort_size={policy.cohort_size}; derive it from that policy "
                          "(Cohort.of(policy.cohort_size, ...))")
    population, size = counted.population, counted.size
    if size == population and policy.dropout == 0 and policy.straggler_delay_s == 0:
        # Nothing to draw: every client takes part, as the draws below would decide.
        everyone = ClientIds.span(0, population)
        return RoundPlan(cohort=everyone, dropped=ClientIds(), late=ClientIds(),
                         participants=everyone, delays_s=ClientDelays(everyone, None))
    rng = sampling.round_generator(policy.seed, round_index)
    chosen = sampling.draw(rng, population, size)  # as `data.sample_cohort` draws it
    cohort = (ClientIds.span(0, population) if size == population else ClientIds(chosen))
    del chosen
    drops = rng.random(size) < policy.dropout
    delays = (rng.exponential(policy.straggler_delay_s, size) if policy.straggler_delay_s > 0
              else None)
    late_mask = (delays > policy.round_deadline_s
                 if policy.round_deadline_s is not None and delays is not None
                 else np.zeros(size, bool))
    if not drops.any() and not late_mask.any():  # everyone reports: share the encoding
        participants, dropped, late = cohort, ClientIds(), ClientIds()
    else:
        ids = cohort.array()
        dropped = ClientIds(ids[drops])
        late = ClientIds(ids[late_mask & ~drops])
        participants = ClientIds(ids[~drops & ~late_mask])
    return RoundPlan(cohort=cohort, dropped=dropped, late=late, participants=participants,
                     delays_s=ClientDelays(cohort, delays))


def check_min_clients(policy: RoundPolicy, plan: RoundPlan, round_index: int) -> None:
    """Raises FleetError when fewer than `min_clients` clients report.

    The message names only what happened (clients that dropped out, clients past the
    round deadline, a cohort smaller than `min_clients`) and the settings that change it.
    """
    if len(plan.participants) >= policy.min_clients:
        return
    why, fixes = [], ["lower min_clients"]
    if len(plan.dropped):
        why.append(f"{len(plan.dropped)} dropped out")
        fixes.append("lower dropout")
    if len(plan.late):
        why.append(f"{len(plan.late)} missed the round deadline of "
                   f"{policy.round_deadline_s:g}s")
        fixes.append("raise round_deadline_s or lower straggler_delay_s")
    if len(plan.cohort) < policy.min_clients:
        why.append("the cohort is smaller than min_clients")
        fixes.append("raise cohort_size or place more clients")
    reasons = f" ({'; '.join(why)})" if why else ""
    raise FleetError(
        f"round {round_index}: only {len(plan.participants)} of {len(plan.cohort)} "
        f"sampled clients reported{reasons} but min_clients={policy.min_clients}; "
        f"{', '.join(fixes[:-1]) + ' or ' + fixes[-1] if len(fixes) > 1 else fixes[0]}")
