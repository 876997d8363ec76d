"""Folders and files that no other local user can plant, swap or redirect.

fax_bridge runs as root beside other users' processes, and writes into folders a user
names (a Flower deployment's home, an app folder, a log folder), often under a shared
`/tmp`. A folder another user made first, or one they can write into, lets them plant a
symbolic link where a file is about to be written (root then overwrites the file it
points to) or swap a program that root then runs. Every such write goes through here:

- `check_chain(folder)`: every folder from `/` down to `folder` (the links on the way
  followed, and checked too) belongs to root or to us and is writable by no one else,
  unless it is sticky as `/tmp` is (there others cannot rename or remove what is ours).
- `private_dir(path)`: makes `path` (and its missing parents) or verifies the one there:
  a real folder (not a link), ours, writable by no one else; narrowed to `mode` (0700).
- `atomic_file(path)` / `write_file(path, data)`: a new file in a checked folder
  (`O_EXCL` under a temporary name, its mode set on the open file), renamed over `path`;
  a link or another user's file already at `path` is refused, never followed.
- `open_append(path)`: a log opened with `O_NOFOLLOW`, refused unless it is a regular
  file of ours with one link. `open_in_place(path)`: an existing device or FIFO (ours
  or root's) or a file of ours, opened to write where it is, never through a link.
- `read_private(path)`: a secret (a token) opened with `O_NOFOLLOW`, refused unless it
  is a regular file of ours that others can neither read nor write.
- `open_regular(path, limit)` / `read_regular(path, limit)`: data a run is handed (a
  carried model, a state file, a population's files, a run's results), opened with
  `O_NOFOLLOW | O_NONBLOCK` (a FIFO never hangs the reader), refused unless it is a
  regular file of at most `limit` bytes (its size taken from the opened file before a
  byte is read, and never more than `limit` + 1 bytes read).
- `read_json(path, limit)` / `read_json_lines(path, limit)` / `parse_json(text, name)`:
  JSON another party may have written: refused as a `HandedFileError` naming the file
  (and the line) unless it is UTF-8 JSON nested at most `MAX_JSON_DEPTH` deep, whose
  numbers are finite floats or integers within 2^63, whose objects repeat no key.
  `json_field(data, key, kind, name)` takes one field of it as the kind the reader
  needs (an int is never a bool or a float, a number never a bool), naming the file
  and the field otherwise.

A refusal is an `UnsafePathError` naming the path, what was wrong, and the fix; so is a
loop of symbolic links on the way to a path, or a socket where a file is read. This
module imports only the standard library (and `fax_bridge.errors`, when imported as part
of the package), so the processes that never load fax_bridge's package load it by path.
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import stat
import tempfile
from typing import Any, Iterator, Optional, Union

if __name__ == "fax_bridge.system.private_files":
    from fax_bridge.errors import FaxBridgeError
else:  # loaded by its path (`relay`), where fax_bridge's package (jax) is never loaded
    class FaxBridgeError(Exception):  # noqa: N818 - stands in for fax_bridge.errors'
        """fax_bridge's base error, in a process that never loads the package."""

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_MAX_LINKS = 40  # as the kernel's own limit on links followed in one path
MAX_SECRET_BYTES = 1 << 16
_ELSEWHERE = ("Choose another path, in a folder of your own (under your home folder, or "
              "one `mktemp -d` makes)")
_ANOTHER = _ELSEWHERE + ", or remove this one if it holds nothing you need"


class UnsafePathError(FaxBridgeError, PermissionError):
    """A folder or file another local user could have planted or could swap."""


class HandedFileError(FaxBridgeError, ValueError):
    """A file another party handed over whose content is not what its reader takes,
    named with the file, the field and what was wrong."""


