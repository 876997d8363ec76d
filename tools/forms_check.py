"""Checks every single-round program against TFF 0.87's production forms.

    .venv/bin/python tools/forms_check.py [--clients 3] [--devices 2] [--out out/forms]
        [--only NAME ...] [--fcp some|all|none]

Rounds: the quickstart's `fedavg_round`, every target of
`examples/algorithm_rounds.py` (each algorithm in `fax_bridge.algorithms`) and DP-FedAvg
with a fixed and an adaptive clip, and the quickstart round averaging through
`federated_secure_mean` (secure sums in both forms). Each round is
either refused (two trips, client state: it must be one of `EXPECTED_REFUSALS`, and the
reason is printed) or exported in the forms' type, and then, with one TFF 0.87 process
for all rounds (`tools/tff087/build_forms.py`):

- TFF builds its DistributeAggregateForm and MapReduceForm, re-derives the round from
  each and checks that the type signature is the original's;
- the MapReduceForm runs piece by piece in TensorFlow 2.14 sessions;
- back here, the DistributeAggregateForm runs piece by piece in fax_bridge's runtime and
  on a `LocalFleet`, and the round TFF re-derived from it runs in the runtime.

- for the rounds of `FCP_CHECKED` (`--fcp all`: every round), the forms Federated
  Compute's plan builder takes (`fax_bridge.tff.fcp`) are built too,
  checked against the builder's contract (the plain forms must break it), and both run
  for `FCP_ROUNDS` rounds the way a plan's phases run (`tools/tff087/plan_run.py`,
  `plan_run_daf.py`: checkpoint files between phases, each client's examples from the
  TFRecord file `fax_bridge.data.examples` wrote), against as many rounds of `jax.jit`
  (integer leaves such as a PRNG key equal), and the MRF's again with its client work
  converted by TF's TFLite converter and run by `tf.lite.Interpreter`
  (`tools/tff087/tflite_client.py`; the rounds of `EXPECTED_TFLITE_REFUSALS` must
  instead be refused, by name, when their FCP forms are written); a tf.Example written by TensorFlow is read back
  with `fax_bridge.data.examples`.

Every result must equal `jax.jit` of the round to float32 tolerance. Exit status 0 when
all do, 1 otherwise, 2 when the check could not run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import pathlib
import sys
import time

import numpy as np

REPO = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
# Rounds no single form can hold, and the reason their refusal must give.
EXPECTED_REFUSALS = {
    "fed_sgd": "two server-client trips",
    "learned_server_lr": "two server-client trips",
    "learned_client_weights": "client state",
    "streaming_diloco": "client state",
}
RTOL, ATOL = 2e-5, 2e-6
FCP_ROUNDS = 3  # rounds of the FCP forms' plan-shaped runs, against jax.jit
# Rounds whose FCP forms `make forms-check` builds and runs (`--fcp all`: every round;
# about 3-4 s of the TFF process per round): plain FedAvg, a server optimizer's state,
# a uint32 PRNG key in the state, a secure sum, and client results FCP's aggregation
# takes only widened (bfloat16 means, wrapping uint32 and uint8 sums).
FCP_CHECKED = ("quickstart", "fed_adam", "dp_fed_avg", "secure_mean_round",
               "bfloat16_results_round", "uint32_sum_round")
SECURE_RANGE, SECURE_BITS = (-1.0, 1.0), 12  # secure_mean_round's quantization
# Rounds whose float32 state adds a bfloat16 mean of the clients' results: TFF's own
# MapReduceForm, run in TensorFlow, sums that mean's bfloat16 values in bfloat16 (rounding
# each partial sum) where jit rounds the float32 sum once, which moves a float32 leaf by
# up to a bfloat16 ulp of its largest value too (`max_error(..., bfloat16_moved=True)`).
BFLOAT16_MOVED = ("bfloat16_results_round",)
# Rounds whose client work the devices' TFLite client cannot take, and what the refusal
# (`fax_bridge.tff.fcp_client`, when the FCP forms are written) must name: their FCP
# forms are built and run with the client work as jax wrote it, with no TFLite run.
EXPECTED_TFLITE_REFUSALS = {
    "bfloat16_results_round": "a bfloat16 tensor",
    "uint32_sum_round": "a float converted to an unsigned integer",
}


def tflite_allowance(name: str, clients: int) -> float:
    """What a TFLite client may move a round's state by, per round run, beyond float32
    rounding: nothing, except through a secure mean's stochastic rounding, where a value
    an ulp away from jit's can take the neighbouring code, one step of the mean
    (range / (2^bits - 1) / clients) at that element."""
    if name != "secure_mean_round":
        return 0.0
    low, high = SECURE_RANGE
    return (high - low) / (2 ** SECURE_BITS - 1) / clients


def targets(clients: int) -> dict:
    """name -> (program, args, placements) for every checked round."""
    from fax_bridge.tff.cli import resolve_program

    sys.path.insert(0, str(EXAMPLES))
    import algorithm_rounds

    import _digits as D
    import optax

    from fax_bridge import algorithms as A

    out = {"quickstart": resolve_program(str(EXAMPLES / "quickstart.py") + ":fedavg_round",
                                         clients)}
    out.update(algorithm_rounds.export_targets(clients))
    cohort, params = D.Population(0).cohort(range(clients)), D.init_mlp(0)
    for name, clip in (("dp_fed_avg", 1.0), ("dp_fed_avg_adaptive", None)):
        if name not in out:
            alg = A.dp_fed_avg(D.loss, optax.sgd(0.1), clients=clients, noise_multiplier=0.2,
                               clip=clip)
            out[name] = (alg.next, (alg.init(params), cohort.data, cohort.mask),
                         alg.placements)
    out.setdefault("secure_mean_round", secure_mean_round(clients))
    out.setdefault("bfloat16_results_round", bfloat16_results_round(clients))
    out.setdefault("uint32_sum_round", uint32_sum_round(clients))
    return out


def bfloat16_results_round(clients: int):
    """The quickstart's FedAvg round with its client results in bfloat16: the model
    change and the loss averaged as bfloat16 (`federated_mean`), the new model and the
    mean loss in bfloat16 too."""
    import jax
    import jax.numpy as jnp

    import fax_bridge as fb

    sys.path.insert(0, str(EXAMPLES))
    import quickstart

    def narrow(tree):
        return jax.tree.map(lambda x: x.astype(jnp.bfloat16), tree)

    @fb.program(clients=clients)
    def round_fn(params, data):
        delta, _, loss = fb.federated_map_clients(
            lambda p, d: narrow(quickstart.local_train(p, d)),
            (fb.federated_broadcast(params), data))
        mean = fb.federated_mean(delta)
        new = fb.federated_map_server(
            lambda p, d: jax.tree.map(lambda a, b: a + b.astype(a.dtype), p, d),
            (params, mean))
        return new, (fb.federated_mean(loss), fb.federated_map_server(narrow, new))

    (params, data), _ = quickstart.example_args(clients)
    return round_fn, (params, data), ("server", "clients")


def uint32_sum_round(clients: int):
    """A round of unsigned sums that wrap: each client's uint32 hash of its data's bits
    (large, so the sum over clients wraps at 2^32) and uint8 counts, summed with
    `federated_sum` into a uint32 counter of the state and the output."""
    import jax
    import jax.numpy as jnp

    import fax_bridge as fb

    sys.path.insert(0, str(EXAMPLES))
    import quickstart

    @fb.program(clients=clients)
    def round_fn(state, data):
        def work(d):
            bits = jax.lax.bitcast_convert_type(d["x"], jnp.uint32)
            return (bits * jnp.uint32(2654435761)).sum(0), \
                (d["y"] % 7).astype(jnp.uint8) * jnp.uint8(53)

        hashes, counts = fb.federated_map_clients(work, data)
        total, count = fb.federated_sum(hashes), fb.federated_sum(counts)
        new = fb.federated_map_server(
            lambda s, t: {"seen": s["seen"] + t, "rounds": s["rounds"] + jnp.uint32(1)},
            (state, total))
        return new, (total, count)

    (_, data), _ = quickstart.example_args(clients)
    n_features = data["x"].shape[-1]
    state = {"seen": np.arange(n_features, dtype=np.uint32) * np.uint32(4000000007),
             "rounds": np.uint32(0)}
    return round_fn, (state, data), ("server", "clients")


def secure_mean_round(clients: int):
    """The quickstart's FedAvg round with the model change averaged through
    `federated_secure_mean` (secure sums in both forms)."""
    import jax
    import jax.numpy as jnp

    import fax_bridge as fb

    sys.path.insert(0, str(EXAMPLES))
    import quickstart

    @fb.program(clients=clients)
    def round_fn(params, data, keys):
        delta, _, loss = fb.federated_map_clients(
            quickstart.local_train, (fb.federated_broadcast(params), data))
        mean = fb.federated_secure_mean(delta, keys, value_range=SECURE_RANGE,
                                      bits=SECURE_BITS)
        new = fb.federated_map_server(lambda p, d: jax.tree.map(jnp.add, p, d), (params, mean))
        return new, fb.federated_mean(loss)

    (params, data), _ = quickstart.example_args(clients)
    keys = jax.random.key_data(jax.random.split(jax.random.key(0), clients))
    return round_fn, (params, data, keys), ("server", "clients", "clients")


def _flat(tree) -> list:
    import jax

    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _struct_flat(value) -> list:
    from federated_language.common_libs import structure

    if isinstance(value, structure.Struct):
        return [np.asarray(x) for x in structure.flatten(value)]
    return [np.asarray(value)]


def max_error(want: list, got: list, allowance: float = 0.0,
              bfloat16_moved: bool = False) -> float:
    """The largest absolute difference; raises AssertionError beyond float32 tolerance
    (plus `allowance`, absolute, and one bfloat16 ulp for a bfloat16 leaf, or for every
    float leaf with `bfloat16_moved`)."""
    if len(want) != len(got):
        raise AssertionError(f"{len(got)} result tensors, expected {len(want)}")
    worst = 0.0
    for w, g in zip(want, got):
        w, g = np.asarray(w), np.asarray(g)
        if g.dtype.kind == "V" and g.dtype.itemsize == w.dtype.itemsize:
            g = g.view(w.dtype)  # a bfloat16 leaf np.load gives back as raw bytes
        if g.shape != w.shape:  # never broadcast one onto the other
            raise AssertionError(f"a result of shape {list(g.shape)}, expected {list(w.shape)}")
        w, g, ulp = _wide(w), _wide(g), _ulp(w, bfloat16_moved)
        np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL + allowance + ulp)
        if w.size:
            worst = max(worst, float(np.nanmax(np.abs(g.astype(np.float64) - w))))
    return worst


class _NoFcp(Exception):
    """--no-fcp: the round's job gets no Federated Compute forms."""


