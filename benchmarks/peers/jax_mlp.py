"""The workload's MLP and client update in JAX, shared by the JAX-based runners.

Imported inside each runner's `build()` so the import counts as setup time. Works on
every jax the runners use (0.4.26 for google-fax, 0.10.2 for fax_bridge).
"""

from __future__ import annotations

from typing import Any, Dict, Tuple

import jax
import jax.numpy as jnp

import workload


def loss_fn(params: Dict[str, Any], x: Any, y: Any) -> Any:
    """Mean softmax cross-entropy of the 64-64-10 ReLU MLP on one batch."""
    h = jax.nn.relu(x @ params["w1"] + params["b1"])
    logits = h @ params["w2"] + params["b2"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))


def local_train(params: Dict[str, Any], xb: Any, yb: Any) -> Tuple[Any, Any]:
    """SGD with the workload's learning rate over one client's batches, in order;
    returns the new parameters and the mean training loss."""
    def step(p: Dict[str, Any], batch: Tuple[Any, Any]) -> Tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(p, *batch)
        return jax.tree_util.tree_map(lambda w, g: w - workload.LR * g, p, grads), loss

    new_params, losses = jax.lax.scan(step, params, (xb, yb))
    return new_params, jnp.mean(losses)
