"""Forms for Federated Compute's plan builder, built inside the TFF 0.87 environment.

Imported by `build_forms.py` (a job with `"fcp": {...}`). FCP's artifact builder
(`federated_compute_plan_builder.build_plan`, FCP revisions up to 2024-11) turns a
MapReduceForm or DistributeAggregateForm into a Plan whose client phase reads a stream of
serialized `tf.Example`s and whose checkpoints hold the server state. From the round in
the forms' type (its `Xla` parts already TensorFlow computations holding `XlaCallModule`),
the FCP round is

    fcp_round(state@SERVER, examples: sequence<string>@CLIENTS) =
        let s = federated_map(decode, state)          # int32 bits -> uint32 (keys)
            d = federated_map(parse, examples)        # tf.Example -> the client data
            <s', out> = round(s, d)
        in <federated_map(encode, s'), federated_map(encode, out)>

- `parse` reads the client's examples (exactly one per client and round, one feature per
  leaf of the client data named by its path, `data/x`; floats as `float_list`, integers
  and booleans as `int64_list`; the leaf's shape fixed) and casts each to the leaf's
  dtype; TFF merges it into `work` / `client_work`.
- unsigned 16/32/64-bit leaves of the state and output, which a TF checkpoint cannot
  hold ("Tensor slice serialization not implemented"), travel as the signed integers of
  the same bits (`tf.bitcast`, exact both ways); so do those of the DAF's intermediate
  server state (`encode_intermediate`), a checkpoint between `server_prepare` and
  `server_result`.
- each secure sum's bound (a literal in the round) becomes the call of a constant
  TensorFlow computation, which the DistributeAggregateForm carries in its intermediate
  server state: FCP's builder reads the bound as a selection from that state.

`contract(form)` lists what FCP's builder would refuse in a form (part types, the
sequence input, checkpoint dtypes, secure-sum bounds); empty for the forms built here.
"""

from __future__ import annotations

import collections

import numpy as np
import tensorflow as tf
import tensorflow_federated as tff
from tensorflow_federated.python.common_libs import structure
from tensorflow_federated.python.core.impl.compiler import building_blocks as bb
from tensorflow_federated.python.core.impl.compiler import transformation_utils
from tensorflow_federated.python.core.impl.types import computation_types as ct

# Signed integers of the same width for what a TF (tensor-slice) checkpoint cannot hold.
CHECKPOINT_CODES = {np.dtype(np.uint16): np.int16, np.dtype(np.uint32): np.int32,
                    np.dtype(np.uint64): np.int64,
                    np.dtype(tf.bfloat16.as_numpy_dtype): np.int16}
# What FCP's aggregation takes for a client result (its aggregation core's dtypes).
AGGREGATES = tuple(np.dtype(d) for d in (np.float32, np.float64, np.int32, np.int64))
# The aggregations whose client results of other dtypes travel widened
# (`fax_bridge.tff.fcp.AGGREGATED_AS`, the job's "aggregated_as").
WIDENED_URIS = ("federated_sum", "federated_mean", "federated_weighted_mean",
                "federated_min", "federated_max")
SECURE_URIS = ("federated_secure_sum_bitwidth", "federated_secure_sum",
               "federated_secure_modular_sum")
FLOAT_FEATURES = (np.float16, np.float32, tf.bfloat16.as_numpy_dtype)


# ------------------------------------------------------------------------ examples


def features(client_type) -> list:
    """(name, dtype, shape) per leaf of the client data, depth-first; names join the
    element names (or indices) with '/'."""
    out = []

    def walk(t, path):
        if isinstance(t, ct.StructType):
            for i, (name, e) in enumerate(structure.iter_elements(t)):
                walk(e, path + [name if name else str(i)])
        elif isinstance(t, ct.TensorType):
            out.append(("/".join(path) or "value", np.dtype(t.dtype), tuple(t.shape)))
        else:
            raise TypeError(f"client data holds {t}; only tensors and structs fit examples")

    walk(client_type, [])
    return out


