"""Building the checkasm-style harnesses of the asm kernels (tests/kernels/abi/) from the tests.

Shared by tests/kernels/test_abi.py (the residual kernels, checkasm.c) and
tests/kernels/test_quant_abi.py (the quantized matmuls, checkquant.c): the tools, the assembly
exactly as setup.py does it, the harness link, and the CPU's flags.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ASM_DIR = ROOT / "asm"
ABI_DIR = ROOT / "tests" / "kernels" / "abi"
EXT_DIR = ROOT / "ext"

X86_LINUX = pytest.mark.skipif(
    not (sys.platform.startswith("linux") and platform.machine().lower() in ("x86_64", "amd64")),
    reason="the asm kernels and their harness are x86-64 Linux only",
)


def tool(name: str) -> str:
    """The path of ``name``; fails the test where it is missing (x86-64 needs it)."""
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} not found: it is required to build and test the asm kernels on x86-64")
    return path


def run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in the checkout; fail the test with its output when it fails."""
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        pytest.fail(f"command failed ({r.returncode}): {' '.join(cmd)}\n{r.stdout}{r.stderr}")
    return r


def assemble(asm_dir: Path, out_dir: Path, kernels: tuple[str, ...]) -> list[Path]:
    """Assemble the kernels exactly as setup.py does: nasm -f elf64 -I asm/ <file> -o <obj>."""
    nasm = tool("nasm")
    objs = []
    for name in kernels:
        obj = out_dir / f"{name}.o"
        src = asm_dir / f"{name}.asm"
        run([nasm, "-f", "elf64", "-I", f"{asm_dir}/", str(src), "-o", str(obj)])
        objs.append(obj)
    return objs


def build_harness(
    objs: list[Path], out_dir: Path, harness: str, reference: str, defines: tuple[str, ...]
) -> Path:
    """Link ``tests/kernels/abi/<harness>.c`` with the C reference ``ext/<reference>.c``, the kernel
    objects and the ABI trampoline into ``out_dir/<harness>``."""
    gcc = tool("gcc")
    trampoline = out_dir / "trampoline.o"
    run([tool("nasm"), "-f", "elf64", str(ABI_DIR / "trampoline.asm"), "-o", str(trampoline)])
    exe = out_dir / harness
    sources = [str(ABI_DIR / f"{harness}.c"), str(EXT_DIR / f"{reference}.c")]
    objects = [*map(str, objs), str(trampoline)]
    flags = ["-O2", "-Wall", *(f"-D{d}" for d in defines), "-I", str(EXT_DIR)]
    run([gcc, *flags, *sources, *objects, "-o", str(exe), "-lm"])
    return exe


def cpu_flags() -> set[str]:
    """The flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    m = re.search(r"^flags\s*:(.*)$", text, re.MULTILINE)
    return set(m.group(1).split()) if m else set()
