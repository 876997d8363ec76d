"""A `ClientsBackend` that keeps every client's value in this process.

Client values are held as a list of local values, one per client; a map runs the local
computation over them with `client_map` (one XLA call where it can) and an aggregation
reduces the list with `aggregation` (exact sums), so results have the same bits as on a
fleet. This is the
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
from fax_bridge.runtime.backend import ClientsBackend, ClientsValue, LocalValue, as_numpy


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


def _members(value: ClientsValue) -> list[LocalValue]:
    if not isinstance(value, LocalClientsValue):
        raise ComputationError(
            f"the local backend got a clients value it does not hold: {value!r}")
    return value.members


class LocalClientsBackend(ClientsBackend):
    """Runs CLIENTS-placed work in this process (no devices, no network).

    CLIENTS inputs given as `PopulationRef(directory=...)` are read from that store here.
    """

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
        out = client_map.map_clients(fn, _members(arg),
                                     no_argument=fn_type.parameter is None)
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
        w = None if weights is None else _members(weights)
        return aggregation.reduce(kind, _members(value), w, bitwidth)

    def get(self, value: ClientsValue) -> list[LocalValue]:
        return list(_members(value))
