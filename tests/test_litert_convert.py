"""Client parts as LiteRT models: generated MLP and CNN client updates convert with
builtin ops only and run in the LiteRT interpreter within the stated rounding bound of
XLA; the scatter fix-up; refusals that name the op; a fixed batch fed another size."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

import fax_bridge as fb
from fax_bridge import in_process, parity_rounding, tracing
from fax_bridge.errors import ArgumentError
from fax_bridge.litert import convert, flatbuffer, lowering, refusals, runner
from fax_bridge.rounds import round_split as P
from fax_bridge.runtime import interpreter, values

N = 3
PLACE = ("server", "clients", "clients")


def _loss(kind: str, logits, y, classes: int):
    if kind == "gather":  # its gradient is a scatter: the flatbuffer fix-up's case
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
    if kind == "onehot":
        return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(y, classes), -1))
    return jnp.mean((logits - jax.nn.one_hot(y, classes)) ** 2)


def _case(arch: str, batch: int, width: int, classes: int, loss: str, steps: int,
          seed: int):
    """(round program, its arguments): `steps` SGD steps of an MLP or CNN per client."""
    rng = np.random.default_rng(seed)
    if arch == "mlp":
        x = rng.normal(size=(N, batch, width)).astype(np.float32)
        params = {"w": rng.normal(size=(width, classes)).astype(np.float32) * 0.3,
                  "b": np.zeros(classes, np.float32)}

        def logits(p, x):
            return jnp.tanh(x @ p["w"] + p["b"])
    else:
        x = rng.normal(size=(N, batch, width, width, 2)).astype(np.float32)
        params = {"k": rng.normal(size=(3, 3, 2, 4)).astype(np.float32) * 0.3,
                  "w": rng.normal(size=(4, classes)).astype(np.float32) * 0.3}

        def logits(p, x):
            h = jax.lax.conv_general_dilated(x, p["k"], (1, 1), "SAME",
                                             dimension_numbers=("NHWC", "HWIO", "NHWC"))
            return jax.nn.relu(h).mean(axis=(1, 2)) @ p["w"]
    y = rng.integers(0, classes, size=(N, batch)).astype(np.int32)

    def update(p, x, y):
        def objective(q):
            return _loss(loss, logits(q, x), y, classes)

        def step(q, _):
            return jax.tree.map(lambda a, g: a - 0.1 * g, q, jax.grad(objective)(q)), None

        q, _ = jax.lax.scan(step, p, None, length=steps)
        return jax.tree.map(jnp.subtract, q, p), objective(p)

    @fb.program(clients=N)
    def one_round(params, x, y):
        delta, value = fb.federated_map_clients(update, (fb.federated_broadcast(params), x, y))
        return fb.federated_mean(delta), fb.federated_sum(value)

    return one_round, (params, x, y)


def _runs(prog, args, runtimes: tuple):
    """(the round's split, its output leaves run in process with each client runtime)."""
    proto = fb.export_tff(prog, *args, placements=PLACE)
    split = P.split_round(proto)
    prepared = interpreter.prepare(proto)
    arg = values.bind_arguments(prepared.parameter, args, {}).runtime_value()
    out = []
    for runtime in runtimes:
        got = values.check_value(in_process.run_in_process(split, arg, client_runtime=runtime),
                                 prepared.result, "result")
        out.append(jax.tree_util.tree_leaves(values.to_pytree(got, prepared.result)))
    return split, out


@settings(max_examples=1, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@example(arch="cnn", batch=2, width=4, classes=3, loss="gather", steps=2, seed=1)
@example(arch="mlp", batch=3, width=5, classes=2, loss="onehot", steps=3, seed=2)
@given(arch=st.sampled_from(["mlp", "cnn"]), batch=st.integers(1, 4),
       width=st.integers(3, 6), classes=st.integers(2, 4),
       loss=st.sampled_from(["gather", "onehot", "mse"]), steps=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_generated_client_updates_run_in_litert_within_the_rounding_bound(
        arch, batch, width, classes, loss, steps, seed):
    prog, args = _case(arch, batch, width, classes, loss, steps, seed)
    split, (xla, lite, again) = _runs(prog, args, ("xla", "litert", "litert"))
    model = convert.convert_round(split)
    assert not flatbuffer.non_builtin(model.operators)
    assert [t.name for t in model.inputs][:2] == ["broadcast/0/b", "broadcast/0/w"] or \
        [t.name for t in model.inputs][:2] == ["broadcast/0/k", "broadcast/0/w"]
    assert {t.name.split("/")[0] for t in model.outputs} == {"aggregate"}
    bounds = parity_rounding.evaluation_bounds(
        tracing.trace(prog, *args, placements=PLACE), args)
    assert len(bounds) == len(xla) == len(lite)
    for want, got, bound in zip(xla, lite, bounds):
        assert np.shape(got) == np.shape(want)
        diff = np.abs(np.asarray(want, np.float64) - np.asarray(got, np.float64))
        assert np.all(diff <= 2 * bound), (diff.max(), bound.max())
    # reproducible run to run
    assert [np.asarray(a).tobytes() for a in again] == [np.asarray(a).tobytes() for a in lite]


@pytest.fixture(scope="module")
def gather_round():
    prog, args = _case("mlp", 2, 4, 3, "gather", 2, 0)
    return P.split_round(fb.export_tff(prog, *args, placements=PLACE)), args


def test_the_scatter_of_an_index_gather_gradient_is_fixed_in_the_flatbuffer(gather_round):
    from ai_edge_litert.interpreter import Interpreter

    split, _ = gather_round
    param, result = lowering.split_types(split)
    sig = lowering.client_signature(param, result, split.aggregations)
    raw = convert.stablehlo_to_tflite(lowering.lower(split.client_part, sig),
                                      [t.name for t in sig.inputs],
                                      [t.name for t in sig.outputs])
    assert "STABLEHLO_SCATTER" in flatbuffer.operators(raw)
    with pytest.raises(RuntimeError, match="scatter"):
        Interpreter(model_content=raw).allocate_tensors()
    fixed, count = flatbuffer.fix_scatter_regions(raw)
    assert count >= 1 and "STABLEHLO_ADD" in flatbuffer.operators(fixed)
    Interpreter(model_content=fixed).allocate_tensors()
    assert flatbuffer.fix_scatter_regions(fixed) == (fixed, 0)  # nothing left to fix


def test_a_model_fed_another_batch_size_is_refused_with_the_fix(gather_round):
    split, (params, x, y) = gather_round
    model = convert.convert_round(split)
    run = runner.runner_for(model)
    leaves = [params["b"], params["w"], x[0], y[0]]
    assert len(run(leaves)) == len(model.outputs)
    with pytest.raises(ArgumentError, match=r"client/0 is float32\[5, 4\].*converted for "
                                            r"float32\[2, 4\].*pad the client's data"):
        run([params["b"], params["w"], np.zeros((5, 4), np.float32), y[0]])


@pytest.mark.parametrize("name, client, op, primitive", [
    ("sort", lambda p, x: jnp.sort(x) * p, "stablehlo.sort", "jnp.sort"),
    ("reduce_precision",
     lambda p, x: jax.lax.reduce_precision(x * p, exponent_bits=3, mantissa_bits=0),
     "stablehlo.reduce_precision", "reduce_precision"),
])
def test_a_client_part_without_builtins_is_refused_naming_the_op(name, client, op, primitive):
    @fb.program(clients=2)
    def one_round(params, x):
        return fb.federated_sum(fb.federated_map_clients(
            client, (fb.federated_broadcast(params), x)))

    args = (np.ones(4, np.float32), np.ones((2, 4), np.float32))
    split = P.split_round(fb.export_tff(one_round, *args, placements=("server", "clients")))
    with pytest.raises(refusals.ConversionRefused) as caught:
        convert.convert_round(split)
    assert op in caught.value.ops
    assert op in str(caught.value) and primitive in str(caught.value)