def jit_rounds(prog, prog_args, rounds: int) -> list:
    """[(flat state, flat output)] after each of `rounds` rounds of `jax.jit(prog)`."""
    import jax

    step, state, out = jax.jit(prog), prog_args[0], []
    for _ in range(rounds):
        state, output = step(state, *prog_args[1:])
        out.append((_flat(state), _flat(output)))
    return out


def exact_error(want: list, got: list, allowance: float = 0.0) -> float:
    """`max_error`, but integer and boolean leaves (a PRNG key, counters) must be equal."""
    if len(want) != len(got):
        raise AssertionError(f"{len(got)} result tensors, expected {len(want)}")
    # leaves kept as a signed integer's bits (unsigned, bfloat16) viewed back first
    got = [np.asarray(g).view(w.dtype) if np.asarray(g).dtype != w.dtype
           and np.asarray(g).dtype.itemsize == w.dtype.itemsize else np.asarray(g)
           for g, w in zip(got, want)]
    for w, g in zip(want, got):
        if w.dtype.kind in "biu" and not np.array_equal(g, w):
            raise AssertionError(f"integer leaf {w.dtype}{list(w.shape)} differs: {g} != {w}")
    floats = [(w, g) for w, g in zip(want, got) if w.dtype.kind not in "biu"]
    return max_error([w for w, _ in floats], [g for _, g in floats], allowance)


