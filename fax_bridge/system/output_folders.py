"""Folders the fax-bridge commands write: only fax_bridge's own files are ever replaced.

Every command that writes into a folder (`fax-bridge flower -o` and
`--write-population`, `fax-bridge forms -o`, `fax-bridge litert -o`) writes through
`staged`: the command writes into a staging folder inside the output folder, and when
it is done its entries (each file, or a folder written whole such as a population's
`node-K/`) are moved into place. Before anything is moved, each entry is checked
against the folder's record (`RECORD`, a small JSON file fax_bridge keeps there naming
the entries each kind of output wrote): an entry already there that the record does not
name, or a symlink or file where a folder goes, is another file, and the command is
refused naming it, unless `force`. A command whose output takes long to make (a
conversion) first checks the entries it will write with `check_entries`, which refuses
with the same text before any work starts; `place` checks again when moving, for a file
that appeared meanwhile. Entries the record names for the same kind that this
write no longer makes are removed, so a rewrite leaves no stale file of an older one;
a record naming a path outside the folder is not a record of fax_bridge's, and refused
so. Nothing is followed through a symlink inside the folder.

`check_folder` checks the output path itself first, with no traceback: an existing
file, a name longer than the file system takes, or a folder that cannot be created or
written is an `OutputError` naming the path and the fix. The folder and those above it
must be ours (or root's) and writable by no one else (`private_files.check_chain`), so
that no other local user can swap a folder of it for a link while it is written.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Iterator, Optional, Sequence

from fax_bridge.system import private_files
from fax_bridge.errors import OutputError

RECORD = ".fax-bridge-written"  # no extension: Flower leaves it out of app bundles
FORMAT = 1
MAX_RECORD_BYTES = 4 << 20  # the names of the files written there; larger is not ours
_STAGE_PREFIX = ".fax-bridge-stage-"
FORCE_HINT = "give --force to replace it"


def _shown(path: str, limit: int = 300) -> str:
    text = repr(path)
    return text if len(text) <= limit else text[:limit - 5] + "...'"


def _nearest_existing(path: str) -> str:
    while not os.path.lexists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_folder(path: str, what: str = "the output folder") -> str:
    """Refuses, with an `OutputError` naming `what` and the fix, a folder path that
    cannot be written: empty, a NUL byte, a name longer than the file system's
    NAME_MAX or a path over PATH_MAX, an existing non-folder (or a folder on the way
    that is a file), or a folder that is not writable (or cannot be created). Returns
    `path` unchanged; creates nothing."""
    if not isinstance(path, str) or not path:
        raise OutputError(f"{what} is empty; give a folder path")
    if "\0" in path:
        raise OutputError(f"{what} {_shown(path)} holds a NUL byte; give a folder path")
    full = os.path.abspath(path)
    probe = _nearest_existing(full)
    probe_dir = probe if os.path.isdir(probe) else os.path.dirname(probe)
    try:
        name_max = os.pathconf(probe_dir, "PC_NAME_MAX")
        path_max = os.pathconf(probe_dir, "PC_PATH_MAX")
    except (OSError, ValueError):
        name_max, path_max = 255, 4096
    for part in full.split(os.sep):
        if len(os.fsencode(part)) > name_max:
            raise OutputError(
                f"{what} {_shown(path)}: the name {_shown(part, 40)} is "
                f"{len(os.fsencode(part))} bytes, over the {name_max} this file system "
                "takes; give a shorter name")
    if len(os.fsencode(full)) >= path_max:
        raise OutputError(f"{what} {_shown(path)} is {len(os.fsencode(full))} bytes long, "
                          f"over the {path_max} a path may have; give a shorter path")
    if os.path.lexists(full) and not os.path.isdir(full):
        kind = "a broken symlink" if os.path.islink(full) else "a file"
        raise OutputError(f"{what} {_shown(path)} is {kind}, not a folder; give a folder "
                          "path (a new one is created)")
    if probe != full and not os.path.isdir(probe):
        raise OutputError(f"{what} {_shown(path)} cannot be created: {_shown(probe)} is a "
                          "file, not a folder")
    if not os.access(probe, os.W_OK | os.X_OK):
        verb = "is not writable" if probe == full else \
            f"cannot be created: {_shown(probe)} is not writable"
        raise OutputError(f"{what} {_shown(path)} {verb}; give a folder you may write")
    return path


def writable_folder(path: str, what: str) -> str:
    """Makes folder `path` (or verifies the one there: `private_files.private_dir`, mode
    0755) and proves it writable by making and removing a file in it, before any work
    whose results go there starts; returns its absolute path. An `OutputError` naming
    `what`, the path and the reason otherwise."""
    check_folder(path, what)
    try:
        folder = private_files.private_dir(path, 0o755)
        fd, probe = tempfile.mkstemp(prefix=_STAGE_PREFIX, dir=folder)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:  # private_files' refusals are PermissionErrors, named
        reason = e.strerror if e.strerror and not str(e).startswith(path) else str(e)
        raise OutputError(f"{what} {_shown(path)} cannot be written ({reason}); give a "
                          "folder this user may write") from None
    return folder


def rescue_folder(kind: str) -> str:
    """A new folder of ours under the temporary directory for output whose own folder
    failed while being written (a run's results must not be lost); its path is for the
    caller to report."""
    return tempfile.mkdtemp(prefix=f"fax-bridge-{kind}-")


def _valid_entry(entry) -> bool:
    if not isinstance(entry, str) or not entry or "\0" in entry or entry.startswith("/"):
        return False
    parts = entry.rstrip("/").split("/")
    return all(p not in ("", ".", "..") for p in parts) and not (
        parts[0].startswith(_STAGE_PREFIX) or parts[0] == RECORD)


def read_record(folder: str) -> Optional[dict]:
    """{kind: [entries]} the folder's record names; {} with no record; None for a file
    at `RECORD` that is not fax_bridge's record (unreadable, another format, a path
    outside the folder, a symlink)."""
    path = os.path.join(folder, RECORD)
    if not os.path.lexists(path):
        return {}
    try:  # a regular file, not a link (a FIFO never blocks), bounded JSON
        data = private_files.read_json(path, MAX_RECORD_BYTES, what="the folder's record")
        kinds = data["written"] if data.get("format") == FORMAT and \
            type(data["format"]) is int else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not isinstance(kinds, dict) or not all(
            isinstance(k, str) and isinstance(v, list) and all(map(_valid_entry, v))
            for k, v in kinds.items()):
        return None
    return {k: list(v) for k, v in kinds.items()}


def _write_record(folder: str, kinds: dict) -> None:
    text = json.dumps({"format": FORMAT, "written": {k: sorted(set(v)) for k, v in
                                                     kinds.items() if v}}, indent=1)
    fd, part = tempfile.mkstemp(prefix=_STAGE_PREFIX, dir=folder)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text + "\n")
    os.chmod(part, 0o644)
    os.replace(part, os.path.join(folder, RECORD))


def _is_folder(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _conflicts(folder: str, entry: str, ours: set) -> list:
    """The paths (relative) that writing `entry` would replace and fax_bridge did not
    write: a non-folder on the way to it, or the entry itself when not ours, a symlink,
    or of the other kind (a folder for a file)."""
    parts = entry.rstrip("/").split("/")
    for i in range(1, len(parts)):
        sub = "/".join(parts[:i])
        path = os.path.join(folder, sub)
        if os.path.lexists(path) and not _is_folder(path):
            return [] if sub in ours and not os.path.islink(path) else [sub]
        if not os.path.lexists(path):
            return []
    path = os.path.join(folder, entry.rstrip("/"))
    if not os.path.lexists(path):
        return []
    whole = entry.endswith("/")
    if entry not in ours or os.path.islink(path) or _is_folder(path) != whole:
        return [entry.rstrip("/")]
    return []


def _remove(path: str) -> None:
    if _is_folder(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def _inside_safely(folder: str, entry: str) -> bool:
    """Whether every folder on the way to `entry` is a real folder (no symlink)."""
    parts = entry.rstrip("/").split("/")
    return all(_is_folder(os.path.join(folder, *parts[:i])) for i in range(1, len(parts)))


def _entries_of(stage: str, whole: Sequence[str]) -> list:
    """Each file under `stage` (relative, `/`-separated), a folder in `whole` as one
    entry `name/`."""
    wanted = {w.rstrip("/") for w in whole}
    out = []
    for root, dirs, files in os.walk(stage):
        rel = os.path.relpath(root, stage)
        rel = "" if rel == "." else rel.replace(os.sep, "/") + "/"
        for d in list(dirs):
            if rel + d in wanted:
                out.append(rel + d + "/")
                dirs.remove(d)
        out += [rel + f for f in files]
    return sorted(out)


def _refuse_conflicts(folder: str, entries: Sequence[str], force: bool,
                      what: str) -> dict:
    """The folder's record; an OutputError, unless `force`, where writing `entries`
    would replace a file fax_bridge did not write (or the record is not ours)."""
    record = read_record(folder)
    if record is None and not force:
        raise OutputError(f"{what} {_shown(folder)}: {RECORD} there is not fax_bridge's "
                          f"record of the files it wrote; remove it, or {FORCE_HINT}")
    record = record or {}
    ours = {e for entries in record.values() for e in entries}
    conflicts = sorted({c for e in entries for c in _conflicts(folder, e, ours)})
    if conflicts and not force:
        shown = ", ".join(_shown(os.path.join(folder, c)) for c in conflicts[:3])
        more = f" and {len(conflicts) - 3} more" if len(conflicts) > 3 else ""
        raise OutputError(
            f"{what} {_shown(folder)}: writing it would replace {shown}{more}, which "
            f"fax-bridge did not write; move them away, choose another folder, or give "
            "--force to replace them")
    return record


def check_entries(folder: str, entries: Sequence[str], *, force: bool = False,
                  what: str = "the output folder") -> None:
    """Refuses, before any work whose output goes to `folder` starts, what `place` would
    refuse for these entries (files relative to `folder`, a folder written whole as
    `name/`): an OutputError with the same text. Creates nothing; `place` checks again
    when it moves the output, for a file that appeared meanwhile."""
    check_folder(folder, what)
    if _is_folder(folder):
        _refuse_conflicts(folder, entries, force, what)


def place(folder: str, stage: str, kind: str, *, force: bool = False,
          whole: Sequence[str] = (), reserve: Sequence[str] = (),
          what: str = "the output folder") -> list:
    """Moves what was written in `stage` into `folder` as `kind`'s entries (module
    docstring); returns their paths in `folder`. `whole`: folders moved as one entry;
    `reserve`: entries claimed and recorded that the caller writes itself afterwards.

    Raises OutputError, moving nothing, when an entry would replace a file fax_bridge
    did not write (unless `force`)."""
    entries = _entries_of(stage, whole) + list(reserve)
    record = _refuse_conflicts(folder, entries, force, what)
    stale = [e for e in record.get(kind, []) if e not in entries]
    record[kind] = sorted(set(record.get(kind, [])) | set(entries))
    for other in record:
        if other != kind:
            record[other] = [e for e in record[other] if e not in entries]
    _write_record(folder, record)  # before moving: an interrupted move leaves ours named
    placed = []
    for entry in entries:
        name = entry.rstrip("/")
        parts = name.split("/")
        for i in range(1, len(parts)):
            sub = os.path.join(folder, *parts[:i])
            if os.path.lexists(sub) and not _is_folder(sub):
                os.unlink(sub)  # ours, or replaced with force (checked above)
            if not os.path.lexists(sub):
                os.mkdir(sub)
        target = os.path.join(folder, *parts)
        if entry in reserve:
            if os.path.islink(target) or (os.path.lexists(target) and not _is_folder(target)):
                os.unlink(target)
            placed.append(target)
            continue
        if entry.endswith("/") or _is_folder(target) or os.path.islink(target):
            _remove(target)
        os.replace(os.path.join(stage, *parts), target)
        placed.append(target)
    for entry in stale:
        if _inside_safely(folder, entry):
            parts = entry.rstrip("/").split("/")
            _remove(os.path.join(folder, *parts))
            for i in range(len(parts) - 1, 0, -1):  # the folders it leaves empty
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(folder, *parts[:i]))
    record[kind] = entries
    _write_record(folder, record)
    return placed


@contextlib.contextmanager
def staged(folder: str, kind: str, *, force: bool = False, whole: Sequence[str] = (),
           reserve: Sequence[str] = (), what: str = "the output folder",
           placed: Optional[list] = None) -> Iterator[str]:
    """A staging folder inside `folder` (created if needed) to write `kind`'s output
    into; on leaving the `with` without an exception its contents are `place`d (the
    paths placed are appended to `placed`), and the staging folder is removed either
    way. Arguments as `place`'s."""
    check_folder(folder, what)
    try:
        private_files.check_chain(folder, make=True)  # no one else can swap what is in it
        stage = tempfile.mkdtemp(prefix=_STAGE_PREFIX, dir=folder)
    except OSError as e:
        raise OutputError(f"{what} {_shown(folder)} cannot be written "
                          f"({e.strerror or e}); give a folder you may write") from None
    os.chmod(stage, 0o755)  # what is moved out keeps the modes written here
    keep = False
    try:
        yield stage
        try:
            done = place(folder, stage, kind, force=force, whole=whole, reserve=reserve,
                         what=what)
        except OSError as e:  # the output is whole in the stage: kept, and said where
            keep = True
            raise OutputError(
                f"{what} {_shown(folder)}: moving the output into place failed "
                f"({e.strerror or e}); it is complete in {_shown(stage)}") from None
        if placed is not None:
            placed.extend(done)
    finally:
        if not keep:
            shutil.rmtree(stage, ignore_errors=True)
