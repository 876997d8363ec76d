"""Output folders (`output_folders`): whatever a folder holds before, a write replaces
only what fax_bridge wrote there, refuses naming any other file in its way (unless
forced), never writes or removes through a symlink, and a bad folder path is one clear
error."""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from processes import as_nobody
from fax_bridge.system import output_folders
from fax_bridge.errors import OutputError

NAMES = ["a", "b", "README.md", "pyproject.toml", ".flwr", "config.toml", "node-0", "ü",
         "x y", "q'\"", "\\", "-f"]
paths = st.lists(st.sampled_from(NAMES), min_size=1, max_size=3).map("/".join)


def _prefix_free(entries) -> bool:
    return not any(b.startswith(a + "/") for a in entries for b in entries if a != b)


def snapshot(root: str) -> dict:
    """{relative path: ("dir",) | ("file", bytes) | ("link", target)}, links not
    followed, the record left out."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if rel == output_folders.RECORD:
                continue
            if os.path.islink(path):
                out[rel] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                out[rel] = ("dir",)
            else:
                with open(path, "rb") as f:
                    out[rel] = ("file", f.read())
    return out


def write(folder: str, entries, text: str, force: bool = False) -> list:
    with output_folders.staged(folder, "test", force=force) as stage:
        for entry in entries:
            path = os.path.join(stage, entry)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    return sorted(entries)


def plant(folder: str, victim: str, theirs) -> None:
    """The user's files (`kind` file, dir or link to the victim folder), skipping what
    cannot exist beside the ones before."""
    for path, kind in theirs:
        full = os.path.join(folder, path)
        try:
            os.makedirs(os.path.dirname(full), exist_ok=True)
            if kind == "file":
                with open(full, "x") as f:
                    f.write("theirs " + path)
            elif kind == "dir":
                os.makedirs(full)
            else:
                os.symlink(victim, full)
        except (FileExistsError, NotADirectoryError):
            pass


def expected_conflict(before: dict, entries) -> bool:
    for entry in entries:
        parts = entry.split("/")
        if entry in before:
            return True
        if any(before.get("/".join(parts[:i]), ("dir",))[0] != "dir"
               for i in range(1, len(parts))):
            return True
    return False


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ours=st.sets(paths, min_size=1, max_size=5).filter(_prefix_free),
       keep=st.integers(1, 5),
       theirs=st.lists(st.tuples(paths, st.sampled_from(["file", "dir", "link"])),
                       max_size=5),
       force=st.booleans())
def test_a_write_replaces_only_its_own_files_whatever_the_folder_holds(
        tmp_path_factory, ours, keep, theirs, force):
    root = tmp_path_factory.mktemp("out")
    folder, victim = str(root / "folder"), str(root / "victim")
    os.makedirs(victim)
    for name in NAMES:  # what a write through a link would hit
        with open(os.path.join(victim, name), "w") as f:
            f.write("victim")
    os.makedirs(folder)
    plant(folder, victim, theirs)
    victim_before, before = snapshot(victim), snapshot(folder)
    conflict = expected_conflict(before, ours)
    again = set(sorted(ours)[:keep])
    if conflict and not force:
        with pytest.raises(OutputError, match="fax-bridge did not write; move them away"):
            write(folder, ours, "first")
        assert snapshot(folder) == before
    else:
        write(folder, ours, "first", force=force)
        after = snapshot(folder)
        for entry in ours:
            assert after[entry] == ("file", b"first")
        for path, kind in before.items():  # the user's files that were not in the way
            if not any(path == e or path.startswith(e + "/") or e.startswith(path + "/")
                       for e in ours):
                assert after[path] == kind
        # written again without force, fewer entries: ours replaced or removed, the
        # user's kept
        write(folder, again, "second")
        final = snapshot(folder)
        for entry in again:
            assert final[entry] == ("file", b"second")
        for entry in ours - again:
            assert entry not in final
        for path, kind in after.items():
            if path not in ours and not any(e.startswith(path + "/") for e in ours):
                assert final[path] == kind
    assert snapshot(victim) == victim_before  # nothing written through a link


def test_a_rewrite_removes_what_it_no_longer_writes_and_keeps_the_rest(tmp_path):
    folder = str(tmp_path / "app")
    write(folder, ["pkg/model.json", "README.md"], "1")
    (tmp_path / "app" / "notes.txt").write_text("mine")
    write(folder, ["README.md"], "2")
    assert snapshot(folder) == {"README.md": ("file", b"2"), "notes.txt": ("file", b"mine")}
    record = json.loads((tmp_path / "app" / output_folders.RECORD).read_text())
    assert record["written"] == {"test": ["README.md"]}


def test_kinds_keep_their_own_entries_in_one_folder(tmp_path):
    folder = str(tmp_path)
    with output_folders.staged(folder, "one") as stage:
        (tmp_path / stage / "a").write_text("a")
    with output_folders.staged(folder, "two", whole=["node-0"]) as stage:
        os.makedirs(os.path.join(stage, "node-0"))
        (tmp_path / stage / "node-0" / "x").write_text("x")
    with output_folders.staged(folder, "one") as stage:
        (tmp_path / stage / "b").write_text("b")
    assert sorted(os.listdir(folder)) == [output_folders.RECORD, "b", "node-0"]
    assert output_folders.read_record(folder) == {"one": ["b"], "two": ["node-0/"]}


@pytest.mark.parametrize("record", [
    "not json", json.dumps({"format": 1, "written": {"x": ["../outside"]}}),
    json.dumps({"format": 1, "written": {"x": ["/etc/passwd"]}}),
    json.dumps({"format": 99, "written": {}}), json.dumps({"format": True, "written": {}}),
    "[" * 300_000 + "]" * 300_000, '{"format": 1e400}', "fifo"])
def test_a_record_fax_bridge_did_not_write_is_refused_and_never_followed(tmp_path, record):
    folder = tmp_path / "out"
    folder.mkdir()
    (tmp_path / "outside").write_text("keep")
    if record == "fifo":  # opened without blocking, refused by its type
        os.mkfifo(folder / output_folders.RECORD)
    else:
        (folder / output_folders.RECORD).write_text(record)
    with pytest.raises(OutputError, match="not fax_bridge's record"):
        write(str(folder), ["a"], "x")
    write(str(folder), ["a"], "x", force=True)  # forced: the record is replaced
    assert (tmp_path / "outside").read_text() == "keep"
    assert output_folders.read_record(str(folder)) == {"test": ["a"]}


def test_a_failed_write_leaves_the_folder_as_it_was(tmp_path):
    write(str(tmp_path), ["a"], "1")
    before = snapshot(str(tmp_path))
    with pytest.raises(RuntimeError):
        with output_folders.staged(str(tmp_path), "test") as stage:
            (tmp_path / stage / "a").write_text("2")
            raise RuntimeError("the writer failed")
    assert snapshot(str(tmp_path)) == before


def _refusal(path: str) -> str:
    with pytest.raises(OutputError) as e:
        output_folders.check_folder(path, "-o")
    assert "\n" not in str(e.value)
    return str(e.value)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 600), depth=st.integers(1, 30))
def test_folder_paths_of_any_length_are_taken_or_refused_by_name(tmp_path, length, depth):
    path = os.path.join(str(tmp_path), *["d" * length] * depth)
    too_long = length > 255 or len(os.fsencode(path)) >= 4096
    if too_long:
        assert "shorter" in _refusal(path)
    else:
        assert output_folders.check_folder(path, "-o") == path


def test_a_file_or_a_file_on_the_way_is_refused_by_name(tmp_path):
    (tmp_path / "f").write_text("x")
    assert "is a file, not a folder" in _refusal(str(tmp_path / "f"))
    assert "cannot be created" in _refusal(str(tmp_path / "f" / "sub"))
    os.symlink(str(tmp_path / "gone"), str(tmp_path / "dangling"))
    assert "broken symlink" in _refusal(str(tmp_path / "dangling"))
    assert "NUL" in _refusal("a\0b") and "empty" in _refusal("")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become nobody")
def test_a_folder_another_user_owns_is_refused_as_not_writable(tmp_path):
    os.chmod(tmp_path, 0o755)

    def check():  # as nobody, a folder of root's
        for path in (str(tmp_path), str(tmp_path / "new")):
            try:
                output_folders.check_folder(path, "-o")
            except OutputError as e:
                assert "not writable" in str(e), e
            else:
                raise AssertionError(f"{path} was taken")

    as_nobody(check)


def test_a_folder_others_can_write_is_refused_before_anything_is_written(tmp_path):
    """Another local user who can write the folder could swap a folder of it for a link
    while root writes there: refused by name (`private_files.check_chain`)."""
    from fax_bridge.errors import FaxBridgeError

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(FaxBridgeError, match="writable by others"):
        write(str(shared / "out"), ["a"], "x")
    assert os.listdir(shared) == []


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ours=st.sets(paths, min_size=1, max_size=5).filter(_prefix_free),
       theirs=st.lists(st.tuples(paths, st.sampled_from(["file", "dir", "link"])),
                       max_size=5),
       force=st.booleans())
def test_entries_are_refused_before_any_work_exactly_as_the_write_refuses_them(
        tmp_path_factory, ours, theirs, force):
    root = tmp_path_factory.mktemp("out")
    folder, victim = str(root / "folder"), str(root / "victim")
    os.makedirs(victim)
    os.makedirs(folder)
    plant(folder, victim, theirs)
    before = snapshot(folder)
    try:
        output_folders.check_entries(folder, sorted(ours), force=force)
        early = None
    except OutputError as e:
        early = str(e)
    assert snapshot(folder) == before  # nothing made: no stage, no folder, no record
    assert not os.path.lexists(os.path.join(folder, output_folders.RECORD))
    try:
        write(folder, ours, "x", force=force)
        late = None
    except OutputError as e:
        late = str(e)
    assert early == late


def test_entries_of_a_folder_not_there_yet_are_checked_without_making_it(tmp_path):
    output_folders.check_entries(str(tmp_path / "new" / "out"), ["a", "b/c"])
    assert not (tmp_path / "new").exists()
    (tmp_path / "file").write_text("mine")
    with pytest.raises(OutputError, match="file"):
        output_folders.check_entries(str(tmp_path / "file"), ["a"])
