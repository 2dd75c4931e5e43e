#!/usr/bin/env bash
# The README's main-job command: set up a fresh Debian/Ubuntu machine (Python >= 3.11), then
# run speculative decoding on the bundled demo pair and check it against plain target decoding.
#   bash scripts/demo.sh                       the default prompt
#   bash scripts/demo.sh "class Stack:"        any prompt; extra flags go to flashspec generate
# Needs no model hub: the demo pair ships inside the package (flashspec/demo/).
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/setup.sh
PY=${PYTHON:-python3}

# The demo never needs the network; say so, so nothing waits on a hub that is not there.
export HF_HUB_OFFLINE=1

PROMPT=${1:-"def quicksort(arr):"}
shift || true
echo "== flashspec generate \"$PROMPT\" --compare $*"
# -m rather than the console script: works even where pip's script folder is not on PATH.
$PY -m flashspec.cli generate "$PROMPT" --compare "$@"
