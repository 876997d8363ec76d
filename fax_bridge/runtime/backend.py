"""Where CLIENTS-placed values live while a TFF computation is interpreted.

The coordinator (`fax_bridge.runtime.interpreter`) evaluates server-side and unplaced
parts itself and hands every CLIENTS-placed operation to a `ClientsBackend`. A backend
holds client values as opaque `ClientsValue` handles, so the data of each client can stay
where it is (in this process, or on a device process reached over gRPC) between
operations; only aggregates travel back.

Local values (server-placed or unplaced) are numpy arrays, or
`federated_language.common_libs.structure.Struct` of them (named or unnamed elements).
A clients value has one such local value per client, in client order.
"""

from __future__ import annotations

import abc
import functools
from typing import Any, Optional, Sequence

import federated_language
import numpy as np
from federated_language.common_libs import structure
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError

LocalValue = Any  # np.ndarray | structure.Struct of LocalValue


class ClientsValue(abc.ABC):
    """Handle to one value per client, held by a backend."""

    @property
    @abc.abstractmethod
    def num_clients(self) -> int:
        """How many clients hold a member of this value."""

    @property
    @abc.abstractmethod
    def type_signature(self) -> federated_language.Type:
        """The member type (not federated) of each client's value."""


class ClientsBackend(abc.ABC):
    """Executes the CLIENTS-placed part of a TFF computation."""

    @abc.abstractmethod
    def put(
            self, member_type: federated_language.Type, values: Sequence[LocalValue]
    ) -> ClientsValue:
        """Places `values[i]` on client i (one value per client)."""

    @abc.abstractmethod
    def broadcast(
            self, member_type: federated_language.Type, value: LocalValue, num_clients: int
    ) -> ClientsValue:
        """Places the same value on every client (all_equal)."""

    @abc.abstractmethod
    def map(
            self,
            fn: computation_pb2.Computation,
            fn_type: federated_language.FunctionType,
            arg: ClientsValue,
    ) -> ClientsValue:
        """Applies a local functional computation (Xla, or Lambda of local parts) per client."""

    @abc.abstractmethod
    def zip(
            self, values: Sequence[ClientsValue], names: Sequence[Optional[str]]
    ) -> ClientsValue:
        """Turns a struct of clients values into a clients value of structs."""

    @abc.abstractmethod
    def aggregate(
            self,
            value: ClientsValue,
            kind: str,
            weights: Optional[ClientsValue] = None,
            bitwidth: Optional[LocalValue] = None,
    ) -> LocalValue:
        """Reduces over clients as `aggregation` defines `kind` (one of aggregation.KINDS)."""

    @abc.abstractmethod
    def get(self, value: ClientsValue) -> list[LocalValue]:
        """Brings every client's member back to the coordinator, in client order."""

    def put_from_store(self, member_type: federated_language.Type, ref: Any,
                       client_ids: Sequence[int]) -> ClientsValue:
        """Places, on client i, the stored rows of population client `client_ids[i]`.

        `ref` is a `fax_bridge.runtime.population.PopulationRef`: the data stays where the
        clients run and only ids travel. Backends that cannot read populations raise.
        """
        raise ComputationError(
            f"{type(self).__name__} cannot read CLIENTS inputs from a population store; "
            "pass the client data itself, or use a backend that hosts the population")

    def population_size(self, ref: Any) -> int:
        """How many clients the population `ref` names holds."""
        raise ComputationError(
            f"{type(self).__name__} hosts no population; give PopulationRef(client_ids=...) "
            "or use a backend that hosts the population")

    def close(self) -> None:
        """Releases whatever the backend holds."""


def as_numpy(value: LocalValue) -> LocalValue:
    """Converts a local value's leaves to numpy arrays, keeping Struct nesting."""
    if isinstance(value, structure.Struct):
        return structure.Struct([(n, as_numpy(m)) for n, m in structure.iter_elements(value)])
    return np.asarray(value)


def leaves(value: LocalValue) -> list[np.ndarray]:
    """The tensors of a local value, depth first."""
    if isinstance(value, structure.Struct):
        out: list[np.ndarray] = []
        for _, member in structure.iter_elements(value):
            out.extend(leaves(member))
        return out
    return [np.asarray(value)]


def unflatten_like(template: LocalValue, flat: list) -> LocalValue:
    """Rebuilds `template`'s Struct nesting (names included) around `flat` leaves."""
    iterator = iter(flat)

    def build(node: LocalValue) -> LocalValue:
        if isinstance(node, structure.Struct):
            return structure.Struct([(n, build(m)) for n, m in structure.iter_elements(node)])
        return next(iterator)

    return build(template)


@functools.lru_cache(maxsize=1024)  # a program's few types, worked out once each
def _nesting(type_: federated_language.Type) -> tuple[Any, int]:
    """(a type's nesting: a tuple of (name, child nesting) per struct, None for a
    tensor; its number of tensors)."""
    if not isinstance(type_, federated_language.StructType):
        return None, 1
    children = [(name, _nesting(t)) for name, t in type_.items()]
    return (tuple((name, node) for name, (node, _) in children),
            sum(count for _, (_, count) in children))


def _build_nested(node: Any, iterator) -> LocalValue:
    if node is None:
        return next(iterator)
    return structure.Struct([(name, _build_nested(child, iterator)) for name, child in node])


def from_leaves(type_: federated_language.Type, flat: list) -> LocalValue:
    """The local value of `type_` whose tensors, depth first, are `flat` (an aggregate
    computed leaf by leaf); ComputationError when their number does not fit the type."""
    node, count = _nesting(type_)
    if count != len(flat):
        raise ComputationError(
            f"an aggregate of {len(flat)} tensors cannot have type {type_}, which has "
            f"{count}; its partials were computed for a value of another type")
    return _build_nested(node, iter(flat))


class ClientRows(Sequence):
    """The members of several clients kept stacked: `stacked` is one member's local
    value whose every tensor carries the clients on a leading axis, and `columns` those
    tensors, depth first. Client i's member is made when asked for (views of its rows),
    so a cohort of 100,000 clients stays one array per tensor; code that takes all of
    them at once (a batched map of a local computation) reads the columns as they are,
    with no split and no restack. Made from a CLIENTS pytree (`values.from_pytree`) and
    from population reads (`population.read_members`)."""

    def __init__(self, stacked: LocalValue, path: str = "") -> None:
        self.stacked = stacked
        self.columns = leaves(stacked)
        sizes = {int(np.shape(leaf)[0]) for leaf in self.columns}
        if len(sizes) > 1:
            where = f"`{path}`" if path else "the value"
            raise ComputationError(
                f"{where}: the leading clients axis differs between tensors "
                f"({sorted(sizes)}); stacked members need one number of clients in every "
                "tensor: every CLIENTS tensor needs one entry per client")
        self._n = sizes.pop() if sizes else 0

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        i = int(index)
        if not -self._n <= i < self._n:
            raise IndexError(f"client {index} out of range for {self._n} clients")
        return unflatten_like(self.stacked, [c[i] for c in self.columns])
