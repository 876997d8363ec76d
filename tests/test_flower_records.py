"""A node's partials as Flower records and back (`fax_bridge.flower.records`): every
form the fleet's messages take (float64 values with spilled elements, limbs, non-finite
flags, addends, extremes) arrives as the message the node made, and what arrives other
than it was sent, or a message received other than it was sent, is a TransferError."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given, settings, strategies as st

import federated_language

from fax_bridge.errors import FleetError, TransferError
from fax_bridge.rounds import partials, validate
from fax_bridge.runtime import aggregation, double_sums
from fax_bridge.runtime.double_sums import DoubleSum

pytest.importorskip("flwr")
from fax_bridge.flower import records  # noqa: E402


def _through_records(messages: list, kinds: list, where: str = "node 7") -> list:
    """`messages` laid out as a node lays them out, carried in Flower ArrayRecords and
    ConfigRecords, and read back as the ServerApp reads them."""
    from flwr.app import ArrayRecord, ConfigRecord

    arrays, layout, counts = records.partials_layout(messages)
    record = ArrayRecord({k: records.array(v) for k, v in arrays.items()})
    return records.from_layout(records.numpy_dict(record, where), ConfigRecord(layout),
                               counts, kinds, where)


def _stack(rng, clients: int, shape: tuple, dtype, spills: int, nonfinite: bool):
    """Addends ([clients, *shape]) of `dtype` whose float64 sum over the clients is
    exact but at `spills` elements (a large addend beside one 2**-40 of it), and with
    an infinity at one element when `nonfinite`."""
    stack = (rng.normal(size=(clients,) + shape) * 0.05).astype(dtype)
    flat = stack.reshape(clients, -1)
    size = flat.shape[1]
    cols = rng.choice(size, min(spills, size), replace=False) if clients > 1 else []
    for c in cols:
        flat[0, c] = np.asarray(1.5, dtype)
        flat[1, c] = np.asarray(1.5 * 2.0 ** -40, dtype)
    if nonfinite:
        flat[-1, int(rng.integers(size))] = np.inf
    return stack


SHAPES = st.one_of(st.tuples(st.integers(1, 300)),
                   st.tuples(st.integers(1, 40), st.integers(1, 70)),
                   st.sampled_from([(1568, 64), (256, 1000)]))


@settings(max_examples=40, deadline=None)
@given(kind=st.sampled_from(["sum", "mean", "weighted_mean", "max"]),
       clients=st.integers(1, 5), shape=SHAPES,
       dtype=st.sampled_from([np.float32, np.float16, np.int32]),
       spill_share=st.sampled_from([0.0, 1e-4, 0.005, 1 / 64, 0.05]),
       nonfinite=st.booleans(), rounded=st.booleans(), seed=st.integers(0, 2 ** 31 - 1))
@example(kind="mean", clients=3, shape=(1568, 64), dtype=np.float32, spill_share=1e-4,
         nonfinite=False, rounded=False, seed=0)
@example(kind="weighted_mean", clients=4, shape=(256, 1000), dtype=np.float32,
         spill_share=0.005, nonfinite=True, rounded=False, seed=1)
@example(kind="mean", clients=3, shape=(1,), dtype=np.float16, spill_share=0.0,
         nonfinite=False, rounded=True, seed=0)
def test_every_partial_arrives_as_the_message_the_node_made(
        kind, clients, shape, dtype, spill_share, nonfinite, rounded, seed):
    """Any partial a node makes (any tensor size; float64 values with some elements
    spilled to limbs, up to and past the share that moves a tensor to limbs; limbs with
    non-finite flags; integer sums; one client's addend; rounded partials; extremes)
    crosses as records into the very message the node made, and the ServerApp's checks
    finish it to the node's bits."""
    if dtype is np.int32 and kind in ("mean", "weighted_mean"):
        dtype = np.float32  # means of integers are refused when traced
    if dtype is np.int32:
        nonfinite = False
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    stack = _stack(rng, clients, shape, dtype, int(np.ceil(spill_share * size)),
                   nonfinite) if dtype is not np.int32 else \
        rng.integers(-1000, 1000, (clients,) + shape).astype(dtype)
    weights = [np.float32(w) for w in rng.uniform(0.5, 3, clients)] \
        if kind == "weighted_mean" else None
    partial = aggregation.partial_of(kind, list(stack), weights)
    message = partials.to_message(partial, rounded=rounded)
    back = _through_records([message], [kind])[0]
    assert back == message  # every field, the spilled elements' included
    t = federated_language.TensorType(np.dtype(dtype), list(shape))
    weight_types = [federated_language.TensorType(np.float32)] if weights else []
    checked, _ = validate.check_partial(back, kind, [t], weight_types, clients, "test",
                                        rounded=rounded)
    # the node's bits: a rounded partial is its sum rounded to the dtype, which the
    # finish of a float16 mean then divides in float32 (not the exact mean's bits)
    want = aggregation.finish(partials.from_message(kind, message) if rounded else partial)
    assert [w.tobytes() for w in want] == [g.tobytes() for g in aggregation.finish(checked)]


@pytest.mark.parametrize("shape", [(1568, 64), (3136, 128)])
def test_a_kernels_spilled_elements_keep_the_nodes_sum(shape):
    """A dense kernel's partial in float64 values with 16 elements spilled to limbs (a
    client's update 2**-40 of another's there): those elements arrive with the node's
    sum, not as the +0.0 the float64 values hold there."""
    rng = np.random.default_rng(0)
    stack = _stack(rng, 8, shape, np.float32, 16, False)
    partial = aggregation.partial_of("mean", list(stack))
    leaf = partial.leaves[0]
    assert isinstance(leaf, DoubleSum) and leaf.cols.size == 16
    assert leaf.cols.size <= double_sums.most_spilled(leaf.size)
    back = _through_records([partials.to_message(partial)], ["mean"])[0]
    t = federated_language.TensorType(np.float32, list(shape))
    checked, _ = validate.check_partial(back, "mean", [t], [], 8, "test")
    got, want = aggregation.finish(checked)[0], aggregation.finish(partial)[0]
    assert got.tobytes() == want.tobytes()
    assert np.abs(got.reshape(-1)[leaf.cols]).min() > 0.1  # 1.5 / 8 where they spilled


def _answer(shape=(40, 70)):
    """A node's honest answer of one mean whose tensor spilled, as records' parts."""
    stack = _stack(np.random.default_rng(3), 3, shape, np.float32, 4, False)
    arrays, layout, counts = records.partials_layout(
        [partials.to_message(aggregation.partial_of("mean", list(stack)))])
    return dict(arrays), dict(layout), counts


def test_a_partial_altered_on_the_way_is_a_transfer_error_naming_the_tensor():
    """What the ServerApp reads back is checked against the sha256 the node computed
    before laying its partials out: a value changed to another well-formed one, or a
    field left out on the way (as a conversion that drops the spilled elements did),
    is a TransferError naming the node and the tensor; an answer with no digest, or
    one that is no sha256, is refused as forged."""
    arrays, layout, counts = _answer()
    assert records.from_layout(arrays, layout, counts, ["mean"], "node 7")
    changed = dict(arrays)
    changed["a0.v0.doubles"] = arrays["a0.v0.doubles"].copy()
    changed["a0.v0.doubles"].reshape(-1)[5] += 1.0
    with pytest.raises(TransferError, match=r"node 7: partial tensor a0.v0 arrived other "
                                            r"than the node sent it"):
        records.from_layout(changed, layout, counts, ["mean"], "node 7")
    dropped = {k: v for k, v in arrays.items() if not k.endswith((".spilled", ".limbs"))}
    with pytest.raises(TransferError, match="a0.v0 arrived other than the node sent it"):
        records.from_layout(dropped, layout, counts, ["mean"], "node 7")
    for bad in (None, "0" * 63, "g" * 64, 7):
        forged = dict(layout, **{"a0.v0.sha256": bad})
        if bad is None:
            del forged["a0.v0.sha256"]
        with pytest.raises(FleetError, match="node 7: partial tensor a0.v0's sha256") as e:
            records.from_layout(arrays, forged, counts, ["mean"], "node 7")
        assert not isinstance(e.value, TransferError)


def test_a_message_received_other_than_sent_is_a_transfer_error():
    """A node's answer names the sha256 of the broadcast and ids it received; another
    than the ServerApp's of what it sent is a TransferError naming the node, a missing
    one is refused as forged."""
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

    sent = [np.arange(6, dtype=np.float32).reshape(2, 3), np.array([4, 5], np.int64)]
    arrays, layout, counts = _answer()
    content = RecordDict({
        records.PARTIALS: ArrayRecord({k: records.array(v) for k, v in arrays.items()}),
        records.LAYOUT: ConfigRecord(dict(layout, **{
            records.RECEIVED: records.tensors_sha256(sent)})),
        records.METRICS: MetricRecord({"num-clients": counts, "compute-s": 0.1})})
    digest = records.tensors_sha256(sent)
    assert records.answer_of(content, ["mean"], "node 7", sent=digest)[0]
    other = [sent[0] + np.float32(1e-6), sent[1]]
    for altered in (other, [sent[0], sent[1][::-1]], [sent[0].astype(np.float64), sent[1]],
                    [sent[0].reshape(3, 2), sent[1]]):
        with pytest.raises(TransferError, match="node 7: the round's message arrived at "
                                                "the node other than this ServerApp sent"):
            records.answer_of(content, ["mean"], "node 7",
                              sent=records.tensors_sha256(altered))
    del content[records.LAYOUT][records.RECEIVED]
    with pytest.raises(FleetError, match="digest of the message it received"):
        records.answer_of(content, ["mean"], "node 7", sent=digest)


def test_a_leaf_with_a_field_records_do_not_carry_is_refused_not_sent_without_it():
    """A partial tensor with a field a record has no place for (a shared-memory span,
    which only the fleet's own answers set) is refused by name on the node, never
    laid out without it."""
    message = partials.to_message(aggregation.partial_of(
        "sum", [np.ones(3, np.float32), np.ones(3, np.float32)]))
    message.leaves[0].doubles_at.offset = 8
    with pytest.raises(FleetError, match=r"a0.v0 has field\(s\) \['doubles_at'\]"):
        records.partials_layout([message])


# ------------------------------------------- forms and forgeries (small tensors)


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["sum", "mean", "weighted_mean", "min", "max"]),
       clients=st.integers(1, 5), seed=st.integers(0, 2**31 - 1),
       dtype=st.sampled_from([np.float32, np.int32, np.float64]))
