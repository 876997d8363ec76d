#!/usr/bin/env bash
# Builds the TensorFlow Federated 0.87 reference environment in .venv-tff at the
# repository root. Idempotent: when the stamp file inside the venv holds the hash of
# requirements.txt, nothing is done. Safe to run from a fresh clone (CI does).
#
# Environment overrides:
#   TFF_VENV    where to build the venv (default: <repo>/.venv-tff)
#   TFF_PYTHON  interpreter that creates it (default: python3.11)
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
req="$here/requirements.txt"
venv="${TFF_VENV:-$repo/.venv-tff}"
python="${TFF_PYTHON:-python3.11}"
stamp="$venv/.tff087-requirements.sha256"

if ! command -v "$python" >/dev/null 2>&1; then
    echo "setup.sh: '$python' not found. TFF 0.87 needs Python 3.11; install it or set TFF_PYTHON." >&2
    exit 2
fi
if ! "$python" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    echo "setup.sh: '$python' is $("$python" -V 2>&1), but the pinned wheels need Python 3.11; set TFF_PYTHON." >&2
    exit 2
fi

want="$(sha256sum "$req" | cut -d' ' -f1)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
    echo "setup.sh: $venv is up to date with $(basename "$req")"
    exit 0
fi

start=$SECONDS
# A venv from another requirements set (or a half-finished one) is rebuilt from
# scratch: --no-deps installs never remove packages that are no longer pinned.
if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" ]]; then
    echo "setup.sh: $venv exists but is not a venv; move it away or set TFF_VENV." >&2
    exit 2
fi
rm -rf "$venv"
"$python" -m venv "$venv"
# The list is a complete, pinned environment; pip's resolver cannot satisfy TFF's own
# pins (jax==0.4.14 has no Python 3.11 jaxlib), so dependencies are not resolved.
# --no-compile: modules are byte-compiled as they are first imported, not all up front.
"$venv/bin/python" -m pip install --quiet --progress-bar off --no-deps --no-compile -r "$req"
"$venv/bin/python" -c 'import tensorflow_federated' 2>/dev/null || {
    echo "setup.sh: installed, but 'import tensorflow_federated' fails in $venv; see the error with:" >&2
    echo "  $venv/bin/python -c 'import tensorflow_federated'" >&2
    exit 1
}
echo "$want" > "$stamp"
echo "setup.sh: built $venv in $((SECONDS - start)) s"
