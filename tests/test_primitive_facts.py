"""Every federated primitive has one complete record, and the records say what tracing,
export staging, the forms, the exporter and the runtime do with its equations."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from federated_language.compiler import intrinsic_defs
from jax._src import core

import fax_bridge as fb
from fax_bridge.language import primitive_facts, primitives, secure
from fax_bridge.errors import ArgumentError
from fax_bridge.language.placements import Placement
from fax_bridge.language.primitive_facts import Batching, Movement, PrimitiveFacts, facts_of
from fax_bridge.runtime import aggregation
from fax_bridge.runtime import intrinsics as runtime_intrinsics
from fax_bridge.runtime.interpreter import interpret
from fax_bridge.runtime.local_backend import LocalClientsBackend
from fax_bridge.tff import emitters, forms

P, S = primitives, secure
N = 4
_INTRINSICS = {d for d in vars(intrinsic_defs).values()
               if isinstance(d, intrinsic_defs.IntrinsicDef)}


def _defined_primitives():
    return {v for m in (primitives, secure) for v in vars(m).values()
            if isinstance(v, core.Primitive)}


def test_every_federated_primitive_has_a_complete_record():
    records = primitive_facts.registered()
    assert {r.primitive for r in records} == _defined_primitives()
    for r in records:
        assert facts_of(r.primitive) is r
        if not r.communicates:  # the map: local work in a stage
            assert (r.intrinsic, r.kind, r.batching, r.form_role) == (
                None, None, None, None)
            continue
        assert r.intrinsic in _INTRINSICS, r.primitive
        assert r.intrinsic.uri in forms.FORM_INTRINSICS  # a form can hold it
        assert r.intrinsic in runtime_intrinsics.IMPLEMENTATIONS  # the runtime runs it
        assert (r.primitive in emitters.PRIMITIVE_EMITTERS
                or r.intrinsic in emitters.INTRINSIC_EMITTERS)
        assert r.kind is None or r.kind in aggregation.KINDS
        assert isinstance(r.batching, Batching)
        assert r.form_role in forms.DAF_PIECES
        assert (r.movement.takes, r.movement.gives) == (
            (Placement.CLIENTS, Placement.SERVER) if r.aggregates
            else (Placement.SERVER, Placement.CLIENTS))


def test_the_records_reproduce_the_tables_they_replace():
    by_movement = {m: {r.primitive for r in primitive_facts.registered() if r.movement is m}
                   for m in Movement}
    assert by_movement == {
        Movement.BROADCAST: {P.federated_broadcast_p},
        Movement.MAP: {P.federated_map_p},
        Movement.AGGREGATE: {P.federated_sum_p, P.federated_mean_p,
                             P.federated_weighted_mean_p, P.federated_decode_sum_p,
                             S.secure_sum_bitwidth_p, S.secure_sum_p, S.secure_mean_p}}
    assert {r.primitive: r.batching for r in primitive_facts.registered() if r.communicates} \
        == {P.federated_broadcast_p: Batching.KIND, P.federated_sum_p: Batching.KIND,
            P.federated_mean_p: Batching.KIND, P.federated_decode_sum_p: Batching.KIND,
            P.federated_weighted_mean_p: Batching.WEIGHTS,
            S.secure_sum_bitwidth_p: Batching.ALONE, S.secure_sum_p: Batching.ALONE,
            S.secure_mean_p: Batching.ALONE}
    assert set(emitters.PRIMITIVE_EMITTERS) == {S.secure_mean_p}


def test_one_kind_table_agrees_with_intrinsic_defs_and_every_reader(monkeypatch):
    from fax_bridge.rounds import round_split

    assert primitive_facts.kind_table_mismatches() == []
    assert aggregation.KINDS == tuple(primitive_facts.AGGREGATION_KINDS.values())
    assert set(primitive_facts.SECURE_KINDS) == {"secure_sum_bitwidth", "secure_sum"}
    for d, kind in primitive_facts.AGGREGATION_KINDS.items():
        assert d in runtime_intrinsics.IMPLEMENTATIONS
        split_kind = (round_split._SECURE if kind in primitive_facts.SECURE_KINDS
                      else round_split._AGGREGATIONS)[d.uri]
        assert split_kind == kind
    for r in primitive_facts.registered():  # a record's kind is its intrinsic's
        assert r.kind == primitive_facts.AGGREGATION_KINDS.get(r.intrinsic)
    # the check names what a table out of step with intrinsic_defs gets wrong
    monkeypatch.setitem(primitive_facts.AGGREGATION_KINDS,
                        intrinsic_defs.FEDERATED_SECURE_SUM, "sum")
    monkeypatch.setitem(primitive_facts.AGGREGATION_KINDS,
                        intrinsic_defs.FEDERATED_BROADCAST, "sum")
    monkeypatch.delitem(primitive_facts.AGGREGATION_KINDS, intrinsic_defs.FEDERATED_MIN)
    assert sorted(primitive_facts.kind_table_mismatches()) == sorted([
        "federated_min is an aggregation of intrinsic_defs with no kind",
        "federated_broadcast has a kind but is no aggregation of intrinsic_defs",
        "federated_secure_sum: kind 'sum' but intrinsic_defs says AggregationKind.SECURE"])


def test_an_incomplete_record_is_refused():
    prim = core.Primitive("federated_incomplete")
    with pytest.raises(ArgumentError, match="names its intrinsic"):
        primitive_facts.register(PrimitiveFacts(prim, Movement.AGGREGATE, None))
    with pytest.raises(ArgumentError, match="no batching"):
        primitive_facts.register(PrimitiveFacts(prim, Movement.MAP, None, Batching.KIND))
    assert facts_of(prim) is None


X = np.arange(N * 3, dtype=np.float32).reshape(N, 3) / 7
I = np.arange(N * 3, dtype=np.int32).reshape(N, 3)
WEIGHTS = np.array([1.0, 2.0, 0.5, 1.5], np.float32)
KEYS = jax.vmap(lambda i: jax.random.key_data(jax.random.key(i)))(jnp.arange(N))

# One program per aggregating primitive, with its arguments (all at CLIENTS).
AGGREGATING_PROGRAMS = {
    P.federated_sum_p: (fb.federated_sum, (X,)),
    P.federated_mean_p: (fb.federated_mean, (X,)),
    P.federated_weighted_mean_p: (fb.federated_weighted_mean, (X, WEIGHTS)),
    P.federated_decode_sum_p: (lambda c: fb.federated_decode_sum(lambda m: m * 2.0, c), (X,)),
    S.secure_sum_bitwidth_p: (lambda v: fb.federated_secure_sum_bitwidth(v, 8), (I,)),
    S.secure_sum_p: (lambda v: fb.federated_secure_sum(v, 100), (I,)),
    S.secure_mean_p: (lambda v, k: fb.federated_secure_mean(v, k, value_range=(0.0, 2.0)),
                      (X, KEYS)),
}
_AGGREGATION_URIS = {d.uri for d in (
    intrinsic_defs.FEDERATED_SUM, intrinsic_defs.FEDERATED_MEAN,
    intrinsic_defs.FEDERATED_WEIGHTED_MEAN, intrinsic_defs.FEDERATED_AGGREGATE,
    intrinsic_defs.FEDERATED_SECURE_SUM, intrinsic_defs.FEDERATED_SECURE_SUM_BITWIDTH)}


def test_export_and_the_runtime_aggregate_as_the_records_say(monkeypatch):
    assert set(AGGREGATING_PROGRAMS) == {
        r.primitive for r in primitive_facts.registered() if r.aggregates}
    kinds: list = []
    aggregate = LocalClientsBackend.aggregate
    monkeypatch.setattr(LocalClientsBackend, "aggregate",
                        lambda self, value, kind, *a, **k: kinds.append(kind) or aggregate(
                            self, value, kind, *a, **k))
    for prim, (fn, args) in AGGREGATING_PROGRAMS.items():
        facts = facts_of(prim)
        program = fb.program(clients=N)(fn)
        proto = fb.export_tff(program, *args, placements=("clients",) * len(args))
        emitted = [u for u in forms.intrinsic_uris(proto) if u in _AGGREGATION_URIS]
        # the secure mean also counts the clients whose codes it summed, a plain sum
        counted = prim is S.secure_mean_p
        assert emitted == [facts.intrinsic.uri] + [intrinsic_defs.FEDERATED_SUM.uri] * counted, prim
        kinds.clear()
        interpret(proto, *args)
        assert kinds == ([facts.kind] if facts.kind else []) + ["sum"] * counted, prim
