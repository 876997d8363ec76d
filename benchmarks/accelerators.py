"""FedAvg rounds of a decoder language model on whatever `jax.devices()` offers.

One process (an accelerator admits one). Each client takes K local SGD steps on its own
token batches and sends its model delta; the server adds the mean delta. The same round
runs as:

- `hand_vmap`: a hand-written `jit(vmap)` round (every client at once);
- `fax_bridge`: the round as a `fax_bridge.program`, under `jax.jit`;
- `drjax`: the round as a DrJAX program (when drjax is installed);
- `hand_chunked`: a hand-written round mapping k clients at a time (`lax.scan` over
  chunks, `vmap` inside, deltas summed as it goes);
- `fax_bridge_chunked`: the program with `clients_per_step=k`;
- `exported`: the program exported to a TFF proto and run by
  `fax_bridge.runtime.run_computation` in this process, values kept on the device and
  summed exactly there (`on_device=True`);
- `exported_host`: the same with the exact sums and the server step on the host.

For each: the round's time (median of the timed repeats, after a compiled warm-up),
MFU (6 x parameters x tokens a round, attention excluded, against the chip's peak bf16
rate), the compiled round's temporaries (`memory_analysis`), and the largest difference
of its new model from the hand-written round's (`hand_vmap`, or `hand_chunked` where
every client at once does not fit). Matmuls run in bfloat16, parameters and updates in
float32.

With `--largest-cohort [CAP]`, each jit variant's row also gives the largest cohort that
fits the device's memory: the round is compiled, never run, from argument shapes
(`jax.ShapeDtypeStruct`) at N = clients, 2 x clients, 4 x clients, ... up to CAP (4096),
and N fits when its `memory_analysis()` (arguments, results and temporaries, less aliased
bytes) is within the allocator's `bytes_limit` (`fax_bridge.local.chunking.memory_limit`) or
`--memory-bytes`. The doubling stops at the first N that does not fit or fails to
compile; "N+" says the cap was reached.

    python benchmarks/accelerators.py --model 110M --clients 4 --steps 4 --chunk 4
        [--variants hand_vmap,fax_bridge,...] [--repeats 3] [--json OUT]
        [--largest-cohort [CAP]] [--memory-bytes BYTES]
    python benchmarks/accelerators.py --suite [--json OUT]    # SUITE, in one process
    python benchmarks/accelerators.py --quick [--json OUT]    # QUICK: minutes, one process

MFU is against `PEAK_TFLOPS` for the chips it names; on any other accelerator (a GPU) the
peak is measured in the same process first (`measured_peak`: an 8192^3 bfloat16 matrix
product, best of five) and each report says which (`peak_source`).

`--model tiny` runs on a CPU in seconds (the suite's check of this script).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fax_bridge as fb
from fax_bridge.local import chunking

# (width, layers, heads); vocabulary and sequence from VOCAB / SEQ unless tiny.
MODELS = {"tiny": (64, 2, 4), "34M": (512, 6, 8), "110M": (768, 12, 12),
          "268M": (1024, 19, 16)}
VOCAB, SEQ, BATCH, LR = 32768, 512, 4, 0.01
TINY = dict(vocab=512, seq=32, batch=2)
COHORT_CAP = 4096  # --largest-cohort's default cap
# Peak dense bf16 rate by jax's device_kind (TFLOP/s): MFU is left out elsewhere.
PEAK_TFLOPS = {"TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v4": 275.0, "TPU v5p": 459.0,
               "TPU v6 lite": 918.0}
VARIANTS = ("hand_vmap", "fax_bridge", "drjax", "hand_chunked", "fax_bridge_chunked",
            "exported", "exported_host")
REFERENCES = ("hand_vmap", "hand_chunked")  # the hand-written rounds, in that preference
JIT = "hand_vmap,fax_bridge,drjax,hand_chunked,fax_bridge_chunked"
CHUNKED = "hand_chunked,fax_bridge_chunked"
EXPORTED = "hand_vmap,exported"
B8x256 = dict(batch=8, seq=256)  # batches at which the hand round's MFU is near its best
PER_LAYER = dict(B8x256, layout="per-layer")
# docs/accelerators.md's table: (model, clients, local steps, chunk, variants[, how]),
# `how`: `measure`'s layout, batch and seq.
SUITE = (("34M", 8, 4, 4, JIT), ("110M", 4, 4, 2, JIT), ("268M", 2, 2, 2, JIT),
         ("110M", 64, 4, 4, "hand_vmap," + CHUNKED), ("110M", 1024, 1, 4, CHUNKED),
         ("268M", 64, 1, 2, CHUNKED),
         ("34M", 8, 4, 4, EXPORTED, B8x256), ("110M", 4, 4, 4, EXPORTED, B8x256),
         ("268M", 2, 2, 2, EXPORTED, B8x256), ("34M", 8, 4, 4, EXPORTED, PER_LAYER),
         ("110M", 4, 4, 4, EXPORTED, PER_LAYER), ("268M", 2, 2, 2, EXPORTED, PER_LAYER),
         ("110M", 1024, 1, 4, "hand_chunked,exported", PER_LAYER))
# The few rows that say most, in minutes (`--quick`, one timed round each): the jit round
# against the hand-written one at 110M and 268M in both layouts, chunked cohorts of 64
# and 1,024 clients, and the exported round.
VS_HAND = "hand_vmap,fax_bridge"
QUICK = (("110M", 4, 4, 4, VS_HAND, B8x256), ("110M", 4, 4, 4, VS_HAND, PER_LAYER),
         ("268M", 2, 2, 2, VS_HAND, B8x256), ("268M", 2, 2, 2, VS_HAND, PER_LAYER),
         ("110M", 64, 1, 4, CHUNKED, B8x256), ("110M", 4, 4, 4, EXPORTED, B8x256),
         ("110M", 1024, 1, 4, CHUNKED, B8x256))


# --------------------------------------------------------------------------- the model


LAYER_WEIGHTS = ("qkv", "out", "up", "down", "norms")
LAYOUTS = ("stacked", "per-layer")


def init_params(key, width: int, layers: int, vocab: int, layout: str = "stacked") -> dict:
    """A decoder's parameters: the layers stacked on a leading axis (scanned over), or
    (`per-layer`) one leaf per layer weight, as flax, haiku and equinox models hold
    them (`l3_qkv`, ...; the same values)."""
    ks = jax.random.split(key, 5)
    scale = 0.02

    def normal(k, shape):
        return scale * jax.random.normal(k, shape, jnp.float32)

    params = {
        "embed": normal(ks[0], (vocab, width)),
        "qkv": normal(ks[1], (layers, width, 3 * width)),
        "out": normal(ks[2], (layers, width, width)),
        "up": normal(ks[3], (layers, width, 4 * width)),
        "down": normal(ks[4], (layers, 4 * width, width)),
        "norms": jnp.ones((layers, 2, width), jnp.float32),
        "final_norm": jnp.ones((width,), jnp.float32),
    }
    if layout == "per-layer":
        for name in LAYER_WEIGHTS:
            stacked = params.pop(name)
            params.update({f"l{i:02d}_{name}": stacked[i] for i in range(layers)})
    return params


def count_params(params: dict) -> int:
    return int(sum(np.prod(x.shape) for x in jax.tree.leaves(params)))


def _norm(x, g):
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
    return (y * g).astype(jnp.bfloat16)


def loss(params: dict, tokens, heads: int):
    """Mean next-token cross-entropy of one batch [batch, seq]."""
    bf = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    x = bf["embed"][tokens[:, :-1]]
    b, t, d = x.shape
    mask = jnp.tril(jnp.ones((t, t), bool))

    def layer(x, p):
        qkv_w, out_w, up_w, down_w, norms = p
        h = _norm(x, norms[0])
        q, k, v = jnp.split(h @ qkv_w, 3, axis=-1)
        q, k, v = (a.reshape(b, t, heads, d // heads) for a in (q, k, v))
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / np.sqrt(d // heads)
        a = jax.nn.softmax(jnp.where(mask, s, -1e9), axis=-1).astype(jnp.bfloat16)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", a, v).reshape(b, t, d) @ out_w
        h = _norm(x, norms[1])
        return x + jax.nn.gelu(h @ up_w) @ down_w, None

    if "qkv" in bf:  # stacked: scanned over
        x, _ = lax.scan(layer, x, tuple(bf[name] for name in LAYER_WEIGHTS))
    else:  # one leaf per layer weight: unrolled
        for i in range(sum(name.endswith("_qkv") for name in bf)):
            x, _ = layer(x, tuple(bf[f"l{i:02d}_{name}"] for name in LAYER_WEIGHTS))
    logits = (_norm(x, bf["final_norm"]) @ bf["embed"].T).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1))


def local_update(params: dict, tokens, heads: int) -> dict:
    """One client's delta after a local SGD step per batch of `tokens` [steps, b, t]."""
    def step(p, batch):
        g = jax.grad(loss)(p, batch, heads)
        return jax.tree.map(lambda w, gw: w - LR * gw, p, g), None

    new, _ = lax.scan(step, params, tokens)
    return jax.tree.map(jnp.subtract, new, params)


