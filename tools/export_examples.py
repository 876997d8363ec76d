"""Exports every program an example lists in `__exportable__` into a folder of .pb files.

    python tools/export_examples.py --out DIR [--clients 3]

Each example module names its exportable programs in `__exportable__` and provides
example arguments the way `fax-bridge export` expects (`NAME_example_args(clients)` or
`example_args(clients)`), or lists built programs in `export_targets(clients)`. Used by
`make tff-check`, which then has TensorFlow Federated 0.87 read every file back.
"""

from __future__ import annotations

import argparse
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--clients", type=int, default=3)
    args = parser.parse_args(argv)

    from fax_bridge.tff.cli import export_spec, load_target
    from fax_bridge.tff.files import save_computation

    os.makedirs(args.out, exist_ok=True)
    written = 0
    for path in sorted(glob.glob(os.path.join(ROOT, "examples", "*.py"))):
        module, _, _ = load_target(f"{path}:__name__")
        names = list(getattr(module, "__exportable__", []))
        if hasattr(module, "export_targets"):
            names += sorted(module.export_targets(args.clients))
        for name in names:
            proto = export_spec(f"{path}:{name}", args.clients)
            stem = os.path.splitext(os.path.basename(path))[0]
            out = os.path.join(args.out, f"{stem}.{name}.pb")
            save_computation(proto, out)
            print(f"exported {stem}:{name} -> {out} ({proto.ByteSize()} bytes)")
            written += 1
    if not written:
        print("no example lists an __exportable__ program", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
