"""Conversions between python pytrees and TFF values, checked against types.

Conventions:
- Pytrees: dicts are named structs (matched by name; TFF element order kept), tuples and
  lists unnamed structs, NamedTuples and other registered pytree nodes (dataclasses,
  optax states) structs named as the exporter names them, None an empty struct,
  array-likes tensors; an argument without tensors (None, (), {}, nested) fits `<>`.
  Results come back with the structure jit gives the program (NamedTuples,
  dataclasses, None, lists, empty containers) when the output's treedef is known
  (`result_structure`: the exporter records it for the protos it builds in this
  process; `to_pytree(..., structure=)` applies it). Otherwise (a proto read from a
  file or built elsewhere) they come back in the generic structure the type alone
  gives: dicts where every element is named, tuples otherwise, `()` for an empty
  struct.
- Federated values: a SERVER value is its member value; a CLIENTS value is given as a
  pytree whose leaves carry a leading clients axis (its size is the number of clients).
  Inside the runtime a CLIENTS value is a sequence of per-client member values (a
  `ClientRows` over the stacked arrays when it comes from a pytree).
- npz files (the CLI's convention): the key rule and layout live in `npz_keys`.
- Arguments (`bind_arguments`): positional, then by keyword for named elements, one per
  element of a struct parameter (one argument for any other parameter); the binding
  counts and selects clients for the fleet's rounds.

Every mismatch raises `ComputationError` naming the path, what was expected and got.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import federated_language
import jax
import numpy as np
from federated_language.common_libs import structure

from fax_bridge.errors import ComputationError
from fax_bridge.language.pytree_names import named_children
from fax_bridge.runtime.backend import ClientRows, ClientsValue, leaves
from fax_bridge.runtime.population import PopulationRef
from fax_bridge.runtime.result_structure import with_structure

LocalValue = Any  # np.ndarray | structure.Struct
Pytree = Any



_KEEP_DEVICE = contextvars.ContextVar("fax_bridge_keep_device_arrays", default=False)


@contextlib.contextmanager
def device_arrays_kept(keep: bool = True) -> Iterator[None]:
    """Within, where `keep` (else every tensor is read into numpy, as by default): a jax
    array given as a tensor that is not CLIENTS-stacked is checked by its shape and
    dtype and kept where it is (cast there when its dtype differs), not
    read into numpy: a round on the device (`device_sums.on_device`) takes its model
    and returns its result without a copy through the host. CLIENTS tensors are read
    to the host as always (the client calls stack their rows there)."""
    token = _KEEP_DEVICE.set(bool(keep))
    try:
        yield
    finally:
        _KEEP_DEVICE.reset(token)


def _where(path: str) -> str:
    return f"`{path}`" if path else "the value"


def _describe(value) -> str:
    if isinstance(value, structure.Struct):
        return f"a struct of {len(value)} elements"
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(value)}"
    if isinstance(value, (tuple, list)):
        return f"a sequence of {len(value)} elements"
    arr = np.asarray(value)
    return f"{arr.dtype}{list(arr.shape)}"


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


def _tensor(value, type_: federated_language.TensorType, path: str, lead: int) -> np.ndarray:
    """`value` as an array of `type_` (with `lead` leading axes kept as they are)."""
    if type(value) is not np.ndarray and (  # arrays skip the slower container checks
            isinstance(value, (structure.Struct, Mapping)) or (
            isinstance(value, (tuple, list)) and not _is_numeric_seq(value))):
        raise ComputationError(f"{_where(path)}: expected a tensor {type_}, got "
                               f"{_describe(value)}")
    try:
        kept = not lead and isinstance(value, jax.Array) and _KEEP_DEVICE.get()
        arr = value if kept else np.asarray(value)
    except Exception as e:
        raise ComputationError(f"{_where(path)}: cannot be read as an array ({e})") from e
    shape = tuple(type_.shape or ())
    got = arr.shape[lead:]
    if arr.ndim != lead + len(shape) or any(
            d is not None and d != g for d, g in zip(shape, got)):
        extra = " after the leading clients axis" if lead else ""
        raise ComputationError(
            f"{_where(path)}: expected shape {list(shape)}{extra} ({type_}), got "
            f"{arr.dtype}{list(arr.shape)}")
    if arr.dtype != type_.dtype:
        if arr.dtype == object or not np.can_cast(arr.dtype, type_.dtype, "same_kind"):
            raise ComputationError(
                f"{_where(path)}: expected dtype {type_.dtype} ({type_}), got "
                f"{arr.dtype}{list(arr.shape)}")
        arr = arr.astype(type_.dtype)
    return arr


def _is_numeric_seq(value) -> bool:
    try:
        return np.asarray(value).dtype.kind in "biufc"
    except Exception:
        return False


def _struct_items(value, type_: federated_language.StructType, path: str):
    """The elements of a pytree or Struct `value` in the order of `type_`'s elements."""
    items = list(type_.items())
    is_struct = isinstance(value, structure.Struct)  # the common case: checked first
    if not items and not is_struct and _holds_no_tensor(value):
        return []  # the exporter types any argument without tensors as <>
    if not is_struct:
        if isinstance(value, tuple) and hasattr(value, "_fields") and \
                all(n for n, _ in items):
            value = value._asdict()  # a NamedTuple's fields are matched by name
        if isinstance(value, Mapping):
            names = [n for n, _ in items]
            if not all(names):
                raise ComputationError(
                    f"{_where(path)}: {type_} has unnamed elements, pass a tuple, not a "
                    "dict")
            missing = [n for n in names if n not in value]
            known = set(names)  # a key looked up in the list: quadratic in the keys
            extra = sorted(str(k) for k in value if k not in known)
            if missing or extra:
                raise ComputationError(
                    f"{_where(path)}: expected keys {names} ({type_}); missing {missing}, "
                    f"unexpected {extra}")
            return [(n, value[n]) for n in names]
    if is_struct or isinstance(value, (tuple, list)):
        if len(value) != len(items):
            raise ComputationError(
                f"{_where(path)}: expected {len(items)} elements ({type_}), got "
                f"{_describe(value)}")
        if is_struct:
            for (name, _), got in zip(items, structure.name_list_with_nones(value)):
                if got is not None and name is not None and got != name:
                    raise ComputationError(
                        f"{_where(path)}: element named `{got}` where {type_} has "
                        f"`{name}`")
        return [(n, v) for (n, _), v in zip(items, value)]
    children = _pytree_children(value)
    if children is not None:  # a registered dataclass or another custom pytree node
        if all(n for n, _ in children):
            return _struct_items(dict(children), type_, path)
        return _struct_items(tuple(c for _, c in children), type_, path)
    raise ComputationError(f"{_where(path)}: expected a struct {type_}, got "
                           f"{_describe(value)}")


