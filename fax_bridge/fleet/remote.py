"""`RemoteFleet`: rounds on device processes started elsewhere (other hosts, containers).

    # on each host:  fax-bridge device --listen 0.0.0.0:50051 ...
    with RemoteFleet(fleet_file="fleet.json", min_clients=100) as fleet:
        result, report = fleet.run(proto, server_state, client_data, report=True)

The devices are named by address (`addresses=[...]`, or a JSON fleet file, see
`fleet_file`). The fleet only connects to them: it neither starts nor stops them, and
closing it releases what it placed on them. Rounds follow the same `RoundPolicy` as
`LocalFleet` (the code is shared, `session.FleetRounds`). A device that stops answering
during a round (a crash, a cut network link) is dropped: the round is retried on the
devices that still answer Health, without the clients the lost device held, and fails
with FleetError only when fewer than `min_clients` clients are left.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Sequence, Union

from fax_bridge.errors import FleetError
from fax_bridge.fleet import security
from fax_bridge.fleet.fleet_file import check_address, load_fleet_file
from fax_bridge.rounds.policy import RoundPolicy, resolve_policy
from fax_bridge.fleet.session import FleetRounds


class RemoteFleet(FleetRounds):
    """A fleet of already running devices, reached at their addresses.

    Args:
      addresses: HOST:PORT of each device, in client-assignment order; or
      fleet_file: a JSON fleet file giving them (and optionally a token file and TLS).
      token: the fleet token; default: `token_file`, the fleet file's `token_file`, or
        the FAX_BRIDGE_FLEET_TOKEN environment variable, in that order.
      token_file: a file holding the token (owner-only permissions).
      tls: a `fax_bridge.fleet.security.TlsConfig` (or a mapping of its fields) for
        mutual TLS; default the fleet file's `tls`.
      survive_device_loss: finish a round on the devices that still answer when some
        die or miss their deadline (default); False fails the round instead.
      probe_timeout_s: how long a device may take to answer Health after a failed try.
      connect_timeout_s: how long to wait for every device to answer Health on start.
      population: the name of the population every device hosts (`fax-bridge device
        --population DIR`); checked on start. Runs pass `fleet.population` (or a
        `PopulationRef`) for a CLIENTS argument and send only client ids. None: no
        check (a `PopulationRef` then accepts whatever population the devices agree on).
      policy (or its fields as keywords), rpc_timeout_s, progress,
        reject_nonfinite: as for `LocalFleet` (the round-behaviour options both fleets
        share, `session.FleetRounds`).
    """

    def __init__(self, addresses: Optional[Sequence[str]] = None, *,
                 fleet_file: Optional[Union[str, os.PathLike]] = None,
                 token: Optional[str] = None, token_file: Optional[str] = None,
                 tls: Any = None, survive_device_loss: bool = True,
                 probe_timeout_s: float = 2.0, connect_timeout_s: float = 60.0,
                 policy: Optional[RoundPolicy] = None, rpc_timeout_s: float = 60.0, progress: bool = False,
                 reject_nonfinite: bool = False, population: Optional[str] = None,
                 **policy_fields: Any):
        if (addresses is None) == (fleet_file is None):
            raise FleetError("RemoteFleet needs exactly one of addresses=[HOST:PORT, ...] "
                             "or fleet_file=PATH")
        spec = load_fleet_file(fleet_file) if fleet_file is not None else None
        if spec is not None:
            addresses = list(spec.addresses)
            token_file = token_file or spec.token_file
            tls = tls if tls is not None else spec.tls
        addresses = [check_address(a) for a in addresses]
        if not addresses:
            raise FleetError("RemoteFleet got an empty list of device addresses")
        if len(set(addresses)) != len(addresses):
            raise FleetError(f"RemoteFleet addresses {addresses} name a device twice")
        super().__init__(
            policy=resolve_policy(policy, policy_fields, "RemoteFleet"),
            rpc_timeout_s=rpc_timeout_s, progress=progress,
            survive_device_loss=survive_device_loss, probe_timeout_s=probe_timeout_s,
            reject_nonfinite=reject_nonfinite, population_name=population)
        self.configured_addresses = list(addresses)
        self.num_devices = len(addresses)
        self.connect_timeout_s = float(connect_timeout_s)
        self._token = token
        self._token_file = token_file
        self._tls = tls

    def __enter__(self) -> "RemoteFleet":
        self.start()
        return self

    def start(self) -> "RemoteFleet":
        """Connects to every device and waits until each answers Health."""
        if self.backend is not None:
            return self
        if self._closed:
            raise FleetError("this RemoteFleet was closed; make a new one")
        self.addresses = list(self.configured_addresses)
        self.num_devices = len(self.addresses)
        self.backend = self._connect(self.addresses, self.connect_timeout_s)
        if self.population_name is not None:
            try:
                self.backend.population_info(self.population)
            except FleetError:
                self.backend.close()
                self.backend = None
                raise
        return self

    def _backend_options(self) -> dict:
        """The token (argument, token file, or environment, in that order) and TLS."""
        token = self._token
        if token is None and self._token_file is not None:
            token = security.read_token_file(self._token_file)
        if token is None:
            token = os.environ.get(security.TOKEN_ENV) or None
        tls = security.TlsConfig(**self._tls) if isinstance(self._tls, dict) else self._tls
        return {"token": token, "tls": tls}
