#!/usr/bin/env bash
# Build ./wheels/ (repo root): wheels for every runtime dependency of mosaic-learning[learning] (the
# core and torch, scikit-learn: what deploy/Dockerfile installs) and for its build backend
# ([build-system].requires), resolved under ./constraints.txt, so that deploy/Dockerfile can
# install offline. The Dockerfile takes only the dependencies from here
# and builds the project itself from the checkout, so wheels/ needs a rebuild only when
# pyproject.toml's dependencies or constraints.txt change (the Dockerfile says so when a
# dependency is missing). The mosaic_learning wheel built here is used only by the check below.
#
# Usage: deploy/build-wheels.sh [--no-verify]
#   --no-verify   skip the offline install dry-run inside mosaic-base:bookworm
# Env:
#   PYTHON=...         interpreter to build with (default: python3.11, else python3); must be
#                      CPython 3.11 on linux x86_64 so the wheels are cp311/manylinux x86_64
#   TORCH_WHEELS=DIR   where the CPU torch wheel lies (default /opt/wheels; passed as --find-links)
#   BASE_IMAGE=...     image used for the verification step (default mosaic-base:bookworm)
#
# torch is forced onto the local "+cpu" build: when TORCH_WHEELS holds
# torch-<pinned>+cpu-*.whl, "torch==<pinned>+cpu" is added as an extra constraint, and the
# result is checked (no CUDA torch, no nvidia-*/triton wheels) before wheels/ is replaced.
# The project is built from a copy of the tree in /tmp, so the checkout is not written to
# (except wheels/).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$ROOT/wheels"
CONSTRAINTS="$ROOT/constraints.txt"
TORCH_WHEELS="${TORCH_WHEELS:-/opt/wheels}"
BASE_IMAGE="${BASE_IMAGE:-mosaic-base:bookworm}"
VERIFY=1

