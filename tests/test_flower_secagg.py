"""Secure sums through SecAgg+ (`fax_bridge.flower.secagg`): the quantize -> mask -> sum
-> unmask -> dequantize chain run with flwr's own functions gives every node's partials'
exact sum whenever `choose` accepts a round, `choose` refuses exactly the rounds whose
largest partial times the nodes reaches SecAgg+'s modulus, and `check_build` refuses at
app-build time what no split of the clients can carry."""

from __future__ import annotations

import os

import federated_language
import numpy as np
import pytest
from hypothesis import event, example, given, settings, strategies as st

from fax_bridge.errors import AggregationError, ExportError, FleetError
from fax_bridge.rounds.round_split import Aggregation

pytest.importorskip("flwr")
from flwr.common.secure_aggregation.ndarrays_arithmetic import (  # noqa: E402
    factor_combine, factor_extract, parameters_addition, parameters_mod,
    parameters_multiply, parameters_subtraction)
from flwr.common.secure_aggregation.quantization import dequantize, quantize  # noqa: E402
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen  # noqa: E402

from fax_bridge.flower import secagg  # noqa: E402

KINDS = {"secure_sum_bitwidth": np.int32, "secure_sum": np.int64}


def _agg(kind: str, bound: int, shape=(3,), dtype=np.int64, name="s") -> Aggregation:
    return Aggregation(name, kind, 0, None, federated_language.TensorType(dtype, shape),
                       bound=np.asarray(bound, KINDS[kind]))


class _Split:
    def __init__(self, aggregations):
        self.aggregations = aggregations


def _secaggplus(vectors: list, quant: secagg.Quantization) -> list:
    """SecAgg+'s arithmetic on the nodes' vectors, step by step as flwr 1.42's
    `secaggplus_mod` (client) and `SecAggPlusWorkflow` (server) do it, with flwr's own
    functions and a private mask per node (removed at the server as its unmask does)."""
    C, L, M = float(quant.center), quant.levels, secagg.MOD_RANGE
    max_weight, num_examples = 1.0, 1
    masked, masks = None, []
    for i, vector in enumerate(vectors):
        ratio = num_examples / max_weight
        q_ratio = round(ratio * L)
        params = parameters_multiply(vector, q_ratio / L)
        quantized = factor_combine(q_ratio, quantize(params, C, L))
        mask = pseudo_rand_gen(os.urandom(32), M, [a.shape for a in quantized])
        masks.append(mask)
        mine = parameters_mod(parameters_addition(quantized, mask), M)
        masked = mine if masked is None else parameters_addition(masked, mine)
    total = parameters_mod(masked, M)
    for mask in masks:
        total = parameters_subtraction(total, mask)
    q_total, recon = factor_extract(parameters_mod(total, M))
    out = dequantize(recon, C, L)
    for vec in out:
        vec += -(len(vectors) - 1) * C
        vec *= L / q_total
    return out


@st.composite
def _rounds(draw, max_top: int):
    """(kind, bound, clients per node, each node's partials at or under its maximum)."""
    kind = draw(st.sampled_from(sorted(KINDS)))
    if kind == "secure_sum_bitwidth":
        bound = draw(st.one_of(st.integers(0, 31), st.integers(24, 31)))
        top = 2 ** bound - 1
    else:
        bound = top = draw(st.one_of(st.integers(0, 1000), st.integers(2 ** 24, max_top)))
    counts = draw(st.lists(st.integers(1, 40), min_size=2, max_size=6))
    shape = draw(st.sampled_from([(), (0,), (1,), (3,), (2, 0), (2, 3)]))
    size = int(np.prod(shape))
    partials = []
    for k in counts:
        most = k * top
        x = draw(st.lists(st.one_of(st.just(most), st.just(0), st.integers(0, most)),
                          min_size=size, max_size=size))
        partials.append(np.array(x, np.int64).reshape(shape))
    return kind, bound, top, counts, shape, partials


@settings(max_examples=60, deadline=None)
@given(_rounds(max_top=2 ** 31))
@example(("secure_sum_bitwidth", 31, 2 ** 31 - 1, [1, 1], (1,),  # the largest carried
          [np.array([2 ** 31 - 1]), np.array([2 ** 31 - 1])]))
@example(("secure_sum", 9, 9, [2, 3], (),  # a scalar: one element of a flat vector
          [np.array(18), np.array(27)]))
@example(("secure_sum", 9, 9, [2, 3], (2, 0),  # no elements: one zero partial
          [np.zeros((2, 0), np.int64), np.zeros((2, 0), np.int64)]))
@example(("secure_sum", 2 ** 31, 2 ** 31, [1, 1], (1,),  # n * L = 2**32: refused
          [np.array([0]), np.array([0])]))
