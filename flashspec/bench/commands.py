"""The ``flashspec bench`` parser and the dispatch of its commands to their modules."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..cli import argtypes
from ..cli.options import EngineOptions, add_compile_argument
from .common import DEFAULT_OUT


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` and its commands to ``subparsers`` (a parent's ``add_subparsers()``).

    Each command sets ``func=main``; ``main(args)`` returns the exit status.
    """
    bench: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="benchmarks: engine vs HF generate/assisted generation, kernel, round profile",
        description=(
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
        ),
    )
    which = bench.add_subparsers(dest="bench", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--quick", action="store_true", help="a short run (under two minutes)")
        p.add_argument(
            "--out-dir",
            type=Path,
            default=DEFAULT_OUT,
            help=f"where result files go (default {DEFAULT_OUT})",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.set_defaults(func=main)

    def models(p: argparse.ArgumentParser) -> None:
        EngineOptions.add_model_arguments(
            p, draft_default="demo-draft", draft_help="draft: local path, or none (no draft model)"
        )
        p.add_argument(
            "--threads",
            type=argtypes.positive_int,
            default=None,
            help="torch threads (default: torch's own)",
        )
        p.add_argument(
            "--max-prompt-tokens",
            type=argtypes.positive_int,
            default=128,
            help="keep the last N prompt tokens (default 128: the demo pair trained on "
            "256-token windows, and 128 new tokens follow)",
        )

    def engine_options(p: argparse.ArgumentParser) -> None:
        add_compile_argument(p)
        p.add_argument(
            "--humaneval",
            type=argtypes.nonnegative_int,
            default=None,
            help="HumanEval prompts (first N; default 20, 12 for a real model)",
        )
        p.add_argument(
            "--stdlib", type=argtypes.nonnegative_int, default=10, help="held-out stdlib prefixes"
        )
        p.add_argument("--max-new-tokens", type=argtypes.positive_int, default=128)
        p.add_argument(
            "--sweep-prompts",
            type=argtypes.nonnegative_int,
            default=None,
            help="prompts in the gamma sweep (default 8; a real model: 4 of each workload)",
        )
        p.add_argument(
            "--sweep-gammas",
            default=None,
            help="gamma values to sweep (default 1,...,8; a real model: 2,3,4,6,8,10)",
        )
        p.add_argument("--no-sweep", action="store_true", help="skip the gamma sweep")
        p.add_argument(
            "--lengths",
            type=argtypes.int_list,
            default=None,
            help="new-token counts of the long-generation study: the default engine against "
            "HF greedy at each, and time per round against context length (default "
            "128,512,1024; --quick 32,96; 0 skips it)",
        )
        p.add_argument(
            "--length-prompts",
            type=argtypes.positive_int,
            default=None,
            help="prompts of the long-generation study (default 4; a real model 3)",
        )
        p.add_argument(
            "--methods", default=None, help="comma-separated subset of methods (default: all)"
        )

    engine = which.add_parser(
        "engine", help="flashspec vs HF generate / assisted generation / prompt lookup"
    )
    common(engine)
    models(engine)
    engine_options(engine)
    engine.add_argument(
        "--name",
        default="engine",
        help="result file stem (default engine; for a real model its name, e.g. smollm2)",
    )
    engine.add_argument(
        "--copy",
        type=argtypes.nonnegative_int,
        default=None,
        help="a real model: copy-heavy chat requests (rename, docstring, type hints, quote a "
        "text; default 16)",
    )
    engine.add_argument(
        "--no-llamacpp",
        action="store_true",
        help="a real model: skip the llama.cpp rows (they need llama-cpp-python and a GGUF)",
    )

    kernel = which.add_parser("kernel", help="residual kernel vs NumPy, torch and C")
    common(kernel)
    kernel.add_argument("--name", default="kernel", help="result file stem (default kernel)")

    quant = which.add_parser(
        "quant", help="quantized matmul kernels per GGUF format, backend and row count"
    )
    common(quant)
    quant.add_argument("--name", default="quant", help="result file stem (default quant)")

    profile = which.add_parser("profile", help="where one round's time goes")
    common(profile)
    models(profile)
    profile.add_argument(
        "--prompts", type=argtypes.positive_int, default=6, help="HumanEval prompts profiled"
    )
    profile.add_argument("--max-new-tokens", type=argtypes.positive_int, default=128)
    profile.add_argument(
        "--name",
        default="profile",
        help="result file stem (default profile; for a real model profile-NAME)",
    )

    from .regret import add_arguments as regret_arguments

    regret = which.add_parser("regret", help="selectors' synthetic regret on Bernoulli arms")
    common(regret)
    regret_arguments(regret)

    from .adaptive import add_arguments as adaptive_arguments

    adaptive = which.add_parser(
        "adaptive", help="online drafter/gamma selection vs every fixed arm, on real workloads"
    )
    common(adaptive)
    adaptive_arguments(adaptive)

    from .recurrent import add_arguments as recurrent_arguments

    recurrent = which.add_parser(
        "recurrent", help="recurrent/hybrid pairs: speedup over HF generate, replay cost"
    )
    common(recurrent)
    recurrent_arguments(recurrent)

    from .batch import add_arguments as batch_arguments

    batch = which.add_parser(
        "batch", help="ragged vs lockstep batches against HF batched generate, B = 1 to 32"
    )
    common(batch)
    models(batch)
    batch_arguments(batch)

    from .compiled import add_arguments as compiled_arguments

    compiled = which.add_parser(
        "compiled",
        help="the compiled path vs flashspec eager, HF generate eager and HF static+compile",
    )
    common(compiled)
    models(compiled)
    compiled_arguments(compiled)

    every = which.add_parser(
        "all", help="kernel, engine and profile in turn (kernel.json, engine.json, profile.json)"
    )
    common(every)
    models(every)
    engine_options(every)
    every.add_argument(
        "--profile-prompts",
        dest="prompts",
        type=argtypes.positive_int,
        default=6,
        help="prompts profiled",
    )
    return bench


# Command -> the module that runs it (each has ``main(args) -> int``). Imported on use: the
# model benchmarks pull in torch and transformers, which ``kernel`` and ``regret`` do not need.
COMMANDS: dict[str, str] = {
    "engine": ".engine",
    "kernel": ".kernel",
    "quant": ".quant",
    "profile": ".profile",
    "regret": ".regret",
    "adaptive": ".adaptive",
    "recurrent": ".recurrent",
    "batch": ".batch",
    "compiled": ".compiled",
}
ALL = ("kernel", "engine", "profile")
"""What ``flashspec bench all`` runs, in order."""


def _runner(command: str) -> Callable[[argparse.Namespace], int]:
    run: Callable[[argparse.Namespace], int] = importlib.import_module(
        COMMANDS[command], __package__
    ).main
    return run


def main(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.bench`` names; write its JSON (and PNG) to ``args.out_dir``."""
    if args.bench in COMMANDS:
        return _runner(args.bench)(args)
    if args.bench == "all":
        status = 0
        for name in ALL:
            print(f"\n=== flashspec bench {name} ===", file=sys.stderr, flush=True)
            status = max(status, _runner(name)(argparse.Namespace(**{**vars(args), "name": name})))
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
