"""How a round's client part names its LiteRT tensors: by the program's pytree paths.

`signature_names(split, recorded, argument_names)` gives the input and output names of
the split's client part, one per leaf in the signature's order
(`lowering.client_signature`, which takes them as `names`):

  broadcast/<path>            a broadcast value that is part of the round's parameter,
                              by its path there (`broadcast/state/params/w0` for a
                              program that broadcasts `state.params`), found through the
                              server's locals, selections and zips
                              (`grammar.selected_path`, `grammar.zipped_elements`);
  broadcast/<i>/<path>        any other broadcast value, by its leaves' paths as the
                              program broadcast them (`recorded`), else their indices;
  client/<argument>/<path>    the client's data, by the program argument it is;
  aggregate/<k>/value/<path>  the k-th aggregation's value, by its leaves' paths as the
                              program aggregated them (`recorded`); calls of one kind
                              that share their weights are one aggregation (the exporter
                              merges them): their leaves follow each other, each call's
                              under its index in the merge (`aggregate/0/value/1/b`)
                              where two would have the same path; a bare array takes
                              the path of the round's result it becomes unchanged,
                              where that path holds a name (`aggregate/0/value/1/loss`
                              for `(state, {"loss": m})`), else its call's index in a
                              merge (none alone: `aggregate/<k>/value`);
  aggregate/<k>/weight        a weighted mean's weight.

`recorded` is `pytree_names.recording_aggregands`' list from a trace of the program
(`manifest.traced_with_paths`); without it (`convert.convert_round`: a fleet's, an
in-process round's), what the round's proto itself names is named (its parameter's
paths) and the rest by index. Each segment is kept to letters, digits, `_`, `.` and
`-`, and every name is distinct (`pytree_names.tensor_names`).

`client_map_names(fn_type)` names the model of one trip's client map (`litert.phases`):

  client/<path>               a leaf of the map's argument, by its path there;
  result/<path>               a leaf of the map's result, by its path there;

each path the element names the map's types carry, else indices: the zips a round makes
of what it broadcast, the client's data and its state carry none (`client/0/w`,
`client/1/x`, `client/2`, `result/0`), and a model's tensors must not depend on the round (a device
runs the map alone).
"""

from __future__ import annotations

from typing import Optional, Sequence

import federated_language

from fax_bridge.language import pytree_names
from fax_bridge.litert import lowering
from fax_bridge.runtime import grammar, local_eval


def signature_names(split, recorded: Optional[list] = None,
                    argument_names: Optional[Sequence[Optional[str]]] = None) -> tuple:
    """(input names, output names) of the split's client part, in the signature's leaf
    order (`lowering.client_signature`), named by pytree path (module docstring).

    A broadcast or client input is named by the part of the round's parameter it is
    (`grammar.selected_path` through the server's locals and zips: `state.params`'s
    leaves are `broadcast/state/params/<key>`), else by its leaves' paths as the program
    broadcast them (`recorded`), else by index. An aggregand's leaves take the paths
    the program aggregated them with (`recorded`, matched by kind and number of leaves,
    several calls merged into one aggregation as the exporter merges them), a bare
    array among them the path of the round's result it becomes unchanged.
    `argument_names`: the names of the round parameter's elements where its type has
    none (a round in the forms' type: `<server_state, client_data>`)."""
    param, result = lowering.split_types(split)
    round_param = local_eval.parse_type(split.proto.type).parameter
    server = dict(split.server_locals)
    records = list(recorded or [])
    top = _argument_names(split)
    for i, name in enumerate(argument_names or ()):
        if name and i not in top:
            top[i] = name

    def along(indices: list) -> list:  # a parameter path as segments
        return [top.get(indices[0], str(indices[0]))] + _segments(
            getattr(round_param[indices[0]], "member", round_param[indices[0]]), indices[1:])

    def parameter_leaves(comp, type_) -> list:
        path = grammar.selected_path(comp, server, split.parameter_name)
        if path is not None and path and isinstance(round_param,
                                                    federated_language.StructType):
            return [along(path) + rel for rel in _leaf_segments(type_)]
        zipped = grammar.zipped_elements(comp, server)
        if zipped is not None and isinstance(type_, federated_language.StructType) \
                and len(zipped) == len(type_):
            return [leaf for (_, value), member in zip(zipped, type_)
                    for leaf in parameter_leaves(value, member)]
        return [None] * len(_leaf_segments(type_))

    inputs: list = []
    at = 0
    for i, (name, member) in enumerate(zip(split.broadcasts, param[0])):
        found = parameter_leaves(server[name], member)
        indexed = [[str(i)] + rel for rel in _leaf_segments(member)]
        if any(leaf is None for leaf in found):
            match = pytree_names.match_records(records, "broadcast", len(found), at)
            if match is not None:
                at = match[1]
                found = [[str(i)] + path for _, paths in match[0] for path in paths]
        inputs += [["broadcast"] + (leaf if leaf is not None else index)
                   for leaf, index in zip(found, indexed)]
    for i, (j, member) in enumerate(zip(split.client_inputs, param[1])):
        first = top.get(j, str(i))
        inputs += [["client", first] + rel for rel in _leaf_segments(member)]
    outputs: list = [None] * len(result)
    at = 0
    for k, agg in enumerate(split.aggregations):
        member = result[agg.value_index]
        leaves = _leaf_segments(member)
        names = [["aggregate", str(k), "value"] + rel for rel in leaves]
        match = pytree_names.match_records(records, agg.kind, len(leaves), at)
        if match is not None:
            at = match[1]
            bare = any(not path for _, paths in match[0] for path in paths)
            flows = _result_paths(split, agg.local, member) if bare else {}
            paths: list = []
            for r, (_, mine) in enumerate(match[0]):  # a bare array: where it ends
                paths += [path or flows.get(len(paths), [str(r)] if len(match[0]) > 1
                                            else []) for path in mine]
            if len({tuple(p) for p in paths}) < len(paths):  # merged calls of one tree
                paths = [[str(r)] + path for r, (_, mine) in enumerate(match[0])
                         for path in mine]
            names = [["aggregate", str(k), "value"] + path for path in paths]
        outputs[agg.value_index] = names
        if agg.weight_index is not None:
            outputs[agg.weight_index] = [["aggregate", str(k), "weight"] + rel for rel in
                                         _leaf_segments(result[agg.weight_index])]
    outputs = [leaf for i, element in enumerate(outputs) for leaf in (
        element if element is not None else
        [["result", str(i)] + rel for rel in _leaf_segments(result[i])])]
    return (pytree_names.tensor_names(inputs), pytree_names.tensor_names(outputs))


