"""A package's names served from the modules that hold them, on first use (PEP 562).

`served(package, homes, modules)` gives the package's `__getattr__` and `__dir__`:
`homes` maps each public name to the module holding it (a bare module name is taken
inside the package: `"interpreter"` is `<package>.interpreter`), `modules` each name
that is a whole module. So `import fax_bridge.fleet` loads no gRPC until a fleet name
is read, and the top package leaves the fleet, parity and forms to their first use.
"""

from __future__ import annotations

import importlib
from typing import Callable, Mapping, Optional


def served(package: str, homes: Mapping[str, str],
           modules: Optional[Mapping[str, str]] = None) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) of `package` serving `homes` and `modules` (module
    docstring); any other name is an AttributeError naming the package."""
    modules = dict(modules or {})

    def __getattr__(name: str):
        if name in modules:
            return importlib.import_module(modules[name])
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if "." not in home:
            home = f"{package}.{home}"
        return getattr(importlib.import_module(home), name)

    def __dir__() -> list[str]:
        loaded = vars(importlib.import_module(package))
        return sorted(set(loaded) | set(homes) | set(modules))

    return __getattr__, __dir__
