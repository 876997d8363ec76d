"""fax_bridge.system.private_files: a folder or file another local user made first, can write
into, or planted as a link is refused naming its path, and nothing is written through
it; what is ours is made, verified, narrowed and replaced whole."""

from __future__ import annotations

import os
import pwd
import re
import stat
import uuid

import pytest
from hypothesis import given, settings, strategies as st

from fax_bridge.system import private_files
from fax_bridge.errors import FaxBridgeError
from fax_bridge.system.private_files import UnsafePathError

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="gives files to another user")
ROOTS_TEXT = b"root's own file\n"


def _nobody() -> int:
    return pwd.getpwnam("nobody").pw_uid


def _fresh(tmp_path) -> str:
    folder = tmp_path / uuid.uuid4().hex[:8]
    folder.mkdir(mode=0o700)
    return str(folder)


@pytest.fixture
def roots_file(tmp_path):
    """A file of the user running the tests that a planted link points at."""
    path = tmp_path / "precious"
    path.write_bytes(ROOTS_TEXT)
    path.chmod(0o644)
    return str(path)


def _unchanged(path: str) -> None:
    with open(path, "rb") as f:
        assert f.read() == ROOTS_TEXT
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o644


def test_a_private_folder_is_made_with_its_parents_and_narrowed_when_ours(tmp_path):
    home = os.path.join(str(tmp_path), "a", "b", "home")
    assert private_files.private_dir(home) == home
    assert stat.S_IMODE(os.lstat(home).st_mode) == 0o700
    assert not stat.S_IMODE(os.lstat(os.path.dirname(home)).st_mode) & 0o022
    os.chmod(home, 0o750)
    assert private_files.private_dir(home) == home  # ours: verified again, narrowed
    assert stat.S_IMODE(os.lstat(home).st_mode) == 0o700
    app = os.path.join(str(tmp_path), "app")
    private_files.private_dir(app, 0o755)
    assert not stat.S_IMODE(os.lstat(app).st_mode) & 0o022


@settings(max_examples=40, deadline=None)
@given(mode=st.integers(0o500, 0o777), sticky=st.booleans())
def test_a_folder_others_can_write_is_refused_whatever_its_mode(tmp_path_factory, mode,
                                                                 sticky):
    home = os.path.join(_fresh(tmp_path_factory.mktemp("modes")), "home")
    os.mkdir(home)
    os.chmod(home, mode | (stat.S_ISVTX if sticky else 0))
    if mode & 0o022:
        with pytest.raises(UnsafePathError, match=f"{home} is writable by others") as e:
            private_files.private_dir(home)
        assert "another path" in str(e.value)
        assert stat.S_IMODE(os.lstat(home).st_mode) & 0o777 == mode  # left as it was
    else:
        private_files.private_dir(home)
        assert stat.S_IMODE(os.lstat(home).st_mode) == mode & 0o700


def test_a_link_or_a_file_where_the_folder_goes_is_refused(tmp_path, roots_file):
    target = os.path.join(str(tmp_path), "elsewhere")
    os.mkdir(target, 0o700)
    link = os.path.join(str(tmp_path), "home")
    os.symlink(target, link)
    with pytest.raises(UnsafePathError, match=f"{link} is a symbolic link"):
        private_files.private_dir(link)
    with pytest.raises(UnsafePathError, match=f"{roots_file} is not a folder"):
        private_files.private_dir(roots_file)
    _unchanged(roots_file)


@as_root
def test_a_folder_another_user_made_first_is_refused(tmp_path):
    home = os.path.join(str(tmp_path), "flwr")
    os.mkdir(home, 0o700)
    os.chown(home, _nobody(), -1)
    with pytest.raises(UnsafePathError, match=f"{home} belongs to nobody") as e:
        private_files.private_dir(home)
    assert "another path" in str(e.value) and "mktemp -d" in str(e.value)
    with pytest.raises(UnsafePathError, match=f"{home} belongs to nobody"):
        private_files.private_dir(os.path.join(home, "forks"))  # a parent counts too
    assert os.listdir(home) == []


