#!/usr/bin/env bash
# The GPU check (docs/gpu.md): `scripts/gpu_check.sh --prepare` here (the test venv), then on the GPU
# machine `scripts/gpu_check.sh` (its own python; nothing is installed from a network). Arguments
# go to scripts/gpu_check.py (--device cpu --shape tiny: the dry run).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" exec "$PYTHON" scripts/gpu_check.py "$@"
