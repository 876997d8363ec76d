"""How `jax.jit` runs a program's client work: the chunk size a program declares.

`clients_per_step` is an execution choice, not part of what a program computes: tracing
for export runs inside `unchunked()`, so a program exports alike whatever it declares.
`fax_bridge.local.chunking` runs the chunks.

Whether a program runs whole is a jax user context (`jax.make_user_context`), part of
the key of jax's tracing, lowering and compilation caches: a program object traced whole
for export and the same object under `jax.jit` are two cache entries, so neither sees the
other's trace (a context variable of our own would not be in that key: the first trace of
an object would then stand for both).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Union

import jax

from fax_bridge.errors import ProgramError

ClientsPerStep = Union[int, str, None]

_UNCHUNKED = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def unchunked() -> Iterator[None]:
    """Within this context programs run (and trace) whole, whatever `clients_per_step`
    they declare: tracing for export uses it, so every chunk size exports alike. jit's
    caches key on it, so what is traced here is never what jit runs outside it."""
    with _UNCHUNKED(True):
        yield


def is_unchunked() -> bool:
    """True inside `unchunked()`."""
    return bool(_UNCHUNKED.value)


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


