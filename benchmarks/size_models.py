"""The models `model_sizes.py` times, each at a few sizes: builders of (init, batch, loss).

`linear` (`w: [d, d]`, squared error), `mlp` (784 -> h -> h -> 10), `cnn` (EMNIST-sized:
conv 3x3 c1 -> conv 3x3 c2 -> 2x2 max pool -> dense k -> 62) and `lm` (a decoder-only
transformer LM, four heads, 16 tokens a sequence); `SIZES` lists each model's sizes in
increasing order, `BATCH` its examples per client. `litert_sizes.py` converts the same.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def _dense(rng, n_in: int, n_out: int) -> np.ndarray:
    return (rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)).astype(np.float32)


def _xent(logits, labels):
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None], axis=-1))


def linear_model(d: int):
    def init(rng):
        return {"w": _dense(rng, d, d)}

    def batch(rng, clients, n):
        return {"x": rng.standard_normal((clients, n, d)).astype(np.float32),
                "y": rng.standard_normal((clients, n, d)).astype(np.float32)}

    def loss(p, b):
        return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)

    return init, batch, loss


def mlp_model(h: int):
    sizes = (784, h, h, 10)

    def init(rng):
        p = {}
        for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
            p[f"w{i}"], p[f"b{i}"] = _dense(rng, a, b), np.zeros(b, np.float32)
        return p

    def batch(rng, clients, n):
        return {"x": rng.standard_normal((clients, n, 784)).astype(np.float32),
                "y": rng.integers(0, 10, (clients, n)).astype(np.int32)}

    def loss(p, b):
        z = b["x"]
        for i in range(len(sizes) - 1):
            z = z @ p[f"w{i}"] + p[f"b{i}"]
            if i < len(sizes) - 2:
                z = jax.nn.relu(z)
        return _xent(z, b["y"])

    return init, batch, loss


def cnn_features(p, x):
    """The CNN's two ReLU 3x3 convolutions (`c1`, `cb1`, `c2`, `cb2`) and its 2x2 max
    pool on NHWC images `x`, flattened per example."""
    dn = ("NHWC", "HWIO", "NHWC")
    z = jax.nn.relu(jax.lax.conv_general_dilated(x, p["c1"], (1, 1), "VALID",
                                                 dimension_numbers=dn) + p["cb1"])
    z = jax.nn.relu(jax.lax.conv_general_dilated(z, p["c2"], (1, 1), "VALID",
                                                 dimension_numbers=dn) + p["cb2"])
    z = jax.lax.reduce_window(z, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1),
                              "VALID")
    return z.reshape(z.shape[0], -1)


def cnn_model(c1: int, c2: int, k: int):
    flat = 12 * 12 * c2

    def init(rng):
        conv = lambda shape: (rng.standard_normal(shape) / np.sqrt(np.prod(shape[:3]))
                              ).astype(np.float32)
        return {"c1": conv((3, 3, 1, c1)), "cb1": np.zeros(c1, np.float32),
                "c2": conv((3, 3, c1, c2)), "cb2": np.zeros(c2, np.float32),
                "d1": _dense(rng, flat, k), "db1": np.zeros(k, np.float32),
                "d2": _dense(rng, k, 62), "db2": np.zeros(62, np.float32)}

    def batch(rng, clients, n):
        return {"x": rng.random((clients, n, 28, 28, 1)).astype(np.float32),
                "y": rng.integers(0, 62, (clients, n)).astype(np.int32)}

    def loss(p, b):
        z = jax.nn.relu(cnn_features(p, b["x"]) @ p["d1"] + p["db1"])
        return _xent(z @ p["d2"] + p["db2"], b["y"])

    return init, batch, loss


def lm_model(vocab: int, d: int, layers: int, seq: int = 16, heads: int = 4):
    def init(rng):
        p = {"embed": (rng.standard_normal((vocab, d)) * 0.02).astype(np.float32),
             "pos": (rng.standard_normal((seq, d)) * 0.02).astype(np.float32),
             "head": _dense(rng, d, vocab), "ln": np.ones(d, np.float32)}
        for i in range(layers):
            p[f"l{i}"] = {"ln1": np.ones(d, np.float32), "ln2": np.ones(d, np.float32),
                          "qkv": _dense(rng, d, 3 * d), "o": _dense(rng, d, d),
                          "up": _dense(rng, d, 4 * d), "down": _dense(rng, 4 * d, d)}
        return p

    def batch(rng, clients, n):
        return {"tokens": rng.integers(0, vocab, (clients, n, seq + 1)).astype(np.int32)}

    def norm(x, g):
        return g * x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

    def block(lp, x):
        t = x.shape[-2]
        q, k, v = jnp.split(norm(x, lp["ln1"]) @ lp["qkv"], 3, axis=-1)
        split = lambda a: a.reshape(a.shape[:-1] + (heads, d // heads))
        q, k, v = split(q), split(k), split(v)
        att = jnp.einsum("bqhc,bkhc->bhqk", q, k) / np.sqrt(d // heads)
        att = jnp.where(jnp.tril(jnp.ones((t, t), bool)), att, -1e9)
        y = jnp.einsum("bhqk,bkhc->bqhc", jax.nn.softmax(att, -1), v).reshape(x.shape)
        x = x + y @ lp["o"]
        return x + jax.nn.gelu(norm(x, lp["ln2"]) @ lp["up"]) @ lp["down"]

    def loss(p, b):
        tokens = b["tokens"]
        x = p["embed"][tokens[:, :-1]] + p["pos"]
        for i in range(layers):
            x = block(p[f"l{i}"], x)
        return _xent(norm(x, p["ln"]) @ p["head"], tokens[:, 1:])

    return init, batch, loss


# model name -> (size label, builder arguments) in increasing size; `batch` examples each.
SIZES = {
    "linear": [("d=100", (100,)), ("d=316", (316,)), ("d=1000", (1000,)),
               ("d=2000", (2000,)), ("d=3162", (3162,))],
    "mlp": [("h=12", (12,)), ("h=100", (100,)), ("h=512", (512,)), ("h=1024", (1024,)),
            ("h=2900", (2900,))],
    "cnn": [("4-8-8", (4, 8, 8)), ("16-32-32", (16, 32, 32)), ("32-64-128", (32, 64, 128))],
    "lm": [("V512-d64-L2", (512, 64, 2)), ("V2048-d128-L2", (2048, 128, 2)),
           ("V8192-d320-L4", (8192, 320, 4))],
}
BUILDERS = {"linear": linear_model, "mlp": mlp_model, "cnn": cnn_model, "lm": lm_model}
BATCH = {"linear": 8, "mlp": 8, "cnn": 4, "lm": 2}