log() { printf '[build-wheels] %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

while [[ $# -gt 0 ]]; do
    case "$1" in
        --no-verify) VERIFY=0 ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) die "unknown argument: $1" ;;
    esac
    shift
done

[[ -f $ROOT/pyproject.toml ]] || die "no pyproject.toml in $ROOT"
[[ -f $CONSTRAINTS ]] || die "no constraints.txt in $ROOT"

if [[ -z ${PYTHON:-} ]]; then
    if command -v python3.11 >/dev/null; then PYTHON=python3.11; else PYTHON=python3; fi
fi
tag="$("$PYTHON" -c 'import sys, platform; print(f"{sys.implementation.name}{sys.version_info[0]}{sys.version_info[1]}-{sys.platform}-{platform.machine()}")')"
[[ $tag == cpython311-linux-x86_64 ]] || die "$PYTHON is $tag; need CPython 3.11 on linux x86_64 (set PYTHON=...)"
log "python: $("$PYTHON" -c 'import sys; print(sys.executable, sys.version.split()[0])')"

WORK="$(mktemp -d /tmp/mosaic-wheels.XXXXXX)"
trap 'rm -rf "$WORK"' EXIT

# Copy of the project (no venv, caches, build output, old egg-info) to build from.
mkdir -p "$WORK/src"
extra=()
for f in "$ROOT"/README* "$ROOT"/LICENSE* "$ROOT"/NOTICE* "$ROOT"/setup.cfg "$ROOT"/setup.py "$ROOT"/MANIFEST.in; do
    if [[ -e $f ]]; then extra+=("./${f#"$ROOT"/}"); fi
done
(cd "$ROOT" && tar -c \
    --exclude=./.venv --exclude=./.git --exclude=./wheels --exclude=./runs \
    --exclude=./build --exclude=./dist --exclude='*.egg-info' --exclude=__pycache__ \
    --exclude=.pytest_cache --exclude=.ruff_cache --exclude=.hypothesis \
    ./pyproject.toml ./src "${extra[@]}") \
    | tar -C "$WORK/src" -x

pip_args=(wheel --wheel-dir "$WORK/wheels" --constraint "$CONSTRAINTS" --progress-bar off --no-cache-dir)
pinned_torch="$(sed -n 's/^[[:space:]]*torch[[:space:]]*==[[:space:]]*\([^[:space:];#]*\).*/\1/p' "$CONSTRAINTS" | head -n1)"
if [[ -d $TORCH_WHEELS ]]; then
    pip_args+=(--find-links "$TORCH_WHEELS")
    if [[ -n $pinned_torch && $pinned_torch != *+* ]] &&
        compgen -G "$TORCH_WHEELS/torch-${pinned_torch}+cpu-cp311-cp311-*x86_64.whl" >/dev/null; then
        printf 'torch==%s+cpu\n' "$pinned_torch" >"$WORK/cpu-torch.txt"
        pip_args+=(--constraint "$WORK/cpu-torch.txt")
        log "torch pinned to ${pinned_torch}+cpu from $TORCH_WHEELS"
    fi
else
    log "warning: $TORCH_WHEELS does not exist; torch comes from the index (check it is a CPU build)"
fi

# The build backend too (setuptools), so the Dockerfile can build the project with --no-index.
mapfile -t build_reqs < <("$PYTHON" -c 'import sys, tomllib
print("\n".join(tomllib.load(open(sys.argv[1], "rb")).get("build-system", {}).get("requires", [])))' \
    "$ROOT/pyproject.toml" | sed '/^$/d')
log "pip ${pip_args[*]} $WORK/src[learning] ${build_reqs[*]}"
start=$SECONDS
"$PYTHON" -m pip "${pip_args[@]}" "$WORK/src[learning]" "${build_reqs[@]}"
log "pip wheel done in $((SECONDS - start))s"

# Sanity checks before replacing wheels/.
shopt -s nullglob
whls=("$WORK"/wheels/*.whl)
[[ ${#whls[@]} -gt 0 ]] || die "no wheels built"
compgen -G "$WORK/wheels/mosaic_learning-*.whl" >/dev/null || die "project wheel missing"
torch_whl=("$WORK"/wheels/torch-*.whl)
[[ ${#torch_whl[@]} -eq 1 ]] || die "expected exactly one torch wheel, found ${#torch_whl[@]}"
[[ $(basename "${torch_whl[0]}") == torch-*+cpu-* ]] || die "torch wheel is not a +cpu build: $(basename "${torch_whl[0]}")"
bad=()
for w in "${whls[@]}"; do
    b="$(basename "$w")"
    case "$b" in
        nvidia_*|nvidia-*|triton-*) bad+=("$b (CUDA)") ;;
    esac
    # Tags are the last three dash fields: python-abi-platform (compressed sets joined by '.').
    IFS=- read -r -a f <<<"${b%.whl}"
    n=${#f[@]}; py="${f[n-3]}"; abi="${f[n-2]}"; plat="${f[n-1]}"
    case "$plat" in any|*manylinux*x86_64*) ;; *) bad+=("$b (platform $plat)") ;; esac
    case "$abi" in none|abi3|cp311) ;; *) bad+=("$b (abi $abi)") ;; esac
    case ".$py." in
        *.py3.*|*.py311.*|*.cp311.*) ;;
        *) [[ $abi == abi3 && $py == cp3* ]] || bad+=("$b (python tag $py)") ;;
    esac
done
[[ ${#bad[@]} -eq 0 ]] || die "unusable wheels: ${bad[*]}"

rm -rf "$OUT.new"
mkdir -p "$OUT.new"
cp -p "${whls[@]}" "$OUT.new/"
rm -rf "$OUT"
mv "$OUT.new" "$OUT"
log "wheels/: ${#whls[@]} wheels, $(du -sh "$OUT" | cut -f1); torch: $(basename "${torch_whl[0]}")"

# Offline dry-run install inside the bookworm base image (python 3.11.2, glibc 2.36).
if [[ $VERIFY -eq 1 ]]; then
    if command -v docker >/dev/null && docker image inspect "$BASE_IMAGE" >/dev/null 2>&1; then
        log "verifying offline install in $BASE_IMAGE"
        docker run --rm --network none -v "$OUT:/wheels:ro" "$BASE_IMAGE" sh -ec '
            python3 -m venv /tmp/venv
            /tmp/venv/bin/pip install --disable-pip-version-check --no-index --find-links /wheels \
                --dry-run --quiet --report /tmp/report.json "mosaic-learning[learning]"
            python3 -c "import json; r = json.load(open(\"/tmp/report.json\")); print(len(r[\"install\"]), \"packages resolve offline\")"
        ' >&2 || die "offline install check in $BASE_IMAGE failed"
    else
        log "skipping verification: $BASE_IMAGE not available (run deploy/build-base-image.sh)"
    fi
fi
