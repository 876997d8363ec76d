"""How a program's Python arguments name the elements of its exported parameter: the
names of its positional parameters (`argument_names`), and its CLIENTS arguments as one
value named after them (`client_data`), which the FCP forms' features are named by."""

from __future__ import annotations

import collections
import inspect
from typing import Any, Callable, Optional, Sequence


def client_data(args: Sequence[Any], names: Sequence[Optional[str]]) -> Any:
    """A round's CLIENTS arguments as one value whose elements are named after the
    arguments (a namedtuple, in argument order: `<data=<x,y>,mask>`), so its leaves are
    named `data/x`, `mask` (the FCP forms' features); positional where a name is unknown,
    repeated or cannot name a field. (One client argument is the client data itself.)"""
    try:
        return collections.namedtuple("ClientData", names)(*args)
    except (TypeError, ValueError):  # None, `_x`, a keyword, a repeated name
        return tuple(args)


def argument_names(fn: Callable, count: int) -> list[Optional[str]]:
    """The Python names of `fn`'s first `count` positional parameters (None if unknown);
    they name the elements of the exported parameter struct."""
    target = getattr(fn, "fn", fn)
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return [None] * count
    names = [p.name for p in params
             if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)][:count]
    return names + [None] * (count - len(names))
