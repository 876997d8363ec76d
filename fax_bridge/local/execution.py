"""How `jax.jit` runs a program's client work: the chunk size a program declares.

`clients_per_step` is an execution choice, not part of what a program computes: tracing
for export runs inside `unchunked()`, so a program exports alike whatever it declares.
`fax_bridge.local.chunking` runs the chunks.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Any, Iterator, Union

from fax_bridge.errors import ProgramError

ClientsPerStep = Union[int, str, None]

_UNCHUNKED: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "fax_bridge_unchunked", default=False)


@contextlib.contextmanager
def unchunked() -> Iterator[None]:
    """Within this context programs run (and trace) whole, whatever `clients_per_step`
    they declare: tracing for export uses it, so every chunk size exports alike."""
    token = _UNCHUNKED.set(True)
    try:
        yield
    finally:
        _UNCHUNKED.reset(token)


def is_unchunked() -> bool:
    """True inside `unchunked()`."""
    return _UNCHUNKED.get()


def validate(clients_per_step: Any, name: str = "clients") -> ClientsPerStep:
    """`clients_per_step` checked: None, a positive integer, or "auto"."""
    if clients_per_step is None or clients_per_step == "auto":
        return clients_per_step
    if (isinstance(clients_per_step, bool) or not isinstance(clients_per_step, int)
            or clients_per_step < 1):
        raise ProgramError(
            f"clients_per_step must be a positive integer or 'auto', got "
            f"{clients_per_step!r}; e.g. @fax_bridge.program({name}=1024, "
            "clients_per_step=4) runs the clients 4 at a time.")
    return int(clients_per_step)