# --------------------------------------------------------------------------- the rounds


def hand_vmap(heads: int, clients: int, chunk: int) -> Callable:
    del clients, chunk

    def round_(params, data):
        deltas = jax.vmap(lambda d: local_update(params, d, heads))(data)
        return jax.tree.map(lambda w, d: w + jnp.mean(d, axis=0), params, deltas)
    return round_


def hand_chunked(heads: int, clients: int, chunk: int) -> Callable:
    steps = clients // chunk

    def round_(params, data):
        chunks = data.reshape((steps, chunk) + data.shape[1:])

        def body(total, part):
            deltas = jax.vmap(lambda d: local_update(params, d, heads))(part)
            return jax.tree.map(lambda t, d: t + jnp.sum(d, axis=0), total, deltas), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        total, _ = lax.scan(body, zeros, chunks)
        return jax.tree.map(lambda w, t: w + t / clients, params, total)
    return round_


def fax_program(heads: int, clients: int, chunk: Optional[int]):
    @fb.program(clients=clients, clients_per_step=chunk)
    def fedavg(params, data):
        deltas = fb.federated_map_clients(lambda p, d: local_update(p, d, heads),
                                          (fb.federated_broadcast(params), data))
        return jax.tree.map(jnp.add, params, fb.federated_mean(deltas))
    return fedavg