def _owner(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def _refuse(path: str, why: str, fix: str) -> UnsafePathError:
    return UnsafePathError(f"{path} {why}; another local user could have planted it or "
                           f"could swap what it holds. {fix}")


def _explained(path: str, error: OSError, name: str = "") -> OSError:
    """`error` (raised opening or looking up `path`) as an `UnsafePathError` naming
    `name` (or the path) and the fix where it has a cause this names: a loop of symbolic
    links on the way (ELOOP), a socket or a FIFO nothing reads at the path (ENXIO);
    `error` itself otherwise."""
    name = name or path
    if error.errno == errno.ELOOP:
        return UnsafePathError(f"{name} leads through a loop of symbolic links (or more "
                               f"than {_MAX_LINKS} of them); give a path of real folders "
                               "and files")
    if error.errno == errno.ENXIO:
        with contextlib.suppress(OSError):
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                return UnsafePathError(f"{name} is a socket, not a regular file; give "
                                       "the file itself")
        return UnsafePathError(f"{name} is a FIFO or device with nothing at its other "
                               "end, not a regular file; give the file itself")
    return error


def _check_folder(path: str, info: os.stat_result, euid: int) -> None:
    if not stat.S_ISDIR(info.st_mode):
        raise _refuse(path, "is not a folder", "Remove it or choose another path")
    if info.st_uid not in (0, euid):
        raise _refuse(path, f"belongs to {_owner(info.st_uid)}", _ELSEWHERE)
    if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
        raise _refuse(path, f"is writable by others (mode {stat.S_IMODE(info.st_mode):o})",
                      (f"Run `chmod go-w {path}` if it is yours alone to write, or c"
                       if info.st_uid == euid else "C") + _ELSEWHERE[1:])


def check_chain(folder: str, make: bool = False) -> str:
    """Checks every folder from `/` down to `folder` (module docstring); with `make`,
    makes the missing ones (mode 0755 less the umask). Returns `folder`'s real path."""
    euid = os.geteuid()
    pending = [p for p in os.path.abspath(folder).split("/") if p]
    current, links = "/", 0
    _check_folder("/", os.lstat("/"), euid)
    while pending:
        name = pending.pop(0)
        if name in ("", "."):
            continue
        if name == "..":
            current = os.path.dirname(current)
            continue
        path = os.path.join(current, name)
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            if not make:
                raise
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o755)
            info = os.lstat(path)
        if stat.S_ISLNK(info.st_mode):
            links += 1
            if links > _MAX_LINKS:
                raise _refuse(path, "leads through too many links", "Give a real path")
            if info.st_uid not in (0, euid):
                raise _refuse(path, f"is a link owned by {_owner(info.st_uid)}",
                              "Remove it or choose another path")
            target = os.readlink(path)
            if target.startswith("/"):
                current = "/"
            pending[:0] = [p for p in target.split("/") if p]
            continue
        _check_folder(path, info, euid)
        current = path
    return current


def private_dir(path: Union[str, os.PathLike], mode: int = 0o700) -> str:
    """Makes folder `path` with `mode` (its missing parents 0755), or verifies the one
    there: its parents pass `check_chain`, and it is a real folder (not a link) of ours
    that no one else can write; its mode is then narrowed to `mode` (0755 for a folder
    others may read). Returns its absolute path; `UnsafePathError` naming the path
    otherwise."""
    path = os.path.abspath(os.fspath(path))
    check_chain(os.path.dirname(path), make=True)
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _NOFOLLOW)
    except OSError:
        info = os.lstat(path)
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a folder"
        raise _refuse(path, f"is {kind}", "Remove it or choose another path") from None
    try:
        info = os.fstat(fd)
        if info.st_uid != os.geteuid():
            raise _refuse(path, f"belongs to {_owner(info.st_uid)}, not to the user "
                          f"running this ({_owner(os.geteuid())})", _ANOTHER)
        if stat.S_IMODE(info.st_mode) & 0o022:
            raise _refuse(path, "is writable by others (mode "
                          f"{stat.S_IMODE(info.st_mode):o})",
                          f"If what it holds is yours, run `chmod {mode:o} {path}`; or c"
                          + _ANOTHER[1:])
        if stat.S_IMODE(info.st_mode) & ~mode:
            os.fchmod(fd, stat.S_IMODE(info.st_mode) & mode)
    finally:
        os.close(fd)
    return path


_KINDS = {"socket": stat.S_ISSOCK, "regular file": stat.S_ISREG, "folder": stat.S_ISDIR}


def _kind(mode: int) -> str:
    for name, test in (("a symbolic link", stat.S_ISLNK), ("a folder", stat.S_ISDIR),
                       ("a FIFO", stat.S_ISFIFO), ("a socket", stat.S_ISSOCK),
                       ("a regular file", stat.S_ISREG)):
        if test(mode):
            return name
    return "a device"


