"""Client runtimes: what runs a round's client part on a holder of clients, chosen once.

A `ClientRuntime` is an object picked at the edge (a fleet's `FleetConfig`, a device's
command line, a Flower node's config, `check_parity`, `run_in_process`) and handed down
to whatever runs client parts, as DrJAX picks its placed computations once. Two exist:

  XlaClientRuntime()                 the client part's XLA (`round_split.client_partials`:
                                     one batched call where it can); runs every round
  LiteRTClientRuntime(models_dir=)   the client part as a LiteRT model in the LiteRT
                                     interpreter, as phones run it (`litert.runner`);
                                     a round of several trips: one model per trip

Each says up front whether it can run a round (`check_round`: converts the LiteRT models
once, or refuses naming why), runs a client part over a holder's clients
(`client_partials`: one exact partial per aggregation, the same form either way), runs
each client map of a round that runs phase by phase (`map_clients`: a round of several
trips, or with client state; LiteRT runs each trip's map as a model of its own,
`litert.phases`), and names itself (`name`, which a device's answer carries back). `resolve(value)` is
the one place a name ("xla", "litert") becomes a runtime; public entry points accept
either.

What computed a holder's answer is one record, `served(client_runtime, model_sha256)`:
a round report keeps one per holder (`RoundReport.served`: a fleet's device, a Flower
node), made from what the holder's answer names; a holder finds its own with
`model_served(runtime, key)` (the sha256 of the LiteRT model that ran client part `key`
in this process, None for XLA).
"""

from __future__ import annotations

from typing import Any, Optional, Protocol, Union, runtime_checkable

from federated_language.proto import computation_pb2

from fax_bridge.errors import ArgumentError
from fax_bridge.rounds import round_split

NAMES = ("xla", "litert")


@runtime_checkable
class ClientRuntime(Protocol):
    """What runs a round's client part (module docstring)."""

    name: str

    def check_round(self, proto: computation_pb2.Computation,
                    split: Optional[round_split.RoundSplit]) -> None:
        """Refuses (the conversion's refusal, naming the op) a round whose client parts
        or client maps this runtime cannot run; `split`: the round's split, None where
        the round has none (it then runs phase by phase)."""

    def client_partials(self, fn: computation_pb2.Computation, key: str, sent: Any,
                        members: Any, specs: list, guard: Any = None,
                        least_rows: int = 0) -> list:
        """One exact partial per aggregation of `specs` over the clients' `members`
        (`round_split.client_partials`' arguments)."""

    def map_clients(self, fn: computation_pb2.Computation, members: Any,
                    key: Optional[str] = None, no_argument: bool = False,
                    guard: Any = None) -> list:
        """One local value per client of the client computation `fn` over `members`
        (`client_map.map_clients`' arguments): a round run phase by phase runs each of
        its client maps (`round_split.client_maps`) through this."""

    def carrying(self, models_dir: Optional[str]) -> "ClientRuntime":
        """This runtime taking models carried in `models_dir` (an app's) first."""

    def device_args(self) -> list:
        """The `fax-bridge device` options that start a device with this runtime."""


class XlaClientRuntime:
    """The client part's XLA: every round runs, by split or phase by phase."""

    name = "xla"

    def check_round(self, proto, split) -> None:
        del proto, split

    def client_partials(self, fn, key, sent, members, specs, guard=None,
                        least_rows: int = 0) -> list:
        return round_split.client_partials(fn, key, sent, members, specs, guard, least_rows)

    def map_clients(self, fn, members, key=None, no_argument: bool = False,
                    guard=None) -> list:
        from fax_bridge.runtime import client_map

        return client_map.map_clients(fn, members, key=key, no_argument=no_argument,
                                      guard=guard)

    def carrying(self, models_dir) -> "XlaClientRuntime":
        del models_dir
        return self

    def device_args(self) -> list:
        return []

    def __eq__(self, other) -> bool:
        return isinstance(other, XlaClientRuntime)

    def __hash__(self) -> int:
        return hash(self.name)

    def __repr__(self) -> str:
        return "XlaClientRuntime()"


def resolve(value: Union[str, ClientRuntime, None],
                   models_dir: Optional[str] = None) -> ClientRuntime:
    """The client runtime `value` names ("xla", default for None; "litert"), or `value`
    itself when it is one; `models_dir`: where a LiteRT runtime takes carried models
    first. ArgumentError for anything else."""
    if value is None:
        value = "xla"
    if isinstance(value, str):
        if value == "xla" and models_dir is None:
            return XlaClientRuntime()
        if value == "litert":
            from fax_bridge.litert.runner import LiteRTClientRuntime

            return LiteRTClientRuntime(models_dir=models_dir)
        if value not in NAMES:
            raise ArgumentError(
                f"client_runtime={value!r}: expected one of {list(NAMES)} (\"xla\": the "
                "client part's XLA; \"litert\": the LiteRT interpreter, as phones run it) "
                "or a ClientRuntime (fax_bridge.rounds.client_runtime)")
        raise ArgumentError(f"a models directory ({models_dir}) is for client_runtime="
                            "\"litert\"; XLA converts nothing")
    if isinstance(value, ClientRuntime) and isinstance(getattr(value, "name", None), str):
        return value if models_dir is None else value.carrying(models_dir)
    raise ArgumentError(f"client_runtime={value!r}: expected \"xla\", \"litert\" or a "
                        "ClientRuntime (fax_bridge.rounds.client_runtime), got "
                        f"{type(value).__name__}")


def served(client_runtime: str, model_sha256: Optional[str]) -> dict:
    """What computed a holder's answer, as `RoundReport.served` keeps it per holder:
    `{"client_runtime": "xla" or "litert", "model_sha256": the LiteRT model's sha256, or
    None where no model ran (XLA)}`."""
    return {"client_runtime": client_runtime, "model_sha256": model_sha256 or None}


def model_served(runtime: ClientRuntime, key: str) -> Optional[str]:
    """The sha256 of the LiteRT model that last ran client part `key` in this process
    under `runtime`; None for a runtime that runs no model (XLA) or none yet."""
    if runtime.name != "litert":
        return None
    from fax_bridge.litert import runner

    return runner.served(key)