def drjax_round(heads: int, clients: int, chunk: int) -> Callable:
    import drjax
    del chunk

    @drjax.program(placements={"clients": clients})
    def round_(params, data):
        deltas = drjax.map_fn(lambda p, d: local_update(p, d, heads),
                              (drjax.broadcast(params), data))
        return jax.tree.map(jnp.add, params, drjax.reduce_mean(deltas))
    return round_


@functools.lru_cache(maxsize=64)
def _jitted(variant: str, heads: int, clients: int, chunk: int) -> Callable:
    """The variant's round under `jax.jit`, one object per configuration, so the timed
    round and the largest-cohort search share a compilation (jit caches by shapes)."""
    if variant == "fax_bridge":
        return jax.jit(fax_program(heads, clients, None))
    if variant == "fax_bridge_chunked":
        return jax.jit(fax_program(heads, clients, chunk))
    builders = {"hand_vmap": hand_vmap, "hand_chunked": hand_chunked,
                "drjax": drjax_round}
    return jax.jit(builders[variant](heads, clients, chunk))


# --------------------------------------------------------------------------- measuring


def _timed(fn: Callable, args: tuple, repeats: int) -> tuple[Any, list[float]]:
    out = jax.block_until_ready(fn(*args))  # compiles, warms up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return out, times


def _max_diff(a, b) -> float:
    return float(max(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))
                     for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))))


