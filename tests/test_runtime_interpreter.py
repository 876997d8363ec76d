"""Tests of fax_bridge.runtime.interpreter: every supported intrinsic against numpy, and
the errors that malformed or ill-typed computations raise."""

import federated_language as fl
import numpy as np
import pytest
from federated_language.common_libs import structure
from hypothesis import given, settings, strategies as st
from federated_language.compiler import building_blocks as bb
from federated_language.proto import computation_pb2

from fax_bridge.errors import ComputationError, DeclaredTypeError
from fax_bridge.runtime import interpreter
from fax_bridge.runtime.local_backend import LocalClientsBackend
from fax_bridge.tff.xla import typed_xla_computation

F32 = np.float32
I32 = np.int32
V3 = fl.TensorType(F32, [3])
N = 5
RNG = np.random.default_rng(0)
XS = RNG.normal(size=(N, 3)).astype(F32)


def clients(t, all_equal=False):
    return fl.FederatedType(t, fl.CLIENTS, all_equal=all_equal)


def server(t):
    return fl.FederatedType(t, fl.SERVER)


def xla(fn, param_type):
    return bb.CompiledComputation(typed_xla_computation(fn, param_type))


def call(uri, arg, result_type):
    return bb.Call(bb.Intrinsic(uri, fl.FunctionType(arg.type_signature, result_type)), arg)


def fmap(fn, value):
    member = fn.type_signature.result
    if value.type_signature.placement is fl.SERVER:
        return call("federated_apply", bb.Struct([fn, value]), server(member))
    return call("federated_map", bb.Struct([fn, value]), clients(member))


def run(comp, *args, **kwargs):
    return interpreter.interpret(comp.to_proto(), *args, **kwargs)


def lam(name, type_, body_fn):
    return bb.Lambda(name, type_, body_fn(bb.Reference(name, type_)))


# --- federated intrinsics ------------------------------------------------------------


def test_broadcast_zip_map_sum():
    param = fl.StructType([("x", clients(V3)), ("s", server(F32))])

    def body(arg):
        bc = call("federated_broadcast", bb.Selection(arg, name="s"), clients(F32, True))
        zipped = call("federated_zip_at_clients",
                      bb.Struct([bb.Selection(arg, name="x"), bc]),
                      clients(fl.StructType([(None, V3), (None, F32)])))
        scaled = fmap(xla(lambda v, a: v * a, fl.StructType([(None, V3), (None, F32)])),
                      zipped)
        return call("federated_sum", scaled, server(V3))

    out = run(lam("arg", param, body), XS, 2.0)
    np.testing.assert_allclose(out, XS.sum(0) * 2, rtol=1e-6)


def test_mean_min_max_of_named_structs():
    member = fl.StructType([("n", I32), ("v", V3)])
    to_struct = xla(lambda v: {"v": v * 2, "n": (v[0] > 0).astype(I32)}, V3)
    body = lambda x: bb.Struct([
        ("mean", call("federated_mean", fmap(xla(lambda v: v * 2, V3), x), server(V3))),
        ("min", call("federated_min", fmap(to_struct, x), server(member))),
        ("max", call("federated_max", fmap(to_struct, x), server(member))),
    ])
    out = run(lam("x", clients(V3), body), XS)
    np.testing.assert_allclose(out["mean"], (XS * 2).mean(0), rtol=1e-6)
    np.testing.assert_allclose(out["min"]["v"], (XS * 2).min(0))
    np.testing.assert_allclose(out["max"]["v"], (XS * 2).max(0))
    assert out["max"]["n"] == int((XS[:, 0] > 0).any())
    assert out["min"]["n"].dtype == I32


def test_weighted_mean():
    param = fl.StructType([("x", clients(V3)), ("w", clients(F32))])
    body = lambda a: call("federated_weighted_mean",
                          bb.Struct([bb.Selection(a, index=0), bb.Selection(a, index=1)]),
                          server(V3))
    w = np.arange(1, N + 1, dtype=F32)
    out = run(lam("a", param, body), XS, w)
    np.testing.assert_allclose(out, (XS * w[:, None]).sum(0) / w.sum(), rtol=1e-6)


