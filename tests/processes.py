"""Whether test processes still run: `fax_bridge.process_tree`'s readers of /proc, with
sets where the tests compare groups of processes.

A zombie (ended, not yet reaped) counts as ended: a test that killed a process group
asks whether anything of it still works, not whether its parent has reaped it.
"""

from __future__ import annotations

from fax_bridge.process_tree import alive, children, parent, running

__all__ = ["alive", "children", "descendants", "parent", "running"]


def descendants(pid: int) -> set:
    """Every process below `pid`: its children, theirs, and so on."""
    from fax_bridge import process_tree

    return set(process_tree.descendants(pid))
