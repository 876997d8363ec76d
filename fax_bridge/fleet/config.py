"""`FleetConfig`: how a `LocalFleet` starts and reaches its devices, as one object.

Everything but the round policy (`rounds.policy.RoundPolicy`) and the number of devices:
timeouts, the token and TLS, caps, the hosted population, CPU shares, shared memory.
`LocalFleet(config=FleetConfig(...))` takes it whole; `LocalFleet(rpc_timeout_s=30,
cohort_size=50)` takes its fields and the policy's as keywords (`resolve_config` sorts
them and refuses a name that is neither).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Union

from fax_bridge.errors import ArgumentError, FleetError
from fax_bridge.fleet import security
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds.client_runtime import ClientRuntime
from fax_bridge.rounds.policy import RoundPolicy, resolve_policy


@dataclasses.dataclass(frozen=True)
class FleetConfig:
    """How a `LocalFleet` starts and reaches its devices.

    Attributes:
      rpc_timeout_s: deadline of every RPC.
      startup_timeout_s: how long to wait for all devices to listen and answer Health.
      shutdown_grace_s: how long a device may take to stop after SIGTERM before SIGKILL.
      progress: show a tqdm progress bar in `run_rounds` and `run_loop`.
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
      share_cpus: start each device on its own share of the CPUs this process may run
        on (`cpu_shares`: split evenly, round-robin when there are more devices than
        CPUs), so that devices on one machine do not run their XLA threads on each
        other's cores; False leaves placement to the operating system. Linux only
        (ignored elsewhere, and with one CPU).
      shared_memory: pass rounds' large payloads (the broadcast, the devices' partials)
        through shared-memory segments in a directory of this fleet under /dev/shm
        instead of over gRPC (default; the devices run on this host); False sends
        every payload over gRPC, as to remote devices. Ignored where there is no
        /dev/shm. The round report says which bytes went which way (`shared_up`).
      client_runtime: what runs rounds' client parts on the devices, a
        `rounds.client_runtime.ClientRuntime` (a name, "xla" or "litert", is parsed into
        one here): `XlaClientRuntime()` (default) their XLA; `LiteRTClientRuntime(
        models_dir=None)` LiteRT models in the LiteRT interpreter (`fax_bridge.litert`;
        converted once per round shape, before the round, or taken from `models_dir`).
        A LiteRT fleet refuses a round with no single client part, naming why, and an
        answer a device computed otherwise; requests, partials and checks are the same.
    """

    rpc_timeout_s: float = 60.0
    startup_timeout_s: float = 120.0
    shutdown_grace_s: float = 3.0
    progress: bool = False
    log_dir: Optional[Union[str, os.PathLike]] = None
    python: Optional[str] = None
    token: Optional[str] = None
    device_tls: Optional[security.TlsConfig] = None
    coordinator_tls: Optional[security.TlsConfig] = None
    survive_device_loss: bool = True
    probe_timeout_s: float = 2.0
    reject_nonfinite: bool = False
    max_message_bytes: Optional[int] = None
    max_stored_bytes: Optional[int] = None
    population: Optional[Union[str, os.PathLike]] = None
    population_name: Optional[str] = None
    share_cpus: bool = True
    shared_memory: bool = True
    client_runtime: Union[str, ClientRuntime] = "xla"

    def __post_init__(self):
        object.__setattr__(self, "client_runtime", runtimes.resolve(self.client_runtime))
        if (self.device_tls is None) != (self.coordinator_tls is None):
            raise FleetError("mutual TLS needs both device_tls and coordinator_tls (or "
                             "neither)")


def resolve_config(config: Optional[FleetConfig], options: dict,
                   owner: str) -> tuple[FleetConfig, dict]:
    """(the fleet's config, the remaining keywords: the round policy's fields) from
    `config=` or the config's fields given as keywords (not both)."""
    names = {f.name for f in dataclasses.fields(FleetConfig)}
    mine = {k: v for k, v in options.items() if k in names}
    rest = {k: v for k, v in options.items() if k not in names}
    if config is not None and mine:
        raise ArgumentError(f"{owner}() got config= and also {sorted(mine)}; put them in "
                            "the FleetConfig (dataclasses.replace(config, ...))")
    if config is not None and not isinstance(config, FleetConfig):
        raise ArgumentError(f"{owner}(config=...) needs a FleetConfig, got "
                            f"{type(config).__name__}")
    if set(rest) - {f.name for f in dataclasses.fields(RoundPolicy)}:
        try:  # the policy names what it does not know; this adds the config's names
            resolve_policy(None, rest, owner)
        except ArgumentError as e:
            raise ArgumentError(f"{e}; the fleet's own options (FleetConfig) are "
                                f"{sorted(names)}") from None
    return (config if config is not None else FleetConfig(**mine)), rest