@as_root
def test_the_parents_chain_is_checked_through_links(tmp_path):
    base = str(tmp_path)
    theirs = os.path.join(base, "theirs")
    os.mkdir(theirs, 0o755)
    os.chown(theirs, _nobody(), -1)
    via = os.path.join(base, "via")
    os.symlink(theirs, via)  # a link of ours to a folder another user can swap
    with pytest.raises(UnsafePathError, match=f"{theirs} belongs to nobody"):
        private_files.private_dir(os.path.join(via, "home"))
    open_ = os.path.join(base, "open")
    os.mkdir(open_)
    os.chmod(open_, 0o777)
    with pytest.raises(UnsafePathError, match=f"{open_} is writable by others"):
        private_files.check_chain(os.path.join(open_))
    os.chmod(open_, 0o1777)  # sticky as /tmp: others cannot swap what is ours there
    assert private_files.check_chain(open_) == open_
    link = os.path.join(base, "link")
    os.symlink(base, link)
    os.lchown(link, _nobody(), -1)
    with pytest.raises(UnsafePathError, match=f"{link} is a link owned by nobody"):
        private_files.check_chain(link)


def test_a_file_is_written_whole_with_its_mode_and_a_failed_write_leaves_the_old(
        tmp_path):
    path = os.path.join(str(tmp_path), "config.toml")
    private_files.write_file(path, "one")
    assert open(path).read() == "one" and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    private_files.write_file(path, b"two", 0o644)
    assert open(path).read() == "two" and stat.S_IMODE(os.stat(path).st_mode) == 0o644
    with pytest.raises(RuntimeError):
        with private_files.atomic_file(path) as f:
            f.write(b"half")
            raise RuntimeError("the writer failed")
    assert open(path).read() == "two"
    assert os.listdir(str(tmp_path)) == ["config.toml"]  # no part left behind


def _plant(kind: str, path: str, roots_file: str) -> None:
    if kind == "link to our file":
        os.symlink(roots_file, path)
    elif kind == "dangling link":
        os.symlink(path + ".new", path)
    elif kind == "hard link to our file":
        os.link(roots_file, path)
    elif kind == "another user's file":
        with open(path, "wb") as f:
            f.write(b"theirs")
        os.chown(path, _nobody(), -1)
    elif kind == "fifo":
        os.mkfifo(path, 0o600)


KINDS = ["link to our file", "dangling link", "hard link to our file",
         "another user's file", "fifo"]


@as_root
@settings(max_examples=30, deadline=None)
@given(kind=st.sampled_from(KINDS), how=st.sampled_from(["write", "append", "read"]))
def test_whatever_is_planted_under_a_files_name_is_refused_and_never_written_through(
        tmp_path_factory, kind, how):
    folder = _fresh(tmp_path_factory.mktemp("planted"))
    roots_file = os.path.join(folder, "precious")
    with open(roots_file, "wb") as f:
        f.write(ROOTS_TEXT)
    os.chmod(roots_file, 0o644)
    path = os.path.join(folder, "worker-0.token")
    _plant(kind, path, roots_file)
    refused = {"write": kind != "hard link to our file" and kind != "fifo",
               "append": True, "read": True}[how]
    # writing anew replaces a hard link or a fifo of ours (never writes through them)
    try:
        if how == "write":
            private_files.write_file(path, "token" * 8)
        elif how == "append":
            private_files.open_append(path).close()
        else:
            private_files.read_private(path)
    except UnsafePathError as e:
        assert refused, e
        assert str(e).startswith(path) and isinstance(e, (FaxBridgeError, OSError))
    else:
        assert not refused
        assert open(path).read() == "token" * 8 and not os.path.islink(path)
    _unchanged(roots_file)


def test_a_secret_others_can_read_is_refused_naming_the_fix(tmp_path):
    path = os.path.join(str(tmp_path), "token")
    private_files.write_file(path, "s" * 32)
    assert private_files.read_private(path) == b"s" * 32
    os.chmod(path, 0o640)
    with pytest.raises(UnsafePathError, match=f"chmod 600 {path}"):
        private_files.read_private(path)
    os.chmod(path, 0o600)
    with pytest.raises(UnsafePathError, match="more than 16 bytes"):
        private_files.read_private(path, limit=16)


