"""CLIENTS inputs named by reference: rows of a population store read where clients run.

A `PopulationRef` stands for a CLIENTS-placed argument whose members are rows of a
population written by `fax_bridge.data.stream.write_population`. Instead of reading
every client's data and sending it, the coordinator passes the reference (and the
population ids of the chosen clients) to its `ClientsBackend.put_from_store`: a fleet
device that hosts the population itself (`fax-bridge device --population DIR`) reads only
those clients' rows from its store; the local backend reads them from `directory`. A
store file changed on disk since it was opened makes the read a `DataError` naming the
file and the change (`ClientStore.check` and `rows`).

How a member type maps onto stored arrays (checked before any row is read):

- A tensor member reads one stored array (`keys=("x",)`, or the store's only array);
  a struct member reads one array per tensor, depth first (`keys`, or by default the
  arrays named like the struct's elements, which must then be flat and named).
- A stored array holds, per client, `n` examples of one example shape. A member tensor
  of rank `1 + example rank` is the client's whole block `[n, *example_shape]` (its
  first dimension, when known, must equal every chosen client's `n`); a member tensor
  of the example's rank is the client's single example (every chosen client must hold
  exactly one).
- dtypes must match exactly (no casting), and known dimensions must agree.

Every mismatch is a `ComputationError` naming the element, the stored array and both
types.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional, Sequence

import federated_language
import numpy as np

from fax_bridge.data.stream import ClientStore
from fax_bridge.runtime.backend import ClientRows, from_leaves
from fax_bridge.errors import ComputationError
from fax_bridge.runtime import limits


@dataclasses.dataclass(frozen=True, eq=False)
class PopulationRef:
    """A CLIENTS-placed argument read from a population store where the clients run.

    Attributes:
      name: the population the devices must host (`--population-name`, by default the
        store directory's base name); None accepts whatever they host, as long as every
        device hosts the same one.
      directory: the store, for backends that read it in this process (the local
        backend); fleet devices read their own `--population` instead.
      client_ids: population ids of the clients, in client order; None takes every
        client of the population. Rounds on a fleet narrow them to the sampled cohort.
      keys: the stored array behind each tensor of the member type, depth first; None
        picks them by element name (or the only array, for a tensor member).
    """

    name: Optional[str] = None
    directory: Optional[str] = None
    client_ids: Optional[Sequence[int]] = None
    keys: Optional[Sequence[str]] = None

    def __post_init__(self):
        if self.client_ids is not None:
            ids = np.asarray(self.client_ids)
            if ids.ndim != 1 or (ids.size and ids.dtype.kind not in "iu"):
                raise ComputationError(
                    f"PopulationRef client_ids must be a flat sequence of integer ids, got "
                    f"{ids.dtype}{list(ids.shape)}")
            ids = ids.astype(np.int64)
            if ids.size and int(ids.min()) < 0:
                raise ComputationError(
                    f"PopulationRef client_ids hold a negative id {int(ids.min())}")
            ids.setflags(write=False)
            object.__setattr__(self, "client_ids", ids)
        if self.keys is not None:
            if isinstance(self.keys, str):
                object.__setattr__(self, "keys", (self.keys,))
            else:
                object.__setattr__(self, "keys", tuple(str(k) for k in self.keys))

    @property
    def num_clients(self) -> Optional[int]:
        """How many clients the reference names (None: all, not known yet)."""
        return None if self.client_ids is None else int(len(self.client_ids))

    def with_ids(self, client_ids: Sequence[int]) -> "PopulationRef":
        """The same reference naming the population clients `client_ids`."""
        return dataclasses.replace(self, client_ids=np.asarray(client_ids, np.int64))

    def select(self, positions: Sequence[int]) -> "PopulationRef":
        """The clients at `positions` among those this reference names (a cohort)."""
        positions = np.asarray(positions, np.int64)
        if self.client_ids is None:
            return self.with_ids(positions)
        return self.with_ids(np.asarray(self.client_ids)[positions])

    def __repr__(self) -> str:
        ids = "all" if self.client_ids is None else f"{len(self.client_ids)} clients"
        where = f", directory={self.directory!r}" if self.directory else ""
        return f"PopulationRef(name={self.name!r}{where}, {ids}, keys={self.keys})"


# ---------------------------------------------------------------------------------------
# Stores.


def store_digest(directory: str) -> str:
    """A digest of a population's layout (array dtypes and shapes, client offsets), read
    as `ClientStore` reads it (`ClientStore.digest`)."""
    with ClientStore(directory) as store:
        return store.digest


def default_name(directory: str) -> str:
    """The name a population goes by when none is given: its directory's base name."""
    return os.path.basename(os.path.normpath(os.path.abspath(directory)))


def open_store(directory: str):
    """The population at `directory` (a `fax_bridge.data.ClientStore`, its files kept
    open); a clear ComputationError when it is not one."""
    try:
        return ClientStore(directory)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ComputationError(
            f"cannot open the population store {directory}: {e}; write one with "
            "fax_bridge.data.stream.write_population") from None


@dataclasses.dataclass(frozen=True)
class Column:
    """One tensor of the member: which stored array, and whole block or single example."""

    path: str
    key: str
    type_: federated_language.TensorType
    single: bool
    example_bytes: int  # bytes of one stored example
    # max(d, 1) over the example's dimensions, times its itemsize (what a client's block
    # spans per example, as `limits.tensor_bytes` counts it); None when the example's
    # rank leaves no room for the examples axis
    span_bytes: Optional[int]


def _leaf_paths(member_type: federated_language.Type, path: str = "") -> list:
    if isinstance(member_type, federated_language.TensorType):
        return [(path, member_type)]
    if isinstance(member_type, federated_language.StructType):
        out = []
        for i, (name, t) in enumerate(member_type.items()):
            out.extend(_leaf_paths(t, f"{path}.{name or i}" if path else str(name or i)))
        return out
    raise ComputationError(
        f"a population can only fill CLIENTS members of tensors or structs of tensors, "
        f"not {member_type}")


def default_keys(member_type: federated_language.Type,
                 keys: Optional[Sequence[str]]) -> list[str]:
    """The stored array of each tensor of `member_type` ([] leaves a tensor to the store)."""
    leaves = _leaf_paths(member_type)
    if keys is not None:
        keys = list(keys)
        if len(keys) != len(leaves):
            raise ComputationError(
                f"PopulationRef keys {keys} name {len(keys)} stored arrays but the member "
                f"type {member_type} has {len(leaves)} tensors; give one key per tensor, "
                "depth first")
        return keys
    if isinstance(member_type, federated_language.TensorType):
        return []
    items = list(member_type.items())
    if not all(n for n, _ in items) or any(
            not isinstance(t, federated_language.TensorType) for _, t in items):
        raise ComputationError(
            f"the member type {member_type} is not a flat struct of named tensors; give "
            "PopulationRef(keys=[...]) with the stored array of each tensor, depth first")
    return [n for n, _ in items]


def plan_columns(store, member_type: federated_language.Type,
                 keys: Sequence[str]) -> list[Column]:
    """Checks the stored arrays against `member_type`; returns how to read each tensor."""
    leaves = _leaf_paths(member_type)
    keys = list(keys)
    stored = store.spec
    if not keys:
        if len(leaves) != 1 or len(stored) != 1:
            raise ComputationError(
                f"the member type {member_type} does not say which stored arrays to read "
                f"(the population holds {sorted(stored)}); give PopulationRef(keys=[...])")
        keys = list(stored)
    if len(keys) != len(leaves):
        raise ComputationError(
            f"{len(keys)} stored arrays {keys} for a member type {member_type} of "
            f"{len(leaves)} tensors")
    columns = []
    for (path, t), key in zip(leaves, keys):
        element = f"member element `{path}`" if path else "the member"
        if key not in stored:
            raise ComputationError(
                f"{element} ({t}) reads stored array {key!r}, but the population holds "
                f"only {sorted(stored)}")
        dtype, example = stored[key]
        want = np.dtype(t.dtype)
        shape = list(t.shape or ())

        def where() -> str:  # built only for an error: a type's text is slow to make
            return (f"{element} is {t} but the population stores {key!r} as "
                    f"{dtype.name} examples of shape {list(example)}")

        if dtype != want:
            raise ComputationError(f"{where()}: the dtypes differ ({dtype.name} stored, "
                                   f"{want.name} expected); rewrite the population or "
                                   "change the parameter type")
        if len(shape) == len(example) + 1:
            rest, single = shape[1:], False
        elif len(shape) == len(example):
            rest, single = shape, True
        else:
            raise ComputationError(
                f"{where()}: a member tensor must have the example's rank (one example per "
                f"client) or one more (all of a client's examples)")
        if any(w is not None and w != g for w, g in zip(rest, example)):
            raise ComputationError(f"{where()}: the example shapes differ")
        dims = [int(d) for d in example]
        columns.append(Column(
            path=path, key=key, type_=t, single=single,
            example_bytes=int(np.prod(dims, dtype=np.int64)) * dtype.itemsize,
            span_bytes=(int(np.prod([max(d, 1) for d in dims], dtype=np.int64))
                        * dtype.itemsize if len(dims) < limits.MAX_RANK else None)))
    return columns


def check_ids(store, ids: np.ndarray) -> None:
    """Raises ComputationError unless every id names a client of the store."""
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= store.num_clients):
        bad = ids[(ids < 0) | (ids >= store.num_clients)]
        raise ComputationError(
            f"client id {int(bad[0])} is out of range for a population of "
            f"{store.num_clients} clients")


