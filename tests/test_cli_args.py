"""Checked command-line arguments: a bad value is refused by name before any work starts;
finished results are never lost to a bad output path; input files give named errors."""

from __future__ import annotations

import argparse
import io
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from fax_bridge import cli
from fax_bridge.system import cli_args
from fax_bridge.errors import ComputationError, FleetError
from fax_bridge.fleet import security

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TFF_DATA = os.path.join(ROOT, "tests", "data", "tff087")
COMP = os.path.join(TFF_DATA, "zip_map_struct.pb")
INPUTS = os.path.join(TFF_DATA, "zip_map_struct.inputs.npz")
QUICKSTART = os.path.join(ROOT, "examples", "quickstart.py")

# (command line before the flag, flag, a valid value, whether the flag is an integer >= low)
_COMMANDS = {
    "run": ["run", COMP],
    "parity": ["parity", f"{QUICKSTART}:fedavg_round", "--clients", "2"],
    "export": ["export", f"{QUICKSTART}:fedavg_round", "--clients", "2"],
    "device": ["device"],
    "forms": ["forms", f"{QUICKSTART}:fedavg_round", "--form", "daf", "-o", "out"],
}
_FLAGS = [  # (command, flag, lowest valid, highest valid or None)
    ("run", "--devices", 1, 1024), ("run", "--clients", 1, None),
    ("parity", "--clients", 1, None), ("parity", "--devices", 1, 1024),
    ("export", "--clients", 1, None), ("forms", "--clients", 1, None),
    ("device", "--parent-pid", 1, None),
    ("device", "--max-workers", 1, 256), ("device", "--max-message-bytes", 1, (1 << 31) - 1),
    ("device", "--max-stored-bytes", 1, None),
]


def _refused(argv, flag, capsys) -> str:
    with pytest.raises(SystemExit) as info:
        cli.build_parser().parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}" in err or f"/{flag}:" in err, err
    return err


_WITH_CAPSYS = settings(max_examples=60, deadline=None, database=None,
                        suppress_health_check=[HealthCheck.function_scoped_fixture])


@_WITH_CAPSYS
@given(case=st.sampled_from(_FLAGS), value=st.integers(-(1 << 40), 1 << 40) | st.sampled_from(
    ["", "x", "1.5", "0x10", " ", "1e3"]))
def test_integer_flags_accept_their_range_and_name_themselves_otherwise(capsys, case, value):
    command, flag, low, high = case
    argv = _COMMANDS[command] + [flag, str(value)]
    valid = isinstance(value, int) and value >= low and (high is None or value <= high)
    if valid:
        assert getattr(cli.build_parser().parse_args(argv),
                       flag.lstrip("-").replace("-", "_")) == value
    else:
        _refused(argv, flag, capsys)


@_WITH_CAPSYS
@given(flag=st.sampled_from(["--rtol", "--atol"]),
       value=st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(["x", ""]))
def test_tolerances_must_be_finite_and_not_negative(capsys, flag, value):
    argv = _COMMANDS["parity"] + [flag, str(value)]
    if isinstance(value, float) and np.isfinite(value) and value >= 0:
        assert getattr(cli.build_parser().parse_args(argv), flag[2:]) == value
    else:
        _refused(argv, flag, capsys)


_GOOD_HOSTS = ["127.0.0.1", "localhost", "[::1]", "node-1.example.org", "a_b", "10.0.0.2",
               "[fe80::1%eth0]"]
_HOSTS = st.sampled_from(_GOOD_HOSTS + ["", "::1", "no host", "a\"b", "a'b", "é.org", "[x]",
                                        "999.1.1.1", "h\n", "[::1%a\"b]", "-"]) | st.text(
    max_size=10)
_PORTS = st.integers(0, 70000) | st.sampled_from(["", "x", "08", "\u0663", " 1", "1 ", "+1"])


