"""A `ClientsBackend` that keeps every client's value in this process.

Client values are held as a list of local values, one per client, or kept stacked (a
`ClientRows`: a CLIENTS argument, a batched map's results); a map runs the local
computation over them with `client_map` (one XLA call where it can) and an aggregation
reduces them with `aggregation` (exact sums; stacked ones as the columns they are), so
results have the same bits as on a fleet. This is the
reference backend the gRPC one is compared with.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import federated_language
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError, DataError
from fax_bridge.runtime import aggregation, client_map, population
from fax_bridge.runtime.backend import (ClientRows, ClientsBackend, ClientsValue, LocalValue,
                                       as_numpy, leaves, unflatten_like)

# Aggregations that take the clients' tensors stacked (the secure sums check each
# client's member against their bound: they go member by member).
_BY_COLUMNS = ("sum", "mean", "weighted_mean", "min", "max")


class LocalClientsValue(ClientsValue):
    """One local value per client, in client order."""

    def __init__(self, member_type: federated_language.Type, members: list[LocalValue]):
        self._type = member_type
        self.members = members

    @property
    def num_clients(self) -> int:
        return len(self.members)

    @property
    def type_signature(self) -> federated_language.Type:
        return self._type

    def __repr__(self) -> str:
        return f"LocalClientsValue({self._type}, {len(self.members)} clients)"


def _weight_column(weights: Optional[Sequence[LocalValue]], count: int) -> Optional[list]:
    """`[the clients' weights stacked]` when there is one scalar tensor per client (the
    stacked column itself for `ClientRows`), else None (the members' path says what is
    wrong)."""
    if weights is None or len(weights) != count:
        return None
    if isinstance(weights, ClientRows):
        columns = weights.columns
    else:
        flat = [leaves(x) for x in weights]
        if any(len(f) != 1 for f in flat):
            return None
        columns = [np.stack([f[0].reshape(-1) for f in flat])]
    if len(columns) != 1 or columns[0].size != count:
        return None
    return list(columns)


def _members(value: ClientsValue) -> list[LocalValue]:
    if not isinstance(value, LocalClientsValue):
        raise ComputationError(
            f"the local backend got a clients value it does not hold: {value!r}")
    return value.members


class LocalClientsBackend(ClientsBackend):
    """Runs CLIENTS-placed work in this process (no devices, no network).

    CLIENTS inputs given as `PopulationRef(directory=...)` are read from that store here.
    `client_runtime`: what runs the client maps (`rounds.client_runtime`; None: XLA,
    by `client_map`).
    """

    def __init__(self, client_runtime: Any = None) -> None:
        self.client_runtime = client_runtime

    def _store(self, ref):
        if not getattr(ref, "directory", None):
            raise ComputationError(
                f"{ref!r} names no directory; the local backend reads populations in this "
                "process, so give PopulationRef(directory=...)")
        stores = self.__dict__.setdefault("_stores", {})
        store = stores.get(ref.directory)
        if store is not None:
            try:
                store.check()
            except DataError:  # rewritten since: this process reads the new files
                store.close()
                store = None
        if store is None:
            store = stores[ref.directory] = population.open_store(ref.directory)
        return store

    def put_from_store(self, member_type: federated_language.Type, ref: Any,
                       client_ids: Sequence[int]) -> LocalClientsValue:
        store = self._store(ref)
        columns = population.plan_columns(
            store, member_type, population.default_keys(member_type, ref.keys))
        ids = np.asarray(client_ids, np.int64)
        return LocalClientsValue(member_type,
                                 population.read_members(store, member_type, columns, ids))

    def population_size(self, ref: Any) -> int:
        return self._store(ref).num_clients

    def put(self, member_type: federated_language.Type,
            values: Sequence[LocalValue]) -> LocalClientsValue:
        return LocalClientsValue(member_type, [as_numpy(v) for v in values])

    def broadcast(self, member_type: federated_language.Type, value: LocalValue,
                  num_clients: int) -> LocalClientsValue:
        value = as_numpy(value)
        return LocalClientsValue(member_type, [value] * int(num_clients))

    def map(self, fn: computation_pb2.Computation, fn_type: federated_language.FunctionType,
            arg: ClientsValue) -> LocalClientsValue:
        members = _members(arg)
        if self.client_runtime is not None:
            return LocalClientsValue(fn_type.result, self.client_runtime.map_clients(
                fn, members, no_argument=fn_type.parameter is None))
        if fn_type.parameter is not None and members:  # results kept stacked
            stacked = client_map.map_clients_stacked(fn, members)
            if stacked is not None:
                return LocalClientsValue(fn_type.result, stacked.rows())
        out = client_map.map_clients(fn, members, no_argument=fn_type.parameter is None)
        return LocalClientsValue(fn_type.result, out)

    def zip(self, values: Sequence[ClientsValue],
            names: Sequence[Optional[str]]) -> LocalClientsValue:
        columns = [_members(v) for v in values]
        sizes = {len(c) for c in columns}
        if len(sizes) > 1:
            raise ComputationError(
                f"federated_zip of clients values with different numbers of clients "
                f"{sorted(sizes)}")
        n = sizes.pop() if sizes else 0
        member_type = federated_language.StructType(
            [(name, v.type_signature) for name, v in zip(names, values)])
        rows = [structure.Struct([(name, col[i]) for name, col in zip(names, columns)])
                for i in range(n)]
        return LocalClientsValue(member_type, rows)

    def aggregate(self, value: ClientsValue, kind: str,
                  weights: Optional[ClientsValue] = None,
                  bitwidth: Optional[LocalValue] = None) -> LocalValue:
        members = _members(value)
        w = None if weights is None else _members(weights)
        w_columns = _weight_column(w, len(members))
        if isinstance(members, ClientRows) and len(members) and kind in _BY_COLUMNS and (
                w is None or w_columns is not None):
            # The clients' tensors as they are stacked: no split, no restack.
            partial = aggregation.partial_of_columns(kind, members.columns, len(members),
                                                     w_columns)
            return unflatten_like(members.stacked, aggregation.finish(partial))
        return aggregation.reduce(kind, members, w, bitwidth, value.type_signature)

    def get(self, value: ClientsValue) -> list[LocalValue]:
        return list(_members(value))