def feature_kind(dtype: np.dtype) -> str:
    """'float' or 'int64' (the tf.Example list a leaf of `dtype` is stored in)."""
    if any(dtype == np.dtype(f) for f in FLOAT_FEATURES):
        return "float"
    if dtype == np.bool_ or (np.issubdtype(dtype, np.integer) and dtype != np.uint64):
        return "int64"
    raise TypeError(f"a client leaf of dtype {dtype} has no exact tf.Example feature "
                    "(float16/bfloat16/float32 go in float_list, integers up to 32 bits, "
                    "int64 and bool in int64_list)")


def _pack(t, flat: list):
    """`flat` as nested OrderedDicts (named elements) or lists, shaped like type `t`."""
    it = iter(flat)

    def build(node):
        if isinstance(node, ct.StructType):
            elements = list(structure.iter_elements(node))
            if all(name for name, _ in elements):
                return collections.OrderedDict((name, build(e)) for name, e in elements)
            return [build(e) for _, e in elements]
        return next(it)

    return build(t)


def parse_computation(client_type):
    """TF computation `sequence<string> -> client_type`: the client's one example."""
    leaves = features(client_type)
    spec = {name: tf.io.FixedLenFeature(shape, tf.float32 if feature_kind(d) == "float"
                                        else tf.int64) for name, d, shape in leaves}

    @tff.tensorflow.computation(tff.SequenceType(np.str_))
    def parse(examples):
        parsed = examples.map(lambda s: tf.io.parse_single_example(s, spec))
        one = parsed.get_single_element()
        return _pack(client_type, [tf.cast(one[name], d) for name, d, _ in leaves])

    return parse


# ------------------------------------------------------------------------ state codes


def has_codes(t) -> bool:
    return any(np.dtype(leaf.dtype) in CHECKPOINT_CODES for leaf in _tensors(t))


def _tensors(t) -> list:
    t = getattr(t, "member", t)  # federated values: their member
    if isinstance(t, ct.StructType):
        return [x for _, e in structure.iter_elements(t) for x in _tensors(e)]
    return [t]


def coded_type(t):
    """`t` with each unsigned leaf a TF checkpoint cannot hold as its signed twin."""
    if isinstance(t, ct.StructType):
        return ct.StructType([(name, coded_type(e)) for name, e in structure.iter_elements(t)])
    code = CHECKPOINT_CODES.get(np.dtype(t.dtype))
    return t if code is None else ct.TensorType(code, t.shape)


def _leafwise(source, target, convert):
    """TF computation `source -> target` applying `convert(x, dtype)` to each leaf whose
    dtype differs."""
    leaves_in, leaves_out = _tensors(source), _tensors(target)

    @tff.tensorflow.computation(source)
    def cast(value):
        flat = structure.flatten(value) if isinstance(source, ct.StructType) else [value]
        out = [x if a.dtype == b.dtype else convert(x, b.dtype)
               for x, a, b in zip(flat, leaves_in, leaves_out)]
        return _pack(target, out) if isinstance(target, ct.StructType) else out[0]

    return cast


def bitcast_computation(source, target):
    """TF computation `source -> target` bitcasting each leaf whose dtype differs."""
    return _leafwise(source, target, tf.bitcast)


def code_list(t) -> list:
    """Per leaf of `t`: the signed dtype name it is stored as, or None."""
    return [None if np.dtype(x.dtype) not in CHECKPOINT_CODES
            else np.dtype(CHECKPOINT_CODES[np.dtype(x.dtype)]).name for x in _tensors(t)]


# ------------------------------------------------------------------------ secure bounds


def bounds_as_calls(tree):
    """Every literal bound of a secure sum replaced by the call of a constant TF
    computation (the DistributeAggregateForm then carries it in its intermediate state)."""

    def replace(block):
        if not (isinstance(block, bb.Call) and isinstance(block.function, bb.Intrinsic)
                and block.function.uri in SECURE_URIS):
            return block, False
        value, bound = block.argument[0], block.argument[1]
        if not isinstance(bound, bb.Literal):
            return block, False
        array = np.asarray(bound.value)

        @tff.tensorflow.computation
        def constant():
            return tf.constant(array, dtype=tf.as_dtype(array.dtype))

        call = bb.Call(constant.to_building_block())
        return bb.Call(block.function, bb.Struct([value, call])), True

    tree, _ = transformation_utils.transform_postorder(tree, replace)
    return tree