def test_apply_value_at_server_eval_at_server_and_zip_at_server():
    param = fl.StructType([("s", server(V3)), ("t", server(F32))])
    const = bb.Lambda(None, None, bb.Literal(np.float32(4.0), fl.TensorType(F32)))

    def body(a):
        doubled = call("federated_apply",
                       bb.Struct([xla(lambda v: v * 2, V3), bb.Selection(a, name="s")]),
                       server(V3))
        four = call("federated_eval_at_server", const, server(F32))
        lit = call("federated_value_at_server",
                   bb.Literal(np.float32(1.5), fl.TensorType(F32)), server(F32))
        zipped = call("federated_zip_at_server", bb.Struct([doubled, four]),
                      server(fl.StructType([(None, V3), (None, F32)])))
        plus = fmap(xla(lambda v, c: v + c, fl.StructType([(None, V3), (None, F32)])), zipped)
        return bb.Struct([plus, lit, bb.Selection(a, name="t")])

    v = np.array([1.0, 2.0, 3.0], F32)
    out = run(lam("a", param, body), v, 7.0)
    np.testing.assert_allclose(out[0], v * 2 + 4)
    assert out[1] == 1.5 and out[2] == 7.0


def test_value_and_eval_at_clients_need_and_use_num_clients():
    const = bb.Lambda(None, None, bb.Literal(np.float32(2.5), fl.TensorType(F32)))
    body = bb.Struct([
        call("federated_sum", call("federated_eval_at_clients", const, clients(F32)),
             server(F32)),
        call("federated_value_at_clients", bb.Literal(np.int32(3), fl.TensorType(I32)),
             clients(I32, True)),
    ])
    comp = bb.Lambda(None, None, body)
    total, threes = run(comp, num_clients=4)
    assert total == 10.0
    np.testing.assert_array_equal(threes, [3, 3, 3, 3])
    with pytest.raises(ComputationError, match="num_clients"):
        run(comp)


def test_map_all_equal_on_broadcast_value():
    body = lambda s: call(
        "federated_map_all_equal",
        bb.Struct([xla(lambda v: v + 1, V3),
                   call("federated_broadcast", s, clients(V3, True))]),
        clients(V3, True))
    v = np.array([1.0, 2.0, 3.0], F32)
    out = run(lam("s", server(V3), body), v, num_clients=3)
    np.testing.assert_allclose(out, np.tile(v + 1, (3, 1)))


def test_clients_result_comes_back_per_client():
    comp = lam("x", clients(V3), lambda x: fmap(xla(lambda v: v * v, V3), x))
    np.testing.assert_allclose(run(comp, XS), XS * XS)
    listed = interpreter.evaluate(comp.to_proto(), list(XS))
    assert isinstance(listed, list) and len(listed) == N
    np.testing.assert_allclose(listed[2], XS[2] ** 2)


def test_federated_aggregate_with_xla_parts():
    acc_t = fl.StructType([("count", F32), ("total", V3)])
    zero = xla(lambda: {"total": np.zeros(3, F32), "count": np.float32(0)}, None)
    accumulate = xla(lambda a, x: {"total": a["total"] + x, "count": a["count"] + 1},
                     fl.StructType([(None, acc_t), (None, V3)]))
    merge = xla(lambda a, b: {"total": a["total"] + b["total"],
                              "count": a["count"] + b["count"]},
                fl.StructType([(None, acc_t), (None, acc_t)]))
    report = xla(lambda count, total: total / count, acc_t)
    body = lambda x: call(
        "federated_aggregate",
        bb.Struct([x, bb.Call(zero), accumulate, merge, report]), server(V3))
    out = run(lam("x", clients(V3), body), XS)
    np.testing.assert_allclose(out, XS.mean(0), rtol=1e-6)


