"""Secure sums through SecAgg+ (`fax_bridge.flower.secagg`): the quantize -> mask -> sum
-> unmask -> dequantize chain run with flwr's own functions gives every node's partials'
exact sum whenever `choose` accepts a round, `choose` refuses exactly the rounds whose
largest partial times the nodes reaches SecAgg+'s modulus, and `check_build` refuses at
app-build time what no split of the clients can carry."""

from __future__ import annotations

import base64
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
            vector = _secaggplus(zeros, quant)
        try:
            got = secagg.recover(vector, quant, n)
        except FleetError as e:  # a division by zero: refused, never cast to an int
            assert "non-finite or far out of range" in str(e)
        else:
            assert np.all(got != 0)
        return
    quant = secagg.choose([agg], counts)
    assert quant.levels == max(largest, 1) and quant.nodes == n
    vectors = [secagg.node_vector([p], quant.center) for p in partials]
    assert len(vectors) == len(partials) == n >= 2 and all(len(v) == 1 and v[0].shape == (max(1, p.size),)
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


# ------------------------------------------------ what a node may answer each stage

NODES = [11, 12, 13]
CARRIED = 4


def _message(content, node: int):
    from flwr.app import Message
    from flwr.supercore.task_identity import TaskIdentity

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1
    sent = Message(content, dst_node_id=node, message_type="train")
    sent.metadata.__dict__["_message_id"] = f"m{node}"
    return sent


def _honest(stage: str, node: int = 12) -> tuple:
    """(the stage's message to `node`, the reply an honest node gives, its configs as a
    dict): what flwr's `secaggplus_mod` answers, built with flwr's own functions."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
    from flwr.common import Code, FitRes, Parameters, Status
    from flwr.common.secure_aggregation.crypto.shamir import create_shares
    from flwr.compat.common import recorddict_compat as compat
    from flwr.compat.common.parameter import ndarray_to_bytes
    from flwr.supercore.primitives.asymmetric import generate_key_pairs, public_key_to_bytes

    from fax_bridge.flower.relay import SECAGG_CONFIGS

    keys = {n: [public_key_to_bytes(generate_key_pairs()[1]) for _ in range(2)]
            for n in NODES}
    sent = {"setup": {"stage": "setup"},
            "share_keys": {"stage": "share_keys", **{str(n): keys[n] for n in NODES}},
            "collect_masked_vectors": {"stage": "collect_masked_vectors"},
            "unmask": {"stage": "unmask", "active_nids": [13, 12], "dead_nids": [11]}}[stage]
    sent = _message(RecordDict({SECAGG_CONFIGS: ConfigRecord(sent)}), node)
    content = RecordDict()
    if stage == "setup":
        configs = {"pk1": keys[node][0], "pk2": keys[node][1]}
    elif stage == "share_keys":
        others = [n for n in NODES if n != node]
        from flwr.common.secure_aggregation.crypto.symmetric_encryption import encrypt

        configs = {"dsts": others, "ctxts": [encrypt(base64.urlsafe_b64encode(
            os.urandom(32)), os.urandom(396)) for _ in others]}
    elif stage == "collect_masked_vectors":
        content = compat.fitres_to_recorddict(FitRes(Status(Code.OK, ""), Parameters(
            tensors=[], tensor_type="numpy.ndarray"), 1, {}), False)
        content.array_records["fitres.parameters"] = ArrayRecord()
        rng = np.random.default_rng(node)
        configs = {"masked_params": [
            ndarray_to_bytes(rng.integers(0, secagg.MOD_RANGE, (1,))),
            ndarray_to_bytes(rng.integers(0, secagg.MOD_RANGE, (CARRIED,)))]}
    else:
        configs = {"nids": [13, 12, 11],
                   "shares": create_shares(os.urandom(32), 2, 3)[:2]
                   + create_shares(os.urandom(300), 2, 3)[2:]}
    content.config_records[SECAGG_CONFIGS] = ConfigRecord(configs)
    return sent, Message(content, reply_to=sent), configs


def _expected():
    from fax_bridge.flower.secagg_replies import Expected

    return Expected(CARRIED, len(NODES))


STAGE_NAMES = ["setup", "share_keys", "collect_masked_vectors", "unmask"]


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_an_honest_reply_of_each_stage_is_accepted(stage):
    from fax_bridge.flower import secagg_replies

    """Accepted by its own stage's check (no FleetError), and refused by every other
    stage's, whose keys it does not hold: the check reads the reply it accepts."""
    sent, reply, _ = _honest(stage)
    assert secagg_replies.check(stage, sent, reply, _expected()) is None
    for other in STAGE_NAMES:
        if other != stage:
            with pytest.raises(FleetError, match=f"the {other} stage answers exactly"):
                secagg_replies.check(other, sent, reply, _expected())


_GARBAGE = st.one_of(
    st.none(), st.booleans(), st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True),
    st.text(max_size=8), st.binary(max_size=40),
    st.lists(st.integers(-3, 2 ** 40), max_size=4), st.lists(st.binary(max_size=30),
                                                             max_size=4),
    st.sampled_from([[b""], [b"\x93NUMPY"], [11, 12], [12, 13], [13, 12, 11, 11],
                     [b"x" * 5000]]))


