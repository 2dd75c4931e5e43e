"""Residual-kernel benchmark; the code lives in the package (``flashspec bench kernel``).

    python benchmarks/bench_kernel.py [--quick] [--out-dir benchmarks/results]

Kept so that the command the kernel issue documented still works; it runs exactly
``python -m flashspec.bench kernel`` with the same arguments.
"""

from __future__ import annotations

import sys

from flashspec.bench import cli

if __name__ == "__main__":
    sys.exit(cli(["kernel", *sys.argv[1:]]))
