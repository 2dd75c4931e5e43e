#!/usr/bin/env bash
# The README's test command: all set-up on a fresh Debian/Ubuntu machine, then every check.
#   bash scripts/test.sh            lint, types, build, tests, wheel verification
# Set FLASHSPEC_SKIP_WHEEL=1 to skip the wheel build/verify step while iterating.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nasm >/dev/null 2>&1; then
    echo "== installing nasm (apt)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq nasm >/dev/null
fi

PY=${PYTHON:-python3}
echo "== installing flashspec (editable) with pinned test dependencies"
# constraints-ci.txt pins torch to the CPU build; the package itself only asks for a range.
$PY -m pip install -q --disable-pip-version-check -c constraints-ci.txt \
    setuptools wheel
$PY -m pip install -q --disable-pip-version-check -c constraints-ci.txt \
    --no-build-isolation -e '.[dev]'

echo "== ruff"
$PY -m ruff check flashspec tests scripts benchmarks wheels setup.py
echo "== mypy --strict"
$PY -m mypy --strict flashspec

echo "== pytest"
$PY -m pytest -q tests

if [ "${FLASHSPEC_SKIP_WHEEL:-0}" != "1" ] && [ -f wheels/build_and_verify.sh ]; then
    echo "== wheel: build, auditwheel, GNU_STACK, install in a fresh venv, check"
    bash wheels/build_and_verify.sh
fi
echo "== all checks passed"