def test_secure_sum_bitwidth_is_the_exact_sum_of_in_range_values():
    member = fl.StructType([("a", I32), ("b", fl.TensorType(I32, [2]))])
    bits = bb.Struct([bb.Literal(np.int32(3), fl.TensorType(I32)),
                      bb.Literal(np.int32(8), fl.TensorType(I32))])
    body = lambda x: call("federated_secure_sum_bitwidth", bb.Struct([x, bits]),
                          server(member))
    comp = lam("x", clients(member), body)
    a = np.array([7, 7, 5, 0, 1], I32)  # each < 2**3, total 20 >= 2**3: no wrap-around
    b = np.arange(10, dtype=I32).reshape(5, 2) * 20
    out = run(comp, {"a": a, "b": b})
    assert out["a"] == 20
    np.testing.assert_array_equal(out["b"], b.sum(0))
    with pytest.raises(ComputationError, match=r"outside \[0, 2\*\*3 - 1\]"):
        run(comp, {"a": a + 1, "b": b})
    with pytest.raises(ComputationError, match="outside"):
        run(comp, {"a": a, "b": -b})


def test_secure_sum_bitwidth_single_bitwidth_for_a_struct():
    member = fl.StructType([(None, I32), (None, I32)])
    body = lambda x: call(
        "federated_secure_sum_bitwidth",
        bb.Struct([x, bb.Literal(np.int32(2), fl.TensorType(I32))]), server(member))
    out = run(lam("x", clients(member), body), (np.array([1, 2, 3]), np.array([0, 3, 3])))
    assert out == (6, 6)


def test_generic_ops_unplaced_server_and_clients():
    v = np.array([1.0, 2.0, 4.0], F32)

    def local(a):
        plus = call("generic_plus", bb.Struct([a, a]), V3)
        times = call("generic_multiply", bb.Struct([plus, a]), V3)
        return call("generic_divide", bb.Struct([times, plus]), V3)

    np.testing.assert_allclose(run(lam("a", V3, local), v), v)

    srv = lam("s", server(V3), lambda s: call("generic_plus", bb.Struct([s, s]), server(V3)))
    np.testing.assert_allclose(run(srv, v), 2 * v)

    def at_clients(x):
        prod = call("generic_multiply", bb.Struct([x, x]), clients(V3))
        return call("federated_sum", call("generic_plus", bb.Struct([prod, x]), clients(V3)),
                    server(V3))

    out = run(lam("x", clients(V3), at_clients), XS)
    np.testing.assert_allclose(out, (XS * XS + XS).sum(0), rtol=1e-5)


def test_generic_zero_local_server_and_clients():
    member = fl.StructType([("a", V3), ("k", I32)])
    body = bb.Struct([
        bb.Intrinsic("generic_zero", member),
        bb.Intrinsic("generic_zero", server(V3)),
        call("federated_sum", bb.Intrinsic("generic_zero", clients(I32)), server(I32)),
    ])
    out = run(bb.Lambda(None, None, body), num_clients=2)
    np.testing.assert_array_equal(out[0]["a"], np.zeros(3, F32))
    assert out[0]["k"] == 0 and out[1].shape == (3,) and out[2] == 0


def test_block_reference_selection_and_closure_over_local_value():
    # let c = 3.0, f = (y -> mul(<y, c>)) in sum(map(f, x)): the mapped lambda is closed
    # over `c` before it goes to the backend.
    mul = xla(lambda y, c: y * c, fl.StructType([(None, V3), (None, F32)]))
    c = bb.Reference("c", fl.TensorType(F32))
    f = bb.Lambda("y", V3, bb.Call(mul, bb.Struct([bb.Reference("y", V3), c])))
    body = lambda x: bb.Block(
        [("c", bb.Literal(np.float32(3.0), fl.TensorType(F32))), ("f", f)],
        call("federated_sum",
             fmap(bb.Reference("f", f.type_signature), x), server(V3)))
    out = run(lam("x", clients(V3), body), XS)
    np.testing.assert_allclose(out, XS.sum(0) * 3, rtol=1e-6)


