"""The main side of the Federated Compute forms: the client data's tf.Example features
from the round's type, unsigned state leaves as signed bits (exact), a plan-shaped run's
inputs, and the refusals. TFF building them, FCP's contract on them and their
plan-shaped run against jax.jit are `make forms-check` (tools/forms_check.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.data.examples import ExamplePopulation, Feature
from fax_bridge.tff import fcp, forms

N = 3


@fb.program(clients=N)
def secure_round(state, data, keys):
    def work(w, d):
        return jnp.tanh(d["x"] @ w["w"]).mean(0), d["n"].astype(jnp.float32).sum()

    delta, count = fb.federated_map_clients(work, (fb.federated_broadcast(state), data))
    mean = fb.federated_secure_mean(delta, keys, value_range=(-1.0, 1.0), bits=10)
    new = fb.federated_map_server(
        lambda s, m: {"w": s["w"] + m[:, None], "key": jax.random.key_data(
            jax.random.split(jax.random.wrap_key_data(s["key"]))[0])}, (state, mean))
    return new, fb.federated_mean(count)


STATE = {"w": np.ones((4, 1), np.float32),
         "key": np.asarray(jax.random.key_data(jax.random.key(7)))}
DATA = {"x": np.arange(N * 5 * 4, dtype=np.float32).reshape(N, 5, 4) / 50,
        "n": np.arange(N * 5, dtype=np.int32).reshape(N, 5)}
KEYS = np.asarray(jax.random.key_data(jax.random.split(jax.random.key(0), N)))
PLACEMENTS = ("server", "clients", "clients")


@pytest.fixture(scope="module")
def proto():
    return forms.round_proto(secure_round, STATE, DATA, KEYS, placements=PLACEMENTS)[0]


def test_features_are_the_client_leaves_named_by_argument_and_path_in_flatten_order(proto):
    assert fcp.client_features(proto) == [
        Feature("data/n", np.dtype(np.int32), (5,)),
        Feature("data/x", np.dtype(np.float32), (5, 4)),
        Feature("keys", np.dtype(np.uint32), (2,))]
    assert [(p, d.name) for p, d, _ in fcp.state_leaves(proto)] == [
        ("key", "uint32"), ("w", "float32")]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=4),
       st.sampled_from([np.uint16, np.uint32, np.uint64]))
def test_unsigned_state_leaves_travel_as_signed_bits_exactly(values, dtype):
    info = np.iinfo(dtype)
    key = np.array([min(v, info.max) for v in values], dtype)
    w = np.float32([0.5, -1.0])
    stored = fcp.encode_state([key, w])
    assert stored[0].dtype == np.dtype(fcp.CHECKPOINT_CODES[np.dtype(dtype)])
    assert stored[1] is not None and stored[1].dtype == np.float32
    back = fcp.decode_state(stored, [dtype, np.float32])
    np.testing.assert_array_equal(back[0], key)
    assert back[0].dtype == dtype


def test_a_plan_run_reads_the_population_written_as_examples(proto, tmp_path):
    run = fcp.make_run(proto, STATE, (DATA, KEYS), N, str(tmp_path), rounds=3)
    pop = ExamplePopulation(str(tmp_path / "examples"))
    assert run["examples"] == pop.paths and len(pop) == N and run["rounds"] == 3
    np.testing.assert_array_equal(pop.client(2)["keys"], KEYS[2])
    np.testing.assert_array_equal(pop.client(1)["data/x"], DATA["x"][1])
    with np.load(run["state"]) as z:
        assert int(z["num_state"]) == 2 and z["state.0"].dtype == np.int32
        np.testing.assert_array_equal(z["state.0"].view(np.uint32), STATE["key"])


def test_client_arguments_that_do_not_match_the_round_are_refused(proto):
    features = fcp.client_features(proto)
    with pytest.raises(fb.ExportError, match="2 leaves, the round's client data 3"):
        fcp.client_values(features, DATA, N)
    with pytest.raises(fb.ExportError, match=r"client leaf data/n has shape \[3, 5\], not a "
                                             "leading axis of the 4 clients"):
        fcp.client_values(features, (DATA, KEYS), 4)
    bad = {"x": DATA["x"].astype(np.float16), "n": DATA["n"]}
    with pytest.raises(fb.ExportError, match=r"client leaf data/x: float16\[3, 5, 4\]"):
        fcp.client_values(features, (bad, KEYS), N)


def test_an_unknown_target_is_refused_before_anything_is_built():
    with pytest.raises(fb.ExportError, match="target 'fcpp' is not one of"):
        fb.to_map_reduce_form(secure_round, STATE, DATA, KEYS, placements=PLACEMENTS,
                              target="fcpp")


def test_a_form_outside_the_builders_contract_is_refused_naming_each_breach():
    entry = {"same_type": True, "round_type": "t", "contract": [
        "work holds xla local computations, not TensorFlow",
        "the server state holds uint32, which a TF checkpoint cannot hold"]}
    with pytest.raises(fb.ExportError, match="contract: work holds xla.*; the server state "
                                             "holds uint32"):
        fcp.check_result("mrf", {"mrf": entry, "type": "t"})
    with pytest.raises(fb.ExportError, match="no FCP form of this round: TypeError: x"):
        fcp.check_result("daf", {"error": "TypeError: x"})
    with pytest.raises(fb.ExportError, match="could not build the FCP DAF: boom"):
        fcp.check_result("daf", {"daf": {"error": "boom"}, "type": "t"})


@pytest.mark.parametrize("number, name", [(2, "float64"), (23, "uint64")])
def test_client_data_no_example_list_holds_exactly_is_refused(proto, number, name):
    odd = type(proto).FromString(proto.SerializeToString())
    data = odd.type.function.parameter.struct.element[1].value.federated.member
    data.struct.element[1].value.tensor.dtype = number  # the keys' leaf
    with pytest.raises(fb.ExportError, match=f"client data leaf keys has dtype {name}, which "
                                             "no tf.Example feature holds exactly"):
        fcp.client_features(odd)


def test_a_job_without_the_parts_artifacts_is_refused(proto, tmp_path):
    job = forms.job("r", proto, ["daf"], str(tmp_path))
    with pytest.raises(fb.ExportError, match=r"forms.job\(..., artifacts=True\)"):
        fcp.with_fcp(job, proto, ["mrf"])
    job = fcp.with_fcp(forms.job("r", proto, [], str(tmp_path), artifacts=True), proto,
                       ["daf"])
    assert job["fcp"]["forms"] == ["daf"] and job["artifacts"]
    assert set(job["fcp"]) == {"forms", "aggregated_as", "artifacts"}  # parts lowered



def _counted(data):
    return fb.federated_sum(fb.federated_map_clients(lambda d: d["n"].sum(), data))


def one_named_argument(state, data):
    return state, _counted(data)


def several_unnamed_arguments(state, *rest):
    return state, _counted(rest[0])


@pytest.mark.parametrize("fn, args, names", [
    (one_named_argument, (DATA,), ["n", "x"]),  # one argument: the client data itself
    (several_unnamed_arguments, (DATA, KEYS), ["0/n", "0/x", "1"]),  # no names: positions
])
def test_client_arguments_without_names_to_give_keep_their_paths(fn, args, names):
    proto, _ = forms.round_proto(fb.program(clients=N)(fn), STATE, *args,
                                 placements=("server",) + ("clients",) * len(args))
    assert [f.name for f in fcp.client_features(proto)] == names


@fb.program(clients=N)
def narrow_results_round(state, data):
    def work(w, d):
        return ((d["x"] @ w).astype(jnp.bfloat16).mean(0),
                d["n"].astype(jnp.uint32).sum() * jnp.uint32(2**31 - 1), d["n"].astype(jnp.uint8))

    value, count, codes = fb.federated_map_clients(work, (fb.federated_broadcast(state), data))
    return state, (fb.federated_mean(value), fb.federated_sum(count), fb.federated_sum(codes))


def test_client_results_fcp_cannot_aggregate_travel_as_a_type_it_does():
    proto, _ = forms.round_proto(narrow_results_round, np.ones(4, np.float32), DATA,
                                 placements=("server", "clients"))
    assert [(uri, path, d.name, c.name) for uri, path, d, c in fcp.aggregation_codes(proto)] \
        == [("federated_mean", "value", "bfloat16", "float32"),
            ("federated_sum", "0", "uint32", "int64"),  # the two sums: one of a struct
            ("federated_sum", "1", "uint8", "int64")]
    assert all(c in fcp.FCP_AGGREGATES for _, _, _, c in fcp.aggregation_codes(proto))


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["uint8", "uint16", "uint32", "uint64", "int8", "int16"]),
       st.lists(st.integers(0, 2**64 - 1), min_size=1, max_size=6))
def test_an_integer_sum_carried_in_its_fcp_type_gives_the_programs_wrapped_bits(name, raw):
    dtype = np.dtype(name)
    values = np.array([v % 2 ** (8 * dtype.itemsize) for v in raw], np.uint64)
    values = values.astype(dtype.str.replace("i", "u")).view(dtype)  # every bit pattern
    carried = fcp.aggregated_dtype(dtype, "federated_sum", "x")
    assert carried in fcp.FCP_AGGREGATES
    with np.errstate(over="ignore"):  # jit's sum over clients wraps in the dtype
        program = values.sum(dtype=dtype)
    with np.errstate(over="ignore"):  # the carried sum wraps as two's complement
        fcp_sum = values.astype(carried).sum(dtype=carried).astype(dtype)
    assert fcp_sum.tobytes() == np.asarray(program).tobytes()


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["bfloat16", "float16"]),
       st.lists(st.floats(-1e4, 1e4, width=16), min_size=1, max_size=6))
def test_a_narrow_float_mean_carried_as_float32_is_rounded_once(name, raw):
    dtype = jnp.dtype(name)
    values = np.asarray(jnp.asarray(raw, dtype))
    carried = fcp.aggregated_dtype(dtype, "federated_mean", "x")
    assert carried == np.float32 and np.array_equal(
        values.astype(carried).astype(dtype), values)  # the widening is exact
    program = (jnp.sum(jnp.asarray(values, jnp.float32)) / len(raw)).astype(dtype)
    fcp_mean = (values.astype(carried).sum(dtype=carried) / np.float32(len(raw))).astype(dtype)
    assert fcp_mean == np.asarray(program)  # the same value (+0 and -0 alike)


@pytest.mark.parametrize("dtype, uri, match", [
    ("uint64", "federated_max", "federated_max of uint64 client results .* no FCP type"),
    ("complex64", "federated_sum", "federated_sum of complex64 client results"),
])
def test_client_results_no_fcp_type_carries_exactly_are_refused_by_name(dtype, uri, match):
    with pytest.raises(fb.ExportError, match=match):
        fcp.aggregated_dtype(np.dtype(dtype), uri, "x")


def test_bfloat16_state_and_outputs_travel_as_int16_bits_exactly():
    x = np.asarray(jnp.asarray([1.5, -3.0, 1e30, float("nan")], jnp.bfloat16))
    (stored,) = fcp.encode_state([x])
    assert stored.dtype == np.int16
    assert fcp.decode_state([stored], [x.dtype])[0].tobytes() == x.tobytes()


def test_client_work_the_tflite_client_cannot_take_is_refused_before_the_job_changes(tmp_path):
    proto, _ = forms.round_proto(narrow_results_round, np.ones(4, np.float32), DATA,
                                 placements=("server", "clients"))
    job = forms.job("r", proto, [], str(tmp_path), artifacts=True)
    with pytest.raises(fb.ExportError, match=r"cannot run as TFLite.*bfloat16"):
        fcp.with_fcp(job, proto, ["mrf"])
    assert "fcp" not in job
    # forms for a check without the devices' TFLite client keep the client work as it is
    job = fcp.with_fcp(job, proto, ["mrf"], lower_client=False)
    assert job["fcp"]["forms"] == ["mrf"] and "artifacts" not in job["fcp"]
