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

# Bottom to top; each inner tuple a layer of groups, each group a tuple of the top-level
# names (modules or packages of fax_bridge) it holds.
LAYERS: tuple = (
    # base: errors, placements, the primitives' records, addresses, data, wire protos
    # and the trust-boundary helpers: private files and output folders, process trees,
    # the fork server and its protocol, FAX_BRIDGE_* settings, the chunk size choice
    (("errors", "placements", "member_rules", "primitive_facts", "pytree_names",
      "addresses", "cli_args", "parity_report", "forks", "fork_protocol", "fork_server",
      "private_files", "output_folders", "process_tree", "env_settings", "execution", "npz_files",
      "data", "v1"),),
    # the federated language and its jit path, and what is written in it
    (("tracing", "local", "lowering", "primitives", "chunk_size", "chunking", "api", "chunk_stream",
      "secure", "drjax",
      "multihost", "algorithms", "privacy"),),
    (("runtime",),),      # the proto machine: grammar, evaluator, values, exact sums, HLO
    (("tff",),),          # export to TFF protos, forms
    (("rounds", "litert"),),  # round split, engine, policy, checkpoints, codecs, checks;
    # the client part as a LiteRT model (`litert`) beside its XLA form
    (("in_process",), ("fleet",), ("flower",)),  # transports, beside each other
    (("parity", "parity_rounding", "parity_first_order", "parity_shadow", "parity_flower",
      "flower_results"),),
)


def _group_of(top: str) -> tuple[int, int]:
    for level, groups in enumerate(LAYERS):
        for g, names in enumerate(groups):
            if top in names:
                return level, g
    raise KeyError(top)


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
        mine = _group_of(module.split(".")[1])
        for line, target in _imports(module, path, mods):
            if target == "fax_bridge":
                bad.append(f"{path.relative_to(pkg.parent)}:{line}: {module} imports the "
                           "package root (everything); import the module that defines "
                           "the name")
                continue
            theirs = _group_of(target.split(".")[1])
            if theirs[0] > mine[0] or (theirs[0] == mine[0] and theirs[1] != mine[1]):
                bad.append(f"{path.relative_to(pkg.parent)}:{line}: {module} (layer "
                           f"{mine[0]}) imports {target} (layer {theirs[0]}"
                           f"{', a sibling group' if theirs[0] == mine[0] else ''})")
    return bad


def test_every_top_level_name_has_a_layer():
    tops = {p.stem if p.suffix == ".py" else p.name for p in PKG.iterdir()
            if (p.suffix == ".py" or (p / "__init__.py").exists())
            and p.name != "__init__.py"}
    missing = sorted(t for t in tops if not _is_entry_point(f"fax_bridge.{t}")
                     and not any(t in names for groups in LAYERS for names in groups))
    assert not missing, (f"{missing} have no layer in tests/test_structure.py's LAYERS: "
                         "add each where its imports put it (and to docs/structure.md)")


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