def rows_bytes(store, columns: Sequence[Column], ids: np.ndarray) -> int:
    """Bytes the members of `ids` take once read (checked against the tensor cap)."""
    sizes = store.offsets[ids + 1] - store.offsets[ids]  # these clients only
    examples = int(sizes.sum())
    biggest = int(sizes.max()) if sizes.size else 0
    for c in columns:
        # What `limits.tensor_bytes` refuses, without its walk over the dimensions.
        if c.span_bytes is None or max(biggest, 1) * c.span_bytes > \
                limits.LIMITS.max_tensor_bytes:
            dtype, example = store.spec[c.key]
            limits.tensor_bytes([biggest] + list(example), dtype.itemsize,
                                f"stored array {c.key!r} of one client")
    return examples * sum(c.example_bytes for c in columns)


def read_members(store, member_type: federated_language.Type, columns: Sequence[Column],
                 ids: np.ndarray) -> Sequence:
    """The members of clients `ids` (in order), reading only their rows: a `ClientRows` over
    one block per stored array when every client holds as many examples of each, a
    list of members otherwise."""
    ids = np.asarray(ids, np.int64)
    check_ids(store, ids)
    starts = store.offsets[ids]
    counts = store.offsets[ids + 1] - starts
    for c in columns:  # every column's counts checked before any row is read
        where = f"member element `{c.path}`" if c.path else "the member"
        want = 1 if c.single else (c.type_.shape or [None])[0]
        wrong = np.flatnonzero(counts != want) if want is not None else ()
        if len(wrong):
            i = int(wrong[0])
            if c.single:
                raise ComputationError(
                    f"{where} ({c.type_}) is one example per client, but client "
                    f"{int(ids[i])} holds {int(counts[i])} examples of {c.key!r}; use a "
                    f"member type with a leading examples dimension")
            raise ComputationError(
                f"{where} is {c.type_}, but client {int(ids[i])} holds "
                f"{int(counts[i])} examples of {c.key!r}")
    # one copy of only these rows per column; DataError naming a file changed on disk
    blocks = store.read([c.key for c in columns], starts, counts)
    regular = ids.size and int(counts.min()) == int(counts.max())
    per_column = []
    for c, block in zip(columns, blocks):
        if c.single:
            per_column.append(block)
        elif regular:
            per_column.append(block.reshape((len(ids), int(counts[0])) + block.shape[1:]))
        else:
            per_column.append(np.split(block, np.cumsum(counts)[:-1]))
    if per_column and all(isinstance(c, np.ndarray) for c in per_column):
        return ClientRows(from_leaves(member_type, per_column))
    if isinstance(member_type, federated_language.TensorType):
        return per_column[0] if per_column else []
    return [from_leaves(member_type, list(row)) for row in zip(*per_column)]
