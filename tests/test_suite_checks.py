"""The suite's own checks, by reading its source: tests that cannot fail are defects.

Every `tests/test_*.py` file is parsed (`ast`) and three kinds of test are flagged:

1. A test that checks nothing: its body (nested functions included) has no `assert`,
   no `pytest.raises` / `pytest.warns` / `pytest.fail`, no call of an `assert...`
   function or method (numpy's `assert_allclose`, a mock's `assert_called_once`), and
   no call of a helper of its own module that checks (transitively, by these rules).
   A test whose check is elsewhere (a fixture's teardown, a helper of another module)
   says where with a comment `# checked by <where>` in its body.
2. `assert all(...)` or `assert not any(...)` over a collection that may be empty
   (both are true of nothing): the collection must be a non-empty literal, or the same
   assert or an earlier statement of the test must check it (its text appears there:
   `assert xs and all(...)`, `assert len(xs) == 3`, `assert list(d) == [...]`).
   Elementwise predicates of arrays (`all(np.abs(got - want) <= bound)`,
   `all(np.isfinite(x))`) are not collections found by the code under test and are
   left to the checks of the arrays' shapes.
3. A `return` in the body of a parametrized test (`pytest.mark.parametrize`): some of
   its cases would end having checked less than the others; split the cases into
   tests of their own instead.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Iterator

TESTS = pathlib.Path(__file__).resolve().parent
MARKER = "# checked by "
CHECKING_CALLS = {"raises", "warns", "fail", "deprecated_call", "approx_equal"}


def _name(node: ast.AST) -> str:
    """The called name: `f` of `f(...)`, `attr` of `obj.attr(...)`."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return ""


def _own_nodes(fn: ast.AST) -> Iterator[ast.AST]:
    """Every node of `fn`'s body, nested functions and classes included."""
    for stmt in fn.body:
        yield from ast.walk(stmt)


def _checks_directly(fn: ast.AST) -> bool:
    for node in _own_nodes(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Call):
            name = _name(node.func)
            if name.startswith(("assert", "_assert")) or name in CHECKING_CALLS:
                return True
    return False