# ------------------------------------------------------------------------ client results


def _retyped(t, table: dict):
    """`t` with each leaf whose dtype `table` names as the dtype it maps to."""
    if isinstance(t, ct.StructType):
        return ct.StructType([(n, _retyped(e, table)) for n, e in structure.iter_elements(t)])
    to = table.get(np.dtype(t.dtype).name)
    return t if to is None else ct.TensorType(np.dtype(to), t.shape)


def cast_computation(source, target):
    """TF computation `source -> target` casting each leaf whose dtype differs
    (`tf.cast`: exact widenings; back, a float rounded once to nearest even, an integer
    wrapped to its width)."""
    return _leafwise(source, target, tf.cast)


def widened_aggregations(tree, table: dict):
    """Each sum, mean, weighted mean, min or max whose client results hold a dtype FCP's
    aggregation does not take (`table`: dtype name -> the name of the one it travels
    as) made `federated_map(back, intrinsic(federated_map(widen, value)))`: the clients
    widen, FCP aggregates, the server casts the aggregate back once."""
    from tensorflow_federated.python.core.impl.compiler import building_block_factory as bbf

    def widen(value):
        member = value.type_signature.member
        wide = _retyped(member, table)
        if wide.is_equivalent_to(member):
            return value, None
        cast = cast_computation(member, wide).to_building_block()
        return bbf.create_federated_map_or_apply(cast, value), member

    def replace(block):
        if not (isinstance(block, bb.Call) and isinstance(block.function, bb.Intrinsic)
                and block.function.uri in WIDENED_URIS):
            return block, False
        uri = block.function.uri
        if uri == "federated_weighted_mean":
            value, member = widen(bb.Selection(block.argument, index=0))
            weight, weight_member = widen(bb.Selection(block.argument, index=1))
            if member is None and weight_member is None:
                return block, False
            call = bbf.create_federated_mean(value, weight)
        else:
            value, member = widen(block.argument)
            if member is None:
                return block, False
            call = {"federated_sum": bbf.create_federated_sum,
                    "federated_mean": bbf.create_federated_mean,
                    "federated_min": bbf.create_federated_min,
                    "federated_max": bbf.create_federated_max}[uri](
                        *((value, None) if uri == "federated_mean" else (value,)))
        original = block.type_signature.member
        back = cast_computation(call.type_signature.member, original).to_building_block()
        return bbf.create_federated_map_or_apply(back, call), True

    tree, _ = transformation_utils.transform_postorder(tree, replace)
    return tree


# ------------------------------------------------------------------------ the FCP round


def fcp_round(tf_round, aggregated_as: dict | None = None):
    """The FCP round of a round in the forms' type whose parts are TensorFlow (client
    results FCP does not aggregate widened as `aggregated_as` says); also the feature
    list and the state's / output's checkpoint codes."""
    from build_forms import concrete  # the TFF side's shared helpers

    tree = bounds_as_calls(tf_round.to_building_block())
    if aggregated_as:
        tree = widened_aggregations(tree, aggregated_as)
    inner = concrete(tree.proto)
    state_type = inner.type_signature.parameter[0].member
    client_type = inner.type_signature.parameter[1].member
    out_state, output = (inner.type_signature.result[0].member,
                         inner.type_signature.result[1].member)
    parse = parse_computation(client_type)
    stored_state = coded_type(state_type)
    decode = bitcast_computation(stored_state, state_type) if has_codes(state_type) else None
    encode = bitcast_computation(out_state, coded_type(out_state)) \
        if has_codes(out_state) else None
    encode_out = bitcast_computation(output, coded_type(output)) if has_codes(output) else None

    @tff.federated_computation(tff.FederatedType(stored_state, tff.SERVER),
                               tff.FederatedType(tff.SequenceType(np.str_), tff.CLIENTS))
    def round_fn(state, examples):
        if decode is not None:
            state = tff.federated_map(decode, state)
        result = inner(state, tff.federated_map(parse, examples))
        new_state, out = result[0], result[1]
        if encode is not None:
            new_state = tff.federated_map(encode, new_state)
        if encode_out is not None:
            out = tff.federated_map(encode_out, out)
        return new_state, out

    info = {"features": [{"name": n, "dtype": d.name, "shape": list(s),
                          "kind": feature_kind(d)} for n, d, s in features(client_type)],
            "state_codes": code_list(state_type), "output_codes": code_list(output)}
    return round_fn, info


