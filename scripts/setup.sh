#!/usr/bin/env bash
# Set-up shared by scripts/demo.sh and scripts/test.sh on a fresh Debian/Ubuntu machine:
# nasm (apt) if missing, then flashspec installed editable with the pinned dependencies.
#   bash scripts/setup.sh            the package alone
#   bash scripts/setup.sh dev        with the [dev] extra (tests, linters, wheel tools)
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v nasm >/dev/null 2>&1; then
    echo "== installing nasm (apt)"
    if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq nasm >/dev/null
fi

PY=${PYTHON:-python3}
TARGET="."
if [ -n "${1:-}" ]; then TARGET=".[$1]"; fi
echo "== installing flashspec ($TARGET, editable) with pinned dependencies"
# constraints-ci.txt pins torch to the CPU build; the package itself only asks for a range.
# --upgrade: a new venv carries an old setuptools that predates PEP 639 license metadata.
$PY -m pip install -q --disable-pip-version-check -c constraints-ci.txt --upgrade "setuptools>=77" wheel
$PY -m pip install -q --disable-pip-version-check -c constraints-ci.txt \
    --no-build-isolation -e "$TARGET"
