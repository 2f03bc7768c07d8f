#!/usr/bin/env bash
# Run HERE (a machine with network and the dev .venv): download the wheels the GPU machine
# needs (CPython 3.12, manylinux x86_64) into DEST (default REPO/.whl). The versions are those
# installed in the venv; torch, cuda-bindings and nvidia-ml-py are left out (preinstalled
# there). See scripts/gpu_check/wheels.py.
#
#   scripts/gpu_check/wheels.sh [DEST]
set -euo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=${PYTHON:-$REPO/.venv/bin/python}
DEST=$(realpath -m "${1:-$REPO/.whl}")
cd "$REPO"
exec "$PY" -m scripts.gpu_check.wheels --dest "$DEST"