def _holds_no_tensor(value) -> bool:
    """Whether `value` is a pytree of containers only (None, (), [], {}, nested)."""
    if value is None:
        return True
    if isinstance(value, (np.ndarray, np.generic, str, bytes)) or np.isscalar(value):
        return False
    children = (list(value.values()) if isinstance(value, Mapping) else list(value)
                if isinstance(value, (tuple, list)) else
                [c for _, c in _pytree_children(value) or [(None, value)]])
    if len(children) == 1 and children[0] is value:
        return False  # a leaf jax knows (e.g. an array)
    return all(_holds_no_tensor(c) for c in children)


def _pytree_children(value) -> Optional[list]:
    """[(name or None, child)] of a registered pytree node (as the exporter names them)."""
    if isinstance(value, np.ndarray) or np.isscalar(value):
        return None
    try:
        return named_children(value)
    except Exception:  # not a pytree jax knows
        return None


def to_local(value: Pytree, type_: federated_language.Type, path: str = "",
             lead: int = 0) -> LocalValue:
    """Checks a pytree (or Struct) against a local type and returns the TFF local value.

    `lead` leading axes are allowed on every tensor (1 for stacked CLIENTS values).
    """
    if isinstance(type_, federated_language.TensorType):
        return _tensor(value, type_, path, lead)
    if isinstance(type_, federated_language.StructType):
        pairs = _struct_items(value, type_, path)
        return structure.Struct([
            (n, to_local(v, t, _join(path, n if n else i), lead))
            for i, ((n, v), (_, t)) in enumerate(zip(pairs, type_.items()))
        ])
    raise ComputationError(
        f"{_where(path)}: values of type {type_} cannot be given as data; only tensors, "
        "structs and federated values of them can")


