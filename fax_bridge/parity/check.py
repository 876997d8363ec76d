"""Parity between the two paths: jit on this machine vs the exported proto on a fleet.

`check_parity(fn, *args, placements=...)` runs the program locally (jit), exports it to
a TFF proto, runs the proto on a `LocalFleet` of device processes (or a fleet you pass,
or, with `flower=`, a round on Flower's Deployment Engine: `parity/flower.py`), and
compares the two results leaf by leaf (`parity.report`). A mismatched float output that
an aggregation's float rounding may explain says so, with the rounding bound and the
tolerance that covers it (`parity.rounding`).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Union

import federated_language
import jax

from fax_bridge.parity import rounding as parity_rounding
from fax_bridge.language import tracing
from fax_bridge.errors import ArgumentError
from fax_bridge.fleet.launcher import LocalFleet
from fax_bridge.parity.bounded import bounded_comparison, bounded_leaves, tolerances
from fax_bridge.parity.report import LeafParity, ParityReport, chunking_of, compare_leaves
from fax_bridge.rounds import client_runtime as runtimes
from fax_bridge.rounds.client_runtime import ClientRuntime
from fax_bridge.runtime import interpreter
from fax_bridge.tff import export as tff_export
from fax_bridge.tff import types as tff_types


def explain_mismatches(leaves: list[LeafParity], comp: Any, args: tuple) -> None:
    """Sets the `explanation` of each mismatched float leaf that float rounding in an
    aggregation over clients may explain (`parity.rounding`)."""
    wrong = [i for i, leaf in enumerate(leaves) if not leaf.ok and not leaf.note
             and parity_rounding.is_float(leaf.dtype)]
    if not wrong or len(leaves) != len(comp.out_avals):
        return
    try:
        roundings, depends, direct = parity_rounding.aggregation_roundings(comp, args)
    except Exception as e:  # noqa: BLE001 - the comparison stands without the analysis
        for i in wrong:
            leaves[i].explanation = f"(no rounding analysis: {type(e).__name__}: {e})"
        return
    for i in wrong:
        leaves[i].explanation = parity_rounding.explain(
            leaves[i].max_abs, roundings, depends[i], direct[i])


def note_chunked_sums(leaves: list[LeafParity], fn: Any, clients: int,
                      args: Optional[tuple] = None) -> None:
    """Adds to each explained mismatch that jit summed the clients in chunks, when `fn`
    is a program run `clients_per_step` at a time (`fax_bridge.local.chunking`): another
    summation order, which the rounding bound covers as it covers any order."""
    how = chunking_of(fn, clients, args)
    if not how:
        return
    for leaf in leaves:
        if leaf.explanation and not leaf.explanation.startswith("(no rounding"):
            leaf.explanation += (f"; jit summed the {clients} clients {how}: a sum of the "
                                 "chunks' sums, in chunk order, where the exported "
                                 "paths sum exactly")


def leaves_in_type_order(tree: Any, type_: federated_language.Type) -> list:
    """Leaves of a runtime result in the depth-first order of its TFF type.

    The runtime returns named structs as dicts, which jax would flatten in sorted-key
    order; the exported type keeps the program's own order (e.g. NamedTuple fields),
    which is the order of the program's flattened outputs.
    """
    if isinstance(type_, federated_language.FederatedType):
        return leaves_in_type_order(tree, type_.member)
    if isinstance(type_, federated_language.StructType):
        out = []
        for i, (name, element) in enumerate(type_.items()):
            child = tree[name] if isinstance(tree, dict) and name else tree[i]
            out.extend(leaves_in_type_order(child, element))
        return out
    return [tree]


def fleet_arguments(args: tuple, parameter: Optional[federated_language.Type]) -> tuple:
    """The program's positional arguments as the runtime's per-element arguments.

    The exporter makes the elements of a program's only argument the parameter's
    elements; NamedTuple fields are matched by name (`values.bind_arguments`).
    """
    if parameter is None:
        return ()
    if len(args) == 1 and isinstance(parameter, federated_language.StructType):
        args = tuple(child for _, child in tff_types.named_children(args[0]))
    return tuple(args)


def check_parity(fn: Callable, *args, placements: Any = None, fleet: Any = None,
                 devices: int = 2, rtol: Optional[float] = None,
                 atol: Optional[float] = None,
                 clients: Optional[int] = None, flower: Any = None,
                 rounds: int = 1,
                 client_runtime: Union[str, ClientRuntime] = "xla",
                 warm_round: bool = False) -> ParityReport:
    """Runs `fn(*args)` with jit and as an exported TFF proto on a fleet; compares them.

    `fleet` is a running `fax_bridge.LocalFleet` (or any object with the same `run`);
    without one, a `LocalFleet(devices=devices)` is started and stopped here.

    `flower=True` runs `fn`, a round `(state, client_data) -> (new_state, output)`, on
    Flower's Deployment Engine instead: a loopback SuperLink and `devices` warm
    SuperNodes, each serving a block of the example clients, started and stopped here;
    `flower=` a running `fax_bridge.flower.deployment.LocalDeployment` uses that one
    (its SuperNodes must serve the clients of `args`). `rounds` rounds are run there and
    under jit, each fed the state the round before returned (Flower only); the report
    also says whether the result has the bits of the fleet's round plan
    (`ParityReport.fleet_bits`, part of `.ok`).

    `client_runtime="litert"` (or a `LiteRTClientRuntime`): the fleet's devices run the
    round's client part as a LiteRT model in the LiteRT interpreter (`fax_bridge.litert`),
    converted before the round; a round with no single client part is refused, naming
    why, as `fax-bridge litert` refuses it.

    What may differ: jit rounds in float32 as it goes (sums over clients among it), the
    fleet sums exactly and its LiteRT clients round with other kernels; each path stays
    within the program's rounding bound of the exact result
    (`parity.rounding.evaluation_bounds`: a float64 shadow's measure of float32's error,
    or the first-order worst case where smaller), so each float leaf may differ from
    jit by twice it, elementwise, which the report states per leaf with the method
    that gave it; integer and bool leaves must be equal. Give `rtol` or `atol` to
    compare with fixed tolerances instead (the other at its default: 1e-5, 1e-6), as
    `numpy.allclose` does, integers among them.

    Args:
      fn: the program.
      *args: its arguments; CLIENTS ones carry a leading clients axis.
      placements: a pytree prefix of placements per argument.
      fleet: a running fleet to use; default a `LocalFleet(devices=devices)`.
      devices: device processes (or Flower SuperNodes) to start when none is given.
      rtol, atol: fixed tolerances of the comparison instead of the rounding bound.
      clients: the number of clients, for a plain function.
      flower: True, or a running `LocalDeployment`, to compare on Flower instead.
      rounds: rounds to run on Flower.
      client_runtime: "xla", "litert" (the LiteRT interpreter, above) or a
        `rounds.client_runtime.ClientRuntime`.
      warm_round: also time a second, warm round on the fleet (the proto runs twice;
        `fax-bridge parity` does); without it `fleet_s` is None.

    Returns:
      A `ParityReport`: `.ok`, and `.table()` with every output's errors. Its times are
      per round (`local_s`: a compiled jit call; `fleet_s`: with `warm_round`, the
      fleet's second round), with compiling and starting apart (`startup_s`, the
      fleet's first round among them).

    Example:
      >>> import jax.numpy as jnp, fax_bridge as fb
      >>> @fb.program(clients=3)
      ... def total(x):
      ...     return fb.federated_sum(x)
      >>> report = fb.check_parity(total, jnp.array([1.0, 2.0, 3.0]), placements="clients",
      ...                          devices=1)
      >>> report.ok, report.devices
      (True, 1)
    """
    runtime = runtimes.resolve(client_runtime)
    if flower is not None and flower is not False:
        if fleet is not None:
            raise ArgumentError("check_parity: give fleet= or flower=, not both")
        if runtime.name != "xla":
            raise ArgumentError(
                f"check_parity: client_runtime={runtime.name!r} with flower=: the "
                "deployment's SuperNodes run XLA here; check LiteRT on a fleet (no "
                "flower=), or start SuperNodes with --client-runtime litert and run the "
                "app written by `fax-bridge flower ... --litert` (docs/litert.md)")
        from fax_bridge.parity import flower as check

        return check.check_round(fn, args, placements=placements, clients=clients,
                                 deployment=None if flower is True else flower,
                                 nodes=devices, rounds=rounds, rtol=rtol, atol=atol)
    theirs = getattr(getattr(fleet, "client_runtime", None), "name", "xla")
    if runtime.name != "xla" and fleet is not None and theirs != runtime.name:
        raise ArgumentError(f"check_parity: client_runtime={runtime.name!r}, but the fleet "
                            f"given runs client parts with {theirs!r}; start it with "
                            f"LocalFleet(..., client_runtime={runtime.name!r})")
    if rounds != 1:
        raise ArgumentError(f"check_parity: rounds={rounds!r} needs flower=; a fleet "
                            "check compares one call of the program")
    comp = tracing.trace(fn, *args, placements=placements, clients=clients)
    jitted = jax.jit(fn)
    startup: dict[str, float] = {}
    start = time.perf_counter()
    jax.block_until_ready(jitted(*args))
    startup["jit's first call (compiling)"] = time.perf_counter() - start
    start = time.perf_counter()
    local = jax.block_until_ready(jitted(*args))
    local_s = time.perf_counter() - start
    proto = tff_export.export_computation(comp, tff_export.argument_names(fn, len(args)))
    fn_type = interpreter.computation_type(proto)
    param = fn_type.parameter if isinstance(fn_type, federated_language.FunctionType) else None
    run_args = fleet_arguments(args, param)

    def run_on(f):
        """The first round's result and, with `warm_round`, a second round's seconds
        (the first, which compiles on the devices, is timed apart)."""
        t0 = time.perf_counter()
        result = f.run(proto, *run_args, num_clients=comp.clients)
        t1 = time.perf_counter()
        startup["the fleet's first round (compiling)"] = t1 - t0
        if not warm_round:
            return result, None
        f.run(proto, *run_args, num_clients=comp.clients)
        return result, time.perf_counter() - t1

    if fleet is None:
        t0 = time.perf_counter()
        with LocalFleet(devices=devices, client_runtime=runtime) as own:
            startup["fleet start"] = time.perf_counter() - t0
            remote, fleet_s = run_on(own)
        used = devices
    else:
        remote, fleet_s = run_on(fleet)
        used = getattr(fleet, "num_devices", devices)
    result_type = fn_type.result if isinstance(fn_type, federated_language.FunctionType) \
        else fn_type
    if jax.tree_util.tree_structure(remote) != jax.tree_util.tree_structure(local):
        remote = leaves_in_type_order(remote, result_type)  # the generic structure
    paths = [p.replace("out", "result", 1) for p in comp.out_paths]
    given = tolerances(rtol, atol)
    if given is None:
        who = ("the fleet's LiteRT clients" if runtime.name == "litert" else
               f"the fleet ({runtime.name} clients, exact sums)")
        leaves, rtol, atol = bounded_comparison(
            comp, args, jax.tree_util.tree_leaves(local),
            jax.tree_util.tree_leaves(remote), paths, who)
    else:
        rtol, atol = given
        leaves = compare_leaves(local, remote, rtol, atol, paths=paths)
        explain_mismatches(leaves, comp, args)
        note_chunked_sums(leaves, fn, comp.clients, args)
    return ParityReport(leaves=leaves, rtol=rtol, atol=atol, devices=used,
                        client_runtime=runtime.name, chunking=chunking_of(fn, comp.clients, args),
                        local_s=local_s, fleet_s=fleet_s, startup_s=startup, signature=str(
                            federated_language.framework.ComputationBuildingBlock.from_proto(
                                proto).type_signature)
                        if hasattr(federated_language, "framework") else comp.signature())
