"""Build and run the asm ABI/correctness harness (tests/kernels/abi/checkasm.c).

The asm kernels exist only for x86-64 Linux, so everything here is skipped
elsewhere. On x86-64 Linux a missing nasm or gcc is a failure, not a skip: CI
installs both, and a silent skip would let the kernels ship untested.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.abi import ASM_DIR, X86_LINUX, assemble, build_harness, cpu_flags, run, tool

KERNELS = ("residual_avx2", "residual_avx512")
SEED = "20240611"  # fixed so a CI failure reproduces with `checkasm --seed SEED`
HARNESS_TIMEOUT_S = 600

pytestmark = X86_LINUX


def _assemble(asm_dir: Path, out_dir: Path) -> list[Path]:
    return assemble(asm_dir, out_dir, KERNELS)


def _build_harness(objs: list[Path], out_dir: Path) -> Path:
    return build_harness(objs, out_dir, "checkasm", "residual", ("FLASHSPEC_HAVE_ASM",))


@pytest.fixture(scope="module")
def kernel_objects(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return _assemble(ASM_DIR, tmp_path_factory.mktemp("asm"))


@pytest.fixture(scope="module")
def checkasm(kernel_objects: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_harness(kernel_objects, tmp_path_factory.mktemp("checkasm"))


def test_checkasm_passes(checkasm: Path) -> None:
    r = subprocess.run(
        [str(checkasm), "--seed", SEED], capture_output=True, text=True, timeout=HARNESS_TIMEOUT_S
    )
    assert r.returncode == 0, f"checkasm failed (seed {SEED}):\n{r.stdout}\n{r.stderr}"
    summary = re.search(r"checkasm: (\d+) passed, (\d+) failed", r.stdout)
    assert summary, r.stdout
    assert int(summary.group(1)) > 0 and int(summary.group(2)) == 0, r.stdout


def _replace_last(text: str, old: str, new: str) -> str:
    head, found, tail = text.rpartition(old)
    return head + new + tail if found else text


# Each mutant breaks the kernels in one way the harness must notice; if one
# passes, the harness has gone blind to that class of bug.
# name: (file, mutation, expected message, CPU flags the harness needs to see it)
MUTANTS = {
    "clobbers r12": (
        "residual_avx2.asm",
        lambda s: s.replace(
            "FS_FUNC fs_residual_sum_avx2\n", "FS_FUNC fs_residual_sum_avx2\n    xor r12d, r12d\n"
        ),
        "r12 clobbered",
        {"avx2"},
    ),
    "tail store writes past the end": (
        "residual_avx2.asm",
        # the last masked store in the file: the one in fs_scale_avx2's tail
        lambda s: _replace_last(s, "vmaskmovps      [rdi], ymm5, ymm1", "vmovups [rdi], ymm1"),
        "past the end",
        {"avx2"},
    ),
    "missing vzeroupper": (
        "residual_avx2.asm",
        lambda s: re.sub(r"(FS_FUNC fs_scan_avx2.*?)\n\s+vzeroupper\n", r"\1\n", s, flags=re.S),
        "vzeroupper",
        {"avx2", "xgetbv1"},  # the harness reads the upper state with XGETBV(ECX=1)
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_checkasm_catches(mutant: str, tmp_path: Path) -> None:
    file, mutate, expect, needs = MUTANTS[mutant]
    missing = needs - cpu_flags()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}, which the mutant needs")
    asm_dir = tmp_path / "asm"
    shutil.copytree(ASM_DIR, asm_dir)
    src = (asm_dir / file).read_text()
    broken = mutate(src)
    assert broken != src, f"mutant {mutant!r} no longer applies to {file}; update it"
    (asm_dir / file).write_text(broken)
    exe = _build_harness(_assemble(asm_dir, tmp_path), tmp_path)
    r = subprocess.run(
        [str(exe), "--seed", SEED, "--only", "avx2"],
        capture_output=True,
        text=True,
        timeout=HARNESS_TIMEOUT_S,
    )
    assert r.returncode != 0, f"checkasm missed the mutant {mutant!r}:\n{r.stdout}"
    assert expect in r.stderr, r.stderr


def test_gnu_stack_not_executable(kernel_objects: list[Path], tmp_path: Path) -> None:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not found")
    so = tmp_path / "libkernels.so"
    run([tool("gcc"), "-shared", "-o", str(so), *map(str, kernel_objects)])
    headers = run([readelf, "-lW", str(so)]).stdout
    stack = [line for line in headers.splitlines() if "GNU_STACK" in line]
    assert stack, f"no GNU_STACK program header:\n{headers}"
    # Type, offset, vaddr, paddr, filesz, memsz, flags (may contain spaces), align.
    flags = "".join(stack[0].split()[6:-1])
    assert "E" not in flags, f"executable stack: {stack[0]}"
    dynamic = run([readelf, "-dW", str(so)]).stdout
    assert "TEXTREL" not in dynamic, "the kernels need text relocations (not position independent)"


# AVX-512F instructions residual_avx512.asm may use (EVEX-encoded ones plus the
# opmask moves). Before adding one, check that it is in AVX-512F proper: the
# extension's CPUID dispatch checks AVX512F and nothing else.
AVX512F_ALLOWED = {
    "vaddpd",
    "vaddps",
    "vbroadcastss",
    "vcvtps2pd",
    "vextractf64x4",
    "vmaxps",
    "vmovups",
    "vmulps",
    "vpxord",
    "vsubps",
    "kmovw",
}


def _disassemble(obj: Path) -> list[tuple[str, str, str]]:
    """(first opcode byte, mnemonic, operands) for each instruction of obj."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not found")
    raw = run([objdump, "-d", "-M", "intel", str(obj)]).stdout
    insns = []
    for line in raw.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[2].strip():
            mnemonic, _, operands = parts[2].strip().partition(" ")
            insns.append((parts[1].split()[0], mnemonic, operands.strip()))
    assert insns, f"nothing disassembled from {obj}"
    return insns


def test_isa_subsets(kernel_objects: list[Path]) -> None:
    avx2, avx512 = kernel_objects
    for first, mnemonic, operands in _disassemble(avx2):
        insn = f"{mnemonic} {operands}"
        assert first != "62", f"EVEX (AVX-512) instruction in the AVX2 kernels: {insn}"
        assert not re.search(r"\bzmm|\bk[0-7]\b|\{", operands), f"AVX-512 operand: {insn}"
        assert not mnemonic.startswith("vf"), f"FMA instruction in the AVX2 kernels: {insn}"
    for first, mnemonic, operands in _disassemble(avx512):
        if first == "62":
            assert mnemonic in AVX512F_ALLOWED, f"EVEX instruction outside AVX-512F: {mnemonic}"
            # An EVEX instruction on xmm/ymm only would need AVX-512VL.
            assert "zmm" in operands, f"AVX-512VL form (no zmm operand): {mnemonic} {operands}"
        elif mnemonic.startswith("k"):
            assert mnemonic in AVX512F_ALLOWED, f"opmask instruction outside AVX-512F: {mnemonic}"
        assert not mnemonic.startswith("vf"), f"FMA instruction: {mnemonic}"
