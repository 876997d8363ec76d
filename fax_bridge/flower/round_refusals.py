"""Rounds a Flower app cannot run, refused by name before anything is written.

`refuse_arity(fn, args)` refuses a program of other than two arguments (an algorithm's
`next(state, data, mask)`), naming its parameters and the round of two arguments that
wraps it (its CLIENTS arguments folded into the client data, its other SERVER arguments
into the state, which carries them to the next round). `refuse_phased(fn, args)`
refuses a round that asks its clients more than once or keeps state at them, naming
the trips, what each client keeps between them, the CLIENTS state, why a SuperNode
cannot hold them (a Flower round here is one message per node, and Flower keeps a
node's `context.state` in its memory alone) and the fleet or in-process run to use
instead (`ELSEWHERE`). `flower.bundle.build_round` calls both.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from fax_bridge.errors import ExportError
from fax_bridge.rounds import round_split


def refuse_arity(fn: Callable, args: tuple, placements: Any = None) -> None:
    """Raises `ExportError` where `args` are not the two arguments `(state,
    client_data)` of a Flower round, naming the program's parameters, their placements
    and the round of two arguments that wraps it; returns otherwise."""
    if len(args) == 2:
        return
    from fax_bridge.tff import export

    names = [n or f"arg{i}" for i, n in enumerate(export.argument_names(fn, len(args)))]
    if isinstance(placements, (list, tuple)) and len(placements) == len(args):
        where = [str(getattr(p, "name", p)).upper() for p in placements]
        shown = ", ".join(f"{n}@{w}" for n, w in zip(names, where))
    else:
        where, shown = [], ", ".join(names)
    extra = names[1:]
    clients = [n for n, w in zip(names[1:], where[1:]) if w == "CLIENTS"] or extra
    others = [n for n in extra if n not in clients]
    name = _program_name(fn)
    head = (f"a Flower app runs rounds (state, client_data) -> (new_state, output): two "
            f"arguments, the server state and the clients' data; {name} takes "
            f"{len(args)} ({shown or 'none'})")
    if len(args) < 2:
        raise ExportError(head + "; give it the clients' data as its second argument, "
                          "placed at CLIENTS")
    values = dict(zip(names, args))
    raise ExportError(head + ". " + _wrapper_text(names, clients, others, name,
                                                  {n: values[n] for n in clients}))


def _keys(clients: dict) -> dict:
    """{CLIENTS argument: [(client_data key, the argument's own key or None)]}: a
    dict argument of arrays gives one key per entry (led by the argument's name where
    two arguments share an entry's name), an array its own name: client_data is the
    flat dict of arrays a SuperNode's population stores."""
    counts: dict = {}
    for value in clients.values():
        for k in (value if isinstance(value, dict) else ()):
            counts[str(k)] = counts.get(str(k), 0) + 1
    out = {}
    for arg, value in clients.items():
        if isinstance(value, dict) and value and all(hasattr(v, "shape")
                                                     for v in value.values()):
            out[arg] = [(str(k) if counts[str(k)] == 1 and str(k) not in clients
                         else f"{arg}_{k}", k) for k in value]
        else:
            out[arg] = [(arg, None)]
    return out


def _wrapper_text(names: list, clients: list, others: list, name: str,
                  values: Optional[dict] = None) -> str:
    """`refuse_arity`'s advice: a round of two arguments that calls the program named
    `name` (parameters `names`, the first its state), its CLIENTS arguments `clients`
    folded into client_data, one flat dict of arrays (a dict argument's entries become
    keys of their own), and its other SERVER arguments `others` into the state (carried
    unchanged from round to round), with the example arguments it takes."""
    state = names[0]
    keys = _keys({n: (values or {}).get(n) for n in clients})
    unpack = "\n".join(
        f"        {arg} = client_data[{pairs[0][0]!r}]" if pairs[0][1] is None else
        f"        {arg} = {{" + ", ".join(f"{k!r}: client_data[{key!r}]"
                                          for key, k in pairs) + "}"
        for arg, pairs in keys.items())
    example = "{" + ", ".join(
        f"{key!r}: {arg}" if k is None else f"{key!r}: {arg}[{k!r}]"
        for arg, pairs in keys.items() for key, k in pairs) + "}"
    call = f"program({', '.join(names)})"
    text = ("Wrap it in a round of two arguments whose client_data is one dict of arrays "
            f"holding its CLIENTS arguments ({', '.join(clients)})")
    if not others:
        return (text + f", e.g.\n    def flower_round({state}, client_data):\n"
                f"{unpack}\n        return {call}\nwith program = "
                f"{name}, example arguments ({state}, {example}) and placements "
                "(\"server\", \"clients\")")
    carried = next(c for c in ("server_state", "carried", "folded") if c not in names)
    new = next(c for c in (f"new_{state}", "new_state", "updated") if c not in names)
    folded = ", ".join([state, *others])
    kept = ", ".join(others)
    return (text + f" and whose state holds its SERVER arguments ({folded}): the "
            f"round returns {kept} beside the program's new {state}, so the next round "
            "gets them unchanged, e.g.\n"
            f"    def flower_round({carried}, client_data):\n"
            f"        {folded} = {carried}\n"
            f"{unpack}\n"
            f"        {new}, output = {call}\n"
            f"        return ({new}, {kept}), output\n"
            f"with program = {name}, example arguments (({folded}), {example}) and "
            "placements (\"server\", \"clients\")")


ELSEWHERE = (
    "Run it where each trip's client computation runs phase by phase (one LiteRT model "
    "per trip under client_runtime=\"litert\") and the clients' values stay on the "
    "devices that hold the clients: the gRPC fleet (`fax_bridge.LocalFleet(devices=N, "
    "client_runtime=\"xla\" or \"litert\")`, or `fax-bridge parity TARGET --devices N "
    "[--litert]`), or in process (`fax_bridge.in_process.run_computation(..., "
    "client_runtime=\"litert\")`)")


def _program_name(fn: Callable) -> str:
    """A round program's qualified name, led by the algorithm that made it
    (`fed_sgd.next_fn` for `fed_sgd.<locals>.next_fn`)."""
    fn = getattr(fn, "fn", fn)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    return name.replace(".<locals>.", ".")


def _takes(fn: Callable, count: int) -> bool:
    """Whether `fn` can be called with `count` positional arguments (True where its
    signature cannot be read: tracing then says)."""
    import inspect

    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def refuse_phased(fn: Callable, args: tuple, placements: Any = None,
                  clients: Optional[int] = None) -> None:
    """Raises `ExportError` naming why the round of `fn` cannot run on Flower when it
    asks its clients more than once or keeps state at them (the trips and what each
    client keeps between them, the CLIENTS state, why a SuperNode cannot hold it, and
    where the round runs instead); returns for any other round."""
    from fax_bridge.language import tracing
    from fax_bridge.tff import export, forms

    if not _takes(fn, len(args)):  # nothing to trace: the caller's arity refusal names it
        return
    comp = tracing.trace(fn, *args, placements=placements, clients=clients)
    state_in, state_out = forms.client_state(comp)
    lines = forms.second_trips(comp)
    if not (state_in or state_out or lines):
        return
    proto = export.export_computation(comp, export.argument_names(fn, len(args)))
    maps = [m for m in round_split.client_maps(proto) if m.computes]
    why = []
    if lines or len(maps) > 1:
        trips = max((m.trip for m in maps), default=2)
        kept = [f"trip {m.trip}'s client computation ({m.local}) reads what each client "
                f"computed in trip {', '.join(map(str, m.kept_from))}"
                for m in maps if m.kept_from]
        why.append(
            f"its round asks the clients {trips} times ({'; '.join(lines[:3])}"
            f"{'; ...' if len(lines) > 3 else ''})" + (f", and {'; '.join(kept)}" if kept
                                                       else "") +
            ". A Flower round of this app is one `train` message to each SuperNode (one "
            "broadcast, one client part, its partials), and a SuperNode starts a new "
            "ClientApp process for every message: values a client keeps from one trip to "
            "the next could wait only in the node's `context.state`, which Flower holds "
            "in the SuperNode's memory alone, so this app carries no round over several "
            "messages")
    if state_in or state_out:
        named = ", ".join((state_in or state_out)[:4])
        more = len(state_in or state_out) - 4
        why.append(
            f"its round keeps state at the clients from round to round ({named}"
            f"{f' and {more} more' if more > 0 else ''} placed at CLIENTS, argument and "
            "result): each client's own values, computed from its private data. Returned "
            "as the round's result they would leave the SuperNode unaggregated, which a "
            "node of this app never does (only exact partials of aggregations leave it); "
            "kept at the node they would live in `context.state`, which Flower holds in "
            "the SuperNode's memory for one run only (gone when the node restarts, never "
            "in the run's result or checkpoint), so the round's result, which includes "
            "them, could be neither returned nor resumed")
    raise ExportError(
        f"the round {_program_name(fn)} cannot run on Flower: " + "; and ".join(why) + ". "
        + ELSEWHERE + (". Or use a one-trip variant where there is one "
                       "(fax_bridge.algorithms.fed_sgd_one_trip, "
                       "learned_server_lr_one_trip), which a Flower app runs written as "
                       "a round (state, client_data)"
                       if lines and not (state_in or state_out) else "") + ".")
