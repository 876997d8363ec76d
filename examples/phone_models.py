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
example arguments; `make_round(name, clients, algorithm)` builds one at another cohort
size, or under another algorithm of `ALGORITHMS` (fed_sgd, streaming_diloco,
dp_fed_avg, ...) on the same model and data.
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


# family -> (loss, initial parameters, data builder and its seed, the family's algorithm)
_FAMILIES = {
    "transformer": (transformer_loss, transformer_init, _tokens, 1, "fed_avg"),
    "cnn": (cnn_loss, cnn_init, _images, 2, "fed_adam"),
    "cnn_avg": (cnn_avg_loss, cnn_init, _images, 2, "fed_avg"),
    "gru": (rnn_loss, lambda: rnn_init(0, "gru"), _tokens, 3, "fed_avg"),
    "lstm": (rnn_loss, lambda: rnn_init(0, "lstm"), _tokens, 3, "fed_avg"),
    "mlp": (mlp_loss, mlp_init, _vectors, 4, "fed_sgd_one_trip"),
}
ALGORITHMS = ("fed_avg", "fed_adam", "fed_sgd", "fed_sgd_one_trip", "streaming_diloco",
              "dp_fed_avg", "dp_fed_avg_adaptive")


def own_algorithm(name: str) -> str:
    """The algorithm round `name` runs when `make_round` is given none."""
    _check_name(name)
    return _FAMILIES[name][4]


def _check_name(name: str) -> None:
    if name not in _FAMILIES:
        raise ValueError(f"no round {name!r}: one of {', '.join(_FAMILIES)}")


def make_round(name: str, clients: int, algorithm: str | None = None) -> tuple:
    """(program, example args, placements) of round `name` (module docstring) under
    `algorithm` (one of `ALGORITHMS`; None: the family's own).

    Every algorithm takes the same data, `STEPS` batches of `BATCH` examples per client:
    fed_sgd and fed_sgd_one_trip one step over all of them; streaming_diloco is
    `rounds[0]` (two fragments, H = 2 x STEPS so a round runs STEPS inner steps, overlap
    1, E3M0-quantized outer gradients); dp_fed_avg clips each client's update to L2
    norm 1 and adds Gaussian noise of multiplier 0.5 (`dp_fed_avg_adaptive`: the clip
    adapts to the median update norm).
    """
    program, init_state, placements = _algorithm(name, clients, algorithm)
    _, init, data_of, seed, _ = _FAMILIES[name]
    return program, (init_state(init()), *data_of(clients, seed)), placements


def _algorithm(name: str, clients: int, algorithm: str | None) -> tuple:
    """(program, params -> its state, placements): the round without its arguments."""
    _check_name(name)
    loss, init, _, _, own = _FAMILIES[name]
    algorithm = own if algorithm is None else algorithm
    sgd = optax.sgd(0.1)
    if algorithm in ("fed_avg", "fed_adam"):
        alg = getattr(A, algorithm)(loss, sgd, clients=clients)
    elif algorithm in ("fed_sgd", "fed_sgd_one_trip"):
        alg = getattr(A, algorithm)(loss, clients=clients)
    elif algorithm == "streaming_diloco":
        alg = A.streaming_diloco(loss, init(), clients=clients, sync_every=2 * STEPS,
                                 num_fragments=2, overlap=1, quantize=True)
        return alg.rounds[0], alg.init, alg.placements
    elif algorithm in ("dp_fed_avg", "dp_fed_avg_adaptive"):
        clip = 1.0 if algorithm == "dp_fed_avg" else None
        alg = A.dp_fed_avg(loss, sgd, clients=clients, noise_multiplier=0.5, clip=clip)
    else:
        raise ValueError(f"no algorithm {algorithm!r} for round {name!r}: one of "
                         f"{', '.join(ALGORITHMS)}, or None for its own ({own})")
    return alg.next, alg.init, alg.placements


ROUNDS = tuple(_FAMILIES)
CLIENTS = 3  # the cohort each round declares


def _example_args(name: str):
    def example_args(clients: int) -> tuple:
        _, args, placements = make_round(name, clients)
        return args, placements
    return example_args


for _name in ROUNDS:
    globals()[f"{_name}_round"] = _algorithm(_name, CLIENTS, None)[0]
    globals()[f"{_name}_round_example_args"] = _example_args(_name)