def _map_local(fn: Callable, value: LocalValue) -> LocalValue:
    if isinstance(value, structure.Struct):
        names = structure.name_list_with_nones(value)
        return structure.Struct([(n, _map_local(fn, v)) for n, v in zip(names, value)])
    return fn(value)


def unstack(stacked: LocalValue, path: str = "") -> list[LocalValue]:
    """Splits a local value whose tensors carry a leading clients axis, client by client."""
    sizes = {int(np.shape(leaf)[0]) for leaf in leaves(stacked)}
    if len(sizes) > 1:
        raise ComputationError(
            f"{_where(path)}: the leading clients axis differs between tensors "
            f"({sorted(sizes)}); every CLIENTS tensor needs one entry per client")
    n = sizes.pop() if sizes else 0
    return [_map_local(lambda leaf: leaf[i], stacked) for i in range(n)]


def stack(values: Sequence[LocalValue], path: str = "") -> LocalValue:
    """Stacks per-client local values along a new leading clients axis."""
    if isinstance(values, ClientRows) and len(values):
        return values.stacked
    if not values:
        raise ComputationError(f"{_where(path)}: cannot stack a CLIENTS value of 0 clients")
    first = values[0]
    if isinstance(first, structure.Struct):
        names = structure.name_list_with_nones(first)
        return structure.Struct([
            (n, stack([v[k] for v in values], _join(path, n if n else k)))
            for k, n in enumerate(names)
        ])
    return np.stack([np.asarray(v) for v in values])


def from_pytree(value: Pytree, type_: federated_language.Type, path: str = "") -> Any:
    """A pytree as the runtime value of `type_` (CLIENTS: a list of per-client values)."""
    if isinstance(type_, federated_language.FederatedType):
        if type_.placement is federated_language.CLIENTS:
            if isinstance(value, PopulationRef):
                return value  # read where the clients run (backend.put_from_store)
            return ClientRows(to_local(value, type_.member, path, lead=1), path)
        if isinstance(value, PopulationRef):
            raise ComputationError(
                f"{_where(path)}: a PopulationRef can only stand for a CLIENTS value, not "
                f"{type_}")
        return to_local(value, type_.member, path)
    if isinstance(type_, federated_language.StructType) and _contains_federated(type_):
        pairs = _struct_items(value, type_, path)
        return structure.Struct([
            (n, from_pytree(v, t, _join(path, n if n else i)))
            for i, ((n, v), (_, t)) in enumerate(zip(pairs, type_.items()))
        ])
    return to_local(value, type_, path)


def _contains_federated(type_) -> bool:
    if isinstance(type_, federated_language.FederatedType):
        return True
    if isinstance(type_, federated_language.StructType):
        return any(_contains_federated(t) for _, t in type_.items())
    return False


def local_to_pytree(value: LocalValue) -> Pytree:
    """A local value as a pytree: dicts where every element is named, tuples otherwise."""
    if isinstance(value, structure.Struct):
        names = structure.name_list_with_nones(value)
        if names and all(names):
            return {n: local_to_pytree(v) for n, v in zip(names, value)}
        return tuple(local_to_pytree(v) for v in value)
    kept = isinstance(value, jax.Array) and _KEEP_DEVICE.get()
    return value if kept else np.asarray(value)


def to_pytree(value: Any, type_: federated_language.Type,
              structure: Optional[Any] = None) -> Pytree:
    """A runtime value of `type_` as a pytree (CLIENTS values stacked on a leading axis).

    `structure`: the jax treedef of the program's output (`result_structure`); the result
    then has exactly that structure, as jit returns it. Without it: the generic
    structure (dicts where every element is named, tuples otherwise).
    """
    generic = _generic_pytree(value, type_)
    return generic if structure is None else with_structure(generic, structure)