@_WITH_CAPSYS
@given(flag=st.sampled_from(["--listen", "--superlink"]), host=_HOSTS, port=_PORTS)
def test_addresses_are_read_strictly_once_and_are_safe_to_write_anywhere(
        capsys, tmp_path_factory, flag, host, port):
    """A HOST:PORT flag takes an IP address or DNS name and a port in range, spelled one
    way; anything else (no host, a quote, a space, other characters, a port out of
    range, digits of other scripts) is refused naming the flag, never a traceback."""
    import re
    import tomllib

    from fax_bridge.flower.toml_text import connection_toml

    address = f"{host}:{port}"
    argv = (["device", "--listen", address] if flag == "--listen" else
            ["flower", f"{QUICKSTART}:fedavg_round", "-o",
             str(tmp_path_factory.mktemp("app")), "--superlink", address])
    low = 0 if flag == "--listen" else 1
    plain_port = isinstance(port, int) or port == "08"
    if host in _GOOD_HOSTS and plain_port and low <= int(port) <= 65535:
        parsed = cli.build_parser().parse_args(argv)
        assert getattr(parsed, flag[2:]) == f"{host}:{int(port)}"
    try:
        parsed = cli.build_parser().parse_args(argv)
    except SystemExit as e:
        assert e.code == 2
        err = capsys.readouterr().err
        assert f"argument {flag}" in err and "Traceback" not in err
        return
    value = getattr(parsed, flag[2:])
    assert low <= int(value.rsplit(":", 1)[1]) <= 65535
    # nothing a shell or a config file reads apart
    assert re.fullmatch(r"[A-Za-z0-9_.:%\[\]-]+", value), value
    assert tomllib.loads(connection_toml(value))["superlink"]["fax-bridge"]["address"] \
        == value


def test_output_paths_are_checked_first_and_written_exactly(tmp_path, capsys):
    _refused(["run", COMP, "--output", str(tmp_path / "missing" / "x")], "--output", capsys)
    _refused(["export", f"{QUICKSTART}:fedavg_round", "--clients", "2", "-o",
              str(tmp_path)], "--output", capsys)
    args = cli.build_parser().parse_args(["run", COMP, "--output", str(tmp_path / "x")])
    assert args.output == str(tmp_path / "x")
    code = cli.main(["run", COMP, "--inputs", INPUTS, "--devices", "1", "--output",
                     str(tmp_path / "x")])
    assert code == 0
    assert f"wrote {tmp_path / 'x'}\n" in capsys.readouterr().out
    assert (tmp_path / "x").exists() and not (tmp_path / "x.npz").exists()
    assert sorted(cli_args.load_npz(str(tmp_path / "x"))) == ["result"]
    assert os.listdir(tmp_path) == ["x"]  # no partial file left beside it


def test_a_result_that_cannot_be_written_is_saved_elsewhere_and_said_so(tmp_path):
    arrays = {"result": np.arange(3.0)}
    written, failed = cli_args.save_result(str(tmp_path / "gone" / "r.npz"), arrays)
    try:
        assert failed and "gone" in failed and written != str(tmp_path / "gone" / "r.npz")
        np.testing.assert_array_equal(np.load(written)["result"], arrays["result"])
    finally:
        os.unlink(written)


def _npz_bytes() -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, a=np.arange(6, dtype=np.float32), b=np.ones((2, 2), np.int32))
    return buffer.getvalue()


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_truncated_empty_or_garbage_inputs_give_a_named_error(tmp_path_factory, data):
    raw = bytearray(_npz_bytes())
    kind = data.draw(st.sampled_from(["truncate", "flip", "garbage", "pickle", "objects"]))
    if kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1))]
    elif kind == "flip":
        at = data.draw(st.integers(0, len(raw) - 1))
        raw[at] ^= data.draw(st.integers(1, 255))
    elif kind == "garbage":
        raw = bytearray(data.draw(st.binary(max_size=300)))
    elif kind == "pickle":
        raw = bytearray(b"\x80\x04\x95" + data.draw(st.binary(max_size=40)))
    else:
        buffer = io.BytesIO()
        np.savez(buffer, a=np.array([{"x": 1}], dtype=object))
        raw = bytearray(buffer.getvalue())
    path = tmp_path_factory.mktemp("npz") / "in.npz"
    path.write_bytes(bytes(raw))
    try:
        loaded = cli_args.load_npz(str(path))
    except ComputationError as e:
        assert str(e).startswith(f"--inputs {path}") and "allow_pickle" not in str(e)
        return
    assert kind in ("flip", "truncate")  # a change the format does not notice
    assert set(loaded) <= {"a", "b"}