def encode_intermediate(daf):
    """The DAF with unsigned leaves of its intermediate server state kept as signed bits
    (bitcast at the end of `server_prepare`, back at the start of `server_result`): that
    state is a checkpoint between the two server phases. The same DAF when none."""
    prepare_t = daf.server_prepare.type_signature
    inter_t = prepare_t.result[1]
    elements = list(structure.iter_elements(inter_t)) if isinstance(
        inter_t, ct.StructType) else None
    if elements is None or not any(has_codes(getattr(e, "member", e)) for _, e in elements):
        return daf
    coded = []
    for name, e in elements:
        member = getattr(e, "member", e)
        if isinstance(member, ct.StructType) and not isinstance(e, ct.FederatedType) \
                and has_codes(member):
            raise TypeError("an unplaced struct in the intermediate state holds unsigned "
                            "leaves; FCP's checkpoints cannot hold them")
        c = coded_type(member)
        coded.append((name, ct.FederatedType(c, e.placement, e.all_equal)
                      if isinstance(e, ct.FederatedType) else c))
    coded_t = ct.StructType(coded)

    def convert(value, to_coded: bool):
        out = []
        for k, (name, e) in enumerate(elements):
            member = getattr(e, "member", e)
            x = value[k]
            if has_codes(member):
                src, dst = (member, coded_type(member)) if to_coded else (
                    coded_type(member), member)
                cast = bitcast_computation(src, dst)
                x = tff.federated_map(cast, x) if isinstance(e, ct.FederatedType) else cast(x)
            out.append((name, x))
        return structure.Struct(out)

    @tff.federated_computation(prepare_t.parameter)
    def server_prepare(state):
        result = daf.server_prepare(state)
        return result[0], convert(result[1], True)

    result_t = daf.server_result.type_signature

    @tff.federated_computation(coded_t, result_t.parameter[1])
    def server_result(inter, aggregate):
        return daf.server_result(convert(inter, False), aggregate)

    aggregation = _retyped_parameter(daf.client_to_server_aggregation, 0, coded_t)
    return tff.backends.mapreduce.DistributeAggregateForm(
        daf.type_signature, server_prepare, daf.server_to_client_broadcast,
        daf.client_work, aggregation, server_result)


def _retyped_parameter(comp, index: int, new_type):
    """`comp` (a lambda over a struct) with element `index` of its parameter retyped to
    `new_type`; a body that reads a leaf whose type changes fails TFF's type checks."""
    from build_forms import concrete

    lam = comp.to_building_block()
    old = lam.parameter_type
    params = ct.StructType([(n, new_type if i == index else e)
                            for i, (n, e) in enumerate(structure.iter_elements(old))])
    ref = bb.Reference(lam.parameter_name, params)

    def replace(block):
        if isinstance(block, bb.Reference) and block.name == lam.parameter_name:
            return ref, True
        if isinstance(block, bb.Selection):
            return bb.Selection(block.source, index=block.as_index()), True
        return block, False

    body, _ = transformation_utils.transform_postorder(lam.result, replace)
    return concrete(bb.Lambda(lam.parameter_name, params, body).proto)


# ------------------------------------------------------------------------ contract


