"""Runtime and fleet at large model sizes: one FedAvg round of a linear model, timed.

The round: a linear model `w: float32[d, d]` is broadcast to 10 clients, each takes one
SGD step on its 8 examples (`x, y: float32[8, d]`, squared error), and the server gets
`federated_weighted_mean` of the client models by their example counts. For each model
size (d*d parameters, d = round(sqrt(params))) it times, each path in a fresh process
(so peak memory is that path's own):

- jit: the program under `jax.jit`;
- runtime: the exported proto on `runtime.run_computation` (the in-process backend);
- fleet: the exported proto on `LocalFleet(devices=K)` (a round by plan), with the
  round report's bytes up and down per parameter (gRPC messages and the payload that
  went through shared memory together, and the shared-memory part of them apart);
- fleet-grpc: the same fleet with `shared_memory=False`, every payload over gRPC (what
  remote devices get), for comparison (not run unless named in `--paths`).

With `--model mlp` the round is instead `benchmarks/model_parallel.py`'s: a two-layer MLP
(`w1: [width, 3 width]`, `b1`, `w2: [3 width, width]`, `b2`; `mlp_width` picks the
width, so `--params 100M` gives its 100.7M-parameter default, width 4096), 8 clients, one SGD step each on 4 examples, `federated_mean`, on one host
device (no model sharding: the exported round runs whole on each path).

Times are medians over the rounds after a warm-up round: wall seconds, and CPU seconds
(user + system, all threads; for the fleet the coordinator's and the devices' together,
which says what a round costs when other work shares the machine); peak RSS is `VmHWM`
of the process (and of each device process). With `--profile DIR`, the runtime's and the
coordinator's rounds run under cProfile, and each device's round handler too (the
devices start through this script as a shim); the `.prof` files land in DIR.

    PYTHONPATH=$PWD python benchmarks/fleet_sizes.py [--params 100k,1M,4M,10M]
        [--rounds 3] [--devices 2] [--paths jit,runtime,fleet] [--init normal|zeros]
        [--model linear|mlp] [--json OUT] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CLIENTS, EXAMPLES, LR = 10, 8, 0.1
PROFILE_ENV = "FAX_BRIDGE_SIZES_PROFILE_DIR"


def parse_count(text: str) -> int:
    """'100k' -> 100000, '4M' -> 4000000, '2500' -> 2500."""
    text = text.strip()
    scale = {"k": 10**3, "K": 10**3, "M": 10**6, "m": 10**6}.get(text[-1:], 1)
    return int(float(text[:-1] if scale != 1 else text) * scale)


def peak_rss_mb(pid: str = "self") -> float:
    """The process's peak resident set (VmHWM) in MB, or NaN where /proc lacks it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def build(d: int, init: str = "normal"):
    """(the round as a fax_bridge program, its arguments: w, x, y, counts); `init`:
    the model's start, "normal" (scaled by 1/sqrt(d)) or "zeros" (then the clients'
    models are their own steps alone, whose values spread far more between clients)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    import fax_bridge as fb

    @fb.program(clients=CLIENTS)
    def fedavg_round(w, x, y, n):
        w_at_clients = fb.federated_broadcast(w)

        def local(w, x, y):
            g = jax.grad(lambda w: jnp.mean((x @ w - y) ** 2))(w)
            return w - LR * g

        new_w = fb.federated_map_clients(local, (w_at_clients, x, y))
        return fb.federated_weighted_mean(new_w, n)

    rng = np.random.default_rng(0)
    w = (rng.normal(size=(d, d)) / math.sqrt(d)).astype(np.float32)
    if init == "zeros":
        w = np.zeros_like(w)
    x = rng.normal(size=(CLIENTS, EXAMPLES, d)).astype(np.float32)
    y = rng.normal(size=(CLIENTS, EXAMPLES, d)).astype(np.float32)
    n = np.full((CLIENTS,), EXAMPLES, np.float32)
    return fedavg_round, (w, x, y, n)


PLACEMENTS = ("server", "clients", "clients", "clients")
MLP_BATCH = 4


def mlp_width(params: int) -> int:
    """The MLP width whose parameters (6 width^2 + 4 width) come nearest `params`, a
    multiple of 64 from 64 up (100M: 4096, model_parallel.py's default)."""
    width = math.sqrt(params / 6)
    return max(1, round(width / 64) * 64 if width >= 64 else round(width))


def build_mlp(params: int):
    """(model_parallel's FedAvg round of a two-layer MLP, its arguments p, x, y, its
    placements, its parameter count, its width) at `mlp_width(params)`."""
    import numpy as np

    os.environ.setdefault("XLA_FLAGS", "")  # one host device, as for the linear model
    sys.path.insert(0, HERE)
    import model_parallel as mp  # noqa: E402  (a sibling script)

    width = mlp_width(params)
    shapes = mp.shapes(width, 3 * width)
    rng = np.random.default_rng(0)
    p = {k: (rng.normal(size=s) / math.sqrt(s[0])).astype(np.float32)
         for k, s in shapes.items()}
    x, y = (rng.normal(size=(mp.CLIENTS, MLP_BATCH, width)).astype(np.float32)
            for _ in range(2))
    count = sum(math.prod(s) for s in shapes.values())
    return mp.fax_round, (p, x, y), ("server", "clients", "clients"), count, width


def cpu_seconds(pids: tuple = ()) -> float:
    """CPU time (user + system, every thread) of this process and of `pids`, in s."""
    total = time.process_time()
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


def _times(fn, rounds: int, profile_path: Optional[str] = None,
           pids: tuple = ()) -> tuple[list, list]:
    """(wall seconds, CPU seconds of this process and `pids`) of each of `rounds` calls
    after a warm-up call (which compiles and loads the client part); with
    `profile_path`, cProfile stats of the timed calls go there."""
    fn()
    profile = None
    if profile_path is not None:
        import cProfile

        profile = cProfile.Profile()
    walls, cpus = [], []
    for _ in range(rounds):
        cpu = cpu_seconds(pids)
        start = time.perf_counter()
        if profile is not None:
            profile.runcall(fn)
        else:
            fn()
        walls.append(time.perf_counter() - start)
        cpus.append(cpu_seconds(pids) - cpu)
    if profile is not None:
        profile.dump_stats(profile_path)
    return walls, cpus


def measure(path: str, params: int, rounds: int, devices: int,
            profile_dir: Optional[str], init: str = "normal", model: str = "linear") -> dict:
    """One path at one size, in this process."""
    sys.path.insert(0, ROOT)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    import numpy as np

    import fax_bridge as fb
    from fax_bridge.runtime import run_computation

    if model == "mlp":
        program, args, placements, count, d = build_mlp(params)
    else:
        d = max(1, round(math.sqrt(params)))
        program, args = build(d, init)
        placements, count = PLACEMENTS, d * d
    row: dict = {"path": path, "params": count, "d": d, "payload_mb": count * 4 / 1e6,
                 "init": init, "model": model}
    prof = (os.path.join(profile_dir, f"{path}_{count}.prof")
            if profile_dir and path != "jit" else None)
    if path == "jit":
        jitted = jax.jit(program)
        times, cpus = _times(lambda: jax.block_until_ready(jitted(*args)), rounds)
    else:
        proto = fb.export_tff(program, *args, placements=placements)
        if path == "runtime":
            times, cpus = _times(lambda: run_computation(proto, *args), rounds, prof)
        else:
            # A warm-up round of a large model (compiling, paging in) outlasts the
            # default deadline on a loaded machine.
            kwargs = {"rpc_timeout_s": 600.0}
            if profile_dir:
                os.environ[PROFILE_ENV] = profile_dir
                sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
                from round_profile import shim_script  # noqa: E402  (a sibling script)
                kwargs["python"] = shim_script(profile_dir, __file__)
            kwargs["shared_memory"] = path != "fleet-grpc"
            with fb.LocalFleet(devices=devices, **kwargs) as fleet:
                times, cpus = _times(lambda: fleet.run(proto, *args), rounds, prof,
                                     tuple(fleet.pids))
                rep = fleet.last_report
                # Bytes moved: gRPC messages plus the payload shared memory carried.
                up, down = rep.bytes_up + rep.shared_up, rep.bytes_down + rep.shared_down
                row.update(bytes_up=rep.bytes_up, bytes_down=rep.bytes_down,
                           payload_up=rep.payload_up, payload_down=rep.payload_down,
                           shared_up=rep.shared_up, shared_down=rep.shared_down,
                           up_bytes_per_param_per_device=up / devices / count,
                           down_bytes_per_param_per_device=down / devices / count,
                           shared_share_up=rep.shared_up / up if up else 0.0,
                           device_peak_rss_mb=[round(peak_rss_mb(str(p)), 1)
                                               for p in fleet.pids])
    row.update(seconds=statistics.median(times), all_seconds=[round(t, 4) for t in times],
               cpu_seconds=statistics.median(cpus),
               peak_rss_mb=round(peak_rss_mb(), 1),
               devices=devices if path.startswith("fleet") else 0)
    del np
    return row


def _device_shim(argv: list) -> None:
    """Runs `python -m fax_bridge.fleet.device_cli ...` with each round handler after the
first (the warm-up) profiled."""
    import cProfile
    import runpy

    from fax_bridge.fleet import device_round

    original = device_round.run_round
    profile = cProfile.Profile()
    path = os.path.join(os.environ[PROFILE_ENV], f"device_{os.getpid()}.prof")
    calls = [0]

    def run_round(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 1:  # the warm-up round
            return original(*args, **kwargs)
        profile.enable()
        try:
            return original(*args, **kwargs)
        finally:
            profile.disable()
            profile.dump_stats(path)

    device_round.run_round = run_round
    module = argv[argv.index("-m") + 1]
    sys.argv = [module] + argv[argv.index("-m") + 2:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def _child(path: str, params: int, args) -> dict:
    command = [sys.executable, os.path.abspath(__file__), "--one", path, "--params",
               str(params), "--rounds", str(args.rounds), "--devices", str(args.devices),
               "--init", args.init, "--model", args.model]
    if args.profile:
        command += ["--profile", args.profile]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        sys.stderr.write(done.stderr[-4000:])
        return {"path": path, "params": params, "error": done.stderr.strip()[-300:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def _print(rows: list) -> None:
    by = {}
    for r in rows:
        by.setdefault(r["params"], {})[r["path"]] = r
    grpc = any("fleet-grpc" in paths for paths in by.values())
    print("| params | jit s | runtime s | fleet s | runtime/jit | fleet/jit | CPU s jit / "
          "runtime / fleet | up B/param/dev (shared memory) | down B/param/dev | RSS MB "
          "jit / runtime / coordinator / devices |"
          + (" fleet-grpc s (CPU s) |" if grpc else ""))
    print("|---:|---:|---:|---:|---:|---:|---|---:|---:|---|" + ("---:|" if grpc else ""))
    for params, paths in sorted(by.items()):
        def s(p: str) -> Any:
            return paths.get(p, {}).get("seconds")

        def ratio(p: str) -> str:
            return f"{s(p) / s('jit'):.1f}x" if s(p) and s("jit") else "-"

        fleet = paths.get("fleet", {})
        rss = " / ".join(str(paths.get(p, {}).get("peak_rss_mb", "-"))
                         for p in ("jit", "runtime", "fleet"))
        rss += f" / {fleet.get('device_peak_rss_mb', '-')}"
        fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
        cpu = " / ".join(fmt(paths.get(p, {}).get("cpu_seconds"))
                         for p in ("jit", "runtime", "fleet"))
        print(f"| {params:,} | {fmt(s('jit'))} | {fmt(s('runtime'))} | {fmt(s('fleet'))} "
              f"| {ratio('runtime')} | {ratio('fleet')} | {cpu} "
              f"| {fleet.get('up_bytes_per_param_per_device', float('nan')):.2f} "
              f"({fleet.get('shared_share_up', 0.0):.0%}) "
              f"| {fleet.get('down_bytes_per_param_per_device', float('nan')):.2f} | {rss} |"
              + (f" {fmt(s('fleet-grpc'))} "
                 f"({fmt(paths.get('fleet-grpc', {}).get('cpu_seconds'))}) |" if grpc else ""),
              flush=True)


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--device-shim"]:
        _device_shim(argv[1:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100k,1M,4M,10M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--paths", default="jit,runtime,fleet")
    parser.add_argument("--init", choices=("normal", "zeros"), default="normal",
                        help="the model's start (zeros: clients' models spread widely)")
    parser.add_argument("--model", choices=("linear", "mlp"), default="linear",
                        help="mlp: model_parallel.py's MLP round (--params 100M: 100.7M)")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--profile", help="write cProfile stats of the rounds here")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one path, one size
    args = parser.parse_args(argv)
    if args.profile:
        args.profile = os.path.abspath(args.profile)
        os.makedirs(args.profile, exist_ok=True)
    if args.one:
        print(json.dumps(measure(args.one, parse_count(args.params), args.rounds,
                                 args.devices, args.profile, args.init, args.model)))
        return 0
    rows = []
    workload = (f"{CLIENTS} clients x {EXAMPLES} examples, one SGD step, weighted mean"
                if args.model == "linear" else
                f"MLP, 8 clients x {MLP_BATCH} examples, one SGD step, mean")
    print(f"machine: {os.cpu_count()} cores; {workload}; "
          f"median of {args.rounds} rounds after a warm-up; "
          f"fleet: LocalFleet(devices={args.devices}); init {args.init}; XLA_FLAGS="
          f"{os.environ.get('XLA_FLAGS', '')!r}", flush=True)
    for params in [parse_count(p) for p in args.params.split(",")]:
        for path in args.paths.split(","):
            rows.append(_child(path, params, args))
            r = rows[-1]
            print(f"  {path:8} {r['params']:>10,} params: "
                  + (f"{r['seconds']:.3f} s {r['all_seconds']}, CPU {r['cpu_seconds']:.3f} s"
                     if "seconds" in r else f"error {r['error']}"), flush=True)
    _print([r for r in rows if "seconds" in r])
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cores": os.cpu_count(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
