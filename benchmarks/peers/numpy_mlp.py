"""The workload's MLP trained in plain numpy with hand-written backprop (float32).

Flower's clients train with this (so the Flower venv needs no torch, TensorFlow or
jax), and tests use ``fedavg`` as a reference for the other peers' numbers.
"""

from __future__ import annotations

from typing import List, Tuple

import numpy as np

import workload
from workload import Params


def loss_and_grad(params: Params, x: np.ndarray, y: np.ndarray) -> Tuple[float, Params]:
    """Mean softmax cross-entropy of the batch and its gradient w.r.t. ``params``."""
    pre = x @ params["w1"] + params["b1"]
    h = np.maximum(pre, np.float32(0))
    logits = h @ params["w2"] + params["b2"]
    z = logits - logits.max(axis=1, keepdims=True)
    e = np.exp(z)
    s = e.sum(axis=1, keepdims=True)
    logp = z - np.log(s)
    n = x.shape[0]
    rows = np.arange(n)
    loss = -logp[rows, y].mean()
    d_logits = e / s
    d_logits[rows, y] -= 1
    d_logits /= np.float32(n)
    d_h = (d_logits @ params["w2"].T) * (pre > 0)
    grads = {
        "w1": x.T @ d_h,
        "b1": d_h.sum(axis=0),
        "w2": h.T @ d_logits,
        "b2": d_logits.sum(axis=0),
    }
    return float(loss), {k: v.astype(np.float32) for k, v in grads.items()}


def local_train(params: Params, xb: np.ndarray, yb: np.ndarray,
                lr: float = workload.LR) -> Tuple[Params, float]:
    """SGD over the batches ``xb[s], yb[s]`` in order; returns (model, mean step loss)."""
    p = {k: np.array(v, dtype=np.float32) for k, v in params.items()}
    lr32 = np.float32(lr)
    losses = []
    for s in range(xb.shape[0]):
        loss, g = loss_and_grad(p, xb[s], yb[s])
        losses.append(loss)
        for k in p:
            p[k] -= lr32 * g[k]
    return p, float(np.mean(losses))


def weighted_average(models: List[Params], weights: np.ndarray) -> Params:
    """Example-count-weighted mean of the client models."""
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    return {
        k: sum(wi * m[k].astype(np.float64) for wi, m in zip(w, models)).astype(np.float32)
        for k in models[0]
    }


def fedavg(rounds: int, seed: int = 0) -> Tuple[List[float], List[Params]]:
    """The whole workload in numpy: (loss per round, server model after each round)."""
    data = workload.client_data(workload.load_split())
    params = workload.load_init_params()
    losses, history = [], []
    for r in range(rounds):
        ids = workload.cohort(seed, r)
        results = [local_train(params, data.x[i], data.y[i]) for i in ids]
        counts = data.counts[ids]
        params = weighted_average([m for m, _ in results], counts)
        losses.append(float(np.average([l for _, l in results], weights=counts)))
        history.append(params)
    return losses, history