def test_a_log_is_appended_to_and_never_truncated(tmp_path):
    path = os.path.join(str(tmp_path), "superlink.log")
    for line in (b"one\n", b"two\n"):
        with private_files.open_append(path) as f:
            f.write(line)
    assert open(path, "rb").read() == b"one\ntwo\n"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600


def test_data_a_run_is_handed_is_read_only_from_a_regular_file(tmp_path, roots_file):
    """A link (unless followed on purpose), a FIFO (never waited on), a folder, a file
    over the limit and, where asked, another user's file are refused naming the path."""
    assert private_files.read_regular(roots_file, 1024) == ROOTS_TEXT
    link = os.path.join(str(tmp_path), "link")
    os.symlink(roots_file, link)
    with pytest.raises(UnsafePathError, match=f"state {link} is a symbolic link"):
        private_files.read_regular(link, 1024, what="state")
    assert private_files.read_regular(link, 1024, follow_links=True) == ROOTS_TEXT
    fifo = os.path.join(str(tmp_path), "fifo")
    os.mkfifo(fifo)
    with pytest.raises(UnsafePathError, match=f"{fifo} is a FIFO"):
        private_files.read_regular(fifo, 1024)
    with pytest.raises(UnsafePathError, match="is a folder.*write it again"):
        private_files.read_regular(str(tmp_path), 1024, fix="write it again")
    with pytest.raises(UnsafePathError, match=f"holds {len(ROOTS_TEXT)} bytes, more than"):
        private_files.read_regular(roots_file, len(ROOTS_TEXT) - 1)
    with pytest.raises(FileNotFoundError):
        private_files.read_regular(os.path.join(str(tmp_path), "absent"), 1024)
    if os.geteuid() == 0:
        theirs = os.path.join(str(tmp_path), "theirs")
        with open(theirs, "wb") as f:
            f.write(b"x")
        os.chown(theirs, _nobody(), -1)
        assert private_files.read_regular(theirs, 8) == b"x"
        with pytest.raises(UnsafePathError, match="belongs to nobody"):
            private_files.read_regular(theirs, 8, ours=True)


# ----------------------------------------------------------- JSON another party wrote

_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2 ** 63, 2 ** 63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner,
                                                                max_size=4),
    max_leaves=20)


@settings(max_examples=60, deadline=None)
@given(value=_JSON)
def test_json_within_the_bounds_reads_back_as_written(value):
    import json

    assert private_files.parse_json(json.dumps(value).encode(), "f") == value


@settings(max_examples=200, deadline=None)
@given(text=st.binary(max_size=64) | st.text(alphabet='[]{}":,0123456789.eE-+ aNIfinity',
                                             max_size=64))
def test_any_bytes_are_read_or_refused_by_name(text):
    try:
        private_files.parse_json(text, "the file f")
    except private_files.HandedFileError as e:
        assert str(e).startswith("the file f is not JSON this reads")


@pytest.mark.parametrize("text, why", [
    ("[" * 300_000 + "]" * 300_000, "nests deeper than 64"),
    ("[" * 65 + "]" * 65, "nests deeper than 64"),
    ('{"a": ' * 65 + "1" + "}" * 65, "nests deeper than 64"),
    ("[1e400]", "1e400 is beyond a float"), ("-1e400", "beyond a float"),
    ("[NaN]", "NaN is not a number"), ("Infinity", "Infinity is not"),
    ("-Infinity", "Infinity is not"), (str(2 ** 63), "beyond 2\\^63"),
    ("1" * 5000, "beyond 2\\^63"), ('{"a": 1, "a": 1}', "key 'a' twice"),
    (b'"\xff"', "utf-8"), ("", "Expecting value"), ("[1,]", "Expecting value"),
])
def test_json_beyond_the_bounds_is_refused_naming_why(text, why):
    with pytest.raises(private_files.HandedFileError, match=why):
        private_files.parse_json(text, "f")
    private_files.parse_json("[" * 64 + "]" * 64, "f")  # the bound itself is read


@pytest.mark.parametrize("value, kind", [
    (1, "int"), (1.5, "number"), (1, "number"), (True, "bool"), ([], "list"),
    ({}, "object"), ("x", "str"),
])
def test_a_field_of_the_kind_its_reader_needs_is_read(value, kind):
    got = private_files.json_field({"k": value}, "k", kind, "f")
    assert got == value and type(got) is type(value)