def _generic_pytree(value: Any, type_: federated_language.Type) -> Pytree:
    if isinstance(type_, federated_language.FederatedType):
        if type_.placement is federated_language.CLIENTS:
            return local_to_pytree(stack(list(value)))
        return local_to_pytree(value)
    if isinstance(type_, federated_language.StructType) and _contains_federated(type_):
        names = [n for n, _ in type_.items()]
        items = [_generic_pytree(v, t) for v, (_, t) in zip(value, type_.items())]
        if names and all(names):
            return dict(zip(names, items))
        return tuple(items)
    return local_to_pytree(value)


def check_value(value: Any, type_: federated_language.Type, path: str = "",
                population_size: Optional[Any] = None) -> Any:
    """Checks a runtime value (CLIENTS as per-client lists) against `type_`; returns it cast.

    A `PopulationRef` may stand for a CLIENTS value; one naming no client ids gets every
    client of its population, counted by `population_size(ref)`.
    """
    if isinstance(type_, federated_language.FederatedType):
        if type_.placement is federated_language.CLIENTS:
            if isinstance(value, (ClientsValue, ClientRows)):
                return value  # ClientRows: checked as a whole when it was made
            if isinstance(value, PopulationRef):
                if type_.all_equal:
                    raise ComputationError(
                        f"{_where(path)}: a PopulationRef gives each client its own rows; it "
                        f"cannot stand for the all-equal value {type_}")
                if value.client_ids is None:
                    if population_size is None:
                        raise ComputationError(
                            f"{_where(path)}: {value!r} names no client ids and nothing "
                            "can count its population; give client_ids=")
                    value = value.with_ids(np.arange(int(population_size(value))))
                return value
            if isinstance(value, (structure.Struct, Mapping)) or not isinstance(
                    value, (list, tuple)):
                raise ComputationError(
                    f"{_where(path)}: expected a CLIENTS value {type_} (one member per "
                    f"client, as a list), got {_describe(value)}")
            return [to_local(v, type_.member, f"{path}[client {i}]")
                    for i, v in enumerate(value)]
        return to_local(value, type_.member, path)
    if isinstance(type_, federated_language.StructType) and _contains_federated(type_):
        pairs = _struct_items(value, type_, path)
        return structure.Struct([
            (n, check_value(v, t, _join(path, n if n else i), population_size))
            for i, ((n, v), (_, t)) in enumerate(zip(pairs, type_.items()))
        ])
    return to_local(value, type_, path)


# ---------------------------------------------------------------------------------------
# Binding python arguments to a computation's parameter.


def _is_clients(type_) -> bool:
    return (isinstance(type_, federated_language.FederatedType)
            and type_.placement is federated_language.CLIENTS and not type_.all_equal)


@dataclasses.dataclass(frozen=True)
class BoundArguments:
    """Python arguments matched to the elements of a computation's parameter.

    `elements` holds (type, value) per top-level element, in the parameter's order
    (one pair for a parameter that is not a struct; none without a parameter).
    """

    parameter: Optional[federated_language.Type]
    elements: tuple

    def pytree(self) -> Pytree:
        """The argument as one pytree of the parameter's type (None without one)."""
        if self.parameter is None:
            return None
        if isinstance(self.parameter, federated_language.StructType):
            return tuple(v for _, v in self.elements)
        return self.elements[0][1]

    def runtime_value(self) -> Any:
        """The argument as the runtime's value, checked against the parameter's type."""
        if self.parameter is None:
            return None
        return from_pytree(self.pytree(), self.parameter)

    def num_clients(self, population_size: Optional[Callable[[Any], int]] = None
                    ) -> Optional[int]:
        """The number of clients the CLIENTS arguments hold (None when none is at CLIENTS).

        A `PopulationRef` naming no ids counts its population with `population_size`.
        Raises ComputationError when CLIENTS arguments disagree.
        """
        sizes: list[int] = []
        for type_, value in self.elements:
            _leading_sizes(value, type_, sizes, population_size)
        if len(set(sizes)) > 1:
            raise ComputationError(
                f"CLIENTS arguments disagree on the number of clients (leading axes "
                f"{sorted(set(sizes))}); give every CLIENTS tensor one row per client")
        return sizes[0] if sizes else None

    def select_clients(self, chosen: np.ndarray) -> "BoundArguments":
        """The same arguments with only the clients `chosen` (population indices)."""
        return dataclasses.replace(self, elements=tuple(
            (t, _select(v, t, chosen)) for t, v in self.elements))


