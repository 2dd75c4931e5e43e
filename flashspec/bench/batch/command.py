"""``flashspec bench batch``: its flags, the run they describe, and ``main`` (load, measure,
print the report, write the JSON)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ...flags import argtypes
from ...flags.options import add_compile_argument, compile_setting
from ...loading.gguf import MissingDependencyError
from ...loading.named import ModelNotInstalledError
from ...models import DEMO_NAMES
from .. import common, flags
from ..common import humaneval_prompts, machine_info, write_json
from ..pair import draft_for, load_pair, quiet_and_threads
from .measure import DEFAULT_PROMPTS, BatchSettings, run_batch
from .methods import BASELINE, DEFAULT_BATCHES, METHODS
from .report import text

HELP = "ragged vs lockstep batches against HF batched generate, B = 1 to 32"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench batch``."""
    flags.models(parser)
    parser.add_argument(
        "--batches",
        type=argtypes.positive_int,
        nargs="+",
        default=list(DEFAULT_BATCHES),
        help=f"batch sizes (default {' '.join(map(str, DEFAULT_BATCHES))})",
    )
    parser.add_argument(
        "--prompts",
        type=argtypes.positive_int,
        default=DEFAULT_PROMPTS,
        help=f"HumanEval prompts, the first N (default {DEFAULT_PROMPTS}); each batch size runs "
        "them all, in batches of consecutive prompts",
    )
    parser.add_argument(
        "--max-new-tokens", type=argtypes.positive_int, default=64, help="per row (default 64)"
    )
    parser.add_argument(
        "--repeats",
        type=argtypes.positive_int,
        default=3,
        help="passes over the prompts at each batch size; medians are reported (default 3)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        help=f"methods (default all; {BASELINE}, the reference, always runs)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="result file stem (default batch; for a real model batch-NAME, e.g. batch-smollm2)",
    )
    add_compile_argument(parser)


def result_name(target: str) -> str:
    """``batch`` for the demo pair, ``batch-NAME`` for another target."""
    if target in DEMO_NAMES:
        return "batch"
    return f"batch-{common.result_name(target)}"


def settings_from_args(args: argparse.Namespace) -> BatchSettings:
    """The run ``args`` describes (``--quick``: a short one)."""
    batches, prompts = tuple(args.batches), args.prompts
    max_new, repeats = args.max_new_tokens, args.repeats
    if args.quick:
        prompts, max_new, repeats = min(prompts, 8), min(max_new, 32), 1
        batches = tuple(b for b in batches if b <= prompts) or (1,)
    too_big = [b for b in batches if b > prompts]
    if too_big:
        raise SystemExit(f"--batches {too_big} exceed the {prompts} prompts (--prompts)")
    return BatchSettings(
        batches=batches,
        prompts=prompts,
        max_new_tokens=max_new,
        max_prompt_tokens=args.max_prompt_tokens,
        gamma=args.gamma,
        repeats=repeats,
        methods=tuple(args.methods),
        compile=compile_setting(getattr(args, "compile", "auto")),
        progress=not args.no_progress,
        extra={"quick": bool(args.quick), "threads": args.threads, "command": " ".join(sys.argv)},
    )


def main(args: argparse.Namespace) -> int:
    """``flashspec bench batch``: run, print the table and the targets, write the JSON.

    Exit status 1 when a flashspec row differs from HF's beyond a floating-point tie; a target
    that cannot be loaded here (a named model whose package is absent) is skipped, status 0.
    """
    quiet_and_threads(args.threads)
    settings = settings_from_args(args)
    draft = draft_for(args.target, args.draft)
    try:
        pair = load_pair(args.target, draft)
    except (ModelNotInstalledError, MissingDependencyError) as exc:
        print(
            f"flashspec bench batch: skipped, {args.target!r} is not available: {exc}",
            file=sys.stderr,
        )
        return 0
    name = args.name or result_name(args.target)
    settings.extra["name"] = name
    machine = machine_info()  # after set_num_threads: it records the threads in use
    started = time.perf_counter()
    data = {"machine": machine, **run_batch(pair, humaneval_prompts(settings.prompts), settings)}
    data["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(text(data))
    write_json(data, Path(args.out_dir) / f"{name}.json")
    matched = all(
        record.get("all_match", True)
        for entry in data["results"]
        for record in entry["methods"].values()
    )
    return 0 if matched else 1
