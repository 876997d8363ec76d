#!/usr/bin/env bash
# Builds the LiteRT converter's side environment in .venv-litert at the repository root
# (fax_bridge.litert.convert runs fax_bridge/litert/side_convert.py with its python).
# Idempotent: when the stamp file inside the venv holds the hash of requirements.txt,
# nothing is done. Safe to run from a fresh clone.
#
# Environment overrides:
#   LITERT_VENV    where to build the venv (default: <repo>/.venv-litert)
#   LITERT_PYTHON  interpreter that creates it (default: python3.11)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
req="$here/requirements.txt"
venv="${LITERT_VENV:-$repo/.venv-litert}"
python="${LITERT_PYTHON:-python3.11}"
stamp="$venv/.litert-requirements.sha256"

if ! command -v "$python" >/dev/null 2>&1; then
    echo "setup.sh: '$python' not found; install Python 3.11 or set LITERT_PYTHON." >&2
    exit 2
fi
want="$(sha256sum "$req" | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "setup.sh: $venv is up to date with $(basename "$req")"
    exit 0
fi
if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" ]]; then
    echo "setup.sh: $venv exists but is not a venv; move it away or set LITERT_VENV." >&2
    exit 2
fi
start=$SECONDS
rm -rf "$venv"
"$python" -m venv "$venv"
# A complete pinned list: installed as it is, with no resolution.
# --no-compile: modules are byte-compiled as they are first imported, not all up front.
"$venv/bin/python" -m pip install --quiet --progress-bar off --no-deps --no-compile -r "$req"
"$venv/bin/python" -c 'import litert_converter.converter_api_ext' 2>/dev/null || {
    echo "setup.sh: installed, but 'import litert_converter.converter_api_ext' fails in $venv; see the error with:" >&2
    echo "  $venv/bin/python -c 'import litert_converter.converter_api_ext'" >&2
    exit 1
}
echo "$want" > "$stamp"
echo "setup.sh: built $venv in $((SECONDS - start)) s ($(du -sh "$venv" | cut -f1))"
