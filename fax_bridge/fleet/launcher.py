"""`LocalFleet`: K device processes on loopback, a gRPC backend over them, and rounds.

    with LocalFleet(devices=2, cohort_size=50, dropout=0.1, seed=0) as fleet:
        result = fleet.run(proto, server_state, client_data)
        print(fleet.last_report.summary())

Each device is `python -m fax_bridge.fleet.device_cli --listen 127.0.0.1:0` in its own
process group, forked by a server that has already imported it (`fax_bridge.system.forks`: a device
then starts without importing jax again) where the platform allows, else started as a
fresh interpreter; the fleet reads the port each one prints, waits for Health, and on exit
(normal, exception or Ctrl-C) stops every process: SIGTERM to the group, SIGKILL after a
grace period. An atexit hook covers interpreters that exit without leaving the `with`
block, and each device also exits by itself when its launching process is gone.
Rounds pass large payloads (the broadcast, the devices' partials) through a
shared-memory directory the fleet makes and removes (`shared_memory`), since its
devices run on this host; `shared_memory=False` sends them over gRPC.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
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
from typing import Any, Optional, Union

from fax_bridge.errors import FleetError
from fax_bridge.system import forks, private_files
from fax_bridge.fleet import security
from fax_bridge.fleet import shared_memory as shm
from fax_bridge.system.process_tree import signal_group
from fax_bridge.fleet.config import FleetConfig, resolve_config
from fax_bridge.rounds.policy import RoundPolicy, resolve_policy
from fax_bridge.fleet.session import FleetRounds
from fax_bridge.runtime import population as pop

_PACKAGE_ROOT = str(pathlib.Path(__file__).resolve().parents[2])
# One XLA thread per device: several devices share the machine's cores.
_DEVICE_ENV = {
    "JAX_PLATFORMS": "cpu",
    "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
    "OMP_NUM_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "2",
    # Large buffers (messages and arrays of 10-100 MB, each new) on transparent huge
    # pages: faulting them in 4 KiB pages took half of a large model's round.
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}

log = logging.getLogger("fax_bridge.fleet")
# What the fork server imports for the devices it forks: all a device imports before it
# listens, and what its first Load and round import.
DEVICE_MODULES = ("fax_bridge.fleet.device_cli", "fax_bridge.fleet.device_round",
                  "fax_bridge.runtime.hlo", "fax_bridge.runtime.local_eval",
                  "fax_bridge.runtime.client_map", "fax_bridge.runtime.population")

_live: "weakref.WeakSet[LocalFleet]" = weakref.WeakSet()
_live_lock = threading.Lock()


def _stop_all_at_exit() -> None:
    with _live_lock:
        fleets = list(_live)
    for fleet in fleets:
        fleet.close()


atexit.register(_stop_all_at_exit)


class LocalFleet(FleetRounds):
    """A simulated fleet of `devices` device processes on 127.0.0.1.

    Args:
      devices: number of device processes.
      policy: the per-round behaviour (cohort, dropout, delays, deadline, min_clients,
        seed), a `RoundPolicy`; its fields may instead be given as keywords
        (`cohort_size=50, seed=0`).
      config: how the fleet starts and reaches its devices, a `FleetConfig` (timeouts,
        token and TLS, caps, population, CPU shares, shared memory); its fields may
        instead be given as keywords (`rpc_timeout_s=30, shared_memory=False`), as may
        the policy's, in one call.
    """

    def __init__(self, devices: int = 2, *, policy: Optional[RoundPolicy] = None,
                 config: Optional[FleetConfig] = None, **options: Any):
        config, policy_fields = resolve_config(config, options, "LocalFleet")
        if devices < 1:
            raise FleetError(f"devices={devices}; a fleet needs at least one device")
        c = self.config = config
        super().__init__(
            policy=resolve_policy(policy, policy_fields, "LocalFleet"),
            rpc_timeout_s=c.rpc_timeout_s, progress=c.progress,
            survive_device_loss=c.survive_device_loss, probe_timeout_s=c.probe_timeout_s,
            reject_nonfinite=c.reject_nonfinite, population_name=c.population_name)
        self.num_devices = int(devices)
        self._population_dir = None
        if c.population is not None:
            self._population_dir = os.path.abspath(os.fspath(c.population))
            try:
                pop.open_store(self._population_dir)
            except Exception as e:
                raise FleetError(f"LocalFleet population={c.population!r}: {e}") from None
            if c.population_name is None:
                self.population_name = pop.default_name(self._population_dir)
        self.startup_timeout_s = c.startup_timeout_s
        self.shutdown_grace_s = c.shutdown_grace_s
        self.python = c.python or sys.executable
        self._token = c.token or security.new_token()
        self._device_tls = c.device_tls
        self._coordinator_tls = c.coordinator_tls
        self._max_message_bytes = c.max_message_bytes
        self._max_stored_bytes = c.max_stored_bytes
        self._keep_logs = c.log_dir is not None
        self._log_dir = pathlib.Path(c.log_dir) if c.log_dir is not None else None
        self._procs: list = []  # subprocess.Popen or forks.ForkedProcess
        self._logs: list = []
        self._cpus = (cpu_shares(self.num_devices) if c.share_cpus
                      else [None] * self.num_devices)
        self._use_shared_memory = bool(c.shared_memory) and shm.available()
        self._shared: Optional[shm.SharedDir] = None
        self.client_runtime = c.client_runtime  # parsed by FleetConfig

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
            if self._use_shared_memory:
                self._shared = shm.SharedDir.create()
            self._spawn()
            self.addresses = self._read_ports(time.monotonic() + self.startup_timeout_s)
            self._proc_addresses = list(self.addresses)
            self.backend = self._connect(self.addresses, self.startup_timeout_s)
        except BaseException:
            self.close()
            raise
        return self

    def _backend_options(self) -> dict:
        options = dict(token=self._token, tls=self._coordinator_tls,
                       shared_memory=self._shared)
        if self._max_message_bytes is not None:
            options["max_message_bytes"] = self._max_message_bytes
        return options

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

    def _device_args(self, index: int, parent_pid: int) -> list[str]:
        """`device_cli`'s command line for device `index`, watching `parent_pid`."""
        command = ["--listen", "127.0.0.1:0", "--device-id", f"device-{index}",
                   "--parent-pid", str(parent_pid)]
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
        if self._shared is not None:
            command += ["--shared-memory", self._shared.path]
        command += self.client_runtime.device_args()
        return command

    def _fork_server(self, env: dict) -> Optional[forks.ForkServer]:
        """The fork server for this fleet's devices, or None where there is none (the
        devices then start as fresh interpreters)."""
        if not forks.available():
            return None
        try:
            return forks.shared(self.python, env, DEVICE_MODULES, (security.TOKEN_ENV,),
                                self.startup_timeout_s)
        except forks.ForkServerError as e:
            log.warning("starting devices without a fork server: %s", e)
            return None

    def _popen(self, index: int, env: dict) -> Union[subprocess.Popen, forks.ForkedProcess]:
        log_file = private_files.open_append(self._log_dir / f"device-{index}.log")
        if index < len(self._logs):
            self._logs[index].close()
            self._logs[index] = log_file
        else:
            self._logs.append(log_file)
        server = self._fork_server(env)
        if server is not None:
            cpus = self._cpus[index]
            if cpus is None and hasattr(os, "sched_getaffinity"):
                cpus = os.sched_getaffinity(0)
            try:
                return server.run("fax_bridge.fleet.device_cli",
                                  self._device_args(index, server.pid), env=env,
                                  cwd=os.getcwd(), cpus=cpus, stderr_fd=log_file.fileno())
            except forks.ForkServerError as e:
                log.warning("device %d starts without the fork server: %s", index, e)
        proc = subprocess.Popen(
            [self.python, "-m", "fax_bridge.fleet.device_cli",
             *self._device_args(index, os.getpid())],
            stdout=subprocess.PIPE, stderr=log_file,
            stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        if self._cpus[index] is not None:
            try:  # before the interpreter has started any thread, which would not follow
                os.sched_setaffinity(proc.pid, self._cpus[index])
            except OSError:  # the process already ended; its log says why
                pass
        return proc

    def _spawn(self) -> None:
        if self._log_dir is None:
            self._log_dir = pathlib.Path(tempfile.mkdtemp(prefix="fax_bridge_fleet_"))
        private_files.private_dir(self._log_dir)  # ours alone: no log planted as a link
        env = self._device_env()
        with _interrupts_deferred():  # a Ctrl-C inside Popen would orphan its process
            for index in range(self.num_devices):
                self._procs.append(self._popen(index, env))

    # -- faults -------------------------------------------------------------------

    def kill_device(self, index: int, signum: int = signal.SIGKILL) -> None:
        """Sends `signum` to device `index` (a crash when SIGKILL, a hang when SIGSTOP)."""
        signal_group(self._procs[index], signum)
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
            signal_group(old, signal.SIGKILL)
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
        if self._shared is not None:
            self._shared.remove()
        with _live_lock:
            _live.discard(self)

# ---------------------------------------------------------------------------------------
# Processes


def cpu_shares(devices: int, cpus: Optional[list[int]] = None) -> list[Optional[set]]:
    """Each device's CPUs: `cpus` (default: those this process may run on) split into
    `devices` runs of consecutive CPUs as even as can be, or one CPU each, round-robin,
    when there are more devices than CPUs; None for every device when there is nothing
    to split (one CPU, or no `os.sched_getaffinity`)."""
    if cpus is None:
        if not hasattr(os, "sched_getaffinity"):
            return [None] * devices
        cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return [None] * devices
    if devices >= len(cpus):
        return [{cpus[i % len(cpus)]} for i in range(devices)]
    size, extra = divmod(len(cpus), devices)
    shares, start = [], 0
    for i in range(devices):
        stop = start + size + (1 if i < extra else 0)
        shares.append(set(cpus[start:stop]))
        start = stop
    return shares


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


@contextlib.contextmanager
def _interrupts_deferred():
    """Holds back SIGINT's Python handler (KeyboardInterrupt) until the block ends, so
    every process started in it is recorded (and later stopped) first."""
    handler = signal.getsignal(signal.SIGINT)
    if threading.current_thread() is not threading.main_thread() or not callable(handler):
        yield
        return
    held: list = []
    signal.signal(signal.SIGINT, lambda signum, frame: held.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, handler)
    if held:
        handler(signal.SIGINT, held[0])


def _terminate(procs: list, grace_s: float) -> None:
    """SIGTERM each process group, wait up to `grace_s`, then SIGKILL what is left."""
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    for proc in procs:
        if proc.poll() is None:
            signal_group(proc, signal.SIGKILL)
            try:
                proc.wait(timeout=5.0)
            except subprocess.TimeoutExpired:
                pass