def test_partials_cross_as_records_and_are_checked_like_a_device_answer(
        kind, clients, seed, dtype):
    from flwr.app import ArrayRecord, ConfigRecord

    if kind in ("mean", "weighted_mean") and dtype is np.int32:
        dtype = np.float32  # means of integers are refused when traced
    rng = np.random.default_rng(seed)
    members = [(rng.normal(size=3) * 10).astype(dtype) for _ in range(clients)]
    members[0][0] = 0  # exact zeros, and -0 where the sum has only them
    members[-1][1] = -0.0
    weights = [np.float32(w) for w in rng.uniform(0, 3, clients)] \
        if kind == "weighted_mean" else None
    partial = aggregation.partial_of(kind, members, weights)
    arrays, layout, counts = records.partials_layout([partials.to_message(partial)])
    record = ArrayRecord({k: records.array(v) for k, v in arrays.items()})
    back = records.from_layout(records.numpy_dict(record, "test"), ConfigRecord(layout),
                               counts, [kind], "test")
    t = federated_language.TensorType(members[0].dtype, [3])
    weight_types = [federated_language.TensorType(np.float32)] if weights else []
    checked, _ = validate.check_partial(back[0], kind, [t], weight_types, clients, "test")
    want = aggregation.finish(partial)
    got = aggregation.finish(checked)
    assert [w.tobytes() for w in want] == [g.tobytes() for g in got]