def check_entry(path: Union[str, os.PathLike], kind: Optional[str] = None) -> None:
    """Refuses what is at `path`, if anything, unless it is ours and not a link (an
    entry about to be replaced, removed or handed to another program to open), and,
    with `kind` ("socket", "regular file" or "folder"), unless it is one."""
    path = os.fspath(path)
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    except OSError as e:
        raise _explained(path, e) from None
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(path, "is a symbolic link", "Remove it")
    if kind is not None and not _KINDS[kind](info.st_mode):
        raise UnsafePathError(f"{path} is {_kind(info.st_mode)}, where only a {kind} "
                              "this replaces may be; remove it, or choose another path")
    if info.st_uid != os.geteuid():
        raise _refuse(path, f"belongs to {_owner(info.st_uid)}", "Remove it")


@contextlib.contextmanager
def atomic_file(path: Union[str, os.PathLike], mode: int = 0o600) -> Iterator:
    """A binary file to write that replaces `path` once the block ends without an
    error (a failed write leaves `path` as it was). `path`'s folder must pass
    `check_chain`, and a link or another user's file at `path` is refused."""
    path = os.path.abspath(os.fspath(path))
    folder = os.path.dirname(path)
    check_chain(folder)
    check_entry(path)
    fd, part = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".part",
                                dir=folder)  # O_CREAT | O_EXCL: never through a link
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            yield f
        os.replace(part, path)  # renames over a link planted since, never through it
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(part)
        raise


def write_file(path: Union[str, os.PathLike], data: Union[bytes, str],
               mode: int = 0o600) -> str:
    """Writes `data` (text as UTF-8) to `path` through `atomic_file`; returns the path."""
    with atomic_file(path, mode) as f:
        f.write(data.encode() if isinstance(data, str) else data)
    return os.fspath(path)


