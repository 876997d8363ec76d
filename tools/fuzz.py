"""The long fuzzing campaign: every target of tests/test_reliability_fuzz.py, many cases.

    python tools/fuzz.py --cases 2200      # 5 targets x 2200 = 11,000 cases

Runs pytest on the fuzz targets with FAX_BRIDGE_FUZZ_EXAMPLES set, prints hypothesis'
per-target statistics and exits with pytest's status (0: no crash, no hang).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = "tests/test_reliability_fuzz.py"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=2200, help="cases per target")
    args = parser.parse_args(argv)
    env = dict(os.environ, FAX_BRIDGE_FUZZ_EXAMPLES=str(args.cases), JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--hypothesis-show-statistics", TARGETS]
    return subprocess.call(command, cwd=ROOT, env=env)


if __name__ == "__main__":
    sys.exit(main())