def test_a_damaged_partial_is_refused_by_name():
    arrays = {"a0.v0.doubles": np.zeros(4)}
    layout = {"aggregations": 1, "a0.leaves": 1, "a0.weights": 0,
              "a0.v0.dtype": "float32", "a0.v0.shape": [3]}
    with pytest.raises(FleetError, match="expected shape"):
        records.from_layout(arrays, layout, [2], ["sum"], "node 7")
    with pytest.raises(FleetError, match="node 7: partials of 1 aggregations"):
        records.from_layout(arrays, layout, [2], ["sum", "mean"], "node 7")


_FORGED_VALUES = st.one_of(
    st.integers(-2 ** 70, 2 ** 70), st.floats(allow_nan=True), st.text(max_size=5),
    st.lists(st.integers(-2 ** 64, 2 ** 64), max_size=4), st.none(), st.booleans(),
    st.just([2 ** 40] * 3), st.just("bogus"), st.just(["float32"]))


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(["sum", "weighted_mean", "max"]), clients=st.integers(1, 4),
       dtype=st.sampled_from([np.float32, np.int32, np.float64]),
       forgery=st.sampled_from(["layout", "drop_layout", "array", "drop_array", "counts",
                                "negative_weight", "record", "compute"]),
       data=st.data())
def test_forged_partials_are_refused_naming_the_node(kind, clients, dtype, forgery, data):
    """A node's answer with any one field forged (layout entries of any type, huge
    shapes, unknown dtypes, arrays of another form, missing records or arrays, client
    counts, a weight partial below zero) is refused with a FleetError naming the node,
    never a raw KeyError, ValueError, TypeError or OverflowError, nor accepted when no
    honest node could send it."""
    from flwr.app import ArrayRecord

    if kind == "weighted_mean":
        dtype = np.float32
    rng = np.random.default_rng(clients)
    members = [(rng.normal(size=3) * 10).astype(dtype) for _ in range(clients)]
    weights = [np.float32(w) for w in rng.uniform(0, 3, clients)] \
        if kind == "weighted_mean" else None
    partial = aggregation.partial_of(kind, members, weights)
    arrays, layout, counts = records.partials_layout([partials.to_message(partial)])
    metrics = {"num-clients": counts, "compute-s": 0.5}
    content = {records.PARTIALS: arrays, records.LAYOUT: layout, records.METRICS: metrics}
    honest = True
    if forgery == "layout":
        key = data.draw(st.sampled_from(sorted(layout)))
        layout[key] = data.draw(_FORGED_VALUES)
        honest = layout[key] == records.partials_layout(
            [partials.to_message(partial)])[1][key]
    elif forgery == "drop_layout":
        del layout[data.draw(st.sampled_from(sorted(layout)))]
        honest = False
    elif forgery in ("array", "drop_array"):
        key = data.draw(st.sampled_from(sorted(arrays)))
        if forgery == "drop_array":
            del arrays[key]
        else:
            arrays[key] = data.draw(st.sampled_from(
                [np.zeros(0), np.zeros((2, 2)), np.array(-5.0), np.full_like(arrays[key], -5),
                 np.zeros(3, np.uint8), arrays[key].reshape(-1)[:1]]))
        honest = False
    elif forgery == "counts":
        metrics["num-clients"] = data.draw(st.sampled_from(
            [[], [-1], [clients, 1], [1.5], ["x"], [2 ** 70], [clients + 1]]))
        honest = False
    elif forgery == "negative_weight" and weights is not None:
        for key in [k for k in arrays if k.startswith("a0.w.")]:
            arrays[key] = -np.abs(arrays[key]) - 5
        honest = False
    elif forgery == "record":
        del content[data.draw(st.sampled_from(sorted(content)))]
        honest = False
    elif forgery == "compute":
        metrics["compute-s"] = data.draw(st.sampled_from([-1.0, float("nan"), [1.0], "x"]))
        honest = False
    wrapped = dict(content)  # layout and metrics as the node sent them, of any type
    if records.PARTIALS in wrapped:
        wrapped[records.PARTIALS] = ArrayRecord({k: records.array(v)
                                                 for k, v in arrays.items()})
    t = federated_language.TensorType(np.dtype(dtype), [3])
    weight_types = [federated_language.TensorType(np.float32)] if weights else []

    try:
        back, _ = records.answer_of(wrapped, [kind], "node 7 (clients 0..3)")
        validate.check_partial(back[0], kind, [t], weight_types, clients,
                               "node 7 (clients 0..3)")
    except FleetError as e:
        assert "node 7 (clients 0..3)" in str(e)
        return
    # accepted: what it holds is the honest answer (a forged entry equal to the honest
    # one, or a default the honest layout spells out), or values an honest node could
    # hold in arrays of the honest form
    assert honest or back[0] == partials.to_message(partial) or forgery == "array", \
        "a forged answer was accepted"