def _wide(x):
    """A bfloat16 leaf as float32 (exact), others as they are."""
    return x.astype(np.float32) if x.dtype.name == "bfloat16" else x


def _ulp(w, bfloat16_moved: bool = False) -> float:
    """jit's tolerance for a bfloat16 leaf beyond float32's: one bfloat16 ulp of its
    largest value (jit and the plan round the same float32 sum once, but the float32
    client work before it may differ in its last bits, which can move the rounding);
    0 for other dtypes, unless `bfloat16_moved` (`BFLOAT16_MOVED`) for a float leaf."""
    moved = bfloat16_moved and w.dtype.kind == "f"
    if (w.dtype.name != "bfloat16" and not moved) or not w.size:
        return 0.0
    top = float(np.max(np.abs(w.astype(np.float32))))
    return float(2.0 ** (np.floor(np.log2(top)) - 7)) if top > 0 else 0.0


def fcp_cells(name: str, result: dict, rounds: list, check, failures: list,
              clients: int = 0, tflite_refusal: str = "") -> list:
    """The FCP forms' cells: each built within FCP's contract, the MRF's plan-shaped run
    against `jax.jit` over the rounds (state after every round, outputs), TensorFlow's
    own tf.Example read back here, and the plain forms' contract breaches caught."""
    from fax_bridge.data.examples import Feature, decode_example, read_records
    from fax_bridge.errors import ExportError
    from fax_bridge.tff import fcp, fcp_run

    fcp_result = result.get("fcp")
    if fcp_result is None:
        return []
    cells = []
    for kind in ("mrf", "daf"):
        try:
            fcp.check_result(kind, fcp_result)
            cells.append(f"fcp-{kind} built")
        except ExportError as e:
            failures.append(name)
            cells.append(f"fcp-{kind} FAILED ({str(e)[:400]})")
    runs = [(kind, fcp_result.get(kind, {})) for kind in ("mrf", "daf")]
    tflite = fcp_result.get("mrf", {}).get("tflite")
    if tflite_refusal:
        cells.append(f"fcp-mrf-tflite refused as expected ({tflite_refusal[:300]})")
    elif name in EXPECTED_TFLITE_REFUSALS:
        failures.append(name)
        cells.append(f"fcp-mrf-tflite NOT REFUSED (expected: "
                     f"{EXPECTED_TFLITE_REFUSALS[name]})")
    if tflite is not None and "error" in tflite:
        failures.append(name)
        cells.append(f"fcp-mrf-tflite FAILED ({tflite['error'][:400]})")
    elif tflite is not None:
        runs.append(("mrf-tflite", tflite))
    for kind, entry in runs:
        if "outputs" not in entry:
            continue

        step = tflite_allowance(name, clients) if kind == "mrf-tflite" else 0.0

        def plan_error(entry=entry, step=step):
            worst = 0.0
            ran = fcp_run.plan_rounds(entry["outputs"], len(rounds))
            for r, ((state, output), (got_state, got_output)) in enumerate(zip(rounds, ran)):
                worst = max(worst, exact_error(state + output, got_state + got_output,
                                               (r + 1) * step))
            return worst
        cells.append(check(name, f"fcp-{kind}-plan-{len(rounds)}-rounds", plan_error))
    if "tf_examples" in fcp_result:
        def tf_written():
            features = [Feature(f["name"], np.dtype(f["dtype"]), tuple(f["shape"]))
                        for f in fcp_result["info"]["features"]]
            (record,) = read_records(fcp_result["tf_examples"]["path"])
            values = decode_example(features, record)
            for f in features:  # counting up from 0, wrapped at an integer's range
                if f.kind == "float":
                    want = np.arange(f.size) / 4
                else:
                    top = 1 if f.dtype == np.bool_ else int(np.iinfo(f.dtype).max)
                    want = np.arange(f.size) % (top + 1) if top < f.size else \
                        np.arange(f.size)
                np.testing.assert_array_equal(values[f.name].ravel(), want.astype(f.dtype))
            return 0.0
        cells.append(check(name, "tf-example-read", tf_written))
    return cells


