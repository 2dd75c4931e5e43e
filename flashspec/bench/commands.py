"""The ``flashspec bench`` parser, built from one table of its commands, and the dispatch of a
command to the module that runs it."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from ..flags import argtypes
from . import flags
from .common import DEFAULT_OUT

COMMANDS: dict[str, str] = {
    "engine": ".engine",
    "kernel": ".kernel",
    "quant": ".quant",
    "profile": ".profile",
    "regret": ".regret",
    "adaptive": ".adaptive",
    "recurrent": ".recurrent",
    "batch": ".batch.command",
    "compiled": ".compiled.command",
}
"""Command -> the module that runs it, in ``--help``'s order. Each has ``HELP`` (its line in
``--help``), ``add_arguments(parser)`` (its flags, besides ``--quick``, ``--out-dir`` and
``--no-progress``) and ``main(args) -> int``."""

ALL = ("kernel", "engine", "profile")
"""What ``flashspec bench all`` runs, in order."""

DESCRIPTION = (
    "engine: flashspec against plain HF generate, HF assisted generation with the same "
    "draft and HF prompt lookup, on HumanEval and held-out stdlib code, then a gamma "
    "sweep (engine.json, engine.png). kernel: the residual kernel against NumPy, torch "
    "and C (kernel.json, kernel.png). quant: the quantized matmul kernels per GGUF "
    "format and row count against the read bandwidth and torch (quant.json). "
    "profile: where a speculative round's time goes (profile.json). regret: UCB1 and "
    "Thompson sampling on Bernoulli arms (regret.json, regret.png). recurrent: "
    "recurrent/hybrid pairs (recurrent.json). batch: ragged against lockstep batches "
    "and HF batched generate (batch.json). compiled: the compiled path against "
    "flashspec eager, HF generate eager and HF generate on a compiled static cache "
    "(compiled.json)."
)


def _module(command: str) -> ModuleType:
    return importlib.import_module(COMMANDS[command], __package__)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="a short run (under two minutes)")
    p.add_argument(
        "--out-dir",
        type=Path,
        default=DEFAULT_OUT,
        help=f"where result files go (default {DEFAULT_OUT})",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=main)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` and its commands to ``subparsers`` (a parent's ``add_subparsers()``).

    Each command sets ``func=main``; ``main(args)`` returns the exit status.
    """
    bench: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="benchmarks: engine vs HF generate/assisted generation, kernel, round profile",
        description=DESCRIPTION,
    )
    which = bench.add_subparsers(dest="bench", required=True)
    for name in COMMANDS:
        command = _module(name)
        parser = which.add_parser(name, help=command.HELP)
        _common(parser)
        command.add_arguments(parser)

    every = which.add_parser(
        "all", help="kernel, engine and profile in turn (kernel.json, engine.json, profile.json)"
    )
    _common(every)
    flags.models(every)
    flags.engine(every)
    every.add_argument(
        "--profile-prompts",
        dest="prompts",
        type=argtypes.positive_int,
        default=6,
        help="prompts profiled",
    )
    return bench


def main(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.bench`` names; write its JSON (and PNG) to ``args.out_dir``."""
    if args.bench in COMMANDS:
        status: int = _module(args.bench).main(args)
        return status
    if args.bench == "all":
        status = 0
        for name in ALL:
            print(f"\n=== flashspec bench {name} ===", file=sys.stderr, flush=True)
            ran: int = _module(name).main(argparse.Namespace(**{**vars(args), "name": name}))
            status = max(status, ran)
        return status
    raise SystemExit(f"unknown benchmark {args.bench!r}")


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m flashspec.bench engine|kernel|profile|... [...]``: parse ``argv`` (default
    ``sys.argv[1:]``) as ``flashspec bench`` arguments and run the command."""
    parser = argparse.ArgumentParser(prog="flashspec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    status: int = args.func(args)
    return status
