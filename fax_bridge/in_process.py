"""The in-process transport, and `run_computation`: a computation run here on pytrees.

A round-shaped computation (server prepare, one broadcast, one client part,
aggregations, server result: `rounds.round_split`) whose CLIENTS inputs are all values
runs through the round engine (`rounds.engine`) with this module's transport: the client
part once over every client, as one batched XLA call, and its exact partials finished as
every other path finishes them. Anything else, and any call given its own `backend` or
`num_clients`, is interpreted phase by phase (`interpreter.evaluate`). Both give the same
bits: exact aggregations do not depend on how clients are grouped or ordered.

On an accelerator (`device_sums.on_device`: by default wherever jax's default backend
is not the CPU) a round keeps its values there: the client part's results stay jax
arrays, its sums, means and weighted means are summed exactly there
(`device_sums`), and the server result runs there under jit. A model given as jax
arrays is read where it is, and the round's result comes back as jax arrays on that
device, as jit returns them (`values.device_arrays_kept`); CLIENTS data is read to the
host, where the client calls stack it. The bits are the host path's.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from federated_language.common_libs import structure
from federated_language.proto.computation_pb2 import Computation

from fax_bridge.errors import ArgumentError, ComputationError, FaxBridgeError
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds import cohort, engine, round_split
from fax_bridge.rounds.client_runtime import ClientRuntime
from fax_bridge.runtime import device_rounds, device_sums, interpreter, values
from fax_bridge.runtime.backend import ClientsBackend
from fax_bridge.runtime.local_backend import LocalClientsBackend
from fax_bridge.runtime.population import PopulationRef

class InProcessTransport:
    """Every client in this process, as one holder: the client part over the clients'
    inputs, run by `client_runtime` (`rounds.client_runtime`; a name is parsed)."""

    reject_nonfinite = False
    rounded_partials = False
    traffic = None

    def __init__(self, arg: Any, split: round_split.RoundSplit, num_clients: int,
                 backend=None, client_runtime: Union[str, ClientRuntime] = "xla",
                 on_device: bool = False, clients_per_step: Union[int, str, None] = None,
                 progress: bool = False):
        self.client_runtime = runtimes.resolve(client_runtime)
        self.clients_per_step, self.progress = clients_per_step, progress
        # the XLA client part's results kept on the device (`device_sums.on_device`)
        self.on_device = on_device and isinstance(self.client_runtime,
                                                  runtimes.XlaClientRuntime)
        self.inputs = [arg[i] for i in split.client_inputs]
        self.num_clients = num_clients  # `cohort.clients_of`, counted once by the caller
        self.backend = backend

    def run_clients(self, split: round_split.RoundSplit,
                    sent: structure.Struct) -> engine.Answers:
        members = [structure.Struct([(None, column[c]) for column in self.inputs])
                   for c in range(self.num_clients)]
        specs = [a.spec for a in split.aggregations]  # secure sums too, summed exactly
        if self.on_device:
            found = device_rounds.client_partials(
                split.client_part, split.client_part_hash, sent, members, specs,
                self.clients_per_step, self.progress)
            if found is None:  # aggregations the device does not finish: read back
                found = round_split.client_partials(
                    split.client_part, split.client_part_hash, sent, members, specs,
                    on_device=True)
        else:
            found = self.client_runtime.client_partials(
                split.client_part, split.client_part_hash, sent, members, specs)
        return engine.Answers([engine.HolderAnswer("this process", self.num_clients, found)])


def run_in_process(split: round_split.RoundSplit, arg: Any, backend=None,
                   client_runtime: Union[str, ClientRuntime] = "xla",
                   num_clients: Optional[int] = None, on_device: bool = False,
                   clients_per_step: Union[int, str, None] = None,
                   progress: bool = False) -> Any:
    """Runs a split with no devices (`arg`: the runtime value of the parameter);
    `client_runtime`: what runs the client part ("xla", "litert": the LiteRT
    interpreter, or a `ClientRuntime`), which checks the round first. `num_clients`:
    the clients `arg` holds where the caller counted them (`cohort.clients_of`), else
    counted here. `on_device`: values stay on jax's default device (module docstring),
    the clients run `clients_per_step` at a time (`device_rounds`), with a progress
    bar if `progress`."""
    if num_clients is None:
        num_clients = cohort.clients_of(split, arg)
    transport = InProcessTransport(arg, split, num_clients, backend, client_runtime,
                                   on_device, clients_per_step, progress)
    transport.client_runtime.check_round(split.proto, split)
    return engine.run_round(split, arg, transport)


def round_split_of(prepared: interpreter.Prepared) -> Optional[round_split.RoundSplit]:
    """The round split of a prepared computation (`round_split.split_of`), or None when
    it is not round-shaped."""
    return round_split.split_of(prepared.proto)


def _engine_clients(split: Optional[round_split.RoundSplit], arg: Any) -> int:
    """The clients of the round the engine takes (`cohort.clients_of`, counted once), or
    0 where it does not take this call: it takes a split whose CLIENTS inputs are all
    values (no population references) for at least one client."""
    if split is None or not split.client_inputs:
        return 0
    if any(isinstance(arg[i], PopulationRef) for i in split.client_inputs):
        return 0
    return cohort.clients_of(split, arg)


def _why_not_a_round(split: Optional[round_split.RoundSplit]) -> str:
    """Why the round engine does not take a computation (`_engine_clients` gave 0)."""
    if split is None:
        return ("is not round-shaped (server prepare, one broadcast, one client part, "
                "aggregations, server result)")
    if not split.client_inputs:
        return "is a round with no CLIENTS input"
    return ("is a round whose CLIENTS inputs are population references, or that has no "
            "clients")


def run_computation(proto: Union[Computation, bytes, interpreter.Prepared], *args: Any,
                    backend: Optional[ClientsBackend] = None,
                    num_clients: Optional[int] = None, on_device: Optional[bool] = None,
                    client_runtime: Union[str, ClientRuntime, None] = None,
                    clients_per_step: Union[int, str, None] = None, progress: bool = False,
                    **kwargs: Any) -> Any:
    """Runs a computation on python pytrees, one per parameter element; returns a pytree.

    CLIENTS arguments and results carry a leading clients axis. Named parameter elements
    may be passed by keyword (`values.bind_arguments`). `num_clients` is needed only when
    no argument is placed at CLIENTS and the computation places values there itself.
    The result has the structure jit gives the program when the proto was exported in
    this process (or `prepare(proto, structure=)` gave one), else the generic one
    (`runtime.result_structure`). Rounds go through the round engine, the rest through
    the interpreter (module docstring); `interpreter.interpret` always interprets.

    Args:
      proto: a `Computation`, its serialized bytes, or `interpreter.prepare(proto)`.
      *args: one pytree per parameter element.
      backend: a clients backend to run the client work on (interprets the computation).
      num_clients: the number of clients, when no argument is placed at CLIENTS.
      on_device: True: a round keeps its values on jax's default device and sums
        there (the same bits), returning its result there as jax arrays (refused, by
        ArgumentError, for a computation that is not such a round, or with `backend` or
        `num_clients`); False: on the host; None: as `device_sums.on_device` decides
        (the environment variable FAX_BRIDGE_ON_DEVICE, else whenever that device is
        not the CPU). Any other value is refused.
      clients_per_step: on the device path, how many clients one compiled step runs,
        its results summed into the round's exact sums before the next (the device
        holds one chunk's work whatever the cohort; the same bits whatever the
        chunks): a whole number, or None / "auto" (the most whose compiled step
        holds at most FAX_BRIDGE_STEP_BYTES, 1 GiB, by its memory_analysis():
        `device_rounds.chunk_size`).
      progress: on the device path, a tqdm bar of the clients as chunks finish.
      client_runtime: what runs the clients' work ("xla", "litert" or a
        `rounds.client_runtime.ClientRuntime`, which checks the round first): the client
        part of a round by split, each client map of one run phase by phase (LiteRT: a
        model per trip, `litert.phases`). None: XLA.
      **kwargs: named parameter elements.

    Returns:
      The result, checked against the type the proto declares.

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> from fax_bridge.runtime import run_computation
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> proto = fb.export_tff(total, jnp.zeros(3), placements="clients")
      >>> print(run_computation(proto, jnp.array([1.0, 2.0, 3.0])))
      6.0
    """
    prepared = interpreter.prepare(proto)
    runtime = None if client_runtime is None else runtimes.resolve(client_runtime)
    wanted = device_sums.on_device(on_device)  # a value that is not a bool is refused
    if on_device and (backend is not None or num_clients is not None):
        raise ArgumentError("run_computation: on_device=True runs a round in this "
                            "process; a call given backend= or num_clients= is "
                            "interpreted phase by phase on the host: leave on_device out")
    if backend is not None or num_clients is not None:
        if runtime is not None:
            if backend is not None:
                raise ArgumentError("run_computation: give backend= or client_runtime=, "
                                    "not both (a backend runs its clients' work itself)")
            runtime.check_round(prepared.proto, None)
            backend = LocalClientsBackend(client_runtime=runtime)
        return interpreter.interpret(prepared, *args, backend=backend,
                                     num_clients=num_clients, **kwargs)
    bound = values.bind_arguments(prepared.parameter, args, kwargs)
    split = round_split_of(prepared)
    device = split is not None and wanted
    with values.device_arrays_kept(device):
        arg = bound.runtime_value()  # a model given as jax arrays stays on the device
    clients = _engine_clients(split, arg)
    if on_device and not clients:
        raise ArgumentError(
            "run_computation: on_device=True sums a round on the device, and this "
            f"computation {_why_not_a_round(split)}, so it is interpreted on the host; "
            "leave on_device out (or pass None) for such computations")
    if device and not clients:
        arg = bound.runtime_value()  # the interpreter reads numpy
    if not clients:
        if runtime is not None:  # its models made, or refused, before any client work
            runtime.check_round(prepared.proto, None)
        result = interpreter.evaluate(prepared, arg, None if runtime is None
                                      else LocalClientsBackend(client_runtime=runtime))
    else:
        try:
            with values.device_arrays_kept(device):
                result = values.check_value(
                    run_in_process(split, arg, num_clients=clients,
                                   client_runtime=runtime or "xla", on_device=device,
                                   clients_per_step=clients_per_step, progress=progress),
                    prepared.result, "result")
        except FaxBridgeError:
            raise
        except Exception as e:  # as the interpreter reports what a malformed proto does
            raise ComputationError(
                f"the computation could not be run ({type(e).__name__}: {e}); it is "
                "likely malformed or ill-typed") from e
    with values.device_arrays_kept(device):
        return values.to_pytree(result, prepared.result, prepared.structure)
