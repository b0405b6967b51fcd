#!/usr/bin/env bash
# Builds asyncsync's wheel the way a packager would on top of an installed torch and checks that it
# carries the compiled CPU pack op (asyncsync/_pack_cpu*.so, built by setup.py at install time).
#   bash scripts/check_wheel.sh        (uses .venv, made by scripts/setup.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$VENV/bin/pip" wheel -q --no-build-isolation --no-deps . -w "$out" 2>&1 | grep -v "^WARNING: Location" || true
wheel="$(ls "$out"/asyncsync-*.whl)"
# The whole listing first: a grep that stops reading early would break the lister's pipe (pipefail).
listing="$("$VENV/bin/python" -m zipfile -l "$wheel")"
so="$(grep -o 'asyncsync/_pack_cpu[^ ]*\.so' <<<"$listing" || true)"
if [ -z "$so" ]; then
  echo "check_wheel: $(basename "$wheel") has no compiled asyncsync/_pack_cpu extension" >&2
  exit 1
fi
echo "check_wheel: $(basename "$wheel") carries $so"
