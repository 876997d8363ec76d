"""Checked command-line arguments and result files shared by every fax-bridge subcommand.

The `argparse` types here refuse a bad value when the command line is read, before any
work starts; argparse then names the flag (`argument --clients: must be an integer >= 1,
got 0`). Output paths are written exactly as given, never over an input file, through a
new file renamed into place as the output folders' files are (`private_files`: a link
or another user's file at the path is refused, never followed); `save_result` never loses a finished result to a bad
output path: when the file cannot be written it saves the result in the temporary
directory and says where. Output folders are checked here (`output_folder`) and written
through `output_folders`, with `--force` (`add_force`) to replace files fax-bridge did
not write; HOST:PORT flags are read by `addresses` (`listen_address`,
`connect_address`).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import stat
import tempfile
import zipfile
from typing import Callable, Mapping, Optional

import numpy as np

from fax_bridge.errors import ComputationError, FaxBridgeError


def shortened(text: str, limit: Optional[int], whole: str) -> str:
    """`text` cut to its first `limit` characters where longer (None: never), saying
    how long it was and where it is `whole` (a terminal line of a type signature can
    run to kilobytes)."""
    if limit is None or len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text):,} characters; whole {whole})"


def int_in(low: int, high: Optional[int] = None) -> Callable[[str], int]:
    """An argparse type: an integer in [low, high] (no upper bound without `high`)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low or (high is not None and value > high):
            span = f">= {low}" if high is None else f"in {low}..{high}"
            raise argparse.ArgumentTypeError(f"must be an integer {span}, got {value}")
        return value

    return parse


