"""A Flower run's result read back by name, and compared with jit.

A run's ServerApp leaves `reports.jsonl` and `result.npz` (dotted keys, as `fax-bridge
run` writes them) in its out-dir, `APP/results` unless the run config names another.
`load_result(folder)` gives that result as the round's pytree: `folder` is the app (its
`results` folder is read) or the out-dir (the app is the folder above it, or `app=`).
The pytree has the structure `jax.jit(program)` gives the round's result: `fax-bridge
flower` (`bundle.build_round`) records the program's output treedef in the app's
`round.json`, and `load_result` rebuilds the result with it (`result_structure.
with_structure`). Dicts, lists, tuples and None come back exactly; a NamedTuple,
dataclass or other registered node comes back as its class where the calling process
has already imported the class's module (nothing is imported for the file), else as a
tuple of its children in jax's order (`result_structure.structure_from_json`); `structure=`
(e.g. `jax.tree.structure(jax.eval_shape(program, *args))`) supplies the treedef instead.
An app written before `round.json` recorded the structure gives the generic structure
of the round's result type: dicts where every element is named, tuples otherwise
(`npz_keys.result_from_npz`).
Only a run that finished is read: every round reported, none failed
(`parity.flower.run_outcome`).

`compare_with_jit(app, program, *args)` is `check_parity(..., flower=...)` for a
deployment started by hand: the ParityReport of that run's result against as many
rounds of `jax.jit(program)` from `args` (`parity.flower.parity_of_run`), the structure
`load_result` gives against jit's (a "result structure" MISMATCH row where they
differ), with whether
it has the bits of the fleet's round plan run in process by the nodes' client runtime
(each round report's `served`). The app must be the round `program` builds from
`args`; another is refused by name.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from fax_bridge.errors import ArgumentError
from fax_bridge.parity.report import ParityReport


def _locate(folder: str, app: Optional[str]) -> tuple:
    """(the app's round folder, the run's out-dir) for `load_result`'s arguments."""
    from fax_bridge.flower import app_dir, bundle

    def round_folder(path: str) -> Optional[str]:
        package = os.path.join(path, app_dir.PACKAGE)
        # anything there is the app's round file, which `read_round` refuses by name if
        # it is not a regular file
        return package if os.path.lexists(os.path.join(package, bundle.FILE_NAME)) \
            else None

    folder = os.path.abspath(os.fspath(folder))
    if app is not None:
        package = round_folder(os.path.abspath(os.fspath(app)))
        if package is None:
            raise ArgumentError(f"app={app!r} holds no {app_dir.PACKAGE}/{bundle.FILE_NAME}"
                                "; give the folder `fax-bridge flower -o` wrote")
        return package, folder
    package = round_folder(folder)
    if package is not None:
        return package, os.path.join(folder, "results")
    package = round_folder(os.path.dirname(folder))
    if package is not None:
        return package, folder
    raise ArgumentError(
        f"{folder} is neither a Flower app `fax-bridge flower` wrote nor the out-dir of "
        "one of its runs inside it; for an out-dir elsewhere give the app too: "
        "load_result(out_dir, app=APP)")


def _finished(out: str) -> tuple:
    """(result.npz path, the run's round reports) of the finished run in `out`."""
    from fax_bridge.parity.flower import read_reports, run_outcome

    reports = read_reports(out)
    return run_outcome(out, max(1, len(reports))), reports


def load_result(folder: str, app: Optional[str] = None, structure: Any = None) -> Any:
    """The last round's result of the Flower run whose out-dir is `folder`, or whose
    app is `folder` (its `results` out-dir), as the round's pytree (module docstring).

    Args:
      folder: the app `fax-bridge flower -o` wrote, or a run's out-dir.
      app: the app, for an out-dir outside it.
      structure: the jax treedef of the program's output, instead of the one the app
        recorded.

    Returns:
      The result as a pytree of numpy arrays with the program's output structure, e.g.
      `(state, metrics)` for a round returning a pair. FleetError where the run failed
      or has not finished; ComputationError where result.npz does not fit the app's
      round or `structure` has another number of leaves.
    """
    from fax_bridge.flower import bundle
    from fax_bridge.runtime import npz_keys, result_structure

    package, out = _locate(folder, app)
    path, _ = _finished(out)
    made = bundle.read_round(package)
    arrays = npz_keys.read_npz(path, what="the run's result.npz")
    generic = npz_keys.result_from_npz(arrays, made.prepared.result)
    treedef = result_structure.checked_structure(structure) or made.result_structure
    return generic if treedef is None else result_structure.with_structure(generic,
                                                                           treedef)


def compare_with_jit(app: str, program, *args, out_dir: Optional[str] = None,
                     placements: Any = None, rtol: Optional[float] = None,
                     atol: Optional[float] = None) -> ParityReport:
    """The ParityReport of the Flower run of `app` (module docstring) against jit.

    Args:
      app: the app `fax-bridge flower -o` wrote for `program` and `args`.
      program: the round `(state, client_data) -> (new_state, output)`.
      *args: its (state, client data), the run's first state and every client.
      out_dir: the run's out-dir (default `app/results`).
      placements: the program's placements, as the app was written with them.
      rtol, atol: fixed tolerances of each leaf against jit instead of the rounding
        bound (`parity.flower.parity_of_run`).
    """
    import jax

    from fax_bridge.flower import bundle
    from fax_bridge.parity.flower import parity_of_run
    from fax_bridge.rounds import checkpoint
    from fax_bridge.rounds import client_runtime as runtimes

    if len(args) != 2:
        raise ArgumentError(f"a Flower round takes (state, client_data), here {len(args)} "
                            "arguments")
    package, out = _locate(app if out_dir is None else out_dir,
                           None if out_dir is None else app)
    ran = bundle.read_round(package)
    made = bundle.build_round(program, *args, placements=placements)
    if checkpoint.program_fingerprint(made.proto) != \
            checkpoint.program_fingerprint(ran.proto):
        raise ArgumentError(f"the app in {os.path.dirname(package)} runs {ran.prepared.type}"
                            f", not the round {program!r} builds from these arguments "
                            f"({made.prepared.type}); compare with the program and "
                            "arguments the app was written from")
    path, reports = _finished(out)
    names = {str(s.get("client_runtime")) for r in reports
             for s in (r.get("served") or {}).values() if isinstance(s, dict)}
    runtime = runtimes.resolve("litert", bundle.models_dir(package)) \
        if names == {"litert"} else "xla"
    walls = [r.get("wall_s", 0.0) for r in reports]
    seconds = sum(w for w in walls if isinstance(w, (int, float)))
    loaded = load_result(out, app=os.path.dirname(package))
    return parity_of_run(program, args, made, path, len(reports),
                         int(reports[-1].get("devices") or 0), seconds, rtol, atol,
                         client_runtime=runtime,
                         read_as=jax.tree_util.tree_structure(loaded))
