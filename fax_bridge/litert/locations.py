"""Where in the user's code an MLIR operation of a client part was written.

jax and XLA keep each operation's Python stack as its MLIR location (`callsite`s of
`"function"("file":line:column)` frames); an operation inside a private function (a
`jit`, a loop body) may carry only its name, and takes the lines of the calls reaching
it. `user_frame` picks the innermost frame outside jax, numpy and fax_bridge; `lines`
follows the calls.
"""

from __future__ import annotations

import pathlib
import re
from typing import Optional

import jax
import numpy as np

from fax_bridge.litert.side_rewrites import walk

# a frame `"name"("file":line:col)`; the MLIR of jax 0.12 prints its column range as
# well (`"file":line:col to :endcol`, or `to endline:endcol`)
_FRAME = re.compile(r'"([^"]*)"\("([^"]+)":(\d+):\d+(?: to (?:\d+)?:\d+)?\)')
_LIBRARY_DIRS = tuple(str(pathlib.Path(m.__file__).resolve().parent) + "/"
                      for m in (jax, np)) + (str(pathlib.Path(__file__).resolve().parents[1]) + "/",)


def frames(location) -> list:
    """(file, line, function) of each frame of an MLIR location, innermost first."""
    return [(path, int(line), name) for name, path, line in _FRAME.findall(str(location))]


def user_frame(found: list) -> Optional[str]:
    """The innermost of `found` frames outside jax, numpy and fax_bridge (one outside any
    installed package first), as `file:line (function)`."""
    ours = [f for f in found if not f[0].startswith(_LIBRARY_DIRS)
            and not f[0].startswith("<")]
    for path, line, name in ([f for f in ours if "-packages" not in f[0]] or ours):
        return f"{path}:{line} ({name})"
    return None


class Lines:
    """The user's source lines of the operations of one MLIR module."""

    def __init__(self, module):
        self.calls: dict = {}
        for op in walk(module.operation, []):
            if op.name == "func.call" and "callee" in op.attributes:
                self.calls.setdefault(str(op.attributes["callee"]).lstrip("@"), []).append(op)

    def of(self, op, depth: int = 0) -> list:
        """`file:line (function)` of `op`, or of the calls of the function holding it."""
        found = user_frame(frames(op.location))
        if found or depth > 16:
            return [found] if found else []
        parent = op.parent
        while parent is not None and parent.name != "func.func":
            parent = parent.parent
        if parent is None:
            return []
        name = str(parent.attributes["sym_name"]).strip('"')
        out: list = []
        for call in self.calls.get(name, []):
            for line in self.of(call, depth + 1):
                if line not in out:
                    out.append(line)
        return out
