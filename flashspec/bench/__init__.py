"""The ``flashspec bench`` commands (engine, kernel, profile, regret, adaptive, recurrent, batch,
compiled), a module each (a package of methods, measure, report and command where one module
would pass 600 lines), and the helpers that research scripts in ``benchmarks/`` build on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports
from .commands import add_parser, cli, main
from .common import (
    DATA_DIR,
    DEFAULT_OUT,
    HUMANEVAL,
    Prompt,
    held_out_stdlib_files,
    humaneval_prompts,
    machine_info,
    progress,
    pyplot,
    quiet_timing,
    stdlib_prompts,
    write_json,
)

# The public API. Everything above imports the standard library only; the names below pull in
# torch and transformers, so they load on first use (PEP 562), as in ``flashspec`` itself.
#
# Command line:
#   add_parser(subparsers)  add ``bench`` and its commands to a parent's ``add_subparsers()``;
#                           each command sets ``func=main``.
#   main(args)              run the command ``args.bench`` names; returns the exit status.
#   cli(argv=None)          ``python -m flashspec.bench ...``: parse and run ``argv``.
# Prompts and result files (``common``):
#   Prompt, humaneval_prompts, stdlib_prompts, held_out_stdlib_files, DATA_DIR, HUMANEVAL;
#   machine_info, write_json, DEFAULT_OUT; progress, pyplot, quiet_timing.
# The model pair (``pair``):
#   Pair, load_pair(target, draft), make_pair(...), encode(pair, text, max_tokens),
#   setup_pair(args).
# The adaptive workloads (``adaptive``):
#   copy_prompts(limit), mixed_stream(humaneval, copy, seed), FixedArm (a selector that always
#   picks one arm), REGIMES (greedy and sampled settings), SEED_STRIDE (seeds of later passes),
#   load_drafters_for(args) (``args.drafters``: comma-separated names).
# Greedy identity (``identity``): compare_greedy(model, prompt, got, reference) under the tie
#   rule, and its GreedyComparison.
# The submodules (``flashspec.bench.engine``, ``.report``, ``.profile``, ...) are public too:
# ``flashspec.bench.report.engine_table`` and ``flashspec.bench.recurrent.table`` render the
# README's tables.
_LAZY: dict[str, str] = {
    "Pair": ".pair",
    "encode": ".pair",
    "load_pair": ".pair",
    "make_pair": ".pair",
    "setup_pair": ".pair",
    "REGIMES": ".adaptive",
    "SEED_STRIDE": ".adaptive",
    "FixedArm": ".adaptive",
    "copy_prompts": ".adaptive",
    "load_drafters_for": ".adaptive",
    "mixed_stream": ".adaptive",
    "GreedyComparison": ".identity",
    "compare_greedy": ".identity",
}

__all__ = [
    "DATA_DIR",
    "DEFAULT_OUT",
    "HUMANEVAL",
    "REGIMES",
    "SEED_STRIDE",
    "FixedArm",
    "GreedyComparison",
    "Pair",
    "Prompt",
    "add_parser",
    "cli",
    "compare_greedy",
    "copy_prompts",
    "encode",
    "held_out_stdlib_files",
    "humaneval_prompts",
    "load_drafters_for",
    "load_pair",
    "machine_info",
    "main",
    "make_pair",
    "mixed_stream",
    "progress",
    "pyplot",
    "quiet_timing",
    "setup_pair",
    "stdlib_prompts",
    "write_json",
]

if TYPE_CHECKING:
    from .adaptive import (
        REGIMES,
        SEED_STRIDE,
        FixedArm,
        copy_prompts,
        load_drafters_for,
        mixed_stream,
    )
    from .identity import GreedyComparison, compare_greedy
    from .pair import Pair, encode, load_pair, make_pair, setup_pair


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
