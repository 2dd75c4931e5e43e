"""Build and run the quantized-matmul asm harness (tests/kernels/abi/checkquant.c).

checkquant checks asm/quant_avx2.asm and asm/quant_avx512.asm against the C
kernels of ext/quant.c (and a float64 sum over gguf-py's dequantized weights)
for Q4_0/Q4_1/Q8_0/Q5_0 and the repacked Q4_KR/Q6_KR, m = 1..16, odd n and kb, with
guard pages and the ABI trampoline (tests/kernels/abi/trampoline.asm). x86-64 Linux only;
there a missing nasm or gcc is a failure (tests/helpers/abi.py), as for the
residual kernels.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.helpers.abi import ASM_DIR, X86_LINUX, assemble, build_harness, cpu_flags, run, tool

KERNELS = ("quant_avx2", "quant_avx512")
SEED = "20240612"  # fixed so a CI failure reproduces with `checkquant --seed SEED`
HARNESS_TIMEOUT_S = 300

pytestmark = X86_LINUX


def _assemble(asm_dir: Path, out_dir: Path) -> list[Path]:
    return assemble(asm_dir, out_dir, KERNELS)


def _build_harness(objs: list[Path], out_dir: Path) -> Path:
    defines = ("FLASHSPEC_HAVE_ASM", "FLASHSPEC_HAVE_QUANT_ASM")
    return build_harness(objs, out_dir, "checkquant", "quant", defines)


@pytest.fixture(scope="module")
def kernel_objects(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return _assemble(ASM_DIR, tmp_path_factory.mktemp("quant_asm"))


@pytest.fixture(scope="module")
def checkquant(kernel_objects: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_harness(kernel_objects, tmp_path_factory.mktemp("checkquant"))


def test_checkquant_passes(checkquant: Path) -> None:
    r = subprocess.run(
        [str(checkquant), "--seed", SEED], capture_output=True, text=True, timeout=HARNESS_TIMEOUT_S
    )
    print(r.stdout)
    assert r.returncode == 0, f"checkquant failed (seed {SEED}):\n{r.stdout}\n{r.stderr}"
    summary = re.search(r"checkquant: (\d+) passed, (\d+) failed", r.stdout)
    assert summary, r.stdout
    assert int(summary.group(1)) > 0 and int(summary.group(2)) == 0, r.stdout


def _sub(old: str, new: str, count: int = 1):
    def mutate(s: str) -> str:
        # A mutant whose text is gone from the source would test nothing: say so.
        assert old in s, f"mutant anchor not in the source: {old!r}"
        return s.replace(old, new, count)

    return mutate


# Each mutant breaks the kernels in one way the harness must notice.
# name: (file, mutation, backend to run, expected message, CPU flags needed)
MUTANTS = {
    "Q4 nibble order swapped (avx2 Q4_0)": (
        "quant_avx2.asm",
        _sub(
            "    vpsrld          ymm%4, ymm%3, NIBBLE_BITS\n"
            "    vpand           ymm%3, ymm%3, [c_nibble_mask]\n    vpsubd",
            "    vpand           ymm%4, ymm%3, [c_nibble_mask]\n"
            "    vpsrld          ymm%3, ymm%3, NIBBLE_BITS\n    vpsubd",
        ),
        "avx2",
        "float64 reference",
        {"avx2", "fma", "f16c"},
    ),
    "Q4 nibble order swapped (avx512 Q4_1)": (
        "quant_avx512.asm",
        _sub(
            "    vpsrld          zmm%3, zmm%2, NIBBLE_BITS\n    vbroadcastss    zmm0, [SLOT]",
            "    vmovdqa32       zmm%3, zmm%2\n"
            "    vpsrld          zmm%2, zmm%2, NIBBLE_BITS\n    vbroadcastss    zmm0, [SLOT]",
        ),
        "avx512",
        "float64 reference",
        {"avx512f", "avx2"},
    ),
    "Q4_1 min dropped (avx2)": (
        "quant_avx2.asm",
        _sub("vfmadd132ps     ymm%4, ymm1, ymm0", "vmulps          ymm%4, ymm%4, ymm0"),
        "avx2",
        "float64 reference",
        {"avx2", "fma", "f16c"},
    ),
    "Q4_1 min dropped (avx512)": (
        "quant_avx512.asm",
        _sub(
            "vfmadd213ps     zmm0, zmm2, [SLOT + FLOAT_BYTES]{1to16}",
            "vmulps          zmm0, zmm0, zmm2",
        ),
        "avx512",
        "float64 reference",
        {"avx512f", "avx2"},
    ),
    "Q4_KR min dropped (avx2)": (
        "quant_avx2.asm",
        _sub("vbroadcastss    ymm1, [%1 + Q4_KR_M]", "vxorps          ymm1, ymm1, ymm1"),
        "avx2",
        "float64 reference",
        {"avx2", "fma", "f16c"},
    ),
    "Q6_KR halves' scales swapped (avx2)": (
        "quant_avx2.asm",
        _sub("[%1 + Q6_KR_D + %2 * KR_SCALE_BYTES]", "[%1 + Q6_KR_D + (1 - %2) * KR_SCALE_BYTES]"),
        "avx2",
        "float64 reference",
        {"avx2", "fma", "f16c"},
    ),
    "Q6_KR one scale for both halves (avx512)": (
        "quant_avx512.asm",
        _sub("[%1 + Q6_KR_D + KR_SCALE_BYTES]{1to16}", "[%1 + Q6_KR_D]{1to16}"),
        "avx512",
        "float64 reference",
        {"avx512f", "avx2"},
    ),
    "Q4_KR scale and min swapped (avx512)": (
        "quant_avx512.asm",
        _sub("vbroadcastss    zmm0, [%1 + Q4_KR_D]", "vbroadcastss    zmm0, [%1 + Q4_KR_M]"),
        "avx512",
        "float64 reference",
        {"avx512f", "avx2"},
    ),
    "Q5_0 high bits of the wrong elements (avx2)": (
        "quant_avx2.asm",
        _sub("Q5_HIGH_BITS    %1, %4, %2 + 2", "Q5_HIGH_BITS    %1, %4, %2"),
        "avx2",
        "float64 reference",
        {"avx2", "fma", "f16c"},
    ),
    "Q5_0 halves' high bits swapped (avx512)": (
        "quant_avx512.asm",
        _sub("kmovw           k1, [%1 + Q5_0_QH]", "kmovw           k1, [%1 + Q5_0_QH + 2]"),
        "avx512",
        "float64 reference",
        {"avx512f", "avx2"},
    ),
    "Q5_0 bias dropped (avx512)": (
        "quant_avx512.asm",
        _sub("vmovups         zmm2, [c_q5_0_levels]", "vmovups         zmm2, [c_q4_1_levels]"),
        "avx512",
        "float64 reference",
        {"avx512f", "avx2"},
    ),
    "Q5_0 reads past the block (avx2)": (
        "quant_avx2.asm",
        _sub("[%1 + Q5_0_QS + %2 * 8]", "[%1 + Q5_0_QS + %2 * 8 + 1]"),
        "avx2",
        "memory fault",
        {"avx2", "fma", "f16c"},
    ),
    "clobbers r12": (
        "quant.inc",
        _sub(
            "    pop             rbx\n    vzeroupper",
            "    pop             rbx\n    xor r12d, r12d\n    vzeroupper",
        ),
        "avx2",
        "r12 clobbered",
        {"avx2", "fma", "f16c"},
    ),
    "Q8_0 reads past the block (avx512)": (
        "quant_avx512.asm",
        _sub("[%1 + Q8_0_QS + 16]", "[%1 + Q8_0_QS + 18]"),
        "avx512",
        "memory fault",
        {"avx512f", "avx2"},
    ),
    "FMA probe clobbers rbx (avx512)": (
        "quant.inc",
        _sub(
            "    dec             rdi\n    jnz             %%round",
            "    dec             rdi\n    mov ebx, edi\n    jnz             %%round",
        ),
        "avx512",
        "rbx clobbered",
        {"avx512f", "avx2"},
    ),
    "FMA probe without vzeroupper (avx2)": (
        "quant.inc",
        _sub("%%done:\n    vzeroupper\n    ret", "%%done:\n    ret"),
        "avx2",
        "vzeroupper",
        {"avx2", "fma", "f16c", "xgetbv1"},
    ),
    "missing vzeroupper": (
        "quant.inc",
        _sub("    vzeroupper\n    ret", "    ret"),
        "avx2",
        "vzeroupper",
        {"avx2", "fma", "f16c", "xgetbv1"},
    ),
}


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_checkquant_catches(mutant: str, tmp_path: Path) -> None:
    file, mutate, only, expect, needs = MUTANTS[mutant]
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
        [str(exe), "--seed", SEED, "--only", only],
        capture_output=True,
        text=True,
        timeout=HARNESS_TIMEOUT_S,
    )
    assert r.returncode != 0, f"checkquant missed the mutant {mutant!r}:\n{r.stdout}"
    assert expect in r.stderr, r.stderr


def test_gnu_stack_not_executable(kernel_objects: list[Path], tmp_path: Path) -> None:
    readelf = shutil.which("readelf")
    if readelf is None:
        pytest.skip("readelf not found")
    so = tmp_path / "libquant.so"
    run([tool("gcc"), "-shared", "-o", str(so), *map(str, kernel_objects)])
    headers = run([readelf, "-lW", str(so)]).stdout
    stack = [line for line in headers.splitlines() if "GNU_STACK" in line]
    assert stack, f"no GNU_STACK program header:\n{headers}"
    flags = "".join(stack[0].split()[6:-1])
    assert "E" not in flags, f"executable stack: {stack[0]}"
    dynamic = run([readelf, "-dW", str(so)]).stdout
    assert "TEXTREL" not in dynamic, "the kernels need text relocations (not position independent)"


def _disassemble(obj: Path) -> list[tuple[str, str, str]]:
    """(first opcode byte, mnemonic, operands) of each instruction, skipping the
    per-function jump tables (.variants: data in .text)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.skip("objdump not found")
    raw = run([objdump, "-d", "-M", "intel", str(obj)]).stdout
    insns, in_table = [], False
    for line in raw.splitlines():
        label = re.match(r"^[0-9a-f]+ <(.*)>:$", line)
        if label:
            in_table = label.group(1).endswith(".variants")
            continue
        parts = line.split("\t")
        if not in_table and len(parts) >= 3 and parts[2].strip():
            mnemonic, _, operands = parts[2].strip().partition(" ")
            insns.append((parts[1].split()[0], mnemonic, operands.strip()))
    assert insns, f"nothing disassembled from {obj}"
    return insns