def test_zip_of_nested_struct_of_clients_values():
    param = fl.StructType([("a", clients(F32)), ("b", clients(I32))])
    nested_t = fl.StructType([("p", F32), ("q", fl.StructType([("r", I32)]))])

    def body(arg):
        nested = bb.Struct([("p", bb.Selection(arg, index=0)),
                            ("q", bb.Struct([("r", bb.Selection(arg, index=1))]))])
        return call("federated_zip_at_clients", nested, clients(nested_t))

    out = run(lam("arg", param, body), np.arange(3, dtype=F32), np.array([4, 5, 6]))
    np.testing.assert_array_equal(out["p"], [0, 1, 2])
    np.testing.assert_array_equal(out["q"]["r"], [4, 5, 6])


def test_data_names_an_input():
    data = computation_pb2.Computation(type=server(V3).to_proto(),
                                       data=computation_pb2.Data(uri="weights"))
    v = np.ones(3, F32)
    np.testing.assert_array_equal(interpreter.evaluate(data, data={"weights": v}), v)
    with pytest.raises(ComputationError, match="weights"):
        interpreter.evaluate(data)
    inline = computation_pb2.Computation(type=server(V3).to_proto())
    inline.data.content.type_url = "type.googleapis.com/some.Dataset"
    with pytest.raises(ComputationError, match="by uri"):
        interpreter.evaluate(inline)


def test_thousand_clients_through_the_local_backend():
    n = 1000
    xs = RNG.normal(size=(n, 3)).astype(F32)
    comp = lam("x", clients(V3), lambda x: call(
        "federated_mean", fmap(xla(lambda v: v * 2 + 1, V3), x), server(V3)))
    out = interpreter.interpret(comp.to_proto().SerializeToString(), xs,
                                      backend=LocalClientsBackend())
    np.testing.assert_allclose(out, (xs * 2 + 1).mean(0), rtol=1e-5)


# --- errors --------------------------------------------------------------------------


def _intrinsic_proto(uri, type_):
    return computation_pb2.Computation(type=type_.to_proto(),
                                       intrinsic=computation_pb2.Intrinsic(uri=uri))


def _lambda_proto(name, type_, result_type, body):
    comp = computation_pb2.Computation(type=fl.FunctionType(type_, result_type).to_proto())
    getattr(comp, "lambda").parameter_name = name
    getattr(comp, "lambda").result.CopyFrom(body)
    return comp


def test_unknown_intrinsic():
    t = fl.FunctionType(clients(F32), server(F32))
    comp = computation_pb2.Computation(type=t.to_proto())
    comp.call.function.CopyFrom(_intrinsic_proto("federated_frobnicate", t))
    comp.call.argument.reference.name = "x"
    comp = _lambda_proto("x", clients(F32), server(F32), comp)
    with pytest.raises(ComputationError, match="unknown or unsupported intrinsic "
                                               "`federated_frobnicate`"):
        interpreter.evaluate(comp, [np.float32(1)])


def test_unbound_reference():
    body = computation_pb2.Computation(type=server(F32).to_proto())
    body.reference.name = "missing"
    comp = _lambda_proto("x", server(F32), server(F32), body)
    with pytest.raises(ComputationError, match="unbound name `missing`"):
        interpreter.evaluate(comp, np.float32(1))


def test_malformed_protos():
    with pytest.raises(ComputationError, match="no computation case"):
        interpreter.evaluate(computation_pb2.Computation())
    with pytest.raises(ComputationError, match="not a serialized Computation"):
        interpreter.evaluate(b"\xff\xff\xff")
    with pytest.raises(ComputationError, match="Computation proto"):
        interpreter.evaluate({"not": "a proto"})
    sel = computation_pb2.Computation(type=F32_PROTO)
    sel.selection.source.struct.SetInParent()
    sel.selection.index = 2
    with pytest.raises(ComputationError, match="out of range"):
        interpreter.evaluate(sel)
    tf = computation_pb2.Computation(type=fl.FunctionType(None, F32).to_proto())
    tf.tensorflow.SetInParent()
    with pytest.raises(ComputationError, match="TensorFlow"):
        interpreter.evaluate(tf)
    no_type = computation_pb2.Computation(intrinsic=computation_pb2.Intrinsic(
        uri="federated_sum"))
    with pytest.raises(ComputationError, match="no type signature"):
        interpreter.evaluate(no_type)


