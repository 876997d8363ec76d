"""Fleet: device processes hosting virtual clients, the gRPC clients backend, a local launcher.

By role:
- `protocol`: what both sides agree on (protocol name, message caps, client layout,
  HOST:PORT parsing); `wire`, `partials`, `validate`: message encoding and checks.
- `device`: the device service (`DeviceServicer`); `device_process` serves it as a
  process, `device_cli` reads its command line (`fax-bridge device`,
  `python -m fax_bridge.fleet.device_cli`).
- `pool.DevicePool`: channels and deadline-bound calls to many devices;
  `coordinator.GrpcClientsBackend` builds a `ClientsBackend` on it (values on devices),
  sending client values and population reads as `put_messages` streams.
- `round_split`: a round-shaped computation split once (server prepare, client part,
  aggregations, server result; `server_steps` runs the server ones); `engine`: one round
  of a split end to end over a transport (`grpc_transport` for the devices), and the
  round policy every fleet shares.
- `session.FleetRounds`: rounds under a `rounds.RoundPolicy` (through the engine, else
  phase by phase), device loss, `run_loop` with `checkpoint` save/load.
- `launcher.LocalFleet`: starts devices on 127.0.0.1; `remote.RemoteFleet`: joins devices
  started elsewhere, named by address or by a JSON fleet file (`fleet_file`).

Names are imported on first use, so `python -m fax_bridge.fleet.device_cli` loads only what a
device needs.
"""

import importlib

_EXPORTS = {
    "GrpcClientsBackend": "fax_bridge.fleet.coordinator",
    "Traffic": "fax_bridge.fleet.pool",
    "FleetRounds": "fax_bridge.fleet.session",
    "FleetSpec": "fax_bridge.fleet.fleet_file",
    "LocalFleet": "fax_bridge.fleet.launcher",
    "RemoteFleet": "fax_bridge.fleet.remote",
    "load_fleet_file": "fax_bridge.fleet.fleet_file",
    "RoundPolicy": "fax_bridge.fleet.rounds",
    "RoundReport": "fax_bridge.fleet.rounds",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'fax_bridge.fleet' has no attribute {name!r}")
