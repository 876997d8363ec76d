"""The ClientApp of a Flower round: a SuperNode's own clients, their exact partials.

Each SuperNode serves a block of the population, named by its `--node-config`:

    population="/data/pop"   a directory written by `fax_bridge.data.write_population`
    first-client=0           the population id of the node's first client
    num-clients=4            how many clients it serves (default: the rest of its store)
    first-row=0              the store row of its first client (default 0: a store of
                             only this node's clients; give first-client for a store
                             shared by every node)
    keys="x,y"               the stored array of each tensor of the client data, depth
                             first (default: by the data's element names)
    client-runtime="litert"  run the round's client part as a LiteRT model in the LiteRT
                             interpreter, as a phone would (`fax_bridge.litert`): the
                             model the app carries (`fax-bridge flower ... --litert`),
                             else one converted here once per round shape, which needs
                             the converter's environment; default "xla"
    fault="client=1,leaf=0"  compute wrongly on purpose, to watch a parity check fail
                             (`rounds.faults`: `fax-bridge device --fault`'s value)

A `query` message answers with that block. A `train` message brings the broadcast and
the population ids of the node's clients in the round; the node reads only their rows,
runs the round's client part over them by the node's client runtime, parsed once from
its config (`rounds.client_runtime`; XLA: one call for all of them where it can, in the bucket of the most clients a round can bring
the node, from the cohort size the message names, so that it compiles once a run) and
answers with one exact partial per aggregation (`records.partials_layout`, each tensor
with its sha256, which the ServerApp checks on what it reads back), the sha256 of the
broadcast and ids it received (`records.RECEIVED`, checked against what was sent), and
names what computed them (`served_by`: the client runtime, the LiteRT model's sha256). No
client row leaves the node. The ClientApp itself is `relay.client_app`; this runs in its
process, or in a warm `worker`.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Optional

import numpy as np

from fax_bridge.errors import FleetError
from fax_bridge.flower import records
from fax_bridge.rounds.client_runtime import ClientRuntime, XlaClientRuntime

NODE_CONFIG_HELP = ("start the SuperNode with --node-config 'population=\"DIR\" "
                    "first-client=0 num-clients=4' (see fax_bridge.flower.client)")


@dataclasses.dataclass(frozen=True)
class NodeShare:
    """The clients one SuperNode serves: population ids [first, first + count)."""

    population: str
    first: int
    count: int
    first_row: int = 0
    keys: Optional[tuple] = None
    client_runtime: ClientRuntime = XlaClientRuntime()  # parsed from the node config

    @property
    def stop(self) -> int:
        return self.first + self.count

    @classmethod
    def from_config(cls, config) -> "NodeShare":
        """The share a SuperNode's `--node-config` names (module docstring)."""
        if "population" not in config:
            raise FleetError(f"this SuperNode names no population; {NODE_CONFIG_HELP}")
        directory = str(config["population"])
        store = _store(directory)
        first = whole_setting(config, "first-client", 0)
        first_row = whole_setting(config, "first-row", 0)
        count = whole_setting(config, "num-clients", store.num_clients - first_row)
        if first < 0 or first_row < 0 or count < 1 or \
                first_row + count > store.num_clients:
            raise FleetError(
                f"--node-config first-client={first} first-row={first_row} num-clients="
                f"{count} does not fit the population in {directory}, which holds "
                f"{store.num_clients} clients; rows first-row .. first-row+num-clients-1 "
                "must exist")
        keys = config.get("keys")
        keys = tuple(k.strip() for k in str(keys).split(",")) if keys else None
        from fax_bridge.errors import ArgumentError
        from fax_bridge.rounds import client_runtime as runtimes

        try:
            runtime = runtimes.resolve(str(config.get("client-runtime", "xla")))
        except ArgumentError as e:
            raise FleetError(f"--node-config client-runtime: {e}") from None
        if "fault" in config:
            from fax_bridge.rounds import faults

            try:
                runtime = faults.parse(str(config["fault"]), base=runtime.name)
            except ArgumentError as e:
                raise FleetError(f"--node-config fault: {e}") from None
        return cls(directory, first, count, first_row, keys, runtime)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """The store rows of population ids `ids` (each must be this node's)."""
        outside = ids[(ids < self.first) | (ids >= self.stop)]
        if outside.size:
            raise FleetError(
                f"client {int(outside[0])} is not served here: this node serves "
                f"clients {self.first}..{self.stop - 1}")
        return ids - self.first + self.first_row


def whole_setting(config, key: str, default: int) -> int:
    """`config[key]` (else `default`) as a whole number: an int, or a string of one (as
    a command line gives it); a fraction, a bool or anything else is a FleetError naming
    the setting, never truncated."""
    value = config.get(key, default)
    if isinstance(value, str) and value.strip().lstrip("+-").isdigit():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise FleetError(f"--node-config {key}={value!r} is not a whole number; give e.g. "
                         f"{key}=4; {NODE_CONFIG_HELP}")
    return int(value)