def test_an_archive_flagged_encrypted_gives_a_named_error(tmp_path, flag_encrypted):
    """zipfile refuses an entry flagged encrypted with a RuntimeError; like every other way
    damaged bytes fail to parse, it is reported naming the flag and the file."""
    path = tmp_path / "in.npz"
    path.write_bytes(flag_encrypted(_npz_bytes()))
    with pytest.raises(ComputationError, match=f"--inputs {path} is not a readable npz"):
        cli_args.load_npz(str(path))


def test_the_run_command_reports_bad_inputs_without_a_traceback(tmp_path, capsys):
    bad = tmp_path / "in.npz"
    bad.write_bytes(b"")
    assert cli.main(["run", COMP, "--inputs", str(bad)]) == 2
    assert f"--inputs {bad}" in capsys.readouterr().err


def test_no_token_at_all_means_none_is_used():
    assert security.resolve_token(environ={}) is None


@pytest.mark.parametrize("token", ["x", "a" * (security.MIN_TOKEN_CHARS - 1)])
def test_short_tokens_are_refused_by_name(token):
    with pytest.raises(FleetError, match="at least 16"):
        security.resolve_token(environ={security.TOKEN_ENV: token})
    assert security.resolve_token(environ={security.TOKEN_ENV: "a" * 16}) == "a" * 16


def test_a_dead_device_fails_fast_with_a_clear_error():
    from fax_bridge.errors import FleetError
    from fax_bridge.fleet.coordinator import GrpcClientsBackend

    with pytest.raises(FleetError, match="127.0.0.1:1 did not become healthy: nothing answers"):
        GrpcClientsBackend(["127.0.0.1:1"], token=security.new_token(),
                           connect_timeout_s=600)


def test_examples_refuse_zero_rounds_and_more_clients_than_the_data(capsys):
    import sys

    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import _digits
    finally:
        sys.path.pop(0)
    for argv, flag in ((["--rounds", "0"], "--rounds"),
                       (["--clients", str(_digits.POPULATION + 1)], "--clients"),
                       (["--clients", "0"], "--clients")):
        with pytest.raises(SystemExit):
            _digits.parse_args("x", argv=argv)
        assert f"argument {flag}" in capsys.readouterr().err
    assert _digits.parse_args("x", argv=["--clients", str(_digits.POPULATION)]).clients == 100


def test_the_device_log_level_is_one_of_the_known_ones(capsys):
    assert cli.build_parser().parse_args(["device", "--log-level", "INFO"]).log_level == "info"
    _refused(["device", "--log-level", "loud"], "--log-level", capsys)


def test_an_npz_claiming_an_unknown_zip_version_gives_a_named_error(tmp_path):
    buf = io.BytesIO()
    np.savez(buf, a=np.ones(2))
    data = bytearray(buf.getvalue())
    at = data.find(b"PK\x01\x02")  # central directory: 'version needed' at offset 6
    data[at + 6:at + 8] = bytes([109, 0])
    path = tmp_path / "odd.npz"
    path.write_bytes(bytes(data))
    with pytest.raises(ComputationError, match="not a readable npz archive"):
        cli_args.load_npz(str(path))


def _spell(path, how: str, tmp) -> str:
    """Another way to name the file at `path`: relative, through a folder, a link."""
    if how == "relative":
        return os.path.relpath(path)
    if how == "dotted":
        return os.path.join(os.path.dirname(path), ".", "sub", "..", os.path.basename(path))
    link = os.path.join(tmp, f"{how}-{os.path.basename(path)}")
    if not os.path.lexists(link):
        (os.symlink if how == "symlink" else os.link)(path, link)
    return link


