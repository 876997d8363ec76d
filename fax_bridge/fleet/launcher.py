"""`LocalFleet`: K device processes on loopback, a gRPC backend over them, and rounds.

    with LocalFleet(devices=2, cohort_size=50, dropout=0.1, seed=0) as fleet:
        result = fleet.run(proto, server_state, client_data)
        print(fleet.last_report.summary())

Each device is `python -m fax_bridge.fleet.device --listen 127.0.0.1:0` in its own
process group; the fleet reads the port each one prints, waits for Health, and on exit
(normal, exception or Ctrl-C) stops every process: SIGTERM to the group, SIGKILL after a
grace period. An atexit hook covers interpreters that exit without leaving the `with`
block, and each device also exits by itself when its launching process is gone.
"""

from __future__ import annotations

import atexit
import json
import os
import pathlib
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from typing import Any, Iterable, Optional, Sequence, Union

import federated_language
import numpy as np

from fax_bridge.errors import FleetError
from fax_bridge.fleet import security
from fax_bridge.fleet.coordinator import GrpcClientsBackend, partition
from fax_bridge.fleet.rounds import RoundPolicy, RoundReport, check_min_clients, plan_round
from fax_bridge.runtime.population import PopulationRef

_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
# One XLA thread per device: several devices share the machine's cores.
_DEVICE_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
}

_live: "weakref.WeakSet[LocalFleet]" = weakref.WeakSet()
_live_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    with _live_lock:
        fleets = list(_live)
    for fleet in fleets:
        fleet.close()


atexit.register(_stop_all_at_exit)