def measure(model: str, clients: int, steps: int, chunk: int, variants: list[str],
            repeats: int, seed: int = 0, cohort_cap: Optional[int] = None,
            memory_bytes: Optional[int] = None, layout: str = "stacked",
            batch: Optional[int] = None, seq: Optional[int] = None) -> dict:
    """Runs the chosen variants of one round; a row per variant (an error is a row).

    Args:
      model, clients, steps, chunk: a key of MODELS, the cohort, the local steps of each
        client and the chunk size of the chunked variants.
      variants, repeats, seed: which of VARIANTS, how many timed rounds, the data's seed.
      cohort_cap: when given, each jit variant's row gets `largest_cohort` (see
        `largest_cohort`) searched up to this many clients.
      memory_bytes: the memory that search fits rounds into; by default the device's
        allocator limit, and none on a CPU (each row then says so).
      layout, batch, seq: the parameters' layout (LAYOUTS), and the token batches'
        size and length (default BATCH x SEQ).
    """
    width, layers, heads = MODELS[model]
    sizes = dict(_sizes(model))
    if model != "tiny":
        sizes.update({k: v for k, v in (("batch", batch), ("seq", seq)) if v})
    key_p, key_d = jax.random.split(jax.random.PRNGKey(seed))
    params = init_params(key_p, width, layers, sizes["vocab"], layout)
    data = jax.random.randint(key_d, (clients, steps, sizes["batch"], sizes["seq"] + 1), 0,
                              sizes["vocab"], jnp.int32)
    n_params = count_params(params)
    tokens = clients * steps * sizes["batch"] * sizes["seq"]
    device = jax.devices()[0]
    peak, peak_source = chip_peak(device)
    flops = 6.0 * n_params * tokens
    report = {"model": model, "parameters": n_params, "clients": clients, "steps": steps,
              "chunk": chunk, "tokens": tokens, "layout": layout,
              "leaves": len(jax.tree.leaves(params)), "batch": sizes["batch"],
              "seq": sizes["seq"], "device": device.device_kind,
              "devices": jax.device_count(), "peak_tflops": peak,
              "peak_source": peak_source, "rows": []}
    if cohort_cap is not None:
        memory_bytes = memory_bytes or chunking.memory_limit(host_fallback=False)
        report.update(cohort_cap=cohort_cap, memory_bytes=memory_bytes)
    results: dict[str, Any] = {}  # new models, on the host (the chip keeps no old one)
    for variant in sorted(variants, key=lambda v: v not in REFERENCES):
        row: dict[str, Any] = {"variant": variant}
        try:
            if variant.startswith("exported"):
                out, times, extra = _exported(heads, clients, params, data, repeats,
                                              variant == "exported", chunk)
                row.update(extra)
            else:
                fn = _jitted(variant, heads, clients, chunk)
                mem = fn.lower(params, data).compile().memory_analysis()
                row["temp_gib"] = mem.temp_size_in_bytes / 2 ** 30
                out, times = _timed(fn, (params, data), repeats)
            results[variant] = jax.tree.map(np.asarray, out)
            del out
            row["round_s"] = statistics.median(times)
        except Exception as e:  # noqa: BLE001 - an out-of-memory variant is a result
            row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if "round_s" in row and peak:
            row["mfu"] = flops / row["round_s"] / (peak * 1e12)
        if cohort_cap is not None and not variant.startswith("exported"):
            row["largest_cohort"] = (
                {"absent": f"{device.platform} reports no memory limit: give --memory-bytes"}
                if memory_bytes is None else
                largest_cohort(variant, model, clients, steps, chunk, cohort_cap,
                               memory_bytes))
        report["rows"].append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)  # a row as soon as it is known
    reference = next((results[r] for r in REFERENCES if r in results), None)
    for row in report["rows"]:
        if reference is not None and row["variant"] in results:
            row["max_diff"] = _max_diff(results[row["variant"]], reference)
    order = {v: i for i, v in enumerate(VARIANTS)}
    report["rows"].sort(key=lambda r: order[r["variant"]])
    return report


def chip_peak(device) -> tuple[Optional[float], str]:
    """(peak bf16 TFLOP/s, where the figure comes from): the table's for the chips it
    names, measured here for any other accelerator, none on a CPU."""
    if device.device_kind in PEAK_TFLOPS:
        return PEAK_TFLOPS[device.device_kind], "table"
    if device.platform == "cpu":
        return None, "none on a CPU"
    return measured_peak(), "measured: 8192^3 bf16 matmul, best of 5"


@functools.lru_cache(maxsize=1)
def measured_peak(n: int = 8192, repeats: int = 5) -> float:
    """TFLOP/s of an n^3 bfloat16 matrix product on the default device, best of
    `repeats` timed calls after a compiled warm-up."""
    a = jax.random.normal(jax.random.PRNGKey(1), (n, n), jnp.bfloat16)
    matmul = jax.jit(lambda x: x @ x)
    jax.block_until_ready(matmul(a))
    best = min(_timed(matmul, (a,), repeats)[1])
    return 2.0 * n ** 3 / best / 1e12


def _sizes(model: str) -> dict:
    return TINY if model == "tiny" else dict(vocab=VOCAB, seq=SEQ, batch=BATCH)


