#!/usr/bin/env bash
# The README's test command: all set-up on a fresh Debian/Ubuntu machine, then every check.
#   bash scripts/test.sh            lint, types, build, tests, wheel verification
# Set FLASHSPEC_SKIP_WHEEL=1 to skip the wheel build/verify step while iterating.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh dev
PY=${PYTHON:-python3}

echo "== ruff"
$PY -m ruff check flashspec tests scripts benchmarks wheels setup.py
echo "== mypy --strict"
$PY -m mypy --strict flashspec

# Tests never download; make any accidental hub access fail fast instead of hanging.
export HF_HUB_OFFLINE=1
echo "== pytest"
$PY -m pytest -q tests

if [ "${FLASHSPEC_SKIP_WHEEL:-0}" != "1" ] && [ -f wheels/build_and_verify.sh ]; then
    echo "== wheel: build, auditwheel, GNU_STACK, install in a fresh venv, check"
    bash wheels/build_and_verify.sh
fi
echo "== all checks passed"
