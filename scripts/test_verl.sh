#!/usr/bin/env bash
# The verl tests: a third environment (.venv-verl) with verl 0.9.1 and Ray beside the CPU torch,
# then `pytest -m verl` (asyncsync's checkpoint engine under verl's own manager and workers on a
# local Ray cluster), then the model-layout tests again on the transformers verl pins (< 5.11).
#
#   bash scripts/test_verl.sh [pytest args]
#
# Fails when verl does not import in that environment, and when pytest collects no test (exit 5),
# so a broken install never passes as a skip.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=.venv-verl

VENV=$VENV EXTRAS=test,verl bash scripts/setup.sh

"$VENV/bin/python" -c "import verl.checkpoint_engine, ray" || { echo "test_verl: verl does not import in $VENV" >&2; exit 1; }

run() {  # pytest in $VENV; exit 5 (nothing collected) is a failure
  local rc=0
  "$VENV/bin/python" -m pytest -q -rs "$@" || rc=$?
  if [ "$rc" -eq 5 ]; then echo "test_verl: pytest collected no test ($*)" >&2; return 1; fi
  return "$rc"
}

run -m verl "$@"
# transformers as verl pins it: the layout tests (checkpoint names, fused experts, PEFT) on that version too
"$VENV/bin/python" -c "import transformers; print('model-layout tests on transformers', transformers.__version__)"
run tests/test_layout.py tests/test_conversion.py tests/test_tied_weights.py