# --------------------------------------------------------------------------- the largest cohort


def round_specs(model: str, clients: int, steps: int) -> tuple:
    """The round's (parameters, data) as `jax.ShapeDtypeStruct`s: nothing allocated."""
    width, layers, _ = MODELS[model]
    sizes = _sizes(model)
    params = jax.eval_shape(lambda k: init_params(k, width, layers, sizes["vocab"]),
                            jax.random.PRNGKey(0))
    data = jax.ShapeDtypeStruct((clients, steps, sizes["batch"], sizes["seq"] + 1),
                                jnp.int32)
    return params, data


def cohort_bytes(variant: str, model: str, clients: int, steps: int, chunk: int) -> int:
    """Device bytes of a jit variant's round compiled (not run) for `clients` clients."""
    fn = _jitted(variant, MODELS[model][2], clients, chunk)
    return chunking.compiled_bytes(fn.lower(*round_specs(model, clients, steps)).compile())


def largest_cohort(variant: str, model: str, clients: int, steps: int, chunk: int,
                   cap: int, limit: int) -> dict:
    """The largest of clients x 2^i (up to `cap`) whose compiled round fits `limit` bytes.

    Compiles the round at each doubling until one needs more than `limit` or fails to
    compile (an out-of-memory refusal by the compiler is a result).

    Args:
      variant, model, steps, chunk: the round, as in `measure`.
      clients: the first cohort tried; cap: the most clients tried.
      limit: the device bytes a round may take (`cohort_bytes`).

    Returns:
      `clients` (None when the first does not fit) and its `bytes`; either `capped`
      (the next doubling would pass `cap`) or `stop` (why the next one was not taken);
      the search's `seconds`.
    """
    found: dict[str, Any] = {"clients": None, "bytes": None}
    start, n = time.perf_counter(), clients
    while n <= cap:
        try:
            need = cohort_bytes(variant, model, n, steps, chunk)
        except Exception as e:  # noqa: BLE001 - a refusal to compile ends the search
            found["stop"] = f"{n} clients: {type(e).__name__}: " \
                            f"{(str(e).splitlines() or [''])[0][:200]}"
            break
        if need > limit:
            found["stop"] = f"{n} clients need {need} bytes, over {limit}"
            break
        found.update(clients=n, bytes=need)
        n *= 2
    else:
        found["capped"] = True
    found["seconds"] = time.perf_counter() - start
    return found


def _cohort_cell(row: dict, clients: int) -> str:
    found = row.get("largest_cohort")
    if found is None:
        return ""
    if "absent" in found:
        return found["absent"]
    if found["clients"] is None:
        return f"under {clients} ({found['stop']})"
    return f"{found['clients']}+" if found.get("capped") else str(found["clients"])


def _exported(heads, clients, params, data, repeats, on_device: bool, chunk: int):
    """The exported round's result and times, and its export time, first call (compiles
    included) and, on the device path, its chunk step's temporaries (`memory_analysis`
    of the program that runs `chunk` clients and adds their results to the sums)."""
    from fax_bridge.runtime import device_rounds, interpreter, run_computation
    program = fax_program(heads, clients, None)
    start = time.perf_counter()
    proto = interpreter.prepare(
        fb.export_tff(program, params, data, placements=("server", "clients")))
    export_s = time.perf_counter() - start
    start = time.perf_counter()

    def run(p, d):
        return run_computation(proto, p, d, on_device=on_device, clients_per_step=chunk)

    jax.block_until_ready(run(params, data))
    extra = {"export_s": export_s, "first_s": time.perf_counter() - start}
    out, times = _timed(run, (params, data), repeats)
    mem = device_rounds.step_memory() if on_device else None
    if mem is not None:
        extra["temp_gib"] = mem.temp_size_in_bytes / 2 ** 30
    return out, times, extra


