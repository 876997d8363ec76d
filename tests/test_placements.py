"""placements: naming placements per argument, and the aggregation dtype rule, the same
on every path."""

import jax
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.errors import AggregationError
from fax_bridge.runtime import aggregation, run_computation
from fax_bridge.language.placements import (Placement, aggregate_refusal, broadcast_placements,
                                   parse_placement)

S, C = Placement.SERVER, Placement.CLIENTS


def test_parse_placement_accepts_names_in_any_case_and_members():
    assert parse_placement("Server") is S and parse_placement("CLIENTS") is C
    assert parse_placement(C) is C
    for bad in ("unplaced", Placement.UNPLACED, 3, None):
        with pytest.raises(ValueError, match="must be 'server' or 'clients'"):
            parse_placement(bad, "x")
    assert str(S) == "SERVER" and repr(C) == "Placement.CLIENTS"


def test_broadcast_placements_expands_prefixes_to_leaves():
    args = ({"w": np.ones(2), "b": np.ones(1)}, (np.ones(3), np.ones(3)))
    assert broadcast_placements(None, args) == [S] * 4
    assert broadcast_placements("clients", args) == [C] * 4
    assert broadcast_placements(("server", "clients"), args) == [S, S, C, C]
    assert broadcast_placements(({"w": "server", "b": "clients"}, ("clients", "server")),
                                args) == [C, S, C, S]  # leaves in jax's (sorted-key) order
    with pytest.raises(ValueError, match="one entry per argument"):
        broadcast_placements(("server",), args)
    with pytest.raises(ValueError, match="not a pytree prefix"):
        broadcast_placements((("server", "server"), "clients"), args)


def test_one_dtype_rule_for_aggregations():
    assert "truncate" in aggregate_refusal("federated_mean", np.int32)
    assert "truncate" in aggregate_refusal("federated_weighted_mean", np.int64)
    assert "count is not a bool" in aggregate_refusal("federated_sum", np.bool_)
    for name, dtype in (("federated_mean", np.float32), ("federated_sum", np.int32),
                        ("federated_sum", np.float16)):
        assert aggregate_refusal(name, dtype) is None


# 64-bit dtypes become their 32-bit kin in jax without x64, on every path alike
_DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int16,
           np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64, np.bool_,
           np.complex64, np.complex128]
_OPS = ["federated_sum", "federated_mean", "federated_weighted_mean",
        "federated_secure_sum"]


@settings(max_examples=20, deadline=None)
@given(dtype=st.sampled_from(_DTYPES), op=st.sampled_from(_OPS))
def test_a_dtype_is_aggregated_alike_on_every_path_or_refused_when_traced(dtype, op):
    """jit, the eager call, export and the runtime: the same result, or the same refusal
    at trace time (never a program that jit runs and the runtime then refuses)."""
    n = 3

    @fb.program(clients=n)
    def f(x, w):
        if op == "federated_weighted_mean":
            return fb.federated_weighted_mean(x, w)
        if op == "federated_secure_sum":
            return fb.federated_secure_sum(x, 5)
        return getattr(fb, op)(x)

    x = (np.arange(n * 2).reshape(n, 2) % 5).astype(dtype)
    w = np.array([1.0, 2.0, 0.5], np.float32)
    places = ("clients", "clients")
    try:
        want = np.asarray(jax.jit(f)(x, w))
    except fb.PlacementError as e:
        refused = str(e).split(" (at ")[0]
        for run in (f, lambda x, w: fb.trace(f, x, w, placements=places),
                    lambda x, w: fb.export_tff(f, x, w, placements=places)):
            with pytest.raises(fb.PlacementError) as again:
                run(x, w)
            assert str(again.value).split(" (at ")[0] == refused
        kind = op.removeprefix("federated_")
        if kind in ("sum", "mean", "weighted_mean") and aggregate_refusal(op, dtype):  # protos from elsewhere
            with pytest.raises(AggregationError):
                aggregation.reduce(kind, list(x), list(w) if kind == "weighted_mean" else None)
        return
    got = run_computation(fb.export_tff(f, x, w, placements=places), x, w)
    assert got.dtype == want.dtype == np.asarray(f(x, w)).dtype
    if want.dtype.kind in "iu":
        np.testing.assert_array_equal(got, want)
    else:  # jit's division may round differently from the runtime's exact sums: 1 ulp
        np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64),
                                   rtol=2 * float(ml_dtypes.finfo(want.dtype).eps))


@settings(max_examples=8, deadline=None)
@given(name=st.sampled_from(["workers", "Silos", "clients", "devices"]),
       spelled=st.sampled_from([str.lower, str.upper, lambda s: s]))
def test_a_program_s_own_placement_name_stands_for_clients(name, spelled):
    """trace and export (and so parity, which traces) accept the program's placement name
    for its CLIENTS arguments; an unknown name lists the accepted ones."""
    @fb.program(placements={name: 2})
    def f(w, x):
        return fb.federated_mean(fb.federated_map_clients(
            lambda w, x: w * x, (fb.federated_broadcast(w), x)))

    w, x = np.float32(2.0), np.array([1.0, 3.0], np.float32)
    places = ("server", spelled(name))
    assert broadcast_placements(places, (w, x), name) == [S, C]
    comp = fb.trace(f, w, x, placements=places)
    assert comp.in_placements == [S, C]
    proto = fb.export_tff(f, w, x, placements=places)
    assert proto.type == fb.export_tff(f, w, x, placements=("server", "clients")).type
    assert float(run_computation(proto, w, x)) == 4.0
    with pytest.raises(fb.ProgramError,
                       match=r"must be 'server',? (or )?'clients'.* got 'bogus'") as e:
        fb.export_tff(f, w, x, placements=("server", "bogus"))
    if name.lower() != "clients":
        assert f"or {name!r} ({name!r} is this program's placement" in str(e.value)
