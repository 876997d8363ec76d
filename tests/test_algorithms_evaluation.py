"""algorithms.evaluation: a model's loss and metrics over clients' held-out data, each
the example-weighted mean over the real examples, padded ones counting for nothing; the
program exports and runs in process with jit's values."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import fax_bridge as fb
from fax_bridge.algorithms import accuracy, federated_evaluation
from fax_bridge.errors import ArgumentError
from fax_bridge.in_process import run_computation


def _logits(params, x):
    return x @ params["w"] + params["b"]


def _loss(params, batch):
    logp = jax.nn.log_softmax(_logits(params, batch["x"]))
    return -jnp.mean(jnp.take_along_axis(logp, batch["y"][:, None], axis=1))


def _cohort(seed, clients=3, steps=2, batch=4):
    rng = np.random.default_rng(seed)
    data = {"x": rng.normal(size=(clients, steps, batch, 5)).astype(np.float32),
            "y": rng.integers(0, 3, (clients, steps, batch)).astype(np.int32)}
    mask = rng.random((clients, steps, batch)) < 0.7
    mask[:, 0, 0] = True  # every client holds an example
    params = {"w": rng.normal(size=(5, 3)).astype(np.float32),
              "b": rng.normal(size=3).astype(np.float32)}
    return params, data, mask


def _reference(params, data, mask):
    x, y = data["x"][mask].astype(np.float64), data["y"][mask]
    logits = x @ params["w"].astype(np.float64) + params["b"]
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    return (-logp[np.arange(len(y)), y].mean(), (logits.argmax(-1) == y).mean(), len(y))


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1))
def test_each_value_is_the_mean_over_every_real_example_and_padding_counts_nothing(seed):
    params, data, mask = _cohort(seed)
    evaluate = jax.jit(federated_evaluation(_loss, clients=3,
                                            metrics={"accuracy": accuracy(_logits)}))
    got = evaluate(params, data, mask)
    loss, acc, examples = _reference(params, data, mask)
    assert set(got) == {"loss", "accuracy", "examples"}
    np.testing.assert_allclose(float(got["loss"]), loss, rtol=1e-5)
    np.testing.assert_allclose(float(got["accuracy"]), acc, rtol=1e-6)
    assert float(got["examples"]) == examples
    garbage = {"x": np.where(mask[..., None], data["x"], 1e3).astype(np.float32),
               "y": np.where(mask, data["y"], 2).astype(np.int32)}
    again = evaluate(params, garbage, mask)
    assert all(np.array_equal(got[k], again[k]) for k in got)


def test_the_evaluation_exports_and_runs_in_process_with_jits_values():
    params, data, mask = _cohort(7)
    evaluate = federated_evaluation(_loss, clients=3, metrics={"accuracy": accuracy(_logits)})
    proto = fb.export_tff(evaluate, params, data, mask,
                          placements=("server", "clients", "clients"))
    exported = run_computation(proto, params, data, mask)
    local = jax.jit(evaluate)(params, data, mask)
    assert set(exported) == set(local) == {"loss", "accuracy", "examples"}
    for key in local:
        np.testing.assert_allclose(exported[key], local[key], rtol=1e-6, err_msg=key)


def test_metrics_named_as_the_evaluations_own_values_or_not_callable_are_refused():
    with pytest.raises(ArgumentError, match="may not be named 'loss'"):
        federated_evaluation(_loss, clients=2, metrics={"loss": _loss})
    with pytest.raises(ArgumentError, match="metric 'acc' must be a function"):
        federated_evaluation(_loss, clients=2, metrics={"acc": 0.5})
    with pytest.raises(ArgumentError, match="logits must be a function"):
        accuracy("x @ w")