def table(report: dict) -> str:
    base = {r["variant"]: r.get("round_s") for r in report["rows"]}
    ref = base.get("hand_vmap") or base.get("hand_chunked")
    lines = [f"{report['model']} ({report['parameters'] / 1e6:.1f}M parameters, "
             f"{report.get('layout', 'stacked')}: {report.get('leaves', '?')} leaves), "
             f"{report['clients']} clients x {report['steps']} steps of "
             f"{report.get('batch', '?')} x {report.get('seq', '?')} tokens, chunks of "
             f"{report['chunk']}, on {report['devices']} x {report['device']}",
             "| variant | round | vs hand-written | MFU | temporaries | max diff |",
             "|---|---:|---:|---:|---:|---:|"]
    cohorts = "cohort_cap" in report
    if cohorts:
        limit = report["memory_bytes"]
        lines[0] += f"; largest cohort within {limit / 2 ** 30:.3g} GiB" if limit else ""
        lines[1] += f" largest cohort (to {report['cohort_cap']}) |"
        lines[2] += "---:|"
    for r in report["rows"]:
        cohort = f" {_cohort_cell(r, report['clients'])} |" if cohorts else ""
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error']} | | | | |{cohort}")
            continue
        ratio = f"{r['round_s'] / ref:.2f}x" if ref else ""
        mfu = f"{100 * r['mfu']:.1f}%" if "mfu" in r else ""
        temp = f"{r['temp_gib']:.2f} GiB" if "temp_gib" in r else ""
        diff = f"{r['max_diff']:.2g}" if "max_diff" in r else ""
        lines.append(f"| {r['variant']} | {r['round_s']:.3f} s | {ratio} | {mfu} | {temp} "
                     f"| {diff} |{cohort}")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny")
    parser.add_argument("--clients", type=int, nargs="+", default=[4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--chunk", type=int, default=4)
    parser.add_argument("--layout", choices=LAYOUTS, default="stacked",
                        help="the layers stacked (scanned) or one leaf per layer weight")
    parser.add_argument("--batch", type=int, help=f"sequences a step (default {BATCH})")
    parser.add_argument("--seq", type=int, help=f"tokens a sequence (default {SEQ})")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="append each report to this file as a JSON line")
    parser.add_argument("--suite", action="store_true",
                        help="run every configuration of SUITE (docs/accelerators.md)")
    parser.add_argument("--quick", action="store_true",
                        help="run QUICK's rows, one timed round each (minutes)")
    parser.add_argument("--largest-cohort", type=int, nargs="?", const=COHORT_CAP,
                        metavar="CAP", help="also find each jit variant's largest cohort "
                        f"(compiled, not run) that fits the memory, up to CAP ({COHORT_CAP})")
    parser.add_argument("--memory-bytes", type=int, metavar="BYTES",
                        help="the memory --largest-cohort fits into (default: the "
                        "device's bytes_limit; a CPU reports none)")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    bad = [n for n in args.clients if n % args.chunk and n > args.chunk]
    if bad:
        parser.error(f"--chunk {args.chunk} must divide every cohort (got {bad}) for the "
                     "hand-written chunked round")
    shape = dict(layout=args.layout, batch=args.batch, seq=args.seq)
    if args.suite and args.quick:
        parser.error("--suite and --quick are two row sets: give one")
    if args.quick:
        args.repeats = 1
    rows = SUITE if args.suite else QUICK
    plan = [(m, n, k, c, v.split(","), dict(shape, **more))
            for m, n, k, c, v, *extra in rows for more in [extra[0] if extra else {}]] \
        if args.suite or args.quick else [(args.model, n, args.steps, min(args.chunk, n), variants, shape)
                            for n in args.clients]
    _check_cohort_options(parser, args, max(p[1] for p in plan))
    reports = []
    for model, n, steps, chunk, chosen, how in plan:
        report = measure(model, n, steps, chunk, chosen, args.repeats,
                         cohort_cap=args.largest_cohort, memory_bytes=args.memory_bytes,
                         **how)
        print(table(report), flush=True)
        reports.append(report)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(report) + "\n")
    return reports


def _check_cohort_options(parser: argparse.ArgumentParser, args, clients: int) -> None:
    cap, memory = args.largest_cohort, args.memory_bytes
    if memory is not None and cap is None:
        parser.error("--memory-bytes is the limit of the --largest-cohort search; give "
                     "--largest-cohort [CAP] too")
    if memory is not None and memory <= 0:
        parser.error(f"--memory-bytes must be a positive number of bytes (got {memory})")
    if cap is not None and cap < clients:
        parser.error(f"--largest-cohort {cap} is below a cohort of {clients} clients; "
                     f"give a cap of at least {clients}")


if __name__ == "__main__":
    main(sys.argv[1:])