_STORES: dict = {}  # directory -> ClientStore, opened once per process


def _store(directory: str):
    from fax_bridge.runtime import population

    store = _STORES.get(directory)
    if store is None:
        store = _STORES[directory] = population.open_store(directory)
    return store


def describe(share: NodeShare) -> dict:
    """What a node answers a `query`: its block of the population."""
    return {"first-client": share.first, "num-clients": share.count}


def answer_query(config) -> dict:
    """A node's answer to a `query` message, from its `--node-config`."""
    return describe(NodeShare.from_config(config))


def most_clients(share: NodeShare, cohort: int) -> int:
    """The most clients a round can bring the node: its share, or fewer where the
    run samples a cohort of `cohort` clients (0: not known)."""
    return min(cohort, share.count) if cohort > 0 else share.count


def partials_for(bundle_dir: str, share: NodeShare, ids: np.ndarray,
                 broadcast: list, most: int = 0) -> list:
    """The exact partial (`aggregation.Partial`) of each aggregation of the round over
    the node's clients `ids`, given the broadcast tensors, in split order. `most`: the
    most clients a round of the run can bring the node (`most_clients`); every round
    runs its clients in the bucket of that many (`client_map.bucket`; padding rows cost
    no work; while their inputs take under `client_map.MAX_PAD_BYTES`), so the client
    part compiles once, in the run's first round, however the node's share of the
    cohort varies."""
    import federated_language

    from fax_bridge.flower.bundle import models_dir, read_round
    from fax_bridge.runtime import population
    from fax_bridge.runtime.backend import from_leaves

    made = read_round(bundle_dir)
    split = made.split
    store = _store(share.population)
    member_type = federated_language.StructType([(None, t) for t in split.input_types])
    keys = [k for t in split.input_types
            for k in population.default_keys(t, share.keys)]
    columns = population.plan_columns(store, member_type, keys)
    members = population.read_members(store, member_type, columns, share.rows(ids))
    sent = from_leaves(made.sent_type, broadcast)
    specs = [a.spec for a in split.aggregations]
    if share.client_runtime.name == "litert" and made.litert_models is not None:
        from fax_bridge.litert import carried

        carried.expect(models_dir(bundle_dir), made.litert_models)  # round.json's record
    runtime = share.client_runtime.carrying(models_dir(bundle_dir))  # the app's models
    return runtime.client_partials(split.client_part, split.client_part_hash, sent, members,
                                   specs, least_rows=most)


def serve_round(bundle_dir: str, config, arrays: dict, header: dict) -> tuple:
    """A node's answer to a `train` message (as `relay.request_of` unpacks it): (the
    partials' arrays by key, {"layout", "counts", "compute-s", "served"}: `served_by`). The partials of the
    round's secure sums are not among the partials: their exact totals over the node's
    clients come as `relay.KEPT` + "0", "1", ... (tensors depth first over the secure
    sums), which the ClientApp keeps for SecAgg+ (`secagg`) and never sends."""
    start = time.perf_counter()
    share = NodeShare.from_config(config)
    where = f"round {header[records.ROUND].get('round', '?')}"
    ids = records.ids_from_arrays(arrays, where)
    broadcast = records.tensors_from_arrays(arrays, header[records.LAYOUT], where,
                                            prefix="b")
    # --- secure sums (flower/secagg.py): kept back from the answer -------------------
    from fax_bridge.rounds import partials
    from fax_bridge.rounds.round_split import SECURE_KINDS
    from fax_bridge.flower import relay
    from fax_bridge.runtime import aggregation

    most = most_clients(share, int(header[records.ROUND].get("cohort", 0)))
    found = partials_for(bundle_dir, share, ids, broadcast, most)
    plain = [p for p in found if p.kind not in SECURE_KINDS]
    kept = [x for p in found if p.kind in SECURE_KINDS for x in aggregation.finish(p)]
    rounded = bool(header[records.ROUND].get("rounded-partials", False))
    out, layout, counts = records.partials_layout(
        [partials.to_message(p, rounded=rounded) for p in plain])
    layout[records.RECEIVED] = records.tensors_sha256([*broadcast, ids])  # as it arrived
    out.update({f"{relay.KEPT}{i}": x for i, x in enumerate(kept)})
    # ---------------------------------------------------------------------------------
    return out, {"layout": layout, "counts": counts,
                 "compute-s": time.perf_counter() - start,
                 "served": served_by(bundle_dir, share)}


def served_by(bundle_dir: str, share: NodeShare) -> dict:
    """What computed the node's answer, as its `relay.SERVED` record names it: the client
    runtime's name, and the sha256 of the LiteRT model that ran the round's client part
    here ("" for XLA, which runs no model)."""
    model = ""
    if share.client_runtime.name == "litert":
        from fax_bridge.flower.bundle import read_round
        from fax_bridge.rounds.client_runtime import model_served

        model = model_served(share.client_runtime,
                             read_round(bundle_dir).split.client_part_hash) or ""
    return {"client-runtime": share.client_runtime.name, "model-sha256": model}
