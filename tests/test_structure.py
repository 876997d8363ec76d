"""The package's layers, read from its source: every import runs down a layer or within
its own group, never up and never sideways between transports.

The graph is derived with `ast` from every `import` in `fax_bridge` (module level and
inside functions alike: a deferred import is still a dependency). `LAYERS` lists the
groups from the bottom up; a module may import its own group's modules and any lower
layer's. Transports sit in one layer but are separate groups, so none imports another.
Command-line entry points (`cli.py`, `*_cli.py`) and the package's own `__init__` sit
on top of everything, wherever their folder is.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "fax_bridge"


# Bottom to top; each inner tuple a layer of groups, each group a tuple of names:
# top-level modules and packages of fax_bridge (a room: `language`), or dotted
# modules of a room that sit in another layer than their room (`language.placements`).
# A module's layer is that of the longest name that is it or holds it.
LAYERS: tuple = (
    # base: errors, the language's records (placements, member rules, primitive
    # facts, pytree names), the chunk size a program declares, the parity report,
    # system/ (the trust boundaries' helpers, processes and forks), data, wire protos
    (("errors", "language.placements", "language.member_rules", "language.primitive_facts",
     "language.pytree_names", "language.jax_compat", "system", "parity.report", "local.execution", "data", "v1"),),
    # the federated language and its jit path, and what is written in it
    (("language", "local", "api", "drjax", "algorithms", "privacy"),),
    # the proto machine: grammar, evaluator, values, exact sums, HLO; the StableHLO
    # rewrites into TFLite builtins and the source lines of MLIR ops, which the
    # Federated Compute forms (`tff`) and the LiteRT models both use
    (("runtime", "litert.side_rewrites", "litert.builtin_rewrites", "litert.locations"),),
    # export to TFF protos, forms
    (("tff",),),
    # round split, engine, policy, checkpoints, codecs, checks; the client part
    # as a LiteRT model (`litert`) beside its XLA form
    (("rounds", "litert"),),
    # transports, beside each other
    (("in_process",), ("fleet",), ("flower",),),
    # the parity check
    (("parity",),),
)


def _group_of(module: str) -> tuple[int, int]:
    """(layer, group) of a fax_bridge module: those of the longest name in `LAYERS` (a
    top-level module or package, or a dotted module inside a room) that is it or holds it."""
    parts = module.split(".")[1:]
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        for level, groups in enumerate(LAYERS):
            for g, names in enumerate(groups):
                if name in names:
                    return level, g
    raise KeyError(module)


def _modules(pkg: pathlib.Path) -> dict[str, pathlib.Path]:
    mods = {}
    for path in pkg.rglob("*.py"):
        parts = ("fax_bridge",) + path.relative_to(pkg).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imports(module: str, path: pathlib.Path, mods: dict) -> list[tuple[int, str]]:
    """(line, imported fax_bridge module) of every import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                if path.name != "__init__.py":
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                full = f"{target}.{a.name}"
                out.append((node.lineno, full if full in mods else target))
    return [(line, t) for line, t in out if t.split(".")[0] == "fax_bridge"]


def _is_entry_point(module: str) -> bool:
    last = module.rpartition(".")[2]
    return module == "fax_bridge" or last == "cli" or last.endswith("_cli")


def upward_imports(pkg: pathlib.Path = PKG) -> list[str]:
    """Every import that runs up a layer or sideways between groups, as
    'path:line: module (its layer) imports target (its layer)'."""
    mods = _modules(pkg)
    bad = []
    for module, path in sorted(mods.items()):
        if _is_entry_point(module):
            continue
        mine = _group_of(module)
        for line, target in _imports(module, path, mods):
            if target == "fax_bridge":
                bad.append(f"{path.relative_to(pkg.parent)}:{line}: {module} imports the "
                           "package root (everything); import the module that defines "
                           "the name")
                continue
            theirs = _group_of(target)
            if theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1]):
                bad.append(f"{path.relative_to(pkg.parent)}:{line}: {module} (layer "
                           f"{mine[0]}) imports {target} (layer {theirs[0]}"
                           f"{', a sibling group' if theirs[0] == mine[0] else ''})")
    return bad


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules(PKG) if m != "fax_bridge"
                     and not _is_entry_point(m) and not _has_layer(m))
    assert not missing, (f"{missing} have no layer in tests/test_structure.py's LAYERS: "
                         "add each (its room, or its dotted name) where its imports put "
                         "it (and to docs/structure.md)")


def _has_layer(module: str) -> bool:
    try:
        _group_of(module)
    except KeyError:
        return False
    return True


def test_imports_run_only_down_the_layers():
    bad = upward_imports()
    assert not bad, ("imports that run up a layer (move the shared helper down to the "
                     "lowest layer that needs it):\n" + "\n".join(bad))


def test_the_check_finds_an_upward_import(tmp_path):
    """The check itself: a runtime module importing a transport is named, with its line."""
    pkg = tmp_path / "fax_bridge"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "fleet").mkdir()
    for f in ("__init__.py", "runtime/__init__.py", "fleet/__init__.py",
              "fleet/pool.py", "errors.py"):
        (pkg / f).write_text('"""x"""\n')
    (pkg / "runtime" / "run.py").write_text(
        '"""x"""\nfrom fax_bridge.errors import E\n\n\ndef f():\n'
        '    from fax_bridge.fleet import pool\n')
    assert upward_imports(pkg) == ["fax_bridge/runtime/run.py:6: fax_bridge.runtime.run (layer 2) imports "
                   "fax_bridge.fleet.pool (layer 5)"]


def test_the_check_reads_a_room_by_its_dotted_names(tmp_path):
    """A room's module listed below its room (`language.placements`) importing one of the
    room's higher modules is named, with both layers."""
    pkg = tmp_path / "fax_bridge"
    (pkg / "language").mkdir(parents=True)
    for f in ("__init__.py", "language/__init__.py", "language/tracing.py", "errors.py"):
        (pkg / f).write_text('"""x"""\n')
    (pkg / "language" / "placements.py").write_text(
        '"""x"""\nfrom fax_bridge.language import tracing\n')
    assert upward_imports(pkg) == [
        "fax_bridge/language/placements.py:2: fax_bridge.language.placements (layer 0) "
        "imports fax_bridge.language.tracing (layer 1)"]


@pytest.mark.parametrize("module", ["fax_bridge.cli", "fax_bridge.flower.cli",
                                    "fax_bridge.fleet.device_cli", "fax_bridge"])
def test_entry_points_sit_on_top(module):
    assert _is_entry_point(module)


def test_the_files_run_first_are_test_files_named_once():
    """conftest's LONGEST_FIRST (the order `make test` hands files to its workers)
    names existing test files, each once: a renamed file would silently run last."""
    import conftest

    here = pathlib.Path(__file__).resolve().parent
    names = conftest.LONGEST_FIRST
    assert len(set(names)) == len(names)
    assert [n for n in names if not (here / n).is_file()] == []


OLD_TOP_PATHS = {
    "cli_args": "fax_bridge.system.cli_args",
    "flower_results": "fax_bridge.parity.flower_results",
    "multihost": "fax_bridge.local.multihost",
}


def test_modules_served_at_the_top_are_their_rooms_modules():
    """Programs that import these modules from the package's top (`from fax_bridge
    import multihost`) get the module of its room."""
    import importlib

    import fax_bridge

    for old, new in OLD_TOP_PATHS.items():
        assert getattr(fax_bridge, old) is importlib.import_module(new)
