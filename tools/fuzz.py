"""The long fuzzing campaign: every target of tests/test_reliability_fuzz.py, many cases,
then hostile request floods against a device process with its memory measured.

    python tools/fuzz.py --cases 2200      # 6 targets x 2200 = 13,200 cases, then floods

Runs pytest on the fuzz targets with FAX_BRIDGE_FUZZ_EXAMPLES set (hypothesis' per-target
statistics printed), then tools/device_flood.py at `--flood-scale` (1: an unauthenticated
4 x 600 MB flood, 20,000 idle connections, a Broadcast to 20M client ids, a Map over
200,000 clients against a 20 MB cap, SIGTERM while every worker sleeps). Exits non-zero
when either part fails.
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
    parser.add_argument("--flood-scale", type=float, default=1.0,
                        help="size factor of the device floods (0 skips them)")
    args = parser.parse_args(argv)
    env = dict(os.environ, FAX_BRIDGE_FUZZ_EXAMPLES=str(args.cases), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--hypothesis-show-statistics", TARGETS]
    status = subprocess.call(command, cwd=ROOT, env=env)
    if args.flood_scale > 0:
        flood = [sys.executable, str(ROOT / "tools" / "device_flood.py"),
                 "--scale", str(args.flood_scale)]
        status = subprocess.call(flood, cwd=ROOT, env=env) or status
    return status


if __name__ == "__main__":
    sys.exit(main())