@pytest.mark.parametrize("value, kind", [
    (True, "int"), (1.0, "int"), ("1", "int"), (False, "number"), (1, "bool"),
    ({}, "list"), (None, "str"),
])
def test_a_field_of_another_kind_is_refused(value, kind):
    with pytest.raises(private_files.HandedFileError, match="f: field 'k' is .*expected"):
        private_files.json_field({"k": value}, "k", kind, "f")


def test_json_is_read_only_from_a_small_regular_file(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('{"a": [1]}\n[2]\n')
    with pytest.raises(private_files.HandedFileError, match="line 1 is not JSON|Extra data"):
        private_files.read_json(str(path), 100)
    assert private_files.read_json_lines(str(path), 100) == [{"a": [1]}, [2]]
    with pytest.raises(UnsafePathError, match="holds 15 bytes, more than the 14"):
        private_files.read_json(str(path), 14)
    os.mkfifo(str(tmp_path / "fifo"))  # opened without blocking, refused by its type
    with pytest.raises(UnsafePathError, match="is a FIFO"):
        private_files.read_json_lines(str(tmp_path / "fifo"), 100)
    with open(str(tmp_path / "sparse"), "wb") as f:
        f.truncate(1 << 30)  # refused by its size, never read
    with pytest.raises(UnsafePathError, match=f"holds {1 << 30} bytes"):
        private_files.read_json(str(tmp_path / "sparse"), 10 << 20)


@pytest.mark.parametrize("entry", ["folder", "file", "fifo", "socket", "link"])
def test_an_entry_is_refused_unless_it_is_of_the_kind_replaced(tmp_path, entry):
    import socket

    path = str(tmp_path / "entry")
    if entry == "folder":
        os.mkdir(path)
    elif entry == "file":
        open(path, "wb").close()
    elif entry == "fifo":
        os.mkfifo(path)
    elif entry == "link":
        os.symlink(str(tmp_path), path)
    else:
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(path)
    for kind in ("socket", "regular file", "folder"):
        fits = {"socket": "socket", "regular file": "file", "folder": "folder"}[kind] == entry
        if fits:
            private_files.check_entry(path, kind=kind)
            continue
        with pytest.raises(UnsafePathError, match=f"^{path} is a"):
            private_files.check_entry(path, kind=kind)
    private_files.check_entry(str(tmp_path / "nothing"), kind="socket")


_OPENERS = {
    "read_regular": lambda p: private_files.read_regular(p, 100),
    "read_regular following links": lambda p: private_files.read_regular(
        p, 100, follow_links=True),
    "read_json": lambda p: private_files.read_json(p, 100),
    "open_append": lambda p: private_files.open_append(p).close(),
    "read_private": private_files.read_private,
    "open_in_place": lambda p: private_files.open_in_place(p).close(),
    "write_file": lambda p: private_files.write_file(p, b"x"),
    "check_entry": private_files.check_entry,
}


@settings(max_examples=40, deadline=None)
@given(opener=st.sampled_from(sorted(_OPENERS)),
       planted=st.sampled_from(["loop at the path", "loop on the way", "socket"]))
def test_a_link_loop_or_a_socket_is_refused_by_name_not_a_raw_os_error(
        tmp_path_factory, opener, planted):
    import socket

    folder = _fresh(tmp_path_factory.mktemp("odd"))
    os.symlink("b", os.path.join(folder, "a"))
    os.symlink("a", os.path.join(folder, "b"))
    path = os.path.join(folder, {"loop at the path": "a", "loop on the way": "a/x",
                                 "socket": "sock"}[planted])
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(os.path.join(folder, "sock"))
        if planted == "socket" and opener in ("write_file", "check_entry"):
            return  # a socket of ours is replaced whole, never written through
        with pytest.raises(UnsafePathError) as refused:
            _OPENERS[opener](path)
    said = str(refused.value)
    assert path.split("/a/x")[0] in said, said
    assert re.search("symbolic link|loop|too many links" if "loop" in planted
                     else "socket|not a regular file", said), said
