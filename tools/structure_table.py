"""Print the modules of fax_bridge/ as markdown tables: one per package, with lines and docstring.

Standard library only, so it runs anywhere the repository is checked out:
`python3 tools/structure_table.py` (docs/structure.md pastes its output).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "fax_bridge"
SKIPPED = ("v1",)  # generated protobuf and gRPC modules


def first_sentence(path: Path) -> str:
    """The first sentence of a module's docstring on one line, or '' when it has none.

    A docstring's first line may stop mid-sentence where it wraps, so the lines of the
    first paragraph are joined and cut after the sentence that ends first.
    """
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except SyntaxError as err:
        return f"(does not parse: {err.msg}, line {err.lineno})"
    doc = (ast.get_docstring(tree) or "").strip()
    paragraph = " ".join(line.strip() for line in doc.split("\n\n", 1)[0].splitlines())
    end = re.search(r"(?<!\.)\.(?!\.)(\s|$)", paragraph)
    sentence = paragraph[: end.start() + 1] if end else paragraph
    return sentence.replace("|", "\\|")


def line_count(path: Path) -> int:
    """Lines in a file, as `wc -l` counts them."""
    return path.read_bytes().count(b"\n")


def packages(root: Path) -> dict[str, list[Path]]:
    """Modules by package folder (`fax_bridge/tff`, ...), the generated folders left out."""
    found: dict[str, list[Path]] = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in SKIPPED:
            continue
        package = "/".join(("fax_bridge",) + rel.parts[:-1])
        found.setdefault(package, []).append(path)
    return found


def main(argv: list[str]) -> int:
    """Prints the tables for the package folder in argv[1], else this checkout's fax_bridge/."""
    root = Path(argv[1]).resolve() if len(argv) > 1 else ROOT
    if not root.is_dir():
        print(f"no package folder at {root}; give the path to fax_bridge/", file=sys.stderr)
        return 2
    total_lines = 0
    total_modules = 0
    summary = []
    for package, paths in packages(root).items():
        print(f"\n### `{package}/`\n")
        print("| Module | Lines | What it is (first sentence of its docstring) |")
        print("|---|---:|---|")
        package_lines = 0
        for path in paths:
            lines = line_count(path)
            package_lines += lines
            print(f"| `{path.name}` | {lines} | {first_sentence(path)} |")
        summary.append((package, len(paths), package_lines))
        total_lines += package_lines
        total_modules += len(paths)
    print("\n### Totals\n")
    print("| Package | Modules | Lines |")
    print("|---|---:|---:|")
    for package, count, lines in summary:
        print(f"| `{package}/` | {count} | {lines:,} |")
    print(f"| all (outside the generated `v1/`) | {total_modules} | {total_lines:,} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