def float_at_least(low: float) -> Callable[[str], float]:
    """An argparse type: a finite float >= low."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
        if not np.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be a finite number >= {low}, got {text}")
        return value

    return parse


def program_subcommand(subparsers, name: str, help: str, description: str,
                       run: Callable, *, clients_default: Optional[int] = None,
                       clients_help: str = "number of clients") -> argparse.ArgumentParser:
    """Adds subcommand `name` of a command that takes a program: `target`
    (MODULE_OR_FILE:FUNCTION) and `--clients` (>= 1). Without `clients_default`, a
    missing `--clients` is None: the clients the program declares
    (`@fb.program(clients=N)`), which `tff.cli.resolve_program` reads; a plain function
    then needs `--clients`.

    Args:
      subparsers: what `ArgumentParser.add_subparsers` returned.
      name, help: the subcommand and its line in `fax-bridge --help`.
      description: its `--help` text (the command module's docstring), printed as written.
      run: called with the parsed arguments; returns the exit status.
      clients_default: `--clients` when not given; None: the program's own.
      clients_help: what `--clients` counts.

    Returns:
      The subcommand's parser, for its own arguments.
    """
    p = subparsers.add_parser(name, help=help, description=description,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", help="MODULE_OR_FILE:FUNCTION")
    if clients_default is None:
        p.add_argument("--clients", type=int_in(1), default=None,
                       help=f"{clients_help} (>= 1; default: the program's own, "
                            "@fb.program(clients=N); required for a plain function)")
    else:
        p.add_argument("--clients", type=int_in(1), default=clients_default,
                       help=f"{clients_help} (>= 1, default {clients_default})")
    p.set_defaults(func=run)
    return p


def listen_address(text: str) -> str:
    """An argparse type: HOST:PORT to listen on, port in 0..65535 (0: a free port),
    checked by `addresses.parse_address` and returned in its one spelling."""
    return _address(text, allow_port_zero=True)


def connect_address(text: str) -> str:
    """An argparse type: HOST:PORT to connect to (a SuperLink), port in 1..65535,
    checked by `addresses.parse_address` and returned in its one spelling."""
    return _address(text, allow_port_zero=False)


def _address(text: str, allow_port_zero: bool) -> str:
    from fax_bridge.system.addresses import normalized
    from fax_bridge.errors import AddressError

    try:
        return normalized(text, "HOST:PORT", allow_port_zero=allow_port_zero)
    except AddressError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def output_folder(text: str) -> str:
    """An argparse type: a folder a command writes into (`output_folders.check_folder`:
    not an existing file, a name the file system takes, writable or creatable)."""
    from fax_bridge.system.output_folders import check_folder

    try:
        return check_folder(text, "folder")
    except FaxBridgeError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def input_file(text: str) -> str:
    """An argparse type: an existing file that can be read, its name valid Unicode (it is
    written into config files)."""
    if not text or "\0" in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a file path")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a UTF-8 name; rename the file") from None
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not an existing file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text


def add_force(parser: argparse.ArgumentParser) -> None:
    """Adds `--force`: replace files in the output folder that fax-bridge did not write."""
    parser.add_argument("--force", action="store_true",
                        help="replace files in the output folder that fax-bridge did not "
                             "write (without it such a file makes the command stop, "
                             "naming it)")


def output_file(text: str) -> str:
    """An argparse type: a file path that can be written, taken exactly as given.

    An existing file (or device) must be writable and ours (a device may be root's); a
    new one needs a writable folder; a link is refused (it is never written through).
    """
    if not text or text.endswith(os.sep):
        raise argparse.ArgumentTypeError(f"{text!r} names a folder, not a file")
    path = pathlib.Path(text)
    if path.is_symlink():
        raise argparse.ArgumentTypeError(f"{text!r} is a symbolic link; give the file "
                                         "itself (an output is never written through a link)")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder, not a file")
    if path.exists():
        owner = path.lstat().st_uid
        if owner != os.geteuid() and (owner != 0 or path.is_file()):
            raise argparse.ArgumentTypeError(f"{text!r} belongs to another user (uid "
                                             f"{owner}); give a path of your own")
        if not os.access(path, os.W_OK):
            raise argparse.ArgumentTypeError(f"{text!r} exists and is not writable")
        return text
    folder = path.parent
    if not folder.is_dir():
        raise argparse.ArgumentTypeError(
            f"the folder {str(folder)!r} of {text!r} does not exist; create it first")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"the folder {str(folder)!r} is not writable")
    return text


def refuse_overwriting(output: Optional[str], inputs: Mapping[str, Optional[str]]) -> None:
    """Raises FaxBridgeError when `output` is one of `inputs` ({what: path}) on disk.

    The same file reached through a symlink, a hard link or another relative path
    counts as the same file.
    """
    if not output or not os.path.exists(output):
        return
    for what, path in inputs.items():
        if path and os.path.exists(path) and os.path.samefile(output, path):
            raise FaxBridgeError(
                f"--output {output} is the same file as {what} {path}; writing it would "
                "destroy the input. Give another --output path.")


def _write_file(path: str, write: Callable[[object], None]) -> None:
    """`write(file)` into `path` as the output folders' files are written
    (`private_files.atomic_file`): a new file in `path`'s folder (the folders from `/`
    down to it ours or root's and writable by no one else, or sticky as `/tmp` is),
    renamed over `path` once complete, keeping an existing file's mode. A failed write
    leaves an existing file as it was. A link at `path` is refused, never followed, and
    so is another user's file (an `UnsafePathError` naming the path). A device or FIFO
    (ours or root's), or a file of ours in a folder that cannot hold the new file, is
    written in place (`private_files.open_in_place`)."""
    from fax_bridge.system import private_files

    try:
        info: Optional[os.stat_result] = os.lstat(path)
    except FileNotFoundError:
        info = None
    regular = info is not None and stat.S_ISREG(info.st_mode)
    folder = os.path.dirname(os.path.abspath(path))
    if info is not None and not stat.S_ISLNK(info.st_mode) and (
            not regular or not os.access(folder, os.W_OK)):
        with private_files.open_in_place(path) as f:
            write(f)
        return
    if regular:
        mode = stat.S_IMODE(info.st_mode)
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    with private_files.atomic_file(path, mode) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def write_or_rescue(path: str, write: Callable[[object], None], suffix: str,
                    what: str) -> tuple[str, Optional[str]]:
    """Writes with `write(file)` to exactly `path`; on failure to a new temporary file.

    Returns (the path written, None) or (the rescue path, the reason `path` failed).
    """
    try:
        _write_file(path, write)
        return path, None
    except OSError as e:  # the refusals of private_files name the path and the fix
        reason = (str(e) if isinstance(e, FaxBridgeError)
                  else f"cannot write {path!r} ({e.strerror or e})")
    fd, rescue = tempfile.mkstemp(prefix=f"fax-bridge-{what}-", suffix=suffix)
    with os.fdopen(fd, "wb") as f:
        write(f)
    return rescue, reason


def write_npz(file, arrays: Mapping[str, np.ndarray]) -> None:
    """Writes `arrays` as an npz archive (as `numpy.savez`, for any key string)."""
    with zipfile.ZipFile(file, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for key, array in arrays.items():
            with archive.open(key + ".npy", "w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def save_result(path: str, arrays: Mapping[str, np.ndarray]) -> tuple[str, Optional[str]]:
    """Saves a result npz at `path` (or rescues it; see `write_or_rescue`)."""
    return write_or_rescue(path, lambda f: write_npz(f, arrays), ".npz", "result")


def load_npz(path: str, flag: str = "--inputs") -> dict[str, np.ndarray]:
    """The arrays of an npz file (`npz_files.read_npz`: a regular file, no pickles, each
    header checked before its array is allocated), or a ComputationError naming the flag
    and the problem."""
    from fax_bridge.system.npz_files import read_npz
    from fax_bridge.system.private_files import UnsafePathError

    try:
        return read_npz(path, what=flag)
    except FileNotFoundError:
        raise ComputationError(f"{flag} {path}: no such file") from None
    except UnsafePathError as e:  # a folder, a FIFO: named by the reader
        raise ComputationError(str(e)) from None
    except PermissionError as e:
        raise ComputationError(f"{flag} {path}: {e.strerror or e}") from None