def plain_breaches(proto) -> dict:
    """What FCP's builder must find wrong in the plain forms of the round `proto`, per
    form: {kind: {what: text its contract line holds}}."""
    from fax_bridge.tff import fcp, forms

    both = {"client data": "sequence<string>"}
    if any(d in fcp.CHECKPOINT_CODES for _, d, _ in fcp.state_leaves(proto)):
        both["state dtype"] = "cannot hold"
    if any(d in fcp.CHECKPOINT_CODES for _, d, _ in fcp.output_leaves(proto)):
        both["state dtype"] = "cannot hold"
    if fcp.aggregation_codes(proto):
        both["client results"] = "FCP's aggregation does not take"
    daf = dict(both, **{"Xla parts": "not TensorFlow"})
    if any("secure" in uri for uri in forms.intrinsic_uris(proto)):
        daf["literal bound"] = "takes a Literal"
    return {"mrf": both, "daf": daf}


def contract_cells(name: str, result: dict, breaches: dict, failures: list) -> list:
    """FCP's contract shown failing: each plain form breaks it exactly where expected
    (`plain_breaches`), every line of the contract's answer one of those."""
    cells = []
    for kind, want in breaches.items():
        caught = result.get(kind, {}).get("fcp_contract")
        if caught is None:
            continue
        missed = [what for what, text in want.items() if not any(text in c for c in caught)]
        extra = [c for c in caught if not any(text in c for text in want.values())]
        if missed or extra:
            failures.append(name)
            cells.append(f"plain-{kind} contract MISSED {missed} / UNEXPECTED {extra}")
        else:
            cells.append(f"plain-{kind} breaks {len(want)}")
    return cells


