"""Checks that TFF 0.87 reads our Computation protos with the same type signatures as
federated_language.

Runs in the main venv (federated-language 0.5.4). Every .pb file is read here with
`federated_language`'s building blocks and, in one subprocess, by TFF 0.87 itself
(`.venv-tff/bin/python tools/tff087/read_signatures.py`, hard timeout, whole process
group killed on expiry). Signatures are compared one by one; when a file has a sibling
`NAME.json` holding a `type_signature`, that recorded value must agree too.

    .venv/bin/python tools/tff_check.py --pb-dir tests/data/tff087
    .venv/bin/python tools/tff_check.py --pb-dir out/pb --generate "CMD ... {pb_dir}"
    .venv/bin/python tools/tff_check.py a.pb b.pb

`--generate` runs a command first (e.g. one that exports the examples into the folder
given by `--pb-dir`); `{pb_dir}` in it is replaced by that folder. Exit status: 0 when
every file is OK, 1 on any mismatch or error, 2 when the check itself could not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pathlib
import shlex
import subprocess
import sys
from typing import Iterable, Mapping, Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parents[1]
DEFAULT_TFF_PYTHON = REPO / ".venv-tff" / "bin" / "python"
READER_SCRIPT = REPO / "tools" / "tff087" / "read_signatures.py"
DEFAULT_TIMEOUT_S = 180.0

OK = "OK"
MISMATCH = "MISMATCH"
ERROR = "ERROR"


class CheckError(RuntimeError):
    """The check could not run at all (no TFF venv, reader crashed or timed out, ...)."""


@dataclasses.dataclass(frozen=True)
class Row:
    """The outcome for one .pb file."""

    path: str
    fl_signature: Optional[str]
    tff_signature: Optional[str]
    status: str  # OK, MISMATCH or ERROR
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.status == OK


def collect_pb_paths(pb_dirs: Iterable[os.PathLike | str] = (),
                     paths: Iterable[os.PathLike | str] = ()) -> list[pathlib.Path]:
    """Returns the .pb files directly inside each folder plus the given files, deduplicated."""
    found: list[pathlib.Path] = []
    for d in map(pathlib.Path, pb_dirs):
        if not d.is_dir():
            raise CheckError(f"--pb-dir {d} is not a folder")
        inside = sorted(d.glob("*.pb"))
        if not inside:  # an exporter that wrote nothing must not pass unseen
            raise CheckError(f"--pb-dir {d} holds no .pb file")
        found.extend(inside)
    found.extend(map(pathlib.Path, paths))
    unique: dict[pathlib.Path, None] = {}
    for p in found:
        unique.setdefault(p.resolve(), None)
    return list(unique)


def read_fl_signature(path: os.PathLike | str) -> str:
    """Deserializes one Computation with federated_language and returns its type signature."""
    from federated_language.compiler import building_blocks
    from federated_language.proto import computation_pb2

    data = pathlib.Path(path).read_bytes()
    proto = computation_pb2.Computation.FromString(data)
    return str(building_blocks.ComputationBuildingBlock.from_proto(proto).type_signature)


def read_tff_signatures(paths: Sequence[os.PathLike | str],
                        tff_python: os.PathLike | str = DEFAULT_TFF_PYTHON,
                        timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, dict]:
    """Runs TFF's reader on `paths` in its own venv; returns {str(path): {type_signature, error}}.

    The reader runs in a new process group (`fax_bridge.tff.side_env`), killed on timeout
    and after a normal exit, so that no stray child survives.
    """
    from fax_bridge.tff import side_env

    try:
        result = side_env.run_json(READER_SCRIPT, [str(p) for p in paths], timeout_s,
                                   python=tff_python)
    except side_env.SideEnvError as e:
        raise CheckError(str(e)) from e
    missing = [str(p) for p in paths if str(p) not in result]
    if missing:
        raise CheckError(f"TFF's reader returned no entry for {missing}")
    return result


def _recorded_signature(path: pathlib.Path) -> Optional[str]:
    meta = path.with_suffix(".json")
    if not meta.is_file():
        return None
    try:
        return json.loads(meta.read_text()).get("type_signature")
    except (json.JSONDecodeError, AttributeError):
        return None


def compare(paths: Sequence[os.PathLike | str],
            fl: Mapping[str, tuple[Optional[str], Optional[str]]],
            tff: Mapping[str, Mapping[str, Optional[str]]],
            recorded: Optional[Mapping[str, Optional[str]]] = None) -> list[Row]:
    """Pure comparison: `fl[path] = (signature, error)`, `tff[path] = {type_signature, error}`.

    `recorded[path]`, when given and not None, is a signature both readers must match.
    """
    rows = []
    for p in map(str, paths):
        fl_sig, fl_err = fl[p]
        tff_sig, tff_err = tff[p].get("type_signature"), tff[p].get("error")
        want = (recorded or {}).get(p)
        errors = []
        if fl_err:
            errors.append(f"federated_language: {fl_err}")
        if tff_err:
            errors.append(f"TFF: {tff_err}")
        if fl_sig is None and not fl_err:
            errors.append("federated_language: no signature and no error")
        if tff_sig is None and not tff_err:
            errors.append("TFF: no signature and no error")
        if errors:
            rows.append(Row(p, fl_sig, tff_sig, ERROR, "; ".join(errors)))
        elif fl_sig != tff_sig:
            rows.append(Row(p, fl_sig, tff_sig, MISMATCH, "the two readers disagree"))
        elif want is not None and want != fl_sig:
            rows.append(Row(p, fl_sig, tff_sig, MISMATCH,
                            f"both readers differ from the recorded signature {want}"))
        else:
            rows.append(Row(p, fl_sig, tff_sig, OK))
    return rows


def compare_signatures(paths: Sequence[os.PathLike | str],
                       tff_python: os.PathLike | str = DEFAULT_TFF_PYTHON,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> list[Row]:
    """Reads every file with both federated_language and TFF 0.87 and compares the signatures."""
    paths = [str(p) for p in paths]
    if not paths:
        raise CheckError("no .pb files to check")
    fl: dict[str, tuple[Optional[str], Optional[str]]] = {}
    for p in paths:
        try:
            fl[p] = (read_fl_signature(p), None)
        except Exception as e:  # reported in the row
            fl[p] = (None, f"{type(e).__name__}: {e}")
    tff = read_tff_signatures(paths, tff_python=tff_python, timeout_s=timeout_s)
    recorded = {p: _recorded_signature(pathlib.Path(p)) for p in paths}
    return compare(paths, fl, tff, recorded)


def format_table(rows: Sequence[Row], base: os.PathLike | str = REPO) -> str:
    """Renders the rows as a plain-text table, paths relative to `base` where possible."""
    def name(p: str) -> str:
        try:
            return str(pathlib.Path(p).relative_to(base))
        except ValueError:
            return p

    # One line per file; both signatures are spelled out only where they differ.
    width = max([len(name(r.path)) for r in rows] + [4])
    lines = [f"{'status':8s}  {'file'.ljust(width)}  signature (federated_language = TFF 0.87)"]
    for r in rows:
        same = r.fl_signature == r.tff_signature
        sig = (r.fl_signature if same
               else f"fl: {r.fl_signature or '-'}  tff: {r.tff_signature or '-'}")
        lines.append(f"{r.status:8s}  {name(r.path).ljust(width)}  {sig}")
    lines += [f"  {name(r.path)}: {r.detail}" for r in rows if r.status != OK]
    return "\n".join(lines)


def run_generator(command: str, pb_dir: Optional[pathlib.Path], timeout_s: float) -> None:
    """Runs the --generate command (its `{pb_dir}` replaced) from the repository root."""
    if "{pb_dir}" in command and pb_dir is None:
        raise CheckError("--generate uses {pb_dir} but no --pb-dir was given")
    if pb_dir is not None:
        pb_dir.mkdir(parents=True, exist_ok=True)
        command = command.replace("{pb_dir}", shlex.quote(str(pb_dir)))
    from fax_bridge.tff.side_env import kill_group

    proc = subprocess.Popen(shlex.split(command), cwd=REPO, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    try:
        rc = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait()
        raise CheckError(f"--generate command did not finish within {timeout_s:g} s: {command}")
    finally:
        kill_group(proc)
    if rc != 0:
        raise CheckError(f"--generate command exited with status {rc}: {command}")


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", type=pathlib.Path, help=".pb files to check")
    parser.add_argument("--pb-dir", action="append", type=pathlib.Path, default=[],
                        help="check every *.pb directly inside this folder (repeatable)")
    parser.add_argument("--generate", metavar="CMD",
                        help="command run first, e.g. an exporter writing into {pb_dir} "
                             "(the first --pb-dir)")
    parser.add_argument("--tff-python", type=pathlib.Path, default=DEFAULT_TFF_PYTHON,
                        help="interpreter of the TFF 0.87 venv (default: .venv-tff/bin/python)")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds allowed for each subprocess "
                             f"(default: {DEFAULT_TIMEOUT_S:g})")
    args = parser.parse_args(argv)
    if not args.paths and not args.pb_dir:
        parser.error("give --pb-dir DIR and/or .pb files")
    try:
        if args.generate:
            run_generator(args.generate, args.pb_dir[0] if args.pb_dir else None, args.timeout)
        paths = collect_pb_paths(args.pb_dir, args.paths)
        if not paths:
            raise CheckError(f"no .pb files found in {[str(d) for d in args.pb_dir]}")
        rows = compare_signatures(paths, tff_python=args.tff_python, timeout_s=args.timeout)
    except CheckError as e:
        print(f"tff_check: {e}", file=sys.stderr)
        return 2
    print(format_table(rows))
    bad = [r for r in rows if not r.ok]
    print(f"\n{len(rows) - len(bad)}/{len(rows)} OK" + (f", {len(bad)} not OK" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