@_WITH_CAPSYS
@given(which=st.sampled_from(["--inputs", "the computation", "--fleet-file", "export"]),
       how=st.sampled_from(["relative", "dotted", "symlink", "hardlink"]))
def test_the_output_is_never_one_of_the_inputs(tmp_path_factory, capsys, monkeypatch, which,
                                               how):
    tmp = str(tmp_path_factory.mktemp("out"))
    os.makedirs(os.path.join(tmp, "sub"))
    monkeypatch.chdir(tmp)
    inputs, comp, fleet = (os.path.join(tmp, n) for n in ("in.npz", "c.pb", "fleet.json"))
    program = os.path.join(tmp, "prog.py")
    for path, data in ((inputs, open(INPUTS, "rb").read()), (comp, open(COMP, "rb").read()),
                       (fleet, b'{"devices": []}'), (program, b"def f(x):\n  return x\n")):
        with open(path, "wb") as f:
            f.write(data)
    target = {"--inputs": inputs, "the computation": comp, "--fleet-file": fleet,
              "export": program}[which]
    before = open(target, "rb").read()
    output = _spell(target, how, tmp)
    if which == "export":
        argv = ["export", f"{program}:f", "--clients", "2", "-o", output]
    else:
        argv = ["run", comp, "--inputs", inputs, "--fleet-file", fleet, "--output", output]
    if how == "symlink":  # no output is written through a link, to an input or not
        assert f"{output!r} is a symbolic link" in _refused(argv, "--output", capsys)
    else:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert f"--output {output} is the same file as" in err and target in err, err
    assert open(target, "rb").read() == before


