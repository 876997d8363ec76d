"""`FleetRounds`: rounds of a computation on a fleet of devices, under a `RoundPolicy`.

The part `launcher.LocalFleet` (which starts its devices) and `remote.RemoteFleet` (which
joins devices started elsewhere) share: each round samples its cohort, drops and delays
clients per the policy, runs the computation on the participants through a
`GrpcClientsBackend`, and records a `RoundReport`. A round-shaped computation runs
through the round engine (`engine.run_round` over a `grpc_transport.GrpcTransport`);
any other computation runs phase by phase (`interpreter.evaluate` on the same backend):
the computation's shape picks the path (`round_split.split_of`), nothing else; a fleet
whose devices run another client runtime than XLA has it check each round first
(`ClientRuntime.check_round`: LiteRT converts the client part, or each trip's client map
of a round run phase by phase, or refuses naming the op), and refuses an answer (a
round's, or a phase's map) computed by another. The
policy (cohort, `min_clients`, lost devices, the report) is the engine's (`engine.open_round`, `engine.drop_lost`). When
devices stop answering or miss their deadline (`rpc_timeout_s`) and
`survive_device_loss` is set, the round is finished on the devices that answered in
time (on none when every device is lost: a round over no clients, which `min_clients=0`
allows for sums, as when every client drops out); each lost one is named in the report
with why. A device whose round answer no
honest device could send (partials for other clients, tensors or aggregations than it
was sent) is refused by the engine and its clients leave that round the same way,
named in `lost_devices` with what was wrong; too few left for `min_clients` fails it.
`run_loop` threads server state through rounds and checkpoints it (`checkpoint`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any, Callable, Iterable, Optional, Sequence

from fax_bridge.errors import FleetError
from fax_bridge.fleet import grpc_transport
from fax_bridge.rounds import checkpoint, cohort, engine, round_split
from fax_bridge.rounds.client_runtime import ClientRuntime
from fax_bridge.fleet.coordinator import GrpcClientsBackend
from fax_bridge.rounds.ids import ClientIds
from fax_bridge.fleet.protocol import partition
from fax_bridge.rounds.policy import RoundPolicy, RoundReport
from fax_bridge.runtime import interpreter, values
from fax_bridge.runtime.population import PopulationRef


# The round-behaviour options every fleet takes, with the same meaning and defaults.
ROUND_OPTIONS = ("policy", "rpc_timeout_s", "progress",
                 "survive_device_loss", "probe_timeout_s", "reject_nonfinite")


class FleetRounds:
    """Rounds on a fleet of devices reached through a `GrpcClientsBackend`.

    The shared part of `LocalFleet` (which starts its devices) and
    `fax_bridge.fleet.remote.RemoteFleet` (which joins devices started elsewhere):
    seeded cohorts, dropouts, delays and `min_clients` per `RoundPolicy`, round reports,
    and, when `survive_device_loss` is set, finishing a round on the surviving devices
    when some stop answering (their clients count as lost). Subclasses set `backend`,
    `addresses` and `num_devices` in `start()` and release them in `close()`.

    Both fleets take the same round-behaviour options, the keyword arguments of this
    constructor (`ROUND_OPTIONS`): `policy` (or its fields), `rpc_timeout_s`, `progress` (tqdm bars in `run_rounds` and `run_loop`),
    `survive_device_loss`, `probe_timeout_s` and `reject_nonfinite` (refuse NaN and
    infinities in what devices send back).
    """

    def __init__(self, *, policy: RoundPolicy, rpc_timeout_s: float,
                 progress: bool, survive_device_loss: bool, probe_timeout_s: float,
                 reject_nonfinite: bool, population_name: Optional[str] = None) -> None:
        self.policy = policy
        self.reject_nonfinite = bool(reject_nonfinite)
        self.survive_device_loss = bool(survive_device_loss)
        self.probe_timeout_s = float(probe_timeout_s)
        self.population_name = population_name
        self.rpc_timeout_s = rpc_timeout_s
        self.progress = progress
        self.addresses: list[str] = []
        self.backend: Optional[GrpcClientsBackend] = None
        self.reports: list[RoundReport] = []
        self.next_round = 0
        self._closed = False
        # What runs the client parts on the devices, where this fleet chose it
        # (`LocalFleet`: its FleetConfig's); None takes what the devices run.
        self.client_runtime: Optional[ClientRuntime] = None

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self):
        raise NotImplementedError

    def close(self) -> None:
        """Releases this fleet's values on the devices and closes the channels."""
        if self._closed:
            return
        self._closed = True
        if self.backend is not None:
            try:
                self.backend.close()
            except Exception:
                pass  # a device that is gone holds nothing any more

    @property
    def last_report(self) -> Optional[RoundReport]:
        return self.reports[-1] if self.reports else None

    @property
    def population(self) -> PopulationRef:
        """Every client of the population the devices host, as a CLIENTS argument.

        Pass it (or a `PopulationRef` with `keys=` / `client_ids=`) where a CLIENTS
        argument goes: each round's cohort is sampled from it, and each device reads
        only its share of the cohort's rows from its own store.
        """
        return PopulationRef(name=self.population_name)

    def _population_size(self, ref: PopulationRef) -> int:
        if self.backend is None:
            raise FleetError("the fleet is not running; start it first")
        return self.backend.population_size(ref)

    # -- rounds -------------------------------------------------------------------

    def run(self, proto, *args: Any, report: bool = False, num_clients: Optional[int] = None,
            **kwargs: Any):
        """Runs one round of `proto` on pytrees (CLIENTS ones with a leading clients axis).

        The round's cohort, dropouts and delays follow the fleet's policy; the
        computation sees only the participating clients. Returns the result as a
        pytree, or `(result, RoundReport)` with `report=True` (also `last_report`): with
        the structure jit gives the program (NamedTuples, dataclasses, optax states,
        None, lists) when `proto` was exported in this process, so it can be fed to
        `jax.jit(program)` or to the next round; a proto read from a file gives the
        generic structure (`runtime.result_structure`).
        `num_clients` gives the population when no argument is placed at CLIENTS (beside
        CLIENTS arguments it must equal their number of clients: CohortError otherwise);
        a computation that places nothing at CLIENTS itself needs neither.
        """
        if self.backend is None or self._closed:
            raise FleetError(f"the fleet is not running; use `with {type(self).__name__}"
                             "(...) as fleet:`")
        prepared = interpreter.prepare(proto)
        bound = values.bind_arguments(prepared.parameter, args, kwargs)
        # The round's cohort, derived and checked once (`rounds.cohort`) before the round
        # takes its index: a refused cohort leaves the run's rounds and seeds as they were.
        population, source = cohort.population_of(bound, num_clients,
                                                  self._population_size)
        counted = cohort.Cohort.of(self.policy.cohort_size, population or 0, source)
        clients_given = source == cohort.FROM_ARGUMENTS
        round_index = self.next_round
        self.next_round += 1
        rep = engine.open_round(self.policy, None if population is None else counted,
                                round_index, self.reports, self.num_devices,
                                prepared.proto)
        while True:
            try:
                result = self._attempt(prepared, bound, clients_given,
                                       None if population is None else rep.participants,
                                       rep)
                break
            except FleetError as e:
                lost = self._lose_unreachable_devices(rep.participants, rep, e)
                if not any(len(h.clients) for h in lost):  # none of them held a participant
                    if lost:
                        engine.record_lost(rep, lost)
                    rep.error = f"{type(e).__name__}: {e}"
                    raise
                try:
                    engine.drop_lost(rep, self.policy, lost,
                                     "lower min_clients or restart those devices")
                except FleetError as refused:
                    raise refused from e
            except BaseException as e:
                rep.error = f"{type(e).__name__}: {e}"
                raise
        return (result, rep) if report else result

    def _attempt(self, prepared: interpreter.Prepared, bound: values.BoundArguments,
                 clients_given: bool, participants: Optional[ClientIds], rep: RoundReport):
        """One try at the round on the current devices; adds its costs to `rep`.

        `participants`: the population indices taking part (None when the round has no
        population: the computation then must not need a number of clients).
        """
        num_clients = None
        if participants is not None:
            if clients_given:
                bound = bound.select_clients(participants.array())
            else:
                num_clients = len(participants)
            if self.policy.emulate_delays and self.policy.straggler_delay_s > 0:
                self.backend.set_delays(rep.delays_s.of(participants.array()))
        before = dataclasses.replace(self.backend.traffic)
        start = time.perf_counter()
        backend = self.backend
        try:
            split = (round_split.split_of(prepared.proto)
                     if participants is not None and clients_given else None)
            if self.client_runtime is not None:  # converted, or refused, before any work
                self.client_runtime.check_round(prepared.proto, split)
                backend.client_runtime = self.client_runtime.name
            # Checked and converted here. A round by split has its cohort selected
            # above, so every PopulationRef in it names its clients' ids.
            arg = bound.runtime_value()
            if split is not None:
                grpc_transport.check_inputs(split, arg)
                backend.rounded_partials = self.policy.rounded_partials
                transport = grpc_transport.GrpcTransport(
                    backend, split, arg, len(participants), backend.take_delays(),
                    None if self.client_runtime is None else self.client_runtime.name,
                    ids=participants.array(), served=rep.served)
                ended = False
                try:  # a device whose answer is refused leaves the round, named
                    result = engine.run_round(
                        split, arg, transport, prepared.result,
                        on_lost=lambda lost, answered: engine.drop_lost(
                            rep, self.policy, lost, "lower min_clients, or check those "
                            "devices run this fax_bridge and take them out of the fleet"))
                    ended = True
                finally:
                    transport.end_round(ended)
            else:
                result = interpreter.evaluate(prepared, arg, backend, num_clients=num_clients)
            return values.to_pytree(result, prepared.result, prepared.structure)
        finally:
            backend.set_delays(None)
            rep.wall_s += time.perf_counter() - start
            try:
                backend.collect()
            except FleetError:
                pass  # an unreachable device; the caller decides what that means
            rep.add_traffic(backend.traffic - before)

    def _lose_unreachable_devices(self, participants: ClientIds, rep: RoundReport,
                                  error: FleetError) -> list:
        """After a failed try: finds the devices that no longer answer Health, and those
        whose call of the try ran past its deadline (stragglers, answering Health or not).

        Returns them as `engine.LostHolder`s (their addresses with why, and the
        participants they held; none when every device answers in time, or when this
        fleet does not survive device loss), after reconnecting to the others. When
        every device is lost, all of them are returned, as a round whose holders all
        left: the policy decides (`engine.drop_lost`: with `min_clients=0` the round
        finishes over no clients, which asks no device anything), and the fleet keeps
        their addresses, so the next round asks them again.
        """
        if not self.survive_device_loss or self.backend is None:
            return []
        alive = self.backend.probe(self.probe_timeout_s)
        late = set(getattr(error, "late", ()))
        dead = [i for i, ok in enumerate(alive) if not ok or i in late]
        if not dead:
            return []
        blocks = partition(len(participants), len(alive))
        ids = participants.array()
        lost = [engine.LostHolder(self._why_lost(i, error, alive[i]),
                                  ids[blocks[i].start:blocks[i].stop]) for i in dead]
        if len(dead) < len(alive):  # none to reconnect to when every device is lost
            self._reconnect([a for i, a in enumerate(self.addresses) if i not in dead])
        rep.devices = self.num_devices
        return lost

    def _why_lost(self, index: int, error: FleetError, answers_health: bool) -> str:
        """Device `index`'s address and why the round lost it: what its call of the
        failed try ended with (a deadline, an unreachable device), then whether it still
        answers Health (a straggler) or not."""
        reason = getattr(error, "reasons", {}).get(index)
        after = (f"it still answers Health: a straggler, left out of this fleet's rounds"
                 if answers_health else
                 f"no Health answer within {self.probe_timeout_s:g}s")
        if reason is None:
            return f"{self.addresses[index]}: {after} after the round's try failed"
        return f"{self.addresses[index]}: {reason}; then {after}"

    def _reconnect(self, addresses: list[str]) -> None:
        """Replaces the backend by one over `addresses` (handles keep counting)."""
        old = self.backend
        old.rpc_timeout_s = min(old.rpc_timeout_s, self.probe_timeout_s)
        try:
            old.close()
        except FleetError:
            pass
        if old.shared_memory is not None:  # the answers kept for lost devices go
            old.shared_memory.drop_kept(addresses)
        self.backend = self._connect(addresses, self.probe_timeout_s * 5)
        # Survivors may still hold values of the failed try: never reuse their handles.
        self.backend.take_handles(old)
        self.addresses = list(addresses)
        self.num_devices = len(addresses)

    def _connect(self, addresses: list[str], connect_timeout_s: float) -> GrpcClientsBackend:
        """A backend over `addresses` with this fleet's credentials and caps."""
        return GrpcClientsBackend(addresses, rpc_timeout_s=self.rpc_timeout_s,
                                  connect_timeout_s=connect_timeout_s,
                                  reject_nonfinite=self.reject_nonfinite,
                                  **self._backend_options())

    def _backend_options(self) -> dict:
        """Further `GrpcClientsBackend` arguments (token, TLS, caps) of this kind of fleet."""
        return {}

    def run_loop(self, proto, state: Any, num_rounds: int,
                 client_args: Callable[[int], Sequence[Any]], *,
                 next_state: Optional[Callable[[Any], Any]] = None,
                 checkpoint_dir: "Optional[os.PathLike | str]" = None,
                 on_round: Optional[Callable[[int, Any, Any], None]] = None) -> Any:
        """Runs rounds 0..num_rounds-1 of `proto(state, *client_args(r))`; returns the state.

        `next_state(result)` picks the next state from a round's result (default: the
        result itself). Round r is planned as round r of the fleet's policy whatever ran
        before, so a resumed run makes the same choices. With `checkpoint_dir` the state is
        saved after every round and a rerun resumes after the last saved round (refusing a
        checkpoint of a computation of another type, or of another policy).
        `on_round(r, result, report)` is called after each round. With the fleet's
        `progress` a tqdm bar counts the rounds (a resumed run starts at the saved round).
        """
        # The fingerprint names the program (its bytes hold source locations that differ
        # between processes building the same program; the fingerprint leaves them out).
        meta = {"computation": str(interpreter.computation_type(proto)),
                "policy": repr(self.policy), "num_rounds": int(num_rounds)}
        start = 0
        if checkpoint_dir is not None:
            meta["program"] = checkpoint.program_fingerprint(interpreter.as_proto(proto))
            saved = checkpoint.resume(checkpoint_dir, meta, like=state)
            if saved is not None:
                state, start = saved.state, saved.round + 1
        with self._progress_bar(int(num_rounds), initial=start) as bar:
            for r in range(start, int(num_rounds)):
                self.next_round = r
                result = self.run(proto, state, *client_args(r))
                state = next_state(result) if next_state is not None else result
                if checkpoint_dir is not None:
                    checkpoint.save(checkpoint_dir, r, state, meta)
                self._advance(bar)
                if on_round is not None:
                    on_round(r, result, self.last_report)
        return state

    def run_rounds(self, proto, rounds: Iterable[Sequence[Any]],
                   progress: Optional[bool] = None) -> list:
        """Runs `proto` once per argument tuple of `rounds`; a tqdm bar when `progress`."""
        results = []
        rounds = list(rounds)
        with self._progress_bar(len(rounds), show=progress) as bar:
            for args in rounds:
                results.append(self.run(proto, *args))
                self._advance(bar)
        return results

    def _progress_bar(self, total: int, initial: int = 0, show: Optional[bool] = None):
        """A tqdm bar over rounds, shown when `show` (default: the fleet's `progress`)."""
        from fax_bridge.system.progress import bar as tqdm

        show = self.progress if show is None else show
        return tqdm(total=total, initial=initial, disable=not show, unit="round",
                    desc="fleet rounds")

    def _advance(self, bar) -> None:
        """Moves `bar` on by one round, showing the last round's clients and bytes."""
        rep = self.last_report
        bar.set_postfix(clients=len(rep.participants), up=rep.bytes_up,
                        down=rep.bytes_down, refresh=False)
        bar.update(1)
