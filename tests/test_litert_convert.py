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
from fax_bridge import in_process
from fax_bridge.parity import rounding as parity_rounding
from fax_bridge.language import tracing
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


def _runs(prog, args, runtimes: tuple, placements: tuple = PLACE):
    """(the round's split, its output leaves run in process with each client runtime)."""
    proto = fb.export_tff(prog, *args, placements=placements)
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
    assert [t.name for t in model.inputs][:2] == ["broadcast/params/b", "broadcast/params/w"] \
        or [t.name for t in model.inputs][:2] == ["broadcast/params/k", "broadcast/params/w"]
    assert {t.name.split("/")[0] for t in model.outputs} == {"aggregate"}
    bounds = parity_rounding.evaluation_bounds(
        tracing.trace(prog, *args, placements=PLACE), args, float32=xla)
    assert len(bounds) == len(xla) == len(lite)
    for want, got, bound in zip(xla, lite, bounds):
        assert np.shape(got) == np.shape(want)
        diff = np.abs(np.asarray(want, np.float64) - np.asarray(got, np.float64))
        assert np.all(diff <= 2 * bound), (diff.max(), bound.max())
        assert np.max(bound) <= _ceiling(want), (np.max(bound), _ceiling(want))
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
    with pytest.raises(ArgumentError, match=r"client/x is float32\[5, 4\].*converted for "
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
        convert.convert_round(split, use_cache=False)
    assert op in caught.value.ops
    text = str(caught.value)
    assert op in text and primitive in text
    # the line of this file that wrote the op, not fax_bridge's, and no empty message line
    line = client.__code__.co_firstlineno
    assert f"(at {__file__}:{line} (<lambda>))" in text, text
    assert [ln for ln in text.splitlines() if ln.rstrip().endswith(":")] == [], text


def test_jax_random_in_a_client_is_refused_at_the_users_line_naming_the_dropout_helper():
    def client(key, x):
        keep = jax.random.bernoulli(jax.random.wrap_key_data(key), 0.5, x.shape)
        return jnp.where(keep, x, 0.0)

    @fb.program(clients=2)
    def one_round(key, x):
        return fb.federated_sum(fb.federated_map_clients(
            client, (fb.federated_broadcast(key), x)))

    args = (np.asarray(jax.random.key_data(jax.random.PRNGKey(0))),
            np.ones((2, 4), np.float32))
    split = P.split_round(fb.export_tff(one_round, *args, placements=("server", "clients")))
    with pytest.raises(refusals.ConversionRefused) as caught:
        convert.convert_round(split, use_cache=False)
    text = str(caught.value)
    assert f"{__file__}:{client.__code__.co_firstlineno + 1} (" in text, text
    assert "fax_bridge.litert.layers.dropout" in text


# ------------------------------------------------------------------ layer families


def _select_and_scatter_reference(operand, source, window, strides, pads, init):
    """XLA's select_and_scatter (GE select, add scatter), place by place: in each window
    the first maximum among the places that are not padding gets the source value."""
    shape = operand.shape
    out = np.full([s + lo + hi for s, (lo, hi) in zip(shape, pads)], init, np.float32)
    lows = np.array([lo for lo, _ in pads])
    for t in np.ndindex(*source.shape):
        best = None
        for offset in np.ndindex(*window):
            place = np.array(t) * strides + offset
            if np.any(place < lows) or np.any(place >= lows + shape):
                continue
            value = operand[tuple(place - lows)]
            if best is None or not best[0] >= value:
                best = (value, tuple(place))
        if best is not None:
            out[best[1]] += source[t]
    return out[tuple(slice(lo, lo + s) for (lo, _), s in zip(pads, shape))]


def _select_and_scatter_module(shape, tshape, window, strides, pads) -> str:
    t = lambda s: "tensor<" + "x".join(map(str, s)) + "xf32>"  # noqa: E731
    arr = lambda v: ", ".join(map(str, v))  # noqa: E731
    pad = ", ".join(f"[{lo}, {hi}]" for lo, hi in pads)
    return f"""module {{
  func.func public @main(%x: {t(shape)}, %g: {t(tshape)}) -> {t(shape)} {{
    %init = stablehlo.constant dense<0.0> : tensor<f32>
    %0 = "stablehlo.select_and_scatter"(%x, %g, %init) <{{window_dimensions = array<i64: {arr(window)}>, window_strides = array<i64: {arr(strides)}>, padding = dense<[{pad}]> : tensor<{len(shape)}x2xi64>}}> ({{
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %c = stablehlo.compare GE, %a, %b : (tensor<f32>, tensor<f32>) -> tensor<i1>
      stablehlo.return %c : tensor<i1>
    }}, {{
    ^bb0(%a: tensor<f32>, %b: tensor<f32>):
      %s = stablehlo.add %a, %b : tensor<f32>
      stablehlo.return %s : tensor<f32>
    }}) : ({t(shape)}, {t(tshape)}, tensor<f32>) -> {t(shape)}
    return %0 : {t(shape)}
  }}
}}"""


@settings(max_examples=2, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@example(size=4, window=2, stride=2, pad=(0, 0), seed=0)      # the EMNIST CNN's pool
@example(size=5, window=3, stride=2, pad=(1, 1), seed=1)      # overlapping, padded
@given(size=st.integers(3, 6), window=st.integers(1, 3), stride=st.integers(1, 3),
       pad=st.tuples(st.integers(0, 1), st.integers(0, 1)), seed=st.integers(0, 2**16))
def test_a_max_pool_gradient_is_rewritten_with_xlas_first_maximum(size, window, stride,
                                                                   pad, seed):
    from ai_edge_litert.interpreter import Interpreter

    rng = np.random.default_rng(seed)
    shape = (1, size, size + 1, 2)
    win, strides = (1, window, window, 1), np.array((1, stride, stride, 1))
    pads = ((0, 0), pad, pad, (0, 0))
    tshape = tuple((s + lo + hi - w) // st_ + 1
                   for s, (lo, hi), w, st_ in zip(shape, pads, win, strides))
    # few distinct values: ties in most windows; integer sums: exact in any order
    x = rng.integers(0, 3, size=shape).astype(np.float32)
    g = rng.integers(-4, 5, size=tshape).astype(np.float32)
    want = _select_and_scatter_reference(x, g, win, strides, pads, 0.0)
    if pad == (0, 0):  # the reference is jax's own max pool gradient
        pool = lambda v: jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, win,  # noqa: E731
                                               tuple(strides), "VALID")
        _, vjp = jax.vjp(pool, x)
        np.testing.assert_array_equal(np.asarray(vjp(g)[0]), want)
    model = convert.stablehlo_to_tflite(
        _select_and_scatter_module(shape, tshape, win, strides, pads), ["x", "g"], ["out"])
    assert "STABLEHLO_SELECT_AND_SCATTER" not in flatbuffer.operators(model)
    it = Interpreter(model_content=model, num_threads=1)
    got = it.get_signature_runner("client_update")(x=x, g=g)["out"]
    np.testing.assert_array_equal(got, want)


def _convolution_vjp_module(stride: int, padding: str, size: int, kernel: int, cin: int,
                            cout: int, depthwise: bool, dilation: int) -> tuple:
    """(StableHLO text, jitted function, shapes) of a convolution and its vjp: (x, w, g)
    -> (conv(x, w), its gradients with respect to x and w for cotangent g); `depthwise`:
    grouped by input channel (`cout` outputs each); `dilation`: the kernel's."""
    dn = ("NHWC", "HWIO", "NHWC")
    groups = cin if depthwise else 1

    def conv(x, w):
        return jax.lax.conv_general_dilated(x, w, (stride, stride), padding,
                                            rhs_dilation=(dilation, dilation),
                                            dimension_numbers=dn, feature_group_count=groups)

    def fn(x, w, g):
        y, vjp = jax.vjp(conv, x, w)
        return (y, *vjp(g))

    x = jax.ShapeDtypeStruct((2, size, size + 1, cin), np.float32)
    w = jax.ShapeDtypeStruct((kernel, kernel, cin // groups, cout * groups), np.float32)
    g = jax.eval_shape(conv, x, w)
    text = jax.jit(fn).lower(x, w, g).compiler_ir("stablehlo").operation.get_asm(
        large_elements_limit=None, enable_debug_info=False)
    return text, jax.jit(fn), (x.shape, w.shape, g.shape)


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@example(stride=2, padding="SAME", size=8, kernel=3, cin=3, cout=2, depthwise=False,
         dilation=1, seed=0)  # was a TRANSPOSE_CONV the interpreter refused
@example(stride=2, padding="SAME", size=7, kernel=5, cin=1, cout=2, depthwise=False,
         dilation=1, seed=1)  # was left unconverted
@example(stride=2, padding="VALID", size=8, kernel=3, cin=3, cout=1, depthwise=True,
         dilation=1, seed=2)  # a depthwise kernel gradient: batch groups
@example(stride=2, padding="SAME", size=8, kernel=3, cin=3, cout=2, depthwise=False,
         dilation=2, seed=3)  # an input gradient dilated twice: no TRANSPOSE_CONV
@given(stride=st.sampled_from([1, 2]), padding=st.sampled_from(["SAME", "VALID"]),
       size=st.integers(5, 10), kernel=st.sampled_from([3, 5]), cin=st.sampled_from([1, 3]),
       cout=st.integers(1, 3), depthwise=st.booleans(), dilation=st.sampled_from([1, 2]),
       seed=st.integers(0, 2**16))
def test_strided_and_padded_convolution_gradients_convert_and_equal_jits(
        stride, padding, size, kernel, cin, cout, depthwise, dilation, seed):
    """Each convolution of a CNN (stride 1 or 2, SAME or VALID, odd or even sizes, 3x3 or
    5x5, one or several channels, full or depthwise, a dilated kernel or not) converts
    with its gradients (the input gradient a convolution of a dilated input, a
    TRANSPOSE_CONV in LiteRT; a depthwise kernel gradient one of batch groups) and gives
    jit's bits: small integers, so every sum is exact in any order and a misplaced row,
    column or channel is caught."""
    from ai_edge_litert.interpreter import Interpreter

    if padding == "VALID" and (kernel - 1) * dilation + 1 > size:
        kernel = 3  # a VALID window no larger than the input
        if 2 * dilation + 1 > size:
            dilation = 1
    text, jitted, shapes = _convolution_vjp_module(stride, padding, size, kernel, cin, cout,
                                                   depthwise, dilation)
    rng = np.random.default_rng(seed)
    x, w, g = (rng.integers(-2, 3, size=s).astype(np.float32) for s in shapes)
    model = convert.stablehlo_to_tflite(text, ["x", "w", "g"], ["y", "dx", "dw"])
    assert not flatbuffer.non_builtin(flatbuffer.operators(model))
    got = Interpreter(model_content=model, num_threads=1).get_signature_runner(
        "client_update")(x=x, w=w, g=g)
    for name, want in zip(("y", "dx", "dw"), jitted(x, w, g)):
        np.testing.assert_array_equal(got[name], np.asarray(want), err_msg=name)


def _layer_case(family: str, rng):
    """(params, one client's data for each of N clients, loss) of a small model of one
    layer family."""
    dn = ("NHWC", "HWIO", "NHWC")
    d, h, vocab, steps = 3, 4, 7, 4
    if family == "lstm":
        steps = 10
    f32 = lambda *s: (rng.normal(size=s) * 0.3).astype(np.float32)  # noqa: E731
    if family == "strided_conv":  # a stride-2 "SAME" CNN: its input gradient's padding
        params = {"k1": f32(3, 3, 1, 3), "k2": f32(3, 3, 3, 4), "w": f32(16, 3)}
        data = {"x": rng.normal(size=(N, 2, 9, 9, 1)).astype(np.float32)}

        def loss(p, b):
            conv = lambda v, k, pad: jax.lax.conv_general_dilated(  # noqa: E731
                v, k, (2, 2), pad, dimension_numbers=dn)
            z = jax.nn.relu(conv(b["x"], p["k1"], "VALID"))   # 9 -> 4, odd
            z = jax.nn.relu(conv(z, p["k2"], "SAME"))         # 4 -> 2, even
            return jnp.mean(jnp.tanh(z.reshape(z.shape[0], -1) @ p["w"]))
    elif family in ("max_pool", "avg_pool"):
        params = {"k": f32(3, 3, 1, 4), "w": f32(16, 3)}
        # integer pixels: the ReLU's zeros and equal values tie in the pool's windows
        data = {"x": rng.integers(0, 3, size=(N, 2, 6, 6, 1)).astype(np.float32)}

        def loss(p, b):
            z = jax.nn.relu(jax.lax.conv_general_dilated(b["x"], p["k"], (1, 1), "VALID",
                                                         dimension_numbers=dn))
            if family == "max_pool":
                z = jax.lax.reduce_window(z, -jnp.inf, jax.lax.max, (1, 2, 2, 1),
                                          (1, 2, 2, 1), "VALID")
            else:
                z = jax.lax.reduce_window(z, 0.0, jax.lax.add, (1, 2, 2, 1), (1, 2, 2, 1),
                                          "VALID") / 4.0
            return jnp.mean(jnp.tanh(z.reshape(z.shape[0], -1) @ p["w"]))
    elif family in ("embedding_gather", "embedding_one_hot"):
        params = {"e": f32(vocab, h), "w": f32(h, vocab)}
        data = {"t": rng.integers(0, vocab, size=(N, 2, steps)).astype(np.int32)}

        def loss(p, b):
            t = b["t"]
            x = p["e"][t] if family == "embedding_gather" else jax.nn.one_hot(t, vocab) @ p["e"]
            logits = x @ p["w"]
            return -jnp.mean(jnp.sum(jax.nn.log_softmax(logits) * jax.nn.one_hot(t, vocab), -1))
    elif family == "lstm":
        params = {"wi": f32(d, 4 * h), "wh": f32(h, 4 * h), "b": np.zeros(4 * h, np.float32)}
        data = {"x": rng.normal(size=(N, 2, steps, d)).astype(np.float32)}

        def loss(p, b):
            def cell(carry, x):
                hh, c = carry
                i, f, g, o = jnp.split(x @ p["wi"] + hh @ p["wh"] + p["b"], 4, -1)
                c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
                hh = jax.nn.sigmoid(o) * jnp.tanh(c)
                return (hh, c), hh

            zero = jnp.zeros((b["x"].shape[0], h))
            _, hs = jax.lax.scan(cell, (zero, zero), jnp.swapaxes(b["x"], 0, 1))
            return jnp.mean(hs ** 2)
    elif family == "attention_layer_norm":
        params = {"qkv": f32(h, 3 * h), "g": np.ones(h, np.float32), "b": np.zeros(h, np.float32),
                  "up": f32(h, 2 * h), "down": f32(2 * h, h)}
        data = {"x": rng.normal(size=(N, 2, steps, h)).astype(np.float32)}

        def loss(p, b):
            x = b["x"]
            mu = x.mean(-1, keepdims=True)
            x = (x - mu) * jax.lax.rsqrt(((x - mu) ** 2).mean(-1, keepdims=True) + 1e-5)
            q, k, v = jnp.split((x * p["g"] + p["b"]) @ p["qkv"], 3, -1)
            a = jnp.einsum("bqc,bkc->bqk", q, k) / np.sqrt(h)
            a = jnp.where(jnp.tril(jnp.ones((steps, steps), bool)), a, -1e9)
            x = x + jnp.einsum("bqk,bkc->bqc", jax.nn.softmax(a, -1), v)
            return jnp.mean((x + jax.nn.gelu(x @ p["up"]) @ p["down"]) ** 2)
    elif family == "mlp":
        params = {"w0": f32(d, h), "b0": np.zeros(h, np.float32), "w1": f32(h, 2)}
        data = {"x": rng.normal(size=(N, 2, d)).astype(np.float32)}

        def loss(p, b):
            return jnp.mean(jax.nn.relu(b["x"] @ p["w0"] + p["b0"]) @ p["w1"])
    else:  # dropout from a key
        from fax_bridge.litert import layers

        params = {"w": f32(h, 3)}
        data = {"x": rng.normal(size=(N, 2, h)).astype(np.float32),
                "key": rng.integers(-2**31, 2**31 - 1, size=(N, 2)).astype(np.int32)}

        def loss(p, b):
            return jnp.mean(jnp.tanh(layers.dropout(b["key"], 0.5, b["x"]) @ p["w"]))
    return params, data, loss


def _ceiling(values) -> float:
    """The largest bound a float leaf may have: 1e-4 x its largest |value| plus the
    float32 spacing there (a bound above it would pass a wrong answer)."""
    top = np.float32(np.max(np.abs(np.asarray(values, np.float64)), initial=0.0))
    return 1e-4 * float(top) + float(np.spacing(top))


@pytest.mark.parametrize("family", ["mlp", "strided_conv", "max_pool", "avg_pool",
                                    "embedding_gather", "embedding_one_hot", "lstm",
                                    "attention_layer_norm", "dropout"])
def test_each_layer_family_converts_and_its_client_step_is_jits_within_the_bound(family):
    """Each family's LiteRT round is within the rounding bound of XLA's, element by
    element; every bound is under 1e-4 of its leaf's values; and a LiteRT client whose
    result is wrong by a relative 1e-4 in one element is caught on the leaf it feeds."""
    from perturbed_runtime import Perturbed

    from fax_bridge.parity.check import bounded_leaves

    params, data, loss = _layer_case(family, np.random.default_rng(3))

    def update(p, b):
        g = jax.grad(loss)(p, b)
        return jax.tree.map(lambda a, gi: a - 0.5 * gi, p, g)

    @fb.program(clients=N)
    def one_round(p, data):
        return fb.federated_mean(fb.federated_map_clients(update, (fb.federated_broadcast(p),
                                                                   data)))

    args = (params, data)
    wrong = Perturbed("litert", client=1)
    split, (xla, lite, bad) = _runs(one_round, args, ("xla", "litert", wrong),
                                    ("server", "clients"))
    model = convert.convert_round(split)
    assert not flatbuffer.non_builtin(model.operators)
    assert not any(op.startswith("STABLEHLO_SELECT_AND_SCATTER") for op in model.operators)
    comp = tracing.trace(one_round, *args, placements=("server", "clients"))
    methods: list = []
    bounds = parity_rounding.evaluation_bounds(comp, args, methods, float32=xla)
    for want, got, bound in zip(xla, lite, bounds):
        diff = np.abs(np.asarray(want, np.float64) - np.asarray(got, np.float64))
        assert np.all(diff <= 2 * bound), (family, diff.max(), np.max(bound))
        assert np.max(bound) <= _ceiling(want), (family, np.max(bound), _ceiling(want))
    assert len(methods) == len(bounds) and all(  # the report says what gave each bound
        parity_rounding.SHADOW in m or parity_rounding.FIRST_ORDER in m for m in methods)
    paths = comp.out_paths
    leaves = bounded_leaves(xla, lite, bounds, paths, methods)
    assert len(leaves) == len(xla) and all(leaf.ok for leaf in leaves)
    changed = [np.asarray(a).tobytes() != np.asarray(b).tobytes() for a, b in zip(lite, bad)]
    assert wrong.done and sum(changed) == 1, (wrong.done, changed)
    caught = [not leaf.ok for leaf in bounded_leaves(xla, bad, bounds, paths, methods)]
    assert caught == changed, (family, caught, changed)


def test_dropout_masks_are_the_same_bits_in_litert_and_xla():
    from fax_bridge.litert import layers

    @fb.program(clients=2)
    def one_round(key, x):
        drop = lambda k, v: layers.dropout(k, 0.25, v)  # noqa: E731
        return fb.federated_sum(fb.federated_map_clients(drop, (fb.federated_broadcast(key), x)))

    args = (np.array([-2**31, 2**31 - 1], np.int32), np.ones((2, 64), np.float32))
    _, (xla, lite) = _runs(one_round, args, ("xla", "litert"), ("server", "clients"))
    assert np.asarray(xla[0]).tobytes() == np.asarray(lite[0]).tobytes()
    dropped = np.mean(np.asarray(xla[0]) == 0)
    assert 0.05 < dropped < 0.5  # about a quarter of each client's 64, summed over 2
    with pytest.raises(ArgumentError, match="int32"):
        layers.dropout(np.uint32(1), 0.5, np.ones(3, np.float32))


def test_ops_newer_than_the_converter_are_rewritten_as_ops_it_has():
    # jax 0.12 writes log2, exp2 and fma, which the LiteRT converter's StableHLO cannot
    # parse: they become log / ln 2, exp(x ln 2) and a multiply and an add, within float
    # rounding of the fused ops.
    import jax
    import jax.numpy as jnp
    from jax._src.interpreters import mlir

    from fax_bridge.litert import lowering as litert_lowering
    from fax_bridge.runtime import hlo

    def fn(x, y):
        return jnp.log2(x) + jnp.exp2(y) + jax.lax.mul(x, y) + 1.0, jax.random.normal(
            jax.random.key(0), (5,))

    x = np.linspace(0.5, 9.0, 5, dtype=np.float32)
    y = np.linspace(-3.0, 3.0, 5, dtype=np.float32)
    module = jax.jit(fn).lower(x, y).compiler_ir("stablehlo")
    litert_lowering.older_ops(module)
    text = str(module)
    assert not [op for op in ("stablehlo.log2", "stablehlo.exp2", "stablehlo.fma")
                if op in text]
    got = hlo.HloExecutable(b"", stablehlo=mlir.module_to_bytecode(module))([x, y])
    for g, w in zip(got, jax.jit(fn)(x, y)):
        np.testing.assert_allclose(g, np.asarray(w), rtol=2e-6, atol=1e-6)