def test_a_run_without_inputs_says_they_are_missing_and_how_to_give_them(capsys):
    assert cli.main(["run", COMP]) == 2
    err = capsys.readouterr().err
    assert "no --inputs given" in err and "`a` (float32[3])" in err and "`b`" in err
    assert "--inputs IN.npz" in err and "does not fit" not in err


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.float16])
def test_run_refuses_inputs_of_another_dtype_unless_cast(tmp_path, capsys, dtype):
    path = tmp_path / "in.npz"
    with np.load(INPUTS) as f:
        np.savez(path, a=f["a"].astype(dtype), b=f["b"])
    assert cli.main(["run", COMP, "--inputs", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"`a` holds {np.dtype(dtype).name}" in err and "float32" in err
    assert "--cast" in err


def test_a_write_that_fails_keeps_the_old_file_and_leaves_no_part(tmp_path):
    path = tmp_path / "out.npz"
    path.write_bytes(b"old")
    os.chmod(path, 0o640)
    calls = []

    def fails_once(f):
        calls.append(1)
        f.write(b"new")
        if len(calls) == 1:
            raise OSError(28, "No space left on device")

    written, failed = cli_args.write_or_rescue(str(path), fails_once, ".npz", "t")
    try:
        assert "No space left" in failed and written != str(path)
        assert open(written, "rb").read() == b"new"
    finally:
        os.unlink(written)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.npz"]
    written, failed = cli_args.save_result(str(path), {"result": np.arange(2.0)})
    assert failed is None and written == str(path)
    assert os.stat(path).st_mode & 0o777 == 0o640  # its mode is kept
    np.testing.assert_array_equal(cli_args.load_npz(str(path))["result"], [0.0, 1.0])


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_device_is_written_as_given_and_the_result_rescued():
    written, failed = cli_args.save_result("/dev/full", {"result": np.arange(3.0)})
    try:
        assert "cannot write '/dev/full'" in failed and "No space left" in failed
        np.testing.assert_array_equal(cli_args.load_npz(written)["result"], np.arange(3.0))
    finally:
        os.unlink(written)
    assert not os.path.exists("/dev/full.npz")


@settings(max_examples=60, deadline=None)
@given(text=st.text(max_size=300), limit=st.one_of(st.none(), st.integers(0, 250)))
def test_a_shortened_line_keeps_its_start_and_says_its_length_and_where_it_is_whole(
        text, limit):
    got = cli_args.shortened(text, limit, "in FILE")
    if limit is None or len(text) <= limit:
        assert got == text
    else:
        assert got.startswith(text[:limit] + "... ") and \
            got.endswith(f"({len(text):,} characters; whole in FILE)")


def test_forms_prints_types_cut_short_unless_verbose(tmp_path, capsys, monkeypatch):
    """A form's signature runs to kilobytes on one line: `fax-bridge forms` prints the
    first SIGNATURE_CHARS characters of each type and says where the whole one is."""
    from fax_bridge import cli
    from fax_bridge.tff import forms, forms_cli

    long_type = "<" + ",".join(f"w{i}=float32[1568,64]" for i in range(200)) + ">"
    manifest = {"form": "DistributeAggregateForm", "type_signature": long_type,
                "files": {"server_prepare": {"file": "server_prepare.pb", "bytes": 10,
                                             "type": long_type}}}
    monkeypatch.setattr(forms, "to_distribute_aggregate_form", lambda *a, **k: None)
    monkeypatch.setattr(forms, "write_form", lambda form, stage: manifest)
    argv = ["forms", f"{QUICKSTART}:fedavg_round", "--clients", "2", "--form", "daf",
            "-o", str(tmp_path / "out")]
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert long_type not in out and f"({len(long_type):,} characters; whole in " in out
    cut = forms_cli.SIGNATURE_CHARS
    assert out.count(long_type[:cut] + "... (") == 2 and long_type[:cut + 1] not in out
    assert cli.main(argv + ["--verbose"]) == 0
    assert capsys.readouterr().out.count(long_type) == 2


def _plant_at(kind: str, path: str, victim: str) -> None:
    """What another user (uid nobody) leaves at an output path: a link to `victim` (a
    file of ours), a dangling link to `victim`, their file or their FIFO."""
    import pwd

    nobody = pwd.getpwnam("nobody").pw_uid
    if kind in ("link", "dangling link"):
        os.symlink(victim, path)
        os.lchown(path, nobody, -1)
    elif kind == "their file":
        with open(path, "wb") as f:
            f.write(b"theirs")
        os.chown(path, nobody, -1)
    else:
        os.mkfifo(path, 0o666)
        os.chown(path, nobody, -1)


@pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user")
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["link", "dangling link", "their file", "fifo"]),
       writer=st.sampled_from(["report", "result"]))
def test_an_output_file_another_user_planted_is_refused_and_the_output_rescued(
        tmp_path_factory, kind, writer):
    folder = tmp_path_factory.mktemp("shared")
    os.chmod(folder, 0o1777)  # a shared, sticky folder such as /tmp
    victim, path = str(folder / "precious"), str(folder / "report.json")
    if kind != "dangling link":
        with open(victim, "wb") as f:
            f.write(b"ours")
    _plant_at(kind, path, victim)
    with pytest.raises(argparse.ArgumentTypeError, match="symbolic link|another user"):
        cli_args.output_file(path)  # refused when the command line is read
    if writer == "report":  # as `fax-bridge parity --json` writes its report
        written, why = cli_args.write_or_rescue(path, lambda f: f.write(b'{"ok": true}'),
                                                ".json", "parity")
    else:
        written, why = cli_args.save_result(path, {"result": np.arange(2.0)})
    try:
        assert written != path and why and path in why, why
        assert ("symbolic link" if "link" in kind else "belongs to nobody") in why, why
        assert os.stat(written).st_uid == os.geteuid()
    finally:
        os.unlink(written)
    if kind == "dangling link":
        assert not os.path.lexists(victim)  # nothing made where the link pointed
    else:
        assert open(victim, "rb").read() == b"ours"
    if kind == "their file":
        assert open(path, "rb").read() == b"theirs"