def write_inputs(path: str, args, clients: int) -> tuple[list, list]:
    """The MRF runner's npz: flat state leaves and each client's flat data leaves."""
    state = _flat(args[0])
    client_leaves = _flat(tuple(args[1:]))
    z = {"num_state": len(state), "num_client_leaves": len(client_leaves),
         "num_clients": clients}
    z.update({f"state.{i}": v for i, v in enumerate(state)})
    for j in range(clients):
        z.update({f"client.{j}.{i}": v[j] for i, v in enumerate(client_leaves)})
    np.savez(path, **z)
    return state, client_leaves


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--out", default=str(REPO / "out" / "forms"))
    parser.add_argument("--timeout", type=float, default=300.0)
    parser.add_argument("--only", nargs="+", metavar="NAME", help="check only these rounds")
    parser.add_argument("--fcp", choices=("some", "all", "none"), default="some",
                        help="which rounds also get the Federated Compute forms and their "
                             "plan-shaped runs: some (FCP_CHECKED, the default), all, none")
    args = parser.parse_args(argv)

    import jax

    import fax_bridge as fb
    from fax_bridge.errors import ExportError
    from fax_bridge.runtime.interpreter import evaluate
    from fax_bridge.tff import fcp, forms
    from fax_bridge.tff.side_env import SideEnvError

    t0 = time.perf_counter()
    rows, jobs, expected, inputs, failures = [], [], {}, {}, []
    t_fcp_prepare, breaches, tflite_refusals = 0.0, {}, {}
    chosen = targets(args.clients)
    unknown = sorted(set(args.only or ()) - set(chosen))
    if unknown:
        print(f"forms_check: no round named {unknown}; the rounds are {sorted(chosen)}",
              file=sys.stderr)
        return 2
    for name, (prog, prog_args, placements) in chosen.items():
        if args.only and name not in args.only:
            continue
        try:
            proto, _ = forms.round_proto(prog, *prog_args, placements=placements)
        except ExportError as e:
            reason = EXPECTED_REFUSALS.get(name)
            ok = reason is not None and reason in str(e)
            rows.append((name, "refused" if ok else "UNEXPECTED REFUSAL", str(e)))
            if not ok:
                failures.append(name)
            continue
        if name in EXPECTED_REFUSALS:
            rows.append((name, "NOT REFUSED", f"expected: {EXPECTED_REFUSALS[name]}"))
            failures.append(name)
            continue
        folder = os.path.join(args.out, name)
        os.makedirs(folder, exist_ok=True)
        in_path = os.path.join(folder, "inputs.npz")
        write_inputs(in_path, prog_args, args.clients)
        job = forms.job(name, proto, ["daf", "mrf"], folder, in_path)
        breaches[name] = plain_breaches(proto)
        clients_tree = prog_args[1] if len(prog_args) == 2 else tuple(prog_args[1:])
        try:
            if args.fcp == "none" or (args.fcp == "some" and name not in FCP_CHECKED):
                raise _NoFcp
            t_fcp0 = time.perf_counter()
            run = fcp.make_run(proto, prog_args[0], clients_tree, args.clients, folder,
                               FCP_ROUNDS)
            try:
                fcp.with_fcp(job, proto, ["mrf", "daf"], run,
                             os.path.join(folder, "tf_written.tfrecord"), tflite=True)
            except ExportError as e:
                reason = EXPECTED_TFLITE_REFUSALS.get(name)
                if reason is None or reason not in str(e):
                    raise
                tflite_refusals[name] = str(e)
                fcp.with_fcp(job, proto, ["mrf", "daf"], run,
                             os.path.join(folder, "tf_written.tfrecord"), lower_client=False)
            t_fcp_prepare += time.perf_counter() - t_fcp0
        except _NoFcp:
            pass
        except ExportError as e:
            rows.append((name, "NO FCP", str(e)))
            failures.append(name)
        jobs.append(job)
        expected[name] = (prog, prog_args)
        clients_tree = prog_args[1] if len(prog_args) == 2 else tuple(prog_args[1:])
        members = [jax.tree_util.tree_map(lambda a, j=j: np.asarray(a)[j], clients_tree)
                   for j in range(args.clients)]
        inputs[name] = (prog_args[0], clients_tree, members)
    t_export = time.perf_counter() - t0
    # TFF builds the forms in its own process while jax.jit computes the references here.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        building = pool.submit(forms.build_forms, jobs, args.out, args.timeout)
        with_fcp = {job["name"] for job in jobs if "fcp" in job}
        rounds = {name: jit_rounds(prog, prog_args, FCP_ROUNDS if name in with_fcp else 1)
                  for name, (prog, prog_args) in expected.items()}
        expected = {name: r[0][0] + r[0][1] for name, r in rounds.items()}
        try:
            built = building.result()
        except SideEnvError as e:
            print(f"forms_check: {e}", file=sys.stderr)
            return 2
    t_tff = time.perf_counter() - t0 - t_export

    def check(name: str, what: str, fn) -> str:
        try:
            return f"{what} {fn():.1e}"
        except Exception as e:  # reported per round, the check goes on
            failures.append(name)
            return f"{what} FAILED ({type(e).__name__}: {str(e)[:300]})"

    daf_forms = {}
    for job in jobs:
        name = job["name"]
        result, want = built[name], expected[name]
        state, clients_tree, members = inputs[name]
        cells = []
        try:
            daf = forms.form_from_result("daf", result["daf"])
            daf_forms[name] = daf
            cells.append(check(name, "daf-runtime", lambda: max_error(
                want, [x for v in forms.run_daf(daf, state, members) for x in _struct_flat(v)])))
            cells.append(check(name, "daf-rederived", lambda: max_error(want, [
                x for v in evaluate(daf.round, [state, members]) for x in _struct_flat(v)])))
        except ExportError as e:
            failures.append(name)
            cells.append(f"daf FAILED ({e})")
        mrf = result["mrf"]
        if "error" in mrf or not mrf.get("same_type"):
            failures.append(name)
            cells.append(f"mrf FAILED ({mrf.get('error') or mrf.get('round_type')})")
        else:
            def mrf_error(mrf=mrf, want=want):
                with np.load(mrf["outputs"]) as z:
                    n_state = sum(1 for k in z.files if k.startswith("state."))
                    got = [z[f"state.{i}"] for i in range(n_state)] + [
                        z[f"output.{i}"] for i in range(len(z.files) - n_state)]
                return max_error(want, got, bfloat16_moved=name in BFLOAT16_MOVED)
            cells.append(check(name, "mrf-tf", mrf_error))
        cells += fcp_cells(name, result, rounds[name], check, failures, args.clients,
                           tflite_refusals.get(name, ""))
        cells += contract_cells(name, result, breaches[name], failures)
        rows.append((name, "forms", "  ".join(cells)))
    t_fleet0 = time.perf_counter()
    if daf_forms:
        with fb.LocalFleet(devices=args.devices) as fleet:
            for name, daf in daf_forms.items():
                state, _, members = inputs[name]
                cell = check(name, "daf-fleet", lambda: max_error(expected[name], [
                    x for v in forms.run_daf(daf, state, members, backend=fleet.backend)
                    for x in _struct_flat(v)]))
                rows = [(n, k, f"{d}  {cell}" if n == name else d) for n, k, d in rows]
    t_fleet = time.perf_counter() - t_fleet0
    width = max(len(r[0]) for r in rows)
    for name, kind, detail in rows:
        print(f"{name.ljust(width)}  {kind:8s}  {detail}")
    print(f"\n{len(jobs)} rounds built as DAF and MRF by TFF 0.87, "
          f"{len(rows) - len(jobs)} refused; export {t_export:.1f} s, TFF side and "
          f"jax.jit references {t_tff:.1f} s, fleet {t_fleet:.1f} s")
    sides = [built[j["name"]].get("fcp", {}) for j in jobs]
    if any(sides):
        wrap = sum(f.get("wrap_seconds", 0.0) for f in sides)
        build = sum(f.get(k, {}).get("seconds", 0.0) for f in sides for k in ("mrf", "daf"))
        plan = sum(f.get(k, {}).get("run_seconds", 0.0) for f in sides for k in ("mrf", "daf"))
        print(f"FCP forms: population and state written {t_fcp_prepare:.1f} s; in the TFF "
              f"process: FCP rounds wrapped {wrap:.1f} s, MRF and DAF built {build:.1f} s, "
              f"plan-shaped runs ({FCP_ROUNDS} rounds each) {plan:.1f} s")
    if failures:
        print(f"forms_check: FAILED for {sorted(set(failures))}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