def _helpers_that_check(tree: ast.Module) -> set:
    """The module's functions that check, directly or through another such function."""
    functions = {n.name: n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    checking = {name for name, fn in functions.items() if _checks_directly(fn)}
    changed = True
    while changed:
        changed = False
        for name, fn in functions.items():
            if name in checking:
                continue
            called = {_name(n.func) for n in _own_nodes(fn) if isinstance(n, ast.Call)}
            if called & checking:
                checking.add(name)
                changed = True
    return checking


def _tests(tree: ast.Module) -> Iterator[ast.FunctionDef]:
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and \
                node.name.startswith("test"):
            yield node
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            yield from (n for n in node.body if isinstance(n, (ast.FunctionDef,
                                                                ast.AsyncFunctionDef))
                        and n.name.startswith("test"))


def _is_parametrized(fn: ast.FunctionDef) -> bool:
    return any("parametrize" in ast.unparse(d) for d in fn.decorator_list)


def _nonempty_literal(node: ast.AST) -> bool:
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return bool(node.elts) and not any(isinstance(e, ast.Starred) for e in node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys) and None not in node.keys
    if isinstance(node, ast.Call) and _name(node.func) == "range":
        return all(isinstance(a, ast.Constant) for a in node.args) and \
            len(range(*[a.value for a in node.args])) > 0
    if isinstance(node, ast.Call) and _name(node.func) in ("enumerate", "sorted", "list",
                                                            "tuple", "reversed"):
        return len(node.args) == 1 and _nonempty_literal(node.args[0])
    return False


def _base(node: ast.AST) -> ast.AST:
    """The collection a view is of: `d` of `d.values()`, `list(d)`, `sorted(d.items())`."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("values", "keys", "items") and not node.args:
            node = node.func.value
        elif isinstance(node, ast.Call) and _name(node.func) in ("list", "sorted", "tuple",
                                                                  "set") \
                and len(node.args) == 1:
            node = node.args[0]
        else:
            return node


def _elementwise(node: ast.AST) -> bool:
    """An array predicate computed elementwise (a comparison, `a | b`, `~a`, `np.f(a)`)."""
    if isinstance(node, (ast.Compare, ast.BinOp, ast.UnaryOp)):
        return True
    if isinstance(node, ast.Call):
        func = node.func
        while isinstance(func, ast.Attribute):
            func = func.value
        return isinstance(func, ast.Name) and func.id in ("np", "numpy")
    return False


def _collections(node: ast.AST) -> list:
    """The collections a comprehension (or a plain argument) iterates over; a zip's
    arguments each."""
    if isinstance(node, (ast.GeneratorExp, ast.ListComp, ast.SetComp)):
        node = node.generators[0].iter
    if isinstance(node, ast.Call) and _name(node.func) == "zip":
        return list(node.args)
    return [node]


def _vacuous_calls(test: ast.Assert) -> Iterator[ast.Call]:
    """The `all(...)` calls an assert requires true, and the `any(...)` ones it requires
    false: true of an empty collection."""
    def walk(node: ast.AST, negated: bool) -> Iterator[ast.Call]:
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            yield from walk(node.operand, not negated)
        elif isinstance(node, ast.BoolOp):
            for value in node.values:
                yield from walk(value, negated)
        elif isinstance(node, ast.Call) and len(node.args) == 1 and \
                _name(node.func) == ("any" if negated else "all"):
            yield node
    yield from walk(test.test, False)


def _unchecked_all(fn: ast.FunctionDef) -> list:
    """`all()`/`not any()` assertions whose collection nothing shows non-empty."""
    found, seen = [], []
    statements = sorted((n for n in _own_nodes(fn) if isinstance(n, ast.stmt)),
                        key=lambda n: (n.lineno, n.col_offset))
    for stmt in statements:
        if isinstance(stmt, ast.Assert):
            whole = ast.unparse(stmt.test)
            for call in _vacuous_calls(stmt):
                for collection in _collections(call.args[0]):
                    if _nonempty_literal(collection) or _elementwise(collection):
                        continue
                    text = ast.unparse(collection)
                    others = whole.replace(ast.unparse(call), "", 1)
                    names = {text, ast.unparse(_base(collection))}
                    if any(n in others or any(n in s for s in seen) for n in names):
                        continue
                    found.append((stmt.lineno, f"{_name(call.func)}() over {text}"))
            seen.append(whole)
        elif isinstance(stmt, (ast.If, ast.While)) or (
                isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
            seen.append(ast.unparse(stmt.test if isinstance(stmt, (ast.If, ast.While))
                                    else stmt.value))
    return found


def _early_returns(fn: ast.FunctionDef) -> list:
    """`return` statements of `fn` itself (not of functions nested in it)."""
    out, stack = [], list(fn.body)
    while stack:
        node = stack.pop()
        if isinstance(node, ast.Return):
            out.append(node.lineno)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda,
                             ast.ClassDef)):
            continue
        stack.extend(ast.iter_child_nodes(node))
    return sorted(out)


def findings(source: str, filename: str = "<test>") -> list:
    """(file, line, what) for each flagged test of a test module's `source`."""
    tree = ast.parse(source)
    lines = source.splitlines()
    checking = _helpers_that_check(tree)
    out = []
    for fn in _tests(tree):
        body = "\n".join(lines[fn.lineno - 1:fn.end_lineno])
        called = {_name(n.func) for n in _own_nodes(fn) if isinstance(n, ast.Call)}
        if not (_checks_directly(fn) or called & checking or MARKER in body):
            out.append((filename, fn.lineno, f"{fn.name} checks nothing"))
        for line, what in _unchecked_all(fn):
            out.append((filename, line, f"{fn.name}: {what}, true if it is empty"))
        if _is_parametrized(fn):
            for line in _early_returns(fn):
                out.append((filename, line, f"{fn.name}: returns early in a parametrized "
                                            "test"))
    return out


def _suite_findings() -> list:
    out = []
    for path in sorted(TESTS.glob("test_*.py")):
        out += findings(path.read_text(), path.name)
    return out


def test_the_suite_has_no_test_that_cannot_fail():
    found = _suite_findings()
    assert found == [], "\n".join(f"tests/{f}:{line}: {what}" for f, line, what in found)


def test_the_checker_flags_each_kind():
    source = '''
import pytest

def _helper(x):
    assert x > 0

def _calls_helper(x):
    _helper(x)

def test_nothing():
    x = 1 + 1

def test_through_a_helper():
    _calls_helper(3)

def test_elsewhere(fixture):
    fixture.run()  # checked by the fixture's teardown

def test_raises():
    with pytest.raises(ValueError):
        int("x")

def test_numpy():
    np.testing.assert_array_equal(a, b)

def test_all_unchecked(items):
    assert all(i > 0 for i in items)

def test_not_any_unchecked(items):
    assert not any(i < 0 for i in items.values())

def test_all_checked(items):
    assert items and all(i > 0 for i in items)

def test_all_checked_before(items):
    assert len(items) == 3
    assert all(i > 0 for i in items)

def test_all_literal():
    assert all(i > 0 for i in (1, 2))
    assert all(x for x, y in zip([1], [2]))

def test_any_positive(items):
    assert any(i > 0 for i in items)

@pytest.mark.parametrize("n", [0, 1])
def test_param_returns(n):
    if n == 0:
        return
    assert n

@pytest.mark.parametrize("n", [0, 1])
def test_param_nested_return(n):
    def inner():
        return n
    assert inner() == n
'''
    got = [(line, what) for _, line, what in findings(source)]
    assert [what for _, what in got] == [
        "test_nothing checks nothing",
        "test_all_unchecked: all() over items, true if it is empty",
        "test_not_any_unchecked: any() over items.values(), true if it is empty",
        "test_param_returns: returns early in a parametrized test",
    ], got