def test_secaggplus_carries_the_exact_sum_exactly_when_choose_accepts(case):
    kind, bound, top, counts, shape, partials = case
    agg = _agg(kind, bound, shape)
    n, largest = len(counts), max(counts) * top
    event("refused" if n * max(largest, 1) >= secagg.MOD_RANGE else "carried")
    if n * max(largest, 1) >= secagg.MOD_RANGE:
        with pytest.raises(AggregationError, match=r"federated_secure_sum.*"
                                                   r"(bitwidth|max_input).*2\*\*32.*"
                                                   r"lower the bound"):
            secagg.choose([agg], counts)
        # at that size SecAgg+'s total weight n * L wraps: even all-zero partials come
        # back wrong (or as a division by zero)
        quant = secagg.Quantization(levels=largest, nodes=n)
        zeros = [secagg.node_vector([np.zeros(shape, np.int64)], quant.center)] * n
        with np.errstate(all="ignore"):
            got = secagg.recover(_secaggplus(zeros, quant), quant, n)
        assert np.all(got != 0)
        return
    quant = secagg.choose([agg], counts)
    assert quant.levels == max(largest, 1) and quant.nodes == n
    vectors = [secagg.node_vector([p], quant.center) for p in partials]
    assert all(len(v) == 1 and v[0].shape == (max(1, p.size),)
               for v, p in zip(vectors, partials))  # one flat vector, never 0-d
    got = secagg.recover(_secaggplus(vectors, quant), quant, n)
    want = np.sum(partials, axis=0)
    assert got.dtype == np.int64 and got.shape == (max(1, want.size),)
    assert np.array_equal(got[:want.size], want.reshape(-1))
    totals = secagg.totals_of([agg], got, sum(counts), "test")
    assert totals["s"].dtype == np.int64 and totals["s"].shape == shape
    assert np.array_equal(totals["s"], want)


def test_choose_needs_two_nodes_and_takes_the_largest_partial_of_every_sum():
    small, wide = _agg("secure_sum_bitwidth", 4, name="a"), _agg("secure_sum", 100, name="b")
    with pytest.raises(FleetError, match="SecAgg\\+, which needs at least 2 SuperNodes"):
        secagg.choose([small], [6])
    quant = secagg.choose([small, wide], [4, 2, 1])
    assert (quant.levels, quant.nodes, quant.center) == (400, 3, 200.0)
    assert secagg.choose([_agg("secure_sum", 0)], [3, 3]).levels == 1  # all zeros
    # int32 values the dtype rule lets 10 clients sum, on uneven nodes: 5 * 6 * top
    top = 2 ** 31 // 10 - 1
    uneven = _agg("secure_sum", top, dtype=np.int32)
    secagg.choose([uneven], [2] * 5)
    with pytest.raises(AggregationError, match="SuperNode of 6 clients.*5 \\* 1288490178"):
        secagg.choose([uneven], [6, 1, 1, 1, 1])


def test_totals_outside_what_the_clients_can_give_are_refused():
    agg = _agg("secure_sum", 10, shape=(2,))
    with pytest.raises(FleetError, match="lies in 0..31, outside.*0..30"):
        secagg.totals_of([agg], np.array([0, 31]), 3, "round 0")
    with pytest.raises(FleetError, match="gave 3 values; the round's secure sums hold 2"):
        secagg.totals_of([agg], np.array([0, 1, 2]), 3, "round 0")
    empty = _agg("secure_sum", 10, shape=(0,))
    assert secagg.totals_of([empty], np.array([0]), 3, "round 0")["s"].shape == (0,)
    with pytest.raises(FleetError, match="no elements is 5, not 0"):
        secagg.totals_of([empty], np.array([5]), 3, "round 0")


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(sorted(KINDS)), st.integers(0, 62), st.integers(1, 10 ** 6))
def test_check_build_refuses_exactly_what_no_split_of_the_clients_can_carry(
        kind, bits, clients):
    bound = bits if kind == "secure_sum_bitwidth" else 2 ** bits - 1
    top = 2 ** bits - 1
    split = _Split([_agg(kind, bound), Aggregation("m", "mean", 1, None,
                                                 federated_language.TensorType(np.float32))])
    if max(clients, 2) * top >= secagg.MOD_RANGE:
        with pytest.raises(ExportError, match=r"federated_secure_sum.*(bitwidth|max_input)"
                                              r".*2\*\*32.*whatever the split.*fleet"):
            secagg.check_build(split, clients)
    else:
        secagg.check_build(split, clients)
        nodes = max(2, min(clients, 64))  # an even split fits choose
        per = -(-max(clients, 2) // nodes)
        if nodes * per * top < secagg.MOD_RANGE:
            secagg.choose(split.aggregations[:1], [per] * nodes)


def test_the_reconstruction_threshold_is_a_majority_or_the_fraction_asked():
    assert [secagg.shares_needed(0.0, n) for n in range(2, 8)] == [2, 2, 3, 3, 4, 4]
    assert [secagg.shares_needed(0.6, n) for n in range(2, 8)] == [2, 2, 3, 3, 4, 5]
    assert [secagg.shares_needed(1.0, n) for n in range(2, 8)] == list(range(2, 8))
    assert secagg.shares_needed(0.1, 10) == 2  # SecAgg+ never reconstructs from one
    for wrong in (-0.1, 1.5):
        with pytest.raises(FleetError, match=f"secagg-threshold={wrong} is not a "
                                             r"fraction of the nodes in \[0, 1\]"):
            secagg.shares_needed(wrong, 3)
