"""The gRPC device fleet transport: device processes hosting virtual clients, a local launcher.

By role:
- `protocol`: what both sides agree on (protocol name, message caps, client layout,
  HOST:PORT parsing); `shared_memory`: large payloads in segments between a coordinator
  and the devices it started.
- `device`: the device service (`DeviceServicer`); `device_process` serves it as a
  process, `device_cli` reads its command line (`fax-bridge device`,
  `python -m fax_bridge.fleet.device_cli`); `device_round` answers a round's request.
- `pool.DevicePool`: channels and deadline-bound calls to many devices;
  `coordinator.GrpcClientsBackend` builds a `ClientsBackend` on it (values on devices),
  sending client values and population reads as `put_messages` streams.
- `grpc_transport`: the devices as a transport of the round engine
  (`fax_bridge.rounds.engine`), which splits, checks and merges rounds for every
  transport.
- `session.FleetRounds`: rounds under a `policy.RoundPolicy` (a round-shaped
  computation through the engine, anything else phase by phase), device loss, `run_loop` with `checkpoint` save/load.
- `launcher.LocalFleet`: starts devices on 127.0.0.1, configured by one
  `config.FleetConfig` (devices' own bounds: `protocol.DeviceLimits`);
  `remote.RemoteFleet`: joins devices
  started elsewhere, named by address or by a JSON fleet file (`fleet_file`).

Names are imported on first use, so `python -m fax_bridge.fleet.device_cli` loads only what a
device needs.
"""

from fax_bridge.system import lazy_names

_EXPORTS = {
    "GrpcClientsBackend": "fax_bridge.fleet.coordinator",
    "Traffic": "fax_bridge.rounds.policy",
    "DeviceLimits": "fax_bridge.fleet.protocol",
    "FleetConfig": "fax_bridge.fleet.config",
    "FleetRounds": "fax_bridge.fleet.session",
    "FleetSpec": "fax_bridge.fleet.fleet_file",
    "LocalFleet": "fax_bridge.fleet.launcher",
    "RemoteFleet": "fax_bridge.fleet.remote",
    "load_fleet_file": "fax_bridge.fleet.fleet_file",
    "RoundPolicy": "fax_bridge.rounds.policy",
    "RoundReport": "fax_bridge.rounds.policy",
}

__all__ = sorted(_EXPORTS)


__getattr__, _ = lazy_names.served(__name__, _EXPORTS)
