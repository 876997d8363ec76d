"""Rounds of the models phones train, small, as their users write them: for parity.

    fax-bridge parity examples/phone_models.py:transformer_round --devices 2 --litert
    fax-bridge parity examples/phone_models.py:cnn_round --devices 2 --litert
    fax-bridge parity examples/phone_models.py:gru_round --devices 2 --litert

  transformer_round  a causal transformer block (token and position embeddings,
                     pre-LayerNorm, causal softmax self-attention, a GELU MLP), fed_avg
  cnn_round          an EMNIST-like CNN (two 3x3 convolutions, a 2x2 max pool, two
                     dense layers), fed_adam; `cnn_avg_round`: an average pool, fed_avg
  gru_round          a GRU next-word model over 12 tokens under `lax.scan`, fed_avg;
                     `lstm_round`: an LSTM cell instead
  mlp_round          a two-layer MLP, fed_sgd_one_trip

Each is a round of `CLIENTS` clients with `NAME_example_args(clients)` (two batches
of two examples per client), so `fax-bridge export`, `parity` and `litert` find its
example arguments; `make_round(name, clients)` builds one at another cohort size.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fax_bridge import algorithms as A

VOCAB, SEQ, DIM = 16, 12, 8
STEPS, BATCH = 2, 2


def _dense(key, m: int, n: int) -> jax.Array:
    return jax.random.normal(key, (m, n)) / jnp.sqrt(m)


def _one_hot_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, logits.shape[-1]), -1))


# ------------------------------------------------------------------ transformer block

def transformer_init(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 8)
    return {"tok": jax.random.normal(k[0], (VOCAB, DIM)) * 0.3,
            "pos": jax.random.normal(k[1], (SEQ, DIM)) * 0.1,
            "ln1": {"g": jnp.ones(DIM), "b": jnp.zeros(DIM)},
            "ln2": {"g": jnp.ones(DIM), "b": jnp.zeros(DIM)},
            "qkv": _dense(k[2], DIM, 3 * DIM), "proj": _dense(k[3], DIM, DIM),
            "up": _dense(k[4], DIM, 4 * DIM), "down": _dense(k[5], 4 * DIM, DIM),
            "out": _dense(k[6], DIM, VOCAB)}


def _layer_norm(p: dict, x: jax.Array) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + 1e-5) * p["g"] + p["b"]


def transformer_logits(params: dict, tokens: jax.Array) -> jax.Array:
    x = params["tok"][tokens] + params["pos"][: tokens.shape[-1]]
    q, k, v = jnp.split(_layer_norm(params["ln1"], x) @ params["qkv"], 3, -1)
    scores = q @ jnp.swapaxes(k, -1, -2) / jnp.sqrt(DIM)
    causal = jnp.tril(jnp.ones((tokens.shape[-1],) * 2, bool))
    attn = jax.nn.softmax(jnp.where(causal, scores, -1e9), -1)
    x = x + (attn @ v) @ params["proj"]
    x = x + jax.nn.gelu(_layer_norm(params["ln2"], x) @ params["up"]) @ params["down"]
    return x @ params["out"]


def transformer_loss(params: dict, batch: dict) -> jax.Array:
    return _one_hot_loss(transformer_logits(params, batch["x"]), batch["y"])


# ------------------------------------------------------------------ CNN

def cnn_init(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {"c1": {"w": jax.random.normal(k[0], (3, 3, 1, 4)) / 3.0, "b": jnp.zeros(4)},
            "c2": {"w": jax.random.normal(k[1], (3, 3, 4, 8)) / 6.0, "b": jnp.zeros(8)},
            "d1": {"w": _dense(k[2], 4 * 4 * 8, 16), "b": jnp.zeros(16)},
            "d2": {"w": _dense(k[3], 16, 10), "b": jnp.zeros(10)}}


def _conv(p: dict, x: jax.Array) -> jax.Array:
    y = jax.lax.conv_general_dilated(x, p["w"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + p["b"])


def cnn_logits(params: dict, x: jax.Array, pool: str = "max") -> jax.Array:
    h = _conv(params["c2"], _conv(params["c1"], x))
    window = (1, 2, 2, 1)
    if pool == "max":
        h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, window, window, "VALID")
    else:
        h = jax.lax.reduce_window(h, 0.0, jax.lax.add, window, window, "VALID") / 4.0
    h = jax.nn.relu(h.reshape(h.shape[0], -1) @ params["d1"]["w"] + params["d1"]["b"])
    return h @ params["d2"]["w"] + params["d2"]["b"]


def cnn_loss(params: dict, batch: dict) -> jax.Array:
    return _one_hot_loss(cnn_logits(params, batch["x"]), batch["y"])


def cnn_avg_loss(params: dict, batch: dict) -> jax.Array:
    return _one_hot_loss(cnn_logits(params, batch["x"], "avg"), batch["y"])


# ------------------------------------------------------------------ recurrent

def rnn_init(seed: int = 0, cell: str = "gru") -> dict:
    gates = 3 if cell == "gru" else 4
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return {"embed": jax.random.normal(k[0], (VOCAB, DIM)) * 0.3,
            "wx": _dense(k[1], DIM, gates * DIM), "wh": _dense(k[2], DIM, gates * DIM),
            "b": jnp.zeros(gates * DIM), "out": _dense(k[3], DIM, VOCAB)}


def _gru(params: dict, h: jax.Array, x: jax.Array) -> jax.Array:
    xr, xz, xn = jnp.split(x @ params["wx"] + params["b"], 3, -1)
    hr, hz, hn = jnp.split(h @ params["wh"], 3, -1)
    r, z = jax.nn.sigmoid(xr + hr), jax.nn.sigmoid(xz + hz)
    return (1 - z) * jnp.tanh(xn + r * hn) + z * h


def _lstm(params: dict, carry: tuple, x: jax.Array) -> tuple:
    h, c = carry
    i, f, g, o = jnp.split(x @ params["wx"] + h @ params["wh"] + params["b"], 4, -1)
    c = jax.nn.sigmoid(f) * c + jax.nn.sigmoid(i) * jnp.tanh(g)
    return jax.nn.sigmoid(o) * jnp.tanh(c), c


def rnn_loss(params: dict, batch: dict) -> jax.Array:
    xs = jnp.swapaxes(params["embed"][batch["x"]], 0, 1)  # (time, batch, dim)
    if params["wx"].shape[1] == 3 * DIM:
        def step(h, x):
            h = _gru(params, h, x)
            return h, h
        init = jnp.zeros((xs.shape[1], DIM), jnp.float32)
    else:
        def step(carry, x):
            carry = _lstm(params, carry, x)
            return carry, carry[0]
        init = (jnp.zeros((xs.shape[1], DIM), jnp.float32),) * 2
    _, hs = jax.lax.scan(step, init, xs)
    return _one_hot_loss(jnp.swapaxes(hs, 0, 1) @ params["out"], batch["y"])


# ------------------------------------------------------------------ MLP

def mlp_init(seed: int = 0) -> dict:
    k = jax.random.split(jax.random.PRNGKey(seed), 2)
    return {"w0": _dense(k[0], 16, 12), "b0": jnp.zeros(12),
            "w1": _dense(k[1], 12, 10), "b1": jnp.zeros(10)}


def mlp_loss(params: dict, batch: dict) -> jax.Array:
    h = jax.nn.relu(batch["x"] @ params["w0"] + params["b0"])
    return _one_hot_loss(h @ params["w1"] + params["b1"], batch["y"])


# ------------------------------------------------------------------ data and rounds

def _tokens(clients: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    text = rng.integers(0, VOCAB, (clients, STEPS, BATCH, SEQ + 1)).astype(np.int32)
    return {"x": text[..., :-1], "y": text[..., 1:]}, np.ones((clients, STEPS, BATCH), bool)


def _images(clients: int, seed: int, side: int = 8) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.random((clients, STEPS, BATCH, side, side, 1)).astype(np.float32)
    y = rng.integers(0, 10, (clients, STEPS, BATCH)).astype(np.int32)
    return {"x": x, "y": y}, np.ones((clients, STEPS, BATCH), bool)


def _vectors(clients: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(clients, STEPS, BATCH, 16)).astype(np.float32)
    y = rng.integers(0, 10, (clients, STEPS, BATCH)).astype(np.int32)
    return {"x": x, "y": y}, np.ones((clients, STEPS, BATCH), bool)


def make_round(name: str, clients: int) -> tuple:
    """(program, example args, placements) of round `name` (module docstring)."""
    sgd = optax.sgd(0.1)
    if name == "transformer":
        alg, params, data = (A.fed_avg(transformer_loss, sgd, clients=clients),
                             transformer_init(), _tokens(clients, 1))
    elif name in ("cnn", "cnn_avg"):
        loss = cnn_loss if name == "cnn" else cnn_avg_loss
        make = A.fed_adam if name == "cnn" else A.fed_avg
        alg, params, data = make(loss, sgd, clients=clients), cnn_init(), _images(clients, 2)
    elif name in ("gru", "lstm"):
        alg, params, data = (A.fed_avg(rnn_loss, sgd, clients=clients), rnn_init(0, name),
                             _tokens(clients, 3))
    elif name == "mlp":
        alg, params, data = (A.fed_sgd_one_trip(mlp_loss, clients=clients), mlp_init(),
                             _vectors(clients, 4))
    else:
        raise ValueError(f"no round {name!r}: one of transformer, cnn, cnn_avg, gru, "
                         "lstm, mlp")
    return alg.next, (alg.init(params), *data), alg.placements


ROUNDS = ("transformer", "cnn", "cnn_avg", "gru", "lstm", "mlp")
CLIENTS = 3  # the cohort each round declares


def _example_args(name: str):
    def example_args(clients: int) -> tuple:
        _, args, placements = make_round(name, clients)
        return args, placements
    return example_args


for _name in ROUNDS:
    globals()[f"{_name}_round"] = make_round(_name, CLIENTS)[0]
    globals()[f"{_name}_round_example_args"] = _example_args(_name)
