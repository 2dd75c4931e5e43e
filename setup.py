"""Build of the flashspec._residual extension: NASM kernels + portable C + glue.

Metadata lives in pyproject.toml; this file only knows how to build the native part.

Environment:
  FLASHSPEC_NO_ASM=1  build the portable C kernel only (what non-x86-64 platforms get).
  NASM=/path/to/nasm  the assembler to use (default: nasm on PATH).
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = Path(__file__).resolve().parent
ASM_SOURCES = ["asm/residual_avx2.asm", "asm/residual_avx512.asm"]
# The quantized-matmul kernels: linked only into flashspec._quant, which is built with
# FLASHSPEC_HAVE_QUANT_ASM (and FLASHSPEC_HAVE_ASM) when they are.
QUANT_ASM_SOURCES = ["asm/quant_avx2.asm", "asm/quant_avx512.asm"]
# Py_buffer entered the limited API in 3.11: one abi3 wheel serves every later CPython.
LIMITED_API_HEX = "0x030B0000"
NASM_HELP = (
    "flashspec needs the NASM assembler to build its AVX2/AVX-512 kernels, and none was "
    "found on PATH.\n"
    "  Debian/Ubuntu: apt-get install nasm\n"
    "  Fedora/RHEL/manylinux: dnf install nasm    (or yum install nasm)\n"
    "  macOS: brew install nasm\n"
    "Or build the portable C kernel only with FLASHSPEC_NO_ASM=1 pip install ."
)


def want_asm() -> bool:
    """The asm objects are elf64: x86-64 Linux only, unless the user opted out."""
    if os.environ.get("FLASHSPEC_NO_ASM", "") not in ("", "0"):
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and sys.platform.startswith("linux")


class BuildExtWithNasm(build_ext):
    """Assemble asm/*.asm with nasm and link the objects into the extension."""

    def build_extension(self, ext: Extension) -> None:
        # build_ext relinks only when a file in ext.sources is newer than the .so: it
        # misses the asm objects, kernels.h and a change of FLASHSPEC_NO_ASM, so an
        # in-tree build (pip wheel ., pip install .) after a FLASHSPEC_NO_ASM=1 one
        # would silently ship the old .so without asm. The extension is small: always
        # rebuild it.
        self.force = True
        if want_asm():
            nasm = os.environ.get("NASM") or shutil.which("nasm")
            if not nasm:
                raise SystemExit("error: " + NASM_HELP)
            objs_dir = Path(self.build_temp) / "asm"
            objs_dir.mkdir(parents=True, exist_ok=True)
            quant = ext.name == "flashspec._quant"
            for src in QUANT_ASM_SOURCES if quant else ASM_SOURCES:
                obj = objs_dir / (Path(src).stem + ".o")
                cmd = [nasm, "-f", "elf64", "-I", str(HERE / "asm") + "/",
                       str(HERE / src), "-o", str(obj)]
                self.announce(" ".join(cmd), level=2)
                subprocess.run(cmd, check=True)
                ext.extra_objects.append(str(obj))
            ext.define_macros.append(("FLASHSPEC_HAVE_ASM", "1"))
            if quant:
                ext.define_macros.append(("FLASHSPEC_HAVE_QUANT_ASM", "1"))
        super().build_extension(ext)


residual = Extension(
    "flashspec._residual",
    sources=["ext/_residual.c", "ext/residual.c", "ext/cpu.c"],
    include_dirs=["ext"],
    define_macros=[("Py_LIMITED_API", LIMITED_API_HEX)],
    py_limited_api=True,
    # Portable optimisation only: the ISA is chosen at run time, never at build time.
    extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-fvisibility=hidden"],
    # The asm objects carry .note.GNU-stack; say it at link time as well.
    extra_link_args=["-Wl,-z,noexecstack"] if sys.platform.startswith("linux") else [],
)

quant = Extension(
    "flashspec._quant",
    sources=["ext/_quant.c", "ext/quant.c", "ext/quant_step.c", "ext/cpu.c"],
    include_dirs=["ext"],
    libraries=["m"],
    define_macros=[("Py_LIMITED_API", LIMITED_API_HEX)],
    py_limited_api=True,
    # Portable optimisation only (the ISA is chosen at run time); no contraction, so a
    # product and a sum round where gguf-py's dequantization rounds.
    extra_compile_args=["-O3", "-std=gnu11", "-fno-strict-aliasing", "-fvisibility=hidden",
                        "-ffp-contract=off", "-pthread"],
    extra_link_args=(["-Wl,-z,noexecstack", "-pthread"]
                     if sys.platform.startswith("linux") else []),
)

setup(
    ext_modules=[residual, quant],
    cmdclass={"build_ext": BuildExtWithNasm},
    options={"bdist_wheel": {"py_limited_api": "cp311"}},
)
