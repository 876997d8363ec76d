#!/usr/bin/env bash
# Builds the virtual environments the peer benchmarks run in, one per peer, at the
# repository root (all gitignored by `.venv-*/`):
#
#   .venv-fax     google-fax 0.0.2 on jax 0.4.26 / numpy<2
#   .venv-tff     TensorFlow Federated 0.87 (tools/tff087/setup.sh when present)
#   .venv-flower  Flower's simulation engine (flwr[simulation], Ray-backed)
#
# Usage: benchmarks/peers/setup_venvs.sh [fax|tff|flower|all]   (default: all)
#
# Idempotent: each venv holds a stamp file with the hash of the package spec it was
# built from; a venv whose stamp matches is left alone, any other is rebuilt from
# scratch. Every pip call runs under a timeout.
#
# Environment overrides: PEERS_PYTHON (interpreter, default python3.11),
# PEERS_PIP_TIMEOUT (seconds per pip call, default 1200).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PEERS_PYTHON:-python3.11}"
pip_timeout="${PEERS_PIP_TIMEOUT:-1200}"

# The package specs. Changing one changes its stamp, which rebuilds that venv.
FAX_SPEC=(google-fax==0.0.2 jax==0.4.26 jaxlib==0.4.26 "numpy<2" scikit-learn psutil)
FLOWER_SPEC=("flwr[simulation]==1.42.0" "numpy<2" scikit-learn psutil)

need_python() {
    if ! command -v "$python" >/dev/null 2>&1; then
        echo "setup_venvs.sh: '$python' not found; install Python 3.11 or set PEERS_PYTHON." >&2
        exit 2
    fi
}

# build_venv NAME IMPORT_CHECK SPEC...
build_venv() {
    local name="$1" check="$2"
    shift 2
    local venv="$repo/.venv-$name"
    local stamp="$venv/.peer-spec.sha256"
    local want
    want="$(printf '%s\n' "$python" "$@" | sha256sum | cut -d' ' -f1)"
    if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        echo "setup_venvs.sh: .venv-$name is up to date"
        return 0
    fi
    need_python
    if [[ -e "$venv" && ! -f "$venv/pyvenv.cfg" ]]; then
        echo "setup_venvs.sh: $venv exists but is not a venv; move it away." >&2
        exit 2
    fi
    local start=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    timeout "$pip_timeout" "$venv/bin/python" -m pip install --quiet --progress-bar off --upgrade pip
    timeout "$pip_timeout" "$venv/bin/python" -m pip install --quiet --progress-bar off --no-compile "$@"
    if ! timeout 300 "$venv/bin/python" -c "$check"; then
        echo "setup_venvs.sh: .venv-$name installed, but its import check fails: $check" >&2
        exit 1
    fi
    echo "$want" > "$stamp"
    echo "setup_venvs.sh: built .venv-$name in $((SECONDS - start)) s"
}

build_fax() {
    build_venv fax "import fax, jax, numpy, sklearn, psutil" "${FAX_SPEC[@]}"
}

build_tff() {
    local tool="$repo/tools/tff087/setup.sh"
    if [[ -x "$tool" || -f "$tool" ]]; then
        bash "$tool"
        return
    fi
    # Fallback: the recipe of the shared reference environment.
    local req="$repo/../shared/tff087/requirements.txt"
    if [[ ! -f "$req" ]]; then
        echo "setup_venvs.sh: neither tools/tff087/setup.sh nor $req found." >&2
        exit 2
    fi
    local venv="$repo/.venv-tff"
    local stamp="$venv/.tff087-requirements.sha256"
    local want
    want="$(sha256sum "$req" | cut -d' ' -f1)"
    if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
        echo "setup_venvs.sh: .venv-tff is up to date"
        return 0
    fi
    need_python
    local start=$SECONDS
    rm -rf "$venv"
    "$python" -m venv "$venv"
    timeout "$pip_timeout" "$venv/bin/python" -m pip install --quiet --progress-bar off --upgrade pip
    timeout "$pip_timeout" "$venv/bin/python" -m pip install --quiet --progress-bar off --no-deps -r "$req"
    timeout 300 "$venv/bin/python" -c "import tensorflow_federated, sklearn, psutil"
    echo "$want" > "$stamp"
    echo "setup_venvs.sh: built .venv-tff in $((SECONDS - start)) s"
}

build_flower() {
    build_venv flower "import flwr, flwr.simulation, ray, numpy, sklearn, psutil" "${FLOWER_SPEC[@]}"
}

target="${1:-all}"
case "$target" in
    fax) build_fax ;;
    tff) build_tff ;;
    flower) build_flower ;;
    all) build_fax; build_tff; build_flower ;;
    *)
        echo "usage: $0 [fax|tff|flower|all]" >&2
        exit 2
        ;;
esac