F32_PROTO = fl.TensorType(F32).to_proto()


def test_input_type_mismatches_name_the_path():
    param = fl.StructType([("x", clients(V3)), ("s", server(fl.StructType([("w", V3)])))])
    comp = lam("a", param, lambda a: bb.Selection(a, index=1))
    with pytest.raises(ComputationError, match=r"`s\.w`: expected shape \[3\]"):
        run(comp, XS, {"w": np.zeros(4, F32)})
    with pytest.raises(ComputationError, match=r"`s`: expected keys \['w'\]"):
        run(comp, XS, {"v": np.zeros(3, F32)})
    with pytest.raises(ComputationError, match=r"`x`: expected shape \[3\] after the "
                                               "leading clients axis"):
        run(comp, XS[:, :2], {"w": np.zeros(3, F32)})
    with pytest.raises(ComputationError, match="dtype"):
        run(comp, XS.astype(np.complex64), {"w": np.zeros(3, F32)})
    with pytest.raises(ComputationError, match="takes 2 arguments"):
        run(comp, XS)


def test_clients_inputs_disagree_on_number_of_clients():
    param = fl.StructType([("a", clients(F32)), ("b", clients(F32))])
    comp = lam("p", param, lambda p: bb.Selection(p, index=0))
    with pytest.raises(ComputationError, match="disagree"):
        run(comp, np.zeros(3, F32), np.zeros(4, F32))


def test_mapped_function_closing_over_a_federated_value_is_rejected():
    # p -> map((y -> p.s), p.x) where `p.s` is SERVER-placed: ill-typed per client, and
    # TFF's own constructors refuse it, so the call is assembled as a raw proto.
    param = fl.StructType([("x", clients(F32)), ("s", server(F32))])
    p = bb.Reference("p", param)
    inner = bb.Lambda("y", F32, bb.Selection(p, index=1)).to_proto()
    map_type = fl.FunctionType([fl.FunctionType(F32, F32), clients(F32)], clients(F32))
    mapped = computation_pb2.Computation(type=clients(F32).to_proto())
    mapped.call.function.CopyFrom(_intrinsic_proto("federated_map", map_type))
    mapped.call.argument.struct.element.add().value.CopyFrom(inner)
    mapped.call.argument.struct.element.add().value.CopyFrom(
        bb.Selection(p, index=0).to_proto())
    proto = _lambda_proto("p", param, clients(F32), mapped)
    arg = structure.Struct([("x", [np.float32(1)]), ("s", np.float32(2))])
    with pytest.raises(ComputationError, match="federated value"):
        interpreter.evaluate(proto, arg)


# --- the result honours the declared type ----------------------------------------------


@settings(max_examples=30, deadline=None, database=None)
@given(st.sampled_from([np.float32, np.float64, np.int32, np.bool_]),
       st.sampled_from([[3], [], [1, 3], [None]]),
       st.sampled_from(["server", "clients", "unplaced", "struct"]))
def test_the_result_is_checked_against_the_declared_type(dtype, shape, where):
    import sample_computations as sc

    proto = sc.scaled_aggregate((3,), "sum")  # really returns float32[3]@SERVER
    tensor = fl.TensorType(dtype, shape)
    declared = {"server": server(tensor), "clients": clients(tensor), "unplaced": tensor,
                "struct": fl.StructType([("a", server(tensor))])}[where]
    proto.type.function.result.CopyFrom(declared.to_proto())
    # the declared type must be the body's, placements included (unplaced is not SERVER)
    honest = where == "server" and shape in ([3], [None]) and dtype == np.float32
    if honest:
        got = interpreter.interpret(proto, np.ones((4, 3), F32), np.ones(3, F32))
        assert got.dtype == dtype and got.tolist() == [4, 4, 4]
    else:
        with pytest.raises(DeclaredTypeError, match="but its body has type"):
            interpreter.interpret(proto, np.ones((4, 3), F32), np.ones(3, F32))