def bind_arguments(parameter: Optional[federated_language.Type], args: Sequence[Any],
                   kwargs: Mapping[str, Any]) -> BoundArguments:
    """Matches `args` (positional) and `kwargs` (named elements) to `parameter`."""
    args, kwargs = list(args), dict(kwargs)
    if parameter is None:
        if args or kwargs:
            raise ComputationError("the computation takes no arguments, got "
                                   f"{len(args) + len(kwargs)}")
        return BoundArguments(None, ())
    if not isinstance(parameter, federated_language.StructType):
        if kwargs or len(args) != 1:
            raise ComputationError(
                f"the computation takes one argument ({parameter}), got "
                f"{len(args) + len(kwargs)}")
        return BoundArguments(parameter, ((parameter, args[0]),))
    items = list(parameter.items())
    if len(args) > len(items):
        raise ComputationError(
            f"the computation takes {len(items)} arguments ({parameter}), got {len(args)}")
    given = list(args)
    for name, _ in items[len(args):]:
        if name in kwargs:
            given.append(kwargs.pop(name))
        else:
            break
    if kwargs:
        raise ComputationError(
            f"unexpected keyword arguments {sorted(kwargs)} for parameter {parameter}")
    if len(given) != len(items):
        missing = [n or str(i) for i, (n, _) in enumerate(items)][len(given):]
        raise ComputationError(
            f"the computation takes {len(items)} arguments ({parameter}), got "
            f"{len(given)}; missing {missing}")
    return BoundArguments(parameter, tuple((t, v) for (_, t), v in zip(items, given)))


def _leading_sizes(value, type_, out: list, population_size=None) -> None:
    if _is_clients(type_) and isinstance(value, PopulationRef):
        if value.client_ids is not None:
            out.append(len(value.client_ids))
        elif population_size is not None:
            out.append(int(population_size(value)))
        else:
            raise ComputationError(
                f"{value!r} names no client ids and nothing can count its population; "
                "give client_ids=")
    elif _is_clients(type_):
        local = to_local(value, type_.member, "", lead=1)
        out.extend(int(leaf.shape[0]) for leaf in leaves(local))
    elif isinstance(type_, federated_language.StructType) and _contains_federated(type_):
        try:
            pairs = _struct_items(value, type_, "")
        except ComputationError:
            return  # reported with its path when the value is converted
        for (_, child), (_, t) in zip(pairs, type_.items()):
            _leading_sizes(child, t, out, population_size)


def _select(value, type_, chosen: np.ndarray):
    if _is_clients(type_) and isinstance(value, PopulationRef):
        return value.select(chosen)  # only ids: each device reads its own rows
    if _is_clients(type_):
        return _map_local(lambda leaf: leaf[chosen], to_local(value, type_.member, "", lead=1))
    if isinstance(type_, federated_language.StructType) and _contains_federated(type_):
        pairs = _struct_items(value, type_, "")
        return tuple(_select(child, t, chosen) for (_, child), (_, t)
                     in zip(pairs, type_.items())) if not isinstance(value, Mapping) else {
            n: _select(child, t, chosen) for (n, child), (_, t) in zip(pairs, type_.items())}
    return value


def num_clients_of(value: Any, type_: Optional[federated_language.Type]) -> Optional[int]:
    """The number of clients of the CLIENTS parts of a runtime value (None if there are none).

    Raises `ComputationError` if two CLIENTS parts disagree.
    """
    found: set[int] = set()

    def walk(v, t):
        if isinstance(t, federated_language.FederatedType):
            if t.placement is federated_language.CLIENTS and not t.all_equal:
                n = getattr(v, "num_clients", None)
                found.add(int(n) if n is not None else len(v))
        elif isinstance(t, federated_language.StructType):
            for (_, tt), vv in zip(t.items(), v):
                walk(vv, tt)

    if type_ is not None:
        walk(value, type_)
    if len(found) > 1:
        raise ComputationError(
            f"CLIENTS inputs disagree on the number of clients: {sorted(found)}")
    return found.pop() if found else None