def _local_parts_not_tf(comp) -> list:
    """The kinds of local computations other than TensorFlow inside `comp`."""
    kinds = []

    def visit(block):
        if isinstance(block, bb.CompiledComputation):
            kind = block.proto.WhichOneof("computation")
            if kind != "tensorflow":
                kinds.append(kind)
        return block, False

    transformation_utils.transform_postorder(comp.to_building_block(), visit)
    return sorted(set(kinds))


def _dtype_problems(what: str, t) -> list:
    bad = sorted({np.dtype(x.dtype).name for x in _tensors(t)
                  if np.dtype(x.dtype) in CHECKPOINT_CODES})
    return [f"{what} holds {', '.join(bad)}, which a TF checkpoint cannot hold"] if bad else []


def _is_sequence_of_strings(t) -> bool:
    return isinstance(t, ct.SequenceType) and isinstance(t.element, ct.TensorType) \
        and np.dtype(t.element.dtype).kind in "USO" and not t.element.shape


def contract(kind: str, form) -> list:
    """What FCP's plan builder refuses in `form` ("mrf" or "daf"), one line each."""
    problems = []
    names = (("prepare", "work", "zero", "accumulate", "merge", "report",
              "secure_sum_bitwidth", "secure_sum_max_input", "secure_modular_sum_modulus",
              "update") if kind == "mrf" else
             ("server_prepare", "server_to_client_broadcast", "client_work",
              "client_to_server_aggregation", "server_result"))
    for name in names:
        bad = _local_parts_not_tf(getattr(form, name))
        if bad:
            problems.append(f"{name} holds {', '.join(bad)} local computations, not "
                            "TensorFlow")
    if kind == "mrf":
        data = form.work.type_signature.parameter[0]
        state = form.update.type_signature.parameter[0]
        results = form.update.type_signature.result
        new_state, output = results[0], results[1]
    else:
        data = form.client_work.type_signature.parameter[0].member
        state = form.server_prepare.type_signature.parameter.member
        new_state = form.server_result.type_signature.result[0].member
        output = form.server_result.type_signature.result[1].member
        problems += _aggregation_problems(form)
        problems += _dtype_problems("the intermediate server state",
                                    form.server_prepare.type_signature.result[1])
    if not _is_sequence_of_strings(data):
        problems.append(f"the client work takes {data}, not sequence<string> (a stream of "
                        "serialized tf.Example)")
    problems += _aggregate_problems(
        form.work.type_signature.result[0] if kind == "mrf"
        else form.client_work.type_signature.result)
    problems += _dtype_problems("the server state", state)
    problems += _dtype_problems("the new server state", new_state)
    problems += _dtype_problems("the server output", output)
    return problems


def _aggregate_problems(update) -> list:
    """The client update's leaves FCP's aggregation does not take (the MRF's for its
    plain aggregation, the DAF's whole update)."""
    bad = sorted({np.dtype(x.dtype).name for x in _tensors(update)
                  if np.dtype(x.dtype) not in AGGREGATES})
    return [f"the client update holds {', '.join(bad)}, which FCP's aggregation does not "
            "take"] if bad else []


def _aggregation_problems(daf) -> list:
    """Each aggregation intrinsic's arguments must be selections from the parameter
    (client update or intermediate state), as FCP's `build_aggregations` reads them."""
    comp = daf.client_to_server_aggregation.to_building_block()
    if not isinstance(comp, bb.Lambda) or not isinstance(comp.result, bb.Block):
        return ["client_to_server_aggregation is not a lambda over a block of intrinsics"]
    problems = []
    for _, value in comp.result.locals:
        uri = value.function.uri if isinstance(value, bb.Call) and isinstance(
            value.function, bb.Intrinsic) else type(value).__name__
        args = value.argument if isinstance(value, bb.Call) else None
        flat = structure.flatten(args) if isinstance(args, bb.Struct) else [args]
        for arg in flat:
            leaves = structure.flatten(arg) if isinstance(arg, bb.Struct) else [arg]
            for leaf in leaves:
                if not isinstance(leaf, bb.Selection):
                    problems.append(f"{uri} takes a {type(leaf).__name__}, not a value "
                                    "selected from the intermediate state or the update")
    return problems