# VEX instructions the AVX-512 file may use beside AVX-512F (AVX/AVX2 on xmm/ymm 0-15).
AVX512_FILE_VEX = {
    "vaddps", "vaddss", "vcvtph2ps", "vextractf128", "vmovd", "vmovhlps", "vmovq",
    "vmovshdup", "vmovss", "vpbroadcastw", "vzeroupper",
}  # fmt: skip


def test_isa_subsets(kernel_objects: list[Path]) -> None:
    avx2, avx512 = kernel_objects
    for first, mnemonic, operands in _disassemble(avx2):
        insn = f"{mnemonic} {operands}"
        assert first != "62", f"EVEX (AVX-512) instruction in the AVX2 kernels: {insn}"
        assert not re.search(r"\bzmm|\bk[0-7]\b|\{", operands), f"AVX-512 operand: {insn}"
    for first, mnemonic, operands in _disassemble(avx512):
        insn = f"{mnemonic} {operands}"
        if first == "62":
            # AVX-512F only: an EVEX form on xmm/ymm alone would need VL; no opmasks
            # (vpbroadcastw zmm would need BW).
            assert "zmm" in operands, f"AVX-512VL form (no zmm operand): {insn}"
            assert mnemonic not in ("vpbroadcastw", "vpbroadcastb", "vpmovzxbw"), insn
        elif mnemonic.startswith("k"):
            # Opmask loads (Q5_0's high bits): kmovw is AVX-512F; kmovb/kmovd/kmovq are not.
            assert mnemonic == "kmovw", f"opmask instruction beyond AVX-512F: {insn}"
        elif mnemonic.startswith("v"):
            assert mnemonic in AVX512_FILE_VEX, f"unexpected VEX instruction: {insn}"
