"""tff.cli: finding the program to export from MODULE_OR_FILE:FUNCTION."""

import textwrap

import pytest

from fax_bridge.api import Program
from fax_bridge.errors import FaxBridgeError
from fax_bridge.tff import cli

MODULE = textwrap.dedent("""
    import numpy as np
    import fax_bridge as fb

    def step(w, x):
        return fb.federated_mean(fb.federated_broadcast(w) * x)

    def step_example_args(clients):
        return (np.ones(2, np.float32), np.ones((clients, 2), np.float32)), ("server", "clients")

    @fb.program(clients=4)
    def built(w, x):
        return fb.federated_sum(x)

    def example_args(clients):
        return (np.ones(2, np.float32), np.ones((clients, 2), np.float32)), ("server", "clients")

    def no_args(x):
        return x

    def no_args_example_args(clients):
        return "not a pair"
""")


@pytest.fixture
def module_file(tmp_path):
    path = tmp_path / "progs.py"
    path.write_text(MODULE)
    return str(path)


def test_a_plain_function_is_wrapped_with_the_given_clients(module_file):
    prog, args, placements = cli.resolve_program(f"{module_file}:step", 3)
    assert isinstance(prog, Program) and prog.clients == 3
    assert args[1].shape == (3, 2) and placements == ("server", "clients")
    proto = cli.export_spec(f"{module_file}:step", 3)
    assert proto.WhichOneof("computation") == "lambda"


def test_a_built_program_must_agree_on_clients(module_file):
    prog, _, _ = cli.resolve_program(f"{module_file}:built", 4)
    assert prog.clients == 4
    with pytest.raises(FaxBridgeError, match="clients=4, but --clients 3"):
        cli.resolve_program(f"{module_file}:built", 3)


def test_targets_that_cannot_be_resolved_say_why(module_file, tmp_path):
    for spec, message in [
            (module_file, "names no function"),
            (f"{tmp_path}/missing.py:f", "no such file"),
            (f"{module_file}:absent", "has no attribute 'absent'"),
            (f"{module_file}:no_args", "must return \\(args, placements\\)"),
            ("fax_bridge_no_such_module_anywhere:f", "cannot import module"),
    ]:
        with pytest.raises(FaxBridgeError, match=message):
            cli.resolve_program(spec, 2)
    module, fn, name = cli.load_target("fax_bridge.language.placements:parse_placement")
    assert name == "parse_placement" and callable(fn)


TARGETS_MODULE = textwrap.dedent("""
    import numpy as np
    import fax_bridge as fb
    from fax_bridge.algorithms import fed_adam   # imported: the name export_targets uses

    def _round(clients):
        @fb.program(clients=clients)
        def total(x):
            return fb.federated_sum(x)
        return total

    def export_targets(clients):
        x = np.ones((clients, 2), np.float32)
        return {"fed_adam": (_round(clients), (x,), "clients"), "bare": _round(clients)}
""")


def test_an_imported_name_export_targets_builds_resolves_to_its_entry(tmp_path):
    """A module importing `fed_adam` and building its round under that name in
    export_targets: the target is the entry, and the errors name export_targets."""
    path = tmp_path / "cnn_round.py"
    path.write_text(TARGETS_MODULE)
    prog, args, placements = cli.resolve_program(f"{path}:fed_adam", 3)
    assert isinstance(prog, Program) and prog.clients == 3 and args[0].shape == (3, 2)
    with pytest.raises(FaxBridgeError, match="built by export_targets"):
        cli.resolve_program(f"{path}:fed_adam", None)
    with pytest.raises(FaxBridgeError, match=r"\[.bare.\] must be \(program, args, "
                                             r"placements\), got Program"):
        cli.resolve_program(f"{path}:bare", 3)
    (tmp_path / "plain.py").write_text("def f(x):\n    return x\n")
    with pytest.raises(FaxBridgeError, match="nor export_targets"):
        cli.resolve_program(f"{tmp_path}/plain.py:f", 3)