def client_map_names(fn_type: federated_language.FunctionType) -> tuple:
    """(input names, output names) of the model of a client map of type `fn_type` (a
    `federated_language.FunctionType`), in `lowering.flatten`'s leaf order (module
    docstring): `client/<path>` in, `result/<path>` out."""
    inputs = [] if fn_type.parameter is None else [
        ["client"] + rel for rel in _leaf_segments(fn_type.parameter)]
    outputs = [["result"] + rel for rel in _leaf_segments(fn_type.result)]
    return (tuple(pytree_names.tensor_names(inputs)),
            tuple(pytree_names.tensor_names(outputs)))


def _leaf_segments(type_) -> list:
    """The segments of each tensor of `type_` below it, depth first: an element's name,
    else its index."""
    if not isinstance(type_, federated_language.StructType):
        return [[]]
    return [[name or str(i)] + rel for i, (name, element) in enumerate(type_.items())
            for rel in _leaf_segments(element)]


def _segments(type_, indices: list) -> list:
    """The segments of the part of `type_` at `indices` (names, else indices)."""
    out = []
    for index in indices:
        type_ = getattr(type_, "member", type_)
        if not isinstance(type_, federated_language.StructType) or index >= len(type_):
            return out + [str(i) for i in indices[len(out):]]
        name, type_ = list(type_.items())[index]
        out.append(name or str(index))
    return out


def _result_paths(split, local: str, member) -> dict:
    """{leaf index of the aggregate `local`'s value: the segments of the round result's
    element that is that leaf unchanged, where a name is among them}."""
    scope = dict(split.server_locals)
    rel = _leaf_indices(member)
    found: dict = {}

    def visit(comp, segments: list, depth: int = 0) -> None:
        path = grammar.selected_path(comp, scope, local)
        if path is not None:
            if path in rel and not all(s.isdigit() for s in segments):
                found.setdefault(rel.index(path), segments)
            return
        zipped = grammar.zipped_elements(comp, scope)
        if zipped is None and grammar.which(comp) == "struct":
            zipped = [(e.name or None, e.value) for e in comp.struct.element]
        for j, (name, value) in enumerate(zipped or []):
            if depth < 64:
                visit(value, segments + [name or str(j)], depth + 1)

    visit(split.result, [])
    return found


def _leaf_indices(type_) -> list:
    """The index path of each tensor of `type_` below it, depth first."""
    if not isinstance(type_, federated_language.StructType):
        return [[]]
    return [[i] + rel for i, element in enumerate(type_) for rel in _leaf_indices(element)]


def _argument_names(split) -> dict:
    """{parameter index: its element name} of the round's parameter."""
    type_ = local_eval.parse_type(split.proto.type).parameter
    if not isinstance(type_, federated_language.StructType):
        return {}
    return {i: name for i, (name, _) in enumerate(type_.items()) if name}
