"""The long fuzzing campaign: every target of tests/test_reliability_fuzz.py, many cases,
mutated HLO modules through the real entry points, then hostile request floods against a
device process with its memory measured.

    python tools/fuzz.py --cases 2200      # 6 targets x 2200 = 13,200 cases, HLO
                                           # mutations, then floods

Runs pytest on the fuzz targets with FAX_BRIDGE_FUZZ_EXAMPLES set (hypothesis' per-target
statistics printed), then tools/hlo_fuzz.py: mutations of every byte class of exported
HloModuleProtos through `run_computation` and a device's Load (`--hlo-cases` each, seed
`--hlo-seed`; worker processes, so a crash is seen and counted as one), then
tools/device_flood.py at `--flood-scale` (1: an unauthenticated 4 x 600 MB flood, 20,000
idle connections, a Broadcast to 20M client ids, a Map over 200,000 clients against a
20 MB cap, SIGTERM while every worker sleeps). Exits non-zero when any part fails.
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
    parser.add_argument("--hlo-cases", type=int, default=2600,
                        help="HLO mutations per entry point (0 skips them)")
    parser.add_argument("--hlo-seed", type=int, default=0,
                        help="seed of the HLO mutations (a case is the same on every run)")
    parser.add_argument("--flood-scale", type=float, default=1.0,
                        help="size factor of the device floods (0 skips them)")
    args = parser.parse_args(argv)
    env = dict(os.environ, FAX_BRIDGE_FUZZ_EXAMPLES=str(args.cases), JAX_PLATFORMS="cpu",
               PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
               "--hypothesis-show-statistics", TARGETS]
    status = subprocess.call(command, cwd=ROOT, env=env)
    if args.hlo_cases > 0:
        hlo = [sys.executable, str(ROOT / "tools" / "hlo_fuzz.py"), "--target", "run",
               "--target", "load", "--cases", str(args.hlo_cases),
               "--seed", str(args.hlo_seed)]
        status = subprocess.call(hlo, cwd=ROOT, env=env) or status
    if args.flood_scale > 0:
        flood = [sys.executable, str(ROOT / "tools" / "device_flood.py"),
                 "--scale", str(args.flood_scale)]
        status = subprocess.call(flood, cwd=ROOT, env=env) or status
    return status


if __name__ == "__main__":
    sys.exit(main())