def _token(data: bytes) -> bool:
    """Whether `data` decrypts as a Fernet token would need: its form."""
    import base64
    import binascii

    try:
        raw = base64.urlsafe_b64decode(data)
    except binascii.Error:
        return False
    return base64.urlsafe_b64encode(raw) == data and raw[:1] == b"\x80" and \
        len(raw) >= 73 and (len(raw) - 57) % 16 == 0


def _forge(stage: str, configs: dict, draw) -> tuple:
    """A copy of an honest reply's configs with one thing forged, and whether it still
    equals the honest one (or differs only where one reply cannot show it)."""
    from flwr.compat.common.parameter import ndarray_to_bytes

    forged = dict(configs)
    how = draw(st.sampled_from(["value", "drop", "extra", "item", "array"]))
    key = draw(st.sampled_from(sorted(forged)))
    if how == "value":
        forged[key] = draw(_GARBAGE)
    elif how == "drop":
        del forged[key]
    elif how == "extra":
        forged[draw(st.sampled_from(["stage", "x", "params"]))] = 1
    elif how == "item" and isinstance(forged[key], list) and forged[key]:
        items = list(forged[key])
        i = draw(st.integers(0, len(items) - 1))
        items[i] = draw(st.sampled_from([items[(i + 1) % len(items)], 99, b"\0" * 20,
                                         items[i][:-1] if isinstance(items[i], bytes)
                                         else -1]))
        forged[key] = items
        # what no server can tell from one reply: another ciphertext (it cannot decrypt
        # them) or another share of a valid form (whether shares combine shows only
        # when they are combined)
        form = (key == "ctxts" and isinstance(items[i], bytes) and _token(items[i])
                and len(set(items)) == len(items)) or (
                key == "shares" and isinstance(items[i], bytes) and len(items[i]) >= 20
                and (len(items[i]) - 4) % 16 == 0
                and 1 <= int.from_bytes(items[i][:4], "little") <= len(NODES))
        return forged, forged == configs or bool(form)
    elif stage == "collect_masked_vectors":
        bad = draw(st.sampled_from([
            np.zeros(CARRIED + 1, np.int64), np.zeros(CARRIED, np.float64),
            np.full(CARRIED, 2 ** 32, np.int64), np.full(CARRIED, -1, np.int64),
            np.zeros((CARRIED, 1), np.int64), np.zeros(CARRIED, ">i8"),
            np.zeros(1, np.int32)]))
        forged["masked_params"] = [forged["masked_params"][0], ndarray_to_bytes(bad)]
    elif stage == "unmask":  # a share of another form: a bad index or ragged chunks
        share = draw(st.sampled_from([(0).to_bytes(4, "little") + b"\0" * 48,
                                      (4).to_bytes(4, "little") + b"\0" * 48,
                                      (1).to_bytes(4, "little") + b"\0" * 47]))
        forged["shares"] = [share] + list(forged["shares"][1:])
    return forged, forged == configs


@settings(max_examples=100, deadline=None)
@given(stage=st.sampled_from(STAGE_NAMES), data=st.data())
def test_a_forged_reply_at_any_stage_is_refused_saying_what_is_wrong(stage, data):
    """A reply with any key's value forged (any type, wrong lengths, node ids of others
    or repeated, arrays of another shape, dtype or range, shares of another form), a
    key dropped or added: `secagg_replies.check` raises a FleetError saying what is
    wrong; it accepts only what equals the honest reply."""
    from flwr.app import ConfigRecord, Message

    from fax_bridge.flower import secagg_replies
    from fax_bridge.flower.relay import SECAGG_CONFIGS

    sent, reply, configs = _honest(stage)
    forged, same = _forge(stage, configs, data.draw)
    record = ConfigRecord()
    for key, value in forged.items():  # any value, as a peer's bytes could carry it
        record.__dict__["_data"][key] = value
    content = reply.content
    content.config_records[SECAGG_CONFIGS] = record
    try:
        secagg_replies.check(stage, sent, Message(content, reply_to=sent), _expected())
    except FleetError as e:
        assert str(e) and not same
        return
    assert same, f"accepted a forged {stage} reply: {forged}"


def test_a_reply_from_another_node_or_reusing_a_key_is_refused():
    from flwr.app import Message

    from fax_bridge.flower import secagg_replies

    sent, reply, _ = _honest("setup")
    expected = _expected()
    secagg_replies.check("setup", sent, reply, expected)
    other, _, _ = _honest("setup", node=13)
    with pytest.raises(FleetError, match="its public key is node 12's"):
        secagg_replies.check("setup", other, Message(reply.content, reply_to=other),
                             expected)
    reply.metadata.__dict__["_src_node_id"] = 13
    with pytest.raises(FleetError, match="the reply came as node 13"):
        secagg_replies.check("setup", sent, reply, _expected())
