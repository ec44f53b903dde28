#!/usr/bin/env bash
# Creates .venv (if missing) with everything Nano-SkyRL needs; cheap to re-run (a stamp skips done work).
#   bash setup.sh        runtime dependencies
#   bash setup.sh test   runtime + test dependencies
set -euo pipefail
cd "$(dirname "$0")"
extra=${1:-}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.installed-$(cat pyproject.toml setup.sh | sha1sum | cut -c1-12)-${extra:-run}"
[ -e "$stamp" ] && exit 0
# torch first and pinned on CPU machines: 2.13.0 resolves to the CPU build there, while a later install
# that admitted a newer torch would pull the multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1; then .venv/bin/pip install -q torch
    else .venv/bin/pip install -q torch==2.13.0; fi
fi
.venv/bin/pip install -q --disable-pip-version-check -e ".${extra:+[$extra]}"
touch "$stamp"