def open_in_place(path: Union[str, os.PathLike]):
    """The existing `path` opened to write in binary where it is, emptied first if a
    regular file: a device or FIFO of ours or root's (`/dev/null`, a terminal), or a
    regular file of ours with one link (one whose folder cannot hold a new file). A link
    at `path` is refused, never followed, and so is another user's entry."""
    path = os.fspath(path)
    try:
        info = os.lstat(path)
    except OSError as e:
        raise _explained(path, e) from None
    regular = stat.S_ISREG(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        raise _refuse(path, "is a symbolic link", "Give the file itself, or remove it")
    if stat.S_ISDIR(info.st_mode) or stat.S_ISSOCK(info.st_mode):
        raise UnsafePathError(f"{path} is {_kind(info.st_mode)}, not a file to write; "
                              "give a file path")
    if info.st_uid not in ((os.geteuid(),) if regular else (0, os.geteuid())):
        raise _refuse(path, f"belongs to {_owner(info.st_uid)}", _ANOTHER)
    try:
        fd = os.open(path, os.O_WRONLY | _NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as e:
        raise _explained(path, e) from None
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (info.st_dev, info.st_ino) or (
            regular and now.st_nlink != 1):
        os.close(fd)
        raise _refuse(path, "was swapped while it was opened" if now.st_ino != info.st_ino
                      else f"has {now.st_nlink} hard links", "Remove it")
    os.set_blocking(fd, True)
    if regular:
        os.ftruncate(fd, 0)
    return os.fdopen(fd, "wb")


def _open_checked(path: str, flags: int, mode: int = 0o600) -> int:
    try:
        fd = os.open(path, flags | _NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if os.path.islink(path):
            raise _refuse(path, "is a symbolic link", "Remove it") from None
        if os.path.lexists(path) and not os.path.isfile(path):  # a fifo with no reader
            raise _refuse(path, "is not a regular file", "Remove it") from None
        raise _explained(path, e) from None
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = "is not a regular file"
    elif info.st_uid != os.geteuid():
        why = f"belongs to {_owner(info.st_uid)}"
    elif info.st_nlink != 1 and flags & (os.O_WRONLY | os.O_RDWR):
        why = f"has {info.st_nlink} hard links"
    if why is not None:
        os.close(fd)
        raise _refuse(path, why, "Remove it")
    os.set_blocking(fd, True)
    return fd


def open_append(path: Union[str, os.PathLike], mode: int = 0o600):
    """`path` opened to append in binary (made with `mode` if missing); refused unless
    it is a regular file of ours with one link. Never follows a link at `path`."""
    fd = _open_checked(os.fspath(path), os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    return os.fdopen(fd, "ab")


def open_regular(path: Union[str, os.PathLike], limit: int, *, follow_links: bool = False,
                 ours: bool = False, what: str = "", fix: str = "") -> tuple:
    """(`path` opened to read in binary, its size in bytes): refused with
    `UnsafePathError` naming `what` and `path` unless it is a regular file (not a link
    unless `follow_links`, not a FIFO, a device or a folder) of at most `limit` bytes,
    and, with `ours`, of the user running this. The size is the open file's, so a
    reader can bound what it allocates by it. `fix`: how to make the right file, ending
    a refusal."""
    path = os.fspath(path)
    name = f"{what} {path}" if what else path
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow_links else _NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if not follow_links and os.path.islink(path):
            raise _refuse(name, "is a symbolic link",
                          f"Give the file itself{'; ' + fix if fix else ''}") from None
        raise _explained(path, e, name) from None
    info = os.fstat(fd)
    why = None
    if not stat.S_ISREG(info.st_mode):
        why = ("is a folder" if stat.S_ISDIR(info.st_mode) else
               "is a FIFO" if stat.S_ISFIFO(info.st_mode) else "is a device or socket")
    elif ours and info.st_uid != os.geteuid():
        why = f"belongs to {_owner(info.st_uid)}"
    elif info.st_size > limit:
        os.close(fd)
        raise UnsafePathError(f"{name} holds {info.st_size} bytes, more than the {limit} "
                              f"this reads; {fix or 'give the right file'}")
    if why is not None:
        os.close(fd)
        raise UnsafePathError(f"{name} {why}, not a regular file this reads; " + (
            fix or "give the file itself (write it again with the command that made it)")
            if why.startswith("is a") else f"{name} {why}; {fix or 'give a file of your own'}")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb"), info.st_size


def read_regular(path: Union[str, os.PathLike], limit: int, **kwargs) -> bytes:
    """The bytes of `path` (`open_regular`'s checks and keywords): exactly its size
    when opened, never more than `limit`."""
    f, size = open_regular(path, limit, **kwargs)
    with f:
        data = f.read(size + 1)
    if len(data) != size:
        raise UnsafePathError(f"{kwargs.get('what', '')} {os.fspath(path)}".strip()
                              + " changed size while it was read; give a file nothing "
                              "else writes")
    return data


def read_private(path: Union[str, os.PathLike], limit: int = MAX_SECRET_BYTES) -> bytes:
    """The bytes of a secret at `path` (at most `limit`); refused unless it is a regular
    file of ours that others can neither read nor write. Never follows a link."""
    path = os.fspath(path)
    fd = _open_checked(path, os.O_RDONLY)
    with os.fdopen(fd, "rb") as f:
        perm = stat.S_IMODE(os.fstat(f.fileno()).st_mode)
        if perm & 0o077:
            raise UnsafePathError(f"{path} has mode {perm:o}: other users could read or "
                                  f"write it. Run `chmod 600 {path}`")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafePathError(f"{path} holds more than {limit} bytes; it is not a secret "
                              "this reads (a token); give the right file")
    return data


# JSON another party may have written (a round's file, a run's reports, a population's
# layout): its depth, its numbers and its keys are bounded before a reader sees it.
MAX_JSON_DEPTH = 64
_MAX_JSON_INT = 2 ** 63


def _json_float(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise ValueError(f"the number {literal[:40]} is beyond a float's range")
    return value


def _json_int(literal: str) -> int:
    if len(literal) > 20:  # 2^63 has 19 digits: never convert a longer literal
        raise ValueError(f"the integer {literal[:24]}... is beyond 2^63")
    value = int(literal)
    if not -_MAX_JSON_INT <= value < _MAX_JSON_INT:
        raise ValueError(f"the integer {literal} is beyond 2^63")
    return value


def _json_constant(name: str):
    raise ValueError(f"{name} is not a number this reads")


def _json_object(pairs: list) -> dict:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"an object holds the key {twice[:80]!r} twice")
    return out


def _json_depth(value: Any, limit: int) -> int:
    """The nesting of JSON `value` (a scalar is 0), walked without recursion; stops past
    `limit`."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        node, depth = pending.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth > limit:
                break
            pending.extend((child, depth + 1) for child in
                           (node.values() if isinstance(node, dict) else node))
    return deepest


def parse_json(text: Union[bytes, str], name: str, max_depth: int = MAX_JSON_DEPTH,
               fix: str = "") -> Any:
    """The JSON `text` of the file `name` (module docstring): `HandedFileError` naming
    `name` and what was wrong unless it is UTF-8 JSON nested at most `max_depth` deep,
    its floats finite, its integers within 2^63, no object repeating a key."""
    try:
        data = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text,
                          parse_float=_json_float, parse_int=_json_int,
                          parse_constant=_json_constant, object_pairs_hook=_json_object)
    except RecursionError:
        detail = f"it nests deeper than {max_depth} levels"
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, refused numbers
        detail = str(e)[:300]
    else:
        if _json_depth(data, max_depth) <= max_depth:
            return data
        detail = f"it nests deeper than {max_depth} levels"
    raise HandedFileError(f"{name} is not JSON this reads ({detail}); "
                          f"{fix or 'write it again with the command that made it'}")


def read_json(path: Union[str, os.PathLike], limit: int, *, what: str = "",
              fix: str = "", max_depth: int = MAX_JSON_DEPTH, **kwargs) -> Any:
    """The JSON of the file at `path`: `read_regular`'s checks (at most `limit` bytes;
    its keywords), then `parse_json`'s."""
    data = read_regular(path, limit, what=what, fix=fix, **kwargs)
    name = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    return parse_json(data, name, max_depth, fix)


def read_json_lines(path: Union[str, os.PathLike], limit: int, *, what: str = "",
                    fix: str = "", max_depth: int = MAX_JSON_DEPTH, **kwargs) -> list:
    """The JSON value of each non-blank line of the file at `path` (`read_json`'s
    checks, for the whole file and each line, the line named in a refusal)."""
    data = read_regular(path, limit, what=what, fix=fix, **kwargs)
    name = f"{what} {os.fspath(path)}" if what else os.fspath(path)
    return [parse_json(line, f"{name} line {i}", max_depth, fix)
            for i, line in enumerate(data.split(b"\n"), 1) if line.strip()]


_JSON_KINDS = {
    "int": ((int,), "a whole number"), "number": ((int, float), "a number"),
    "str": ((str,), "a string"), "list": ((list,), "a list"),
    "object": ((dict,), "an object"), "bool": ((bool,), "true or false"),
}
_MISSING = object()


def shown_json(value: Any) -> str:
    """A short text of a JSON value for an error message."""
    text = json.dumps(value) if _json_depth(value, 8) <= 8 else \
        f"<a nested {type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def json_value(value: Any, kind: str, where: str, *, low: Optional[float] = None,
               high: Optional[float] = None, none: bool = False) -> Any:
    """`value` (from a handed-over file's JSON) as `kind` ("int", "number", "str",
    "list", "object", "bool"), within [`low`, `high`] for numbers, None where `none`;
    `HandedFileError` naming `where` (the file and the field) and the value otherwise.
    A bool is never an int or a number; a float is never an int."""
    if value is None and none:
        return None
    types, said = _JSON_KINDS[kind]
    ok = isinstance(value, types) and (kind == "bool" or not isinstance(value, bool))
    if ok and kind in ("int", "number"):
        ok = (low is None or value >= low) and (high is None or value <= high)
        if low is not None or high is not None:
            said += (f" from {low:g}" if low is not None else "") + (
                f" to {high:g}" if high is not None else "")
    if not ok:
        raise HandedFileError(f"{where} is {shown_json(value)}, expected {said}"
                              + (" or null" if none else ""))
    return value


def json_field(data: dict, key: str, kind: str, name: str, *, default: Any = _MISSING,
               **kwargs) -> Any:
    """Field `key` of the JSON object `data` read from the file `name` (`json_value`'s
    `kind` and keywords); `default` where it is absent, or a refusal naming it."""
    if key not in data:
        if default is not _MISSING:
            return default
        raise HandedFileError(f"{name} has no field {key!r}")
    return json_value(data[key], kind, f"{name}: field {key!r}", **kwargs)
