#!/bin/sh
# Used by deploy/Dockerfile (deps stage) after /opt/venv holds the dependencies, before the project is
# installed: refuse CUDA torch, run pip check, optionally prune torch (PRUNE_TORCH=1), and smoke-import the
# dependencies. (The final stage checks the installed project itself.)
set -eu
VENV=${VENV:-/opt/venv}
modules="torch, torch.multiprocessing, numpy, cbor2, aiohttp, pydantic_settings, structlog, prometheus_client, sklearn"
if "$VENV/bin/pip" list --format=freeze | grep -iE '^(nvidia-|triton=)'; then
    echo "finish-venv: CUDA packages installed (see above); torch must be the CPU build" >&2
    exit 1
fi
"$VENV/bin/pip" check
if [ "${PRUNE_TORCH:-1}" = 1 ]; then
    # Never used by a CPU-only runtime without a compiler: C++ test binaries, protoc, and the
    # C++ headers (only for cpp extensions / inductor C++ codegen, which need g++).
    t="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/torch"
    rm -rf "$t/test" "$t/include" "$t"/bin/test_* "$t"/bin/*Test "$t"/bin/protoc*
fi
PYTHONDONTWRITEBYTECODE=1 "$VENV/bin/python" -c "
import $modules
assert torch.version.cuda is None and '+cu' not in torch.__version__, torch.__version__
print('finish-venv: torch', torch.__version__, '(CPU)')"