class FleetRounds:
    """Rounds on a fleet of devices reached through a `GrpcClientsBackend`.

    The shared part of `LocalFleet` (which starts its devices) and
    `fax_bridge.fleet.remote.RemoteFleet` (which joins devices started elsewhere):
    seeded cohorts, dropouts, delays and `min_clients` per `RoundPolicy`, round reports,
    and, when `survive_device_loss` is set, finishing a round on the surviving devices
    when some stop answering (their clients count as lost). Subclasses set `backend`,
    `addresses` and `num_devices` in `start()` and release them in `close()`.
    """

    survive_device_loss: bool = False
    probe_timeout_s: float = 2.0

    def _init_rounds(self, *, policy: RoundPolicy, preaggregate: bool,
                     rpc_timeout_s: float, progress: bool,
                     population_name: Optional[str] = None) -> None:
        self.policy = policy
        self.population_name = population_name
        self.preaggregate = preaggregate
        self.rpc_timeout_s = rpc_timeout_s
        self.progress = progress
        self.addresses: list[str] = []
        self.backend: Optional[GrpcClientsBackend] = None
        self.reports: list[RoundReport] = []
        self._round = 0
        self._closed = False

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
        pytree, or `(result, RoundReport)` with `report=True` (also `last_report`).
        `num_clients` gives the population when no argument is placed at CLIENTS.
        """
        from fax_bridge.runtime import interpreter

        if self.backend is None or self._closed:
            raise FleetError(f"the fleet is not running; use `with {type(self).__name__}"
                             "(...) as fleet:`")
        fn_type = interpreter.computation_type(proto)
        param = fn_type.parameter if isinstance(fn_type, federated_language.FunctionType) else None
        round_index = self._round
        self._round += 1
        population = _population(args, kwargs, param, self._population_size)
        if population is None:
            if num_clients is None:
                raise FleetError(
                    "no argument is placed at CLIENTS, so the number of clients is unknown; "
                    "pass num_clients=N to run()")
            population = int(num_clients)
        plan = plan_round(self.policy, population, round_index)
        rep = RoundReport(round=round_index, population=population, cohort=plan.cohort,
                          dropped=plan.dropped, late=plan.late,
                          participants=plan.participants, delays_s=plan.delays_s,
                          devices=self.num_devices, preaggregate=self.backend.preaggregate)
        self.reports.append(rep)
        try:
            check_min_clients(self.policy, plan, round_index)
        except FleetError as e:
            rep.error = str(e)
            raise
        participants = list(plan.participants)
        while True:
            try:
                result = self._attempt(proto, args, kwargs, param, participants, plan, rep)
                break
            except FleetError as e:
                lost = self._lose_unreachable_devices(participants, rep, e)
                if not lost:
                    rep.error = f"{type(e).__name__}: {e}"
                    raise
                participants = [c for c in participants if c not in lost]
                if len(participants) < self.policy.min_clients:
                    rep.error = (
                        f"round {round_index}: devices {rep.lost_devices} stopped answering, "
                        f"taking clients {sorted(rep.lost_clients)} with them; only "
                        f"{len(participants)} clients are left but min_clients="
                        f"{self.policy.min_clients}")
                    raise FleetError(rep.error + "; lower min_clients or restart those "
                                     "devices") from e
            except BaseException as e:
                rep.error = f"{type(e).__name__}: {e}"
                raise
        rep.participants = participants
        return (result, rep) if report else result

    def _attempt(self, proto, args, kwargs, param, participants, plan, rep):
        """One try at the round on the current devices; adds its costs to `rep`."""
        from fax_bridge.runtime import interpreter

        chosen = np.asarray(participants, dtype=np.int64)
        args, kwargs = _select_clients(args, kwargs, param, chosen, self._population_size)
        if self.policy.emulate_delays and self.policy.straggler_delay_s > 0:
            self.backend.set_delays([plan.delays_s[c] for c in participants])
        before = self.backend.traffic.__class__(**self.backend.traffic.as_dict())
        start = time.perf_counter()
        backend = self.backend
        try:
            return interpreter.run_computation(
                proto, *args, backend=backend,
                num_clients=(None if _population(args, kwargs, param, self._population_size)
                             else len(chosen)),
                **kwargs)
        finally:
            backend.set_delays(None)
            rep.wall_s += time.perf_counter() - start
            try:
                backend.collect()
            except FleetError:
                pass  # an unreachable device; the caller decides what that means
            spent = backend.traffic - before
            rep.compute_s += spent.compute_seconds
            rep.bytes_down += spent.bytes_down
            rep.bytes_up += spent.bytes_up
            rep.payload_down += spent.payload_down
            rep.payload_up += spent.payload_up
            rep.rpcs += spent.rpcs

    def _lose_unreachable_devices(self, participants: list, rep: RoundReport,
                                  error: FleetError) -> set:
        """After a failed try: drops devices that no longer answer Health.

        Returns the participants those devices held (empty when every device answers,
        or when this fleet does not survive device loss), after reconnecting to the
        survivors.
        """
        if not self.survive_device_loss or self.backend is None:
            return set()
        alive = probe_devices(self.backend, self.probe_timeout_s)
        dead = [i for i, ok in enumerate(alive) if not ok]
        if not dead or len(dead) == len(alive):
            return set()
        blocks = partition(len(participants), len(alive))
        lost = {participants[j] for i in dead for j in blocks[i]}
        gone = [self.addresses[i] for i in dead]
        rep.lost_devices.extend(gone)
        rep.lost_clients.extend(sorted(lost))
        self._reconnect([a for i, a in enumerate(self.addresses) if i not in dead])
        rep.devices = self.num_devices
        return lost

    def _reconnect(self, addresses: list[str]) -> None:
        """Replaces the backend by one over `addresses` (handles keep counting)."""
        old = self.backend
        old.rpc_timeout_s = min(old.rpc_timeout_s, self.probe_timeout_s)
        try:
            old.close()
        except FleetError:
            pass
        self.backend = self._connect(addresses, self.probe_timeout_s * 5)
        # Survivors may still hold values of the failed try: never reuse their handles.
        self.backend._handles = old._handles
        self.addresses = list(addresses)
        self.num_devices = len(addresses)

    def _connect(self, addresses: list[str], connect_timeout_s: float) -> GrpcClientsBackend:
        """A backend over `addresses` (subclasses add credentials)."""
        return GrpcClientsBackend(addresses, preaggregate=self.preaggregate,
                                  rpc_timeout_s=self.rpc_timeout_s,
                                  connect_timeout_s=connect_timeout_s)

    def run_loop(self, proto, state: Any, num_rounds: int, client_args, **kwargs) -> Any:
        """Rounds that thread server state, checkpointed with `checkpoint_dir=`.

        See `fax_bridge.fleet.checkpoint.run_loop` (next_state, checkpoint_dir, on_round).
        """
        from fax_bridge.fleet import checkpoint

        return checkpoint.run_loop(self, proto, state, num_rounds, client_args, **kwargs)

    def run_rounds(self, proto, rounds: Iterable[Sequence[Any]],
                   progress: Optional[bool] = None) -> list:
        """Runs `proto` once per argument tuple of `rounds`; a tqdm bar when `progress`."""
        from tqdm.auto import tqdm

        show = self.progress if progress is None else progress
        results = []
        rounds = list(rounds)
        with tqdm(total=len(rounds), disable=not show, unit="round",
                  desc="fleet rounds") as bar:
            for args in rounds:
                results.append(self.run(proto, *args))
                rep = self.last_report
                bar.set_postfix(clients=len(rep.participants), up=rep.bytes_up,
                                down=rep.bytes_down, refresh=False)
                bar.update(1)
        return results



class LocalFleet(FleetRounds):
    """A simulated fleet of `devices` device processes on 127.0.0.1.

    Args:
      devices: number of device processes.
      preaggregate: devices reduce their own clients first (default); False brings every
        per-client result back to the coordinator.
      cohort_size, dropout, straggler_delay_s, round_deadline_s, min_clients, seed,
        emulate_delays: the per-round behaviour, see `RoundPolicy`.
      rpc_timeout_s: deadline of every RPC.
      startup_timeout_s: how long to wait for all devices to listen and answer Health.
      shutdown_grace_s: how long a device may take to stop after SIGTERM before SIGKILL.
      progress: show a tqdm progress bar in `run_rounds`.
      log_dir: where device logs go (kept); default a temporary folder removed on exit.
      python: interpreter that runs the devices (default: this one).
      token: the fleet token; default a fresh `secrets.token_hex` per fleet. Devices get
        it through their environment, never on the command line.
      device_tls, coordinator_tls: `security.TlsConfig`s for mutual TLS (devices'
        server certificate, coordinator's client certificate; both or neither).
      survive_device_loss: finish a round on the devices that still answer when some
        die or miss their deadline (default); False fails the round instead.
      probe_timeout_s: how long a device may take to answer Health after a failed try.
      reject_nonfinite: refuse NaN/inf in what devices send back.
      max_message_bytes, max_stored_bytes: caps on each gRPC message and on the bytes
        each device holds.
      population: a directory written by `write_population` that every device hosts
        (`--population`): runs then pass `fleet.population` (or a `PopulationRef`) for
        a CLIENTS argument and the devices read the cohort's rows themselves.
      population_name: the name the devices give it (default: the directory's name).
    """

    def __init__(self, devices: int = 2, *, preaggregate: bool = True,
                 cohort_size: Optional[int] = None, dropout: float = 0.0,
                 straggler_delay_s: float = 0.0, round_deadline_s: Optional[float] = None,
                 min_clients: int = 1, seed: int = 0, emulate_delays: bool = True,
                 rpc_timeout_s: float = 60.0, startup_timeout_s: float = 120.0,
                 shutdown_grace_s: float = 3.0, progress: bool = False,
                 log_dir: Optional[Union[str, os.PathLike]] = None,
                 python: Optional[str] = None, token: Optional[str] = None,
                 device_tls: Optional[security.TlsConfig] = None,
                 coordinator_tls: Optional[security.TlsConfig] = None,
                 survive_device_loss: bool = True, probe_timeout_s: float = 2.0,
                 reject_nonfinite: bool = False,
                 max_message_bytes: Optional[int] = None,
                 max_stored_bytes: Optional[int] = None,
                 population: Optional[Union[str, os.PathLike]] = None,
                 population_name: Optional[str] = None):
        if devices < 1:
            raise FleetError(f"devices={devices}; a fleet needs at least one device")
        self.num_devices = int(devices)
        self._init_rounds(
            policy=RoundPolicy(cohort_size=cohort_size, dropout=dropout,
                               straggler_delay_s=straggler_delay_s,
                               round_deadline_s=round_deadline_s, min_clients=min_clients,
                               seed=seed, emulate_delays=emulate_delays),
            preaggregate=preaggregate, rpc_timeout_s=rpc_timeout_s, progress=progress,
            population_name=population_name)
        self._population_dir = None
        if population is not None:
            from fax_bridge.runtime import population as pop

            self._population_dir = os.path.abspath(os.fspath(population))
            try:
                pop.open_store(self._population_dir)
            except Exception as e:
                raise FleetError(f"LocalFleet population={population!r}: {e}") from None
            if population_name is None:
                self.population_name = pop.default_name(self._population_dir)
        self.startup_timeout_s = startup_timeout_s
        self.shutdown_grace_s = shutdown_grace_s
        self.python = python or sys.executable
        if (device_tls is None) != (coordinator_tls is None):
            raise FleetError("mutual TLS needs both device_tls and coordinator_tls (or "
                             "neither)")
        self._token = token or security.new_token()
        self._device_tls = device_tls
        self._coordinator_tls = coordinator_tls
        self.survive_device_loss = bool(survive_device_loss)
        self.probe_timeout_s = float(probe_timeout_s)
        self.reject_nonfinite = bool(reject_nonfinite)
        self._max_message_bytes = max_message_bytes
        self._max_stored_bytes = max_stored_bytes
        self._keep_logs = log_dir is not None
        self._log_dir = pathlib.Path(log_dir) if log_dir is not None else None
        self._procs: list[subprocess.Popen] = []
        self._logs: list = []

    # -- lifetime -----------------------------------------------------------------

    def __enter__(self) -> "LocalFleet":
        self.start()
        return self

    @property
    def pids(self) -> list[int]:
        """Process ids of the device processes (in device order)."""
        return [p.pid for p in self._procs]

    def start(self) -> "LocalFleet":
        """Spawns the devices, reads their ports and connects; cleans up if anything fails."""
        if self._procs:
            return self
        with _live_lock:
            _live.add(self)
        try:
            self._spawn()
            self.addresses = self._read_ports(time.monotonic() + self.startup_timeout_s)
            self._proc_addresses = list(self.addresses)
            self.backend = self._connect(self.addresses, self.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _connect(self, addresses: list[str], connect_timeout_s: float) -> GrpcClientsBackend:
        """A backend over `addresses` with this fleet's token and TLS."""
        extra = {}
        if self._max_message_bytes is not None:
            extra["max_message_bytes"] = self._max_message_bytes
        return GrpcClientsBackend(addresses, preaggregate=self.preaggregate,
                                  rpc_timeout_s=self.rpc_timeout_s,
                                  connect_timeout_s=connect_timeout_s, token=self._token,
                                  tls=self._coordinator_tls,
                                  reject_nonfinite=self.reject_nonfinite, **extra)

    def _device_env(self) -> dict:
        env = dict(os.environ)
        for key, value in _DEVICE_ENV.items():
            if key == "XLA_FLAGS":
                env[key] = f"{value} {env.get(key, '')}".strip()
            else:
                env.setdefault(key, value)
        env["PYTHONPATH"] = os.pathsep.join(
            [_PACKAGE_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        env[security.TOKEN_ENV] = self._token  # the environment is private to the user
        return env

    def _device_command(self, index: int) -> list[str]:
        command = [self.python, "-m", "fax_bridge.fleet.device",
                   "--listen", "127.0.0.1:0", "--device-id", f"device-{index}",
                   "--parent-pid", str(os.getpid())]
        if self._device_tls is not None:
            command += ["--tls-ca", self._device_tls.ca_cert, "--tls-cert",
                        self._device_tls.cert, "--tls-key", self._device_tls.key]
        if self._max_message_bytes is not None:
            command += ["--max-message-bytes", str(self._max_message_bytes)]
        if self._max_stored_bytes is not None:
            command += ["--max-stored-bytes", str(self._max_stored_bytes)]
        if self._population_dir is not None:
            command += ["--population", self._population_dir,
                        "--population-name", self.population_name]
        return command

    def _popen(self, index: int, env: dict) -> subprocess.Popen:
        log = open(self._log_dir / f"device-{index}.log", "ab")
        if index < len(self._logs):
            self._logs[index].close()
            self._logs[index] = log
        else:
            self._logs.append(log)
        return subprocess.Popen(
            self._device_command(index), stdout=subprocess.PIPE, stderr=log,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True)

    def _spawn(self) -> None:
        if self._log_dir is None:
            self._log_dir = pathlib.Path(tempfile.mkdtemp(prefix="fax_bridge_fleet_"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        env = self._device_env()
        for index in range(self.num_devices):
            self._procs.append(self._popen(index, env))

    # -- faults -------------------------------------------------------------------

    def kill_device(self, index: int, signum: int = signal.SIGKILL) -> None:
        """Sends `signum` to device `index` (a crash when SIGKILL, a hang when SIGSTOP)."""
        _signal_group(self._procs[index], signum)
        if signum == signal.SIGKILL:
            try:
                self._procs[index].wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass

    def restart_device(self, index: int) -> str:
        """Replaces device `index` by a fresh process; the next round uses it again.

        The old process is killed if it still runs. Returns the new device's address.
        """
        if self.backend is None or self._closed:
            raise FleetError("the fleet is not running; start it before restarting devices")
        old = self._procs[index]
        if old.poll() is None:
            _signal_group(old, signal.SIGKILL)
            old.wait(timeout=10.0)
        if old.stdout is not None:
            old.stdout.close()
        self._procs[index] = self._popen(index, self._device_env())
        address = self._read_ports(time.monotonic() + self.startup_timeout_s,
                                   only=[index])[0]
        self._proc_addresses[index] = address
        self._reconnect([self._proc_addresses[i] for i, p in enumerate(self._procs)
                         if p.poll() is None])
        return address

    def _read_ports(self, deadline: float, only: Optional[list] = None) -> list[str]:
        wanted = list(range(len(self._procs))) if only is None else list(only)
        addresses: dict[int, str] = {}
        buffers = {i: b"" for i in wanted}
        selector = selectors.DefaultSelector()
        for index in wanted:
            proc = self._procs[index]
            os.set_blocking(proc.stdout.fileno(), False)
            selector.register(proc.stdout, selectors.EVENT_READ, index)
        try:
            while len(addresses) < len(wanted):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    missing = sorted(set(wanted) - set(addresses))
                    raise FleetError(
                        f"devices {missing} did not report a port within "
                        f"{self.startup_timeout_s:.0f}s; raise startup_timeout_s or see "
                        f"{self._log_tail(missing[0])}")
                for key, _ in selector.select(timeout=min(remaining, 0.5)):
                    index = key.data
                    try:
                        chunk = os.read(key.fileobj.fileno(), 65536)
                    except BlockingIOError:
                        continue
                    if not chunk:  # end of file: the device closed its stdout
                        selector.unregister(key.fileobj)
                        continue
                    buffers[index] += chunk
                    for line in buffers[index].splitlines():
                        address = _parse_port_line(line)
                        if address:
                            addresses[index] = address
                            selector.unregister(key.fileobj)
                            break
                for index in wanted:
                    proc = self._procs[index]
                    if index not in addresses and proc.poll() is not None:
                        raise FleetError(
                            f"device {index} exited with code {proc.returncode} before "
                            f"listening; {self._log_tail(index)}")
        finally:
            selector.close()
        return [addresses[i] for i in wanted]

    def _log_tail(self, index: int, lines: int = 15) -> str:
        path = self._log_dir / f"device-{index}.log"
        try:
            self._logs[index].flush()
            text = path.read_text(errors="replace").strip().splitlines()[-lines:]
        except OSError:
            text = []
        return f"its log {path}:\n" + "\n".join(text) if text else f"its log {path} (empty)"

    def close(self) -> None:
        """Stops every device process (SIGTERM, then SIGKILL) and releases resources."""
        if self._closed:
            return
        super().close()
        _terminate(self._procs, self.shutdown_grace_s)
        for proc in self._procs:
            if proc.stdout is not None:
                proc.stdout.close()
        for log in self._logs:
            log.close()
        if not self._keep_logs and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)
        with _live_lock:
            _live.discard(self)

# ---------------------------------------------------------------------------------------
# Helpers


def probe_devices(backend: GrpcClientsBackend, timeout_s: float) -> list[bool]:
    """Whether each device of `backend` answers Health within `timeout_s` (in parallel)."""
    return backend.probe(timeout_s)


def _parse_port_line(line: bytes) -> Optional[str]:
    line = line.strip()
    if not line.startswith(b"{"):
        return None
    try:
        info = json.loads(line)
    except ValueError:
        return None
    address = info.get("listening")
    return address if isinstance(address, str) else None


def _terminate(procs: list, grace_s: float) -> None:
    """SIGTERM each process group, wait up to `grace_s`, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass


def _signal_group(proc: subprocess.Popen, signum: int) -> None:
    try:
        os.killpg(proc.pid, signum)  # the device leads its own session and group
    except (ProcessLookupError, PermissionError):
        try:
            proc.send_signal(signum)
        except ProcessLookupError:
            pass


def _param_items(args: Sequence, kwargs: dict, param) -> list:
    """(value, type, where) of each top-level argument, following run_computation."""
    if param is None:
        return []
    if isinstance(param, federated_language.StructType):
        items = list(param.items())
        out = [(a, t, ("args", i)) for i, (a, (_, t)) in enumerate(zip(args, items))]
        for name, t in items[len(args):]:
            if name in kwargs:
                out.append((kwargs[name], t, ("kwargs", name)))
        return out
    return [(args[0], param, ("args", 0))] if args else []


def _is_clients(t) -> bool:
    return (isinstance(t, federated_language.FederatedType)
            and t.placement is federated_language.CLIENTS and not t.all_equal)


def _leading_sizes(value, t, out: list, sizer=None) -> None:
    import jax

    if _is_clients(t) and isinstance(value, PopulationRef):
        if value.client_ids is not None:
            out.append(len(value.client_ids))
        elif sizer is not None:
            out.append(int(sizer(value)))
        else:
            raise FleetError(f"{value!r} names no client ids and no fleet can count them")
    elif _is_clients(t):
        out.extend(int(np.shape(leaf)[0]) for leaf in jax.tree_util.tree_leaves(value))
    elif isinstance(t, federated_language.StructType):
        for i, (name, tt) in enumerate(t.items()):
            child = value.get(name) if isinstance(value, dict) else (
                value[i] if isinstance(value, (list, tuple)) else None)
            if child is not None:
                _leading_sizes(child, tt, out, sizer)


def _population(args: Sequence, kwargs: dict, param, sizer=None) -> Optional[int]:
    sizes: list = []
    for value, t, _ in _param_items(args, kwargs, param):
        _leading_sizes(value, t, sizes, sizer)
    if not sizes:
        return None
    if len(set(sizes)) > 1:
        raise FleetError(
            f"CLIENTS arguments disagree on the number of clients (leading axes "
            f"{sorted(set(sizes))}); give every CLIENTS tensor one row per client")
    return sizes[0]


def _select(value, t, chosen: np.ndarray, sizer=None):
    import jax

    if _is_clients(t) and isinstance(value, PopulationRef):
        return value.select(chosen)  # only ids: each device reads its own rows
    if _is_clients(t):
        return jax.tree_util.tree_map(lambda leaf: np.asarray(leaf)[chosen], value)
    if isinstance(t, federated_language.StructType):
        if isinstance(value, dict):
            types = dict(t.items())
            return {k: _select(v, types[k], chosen, sizer) if k in types else v
                    for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            types = [tt for _, tt in t.items()]
            picked = [_select(v, tt, chosen, sizer) for v, tt in zip(value, types)]
            return type(value)(picked) if isinstance(value, tuple) else picked
    return value


def _select_clients(args: Sequence, kwargs: dict, param, chosen: np.ndarray, sizer=None):
    args, kwargs = list(args), dict(kwargs)
    for value, t, (where, key) in _param_items(args, kwargs, param):
        picked = _select(value, t, chosen, sizer)
        if where == "args":
            args[key] = picked
        else:
            kwargs[key] = picked
    return args, kwargs
