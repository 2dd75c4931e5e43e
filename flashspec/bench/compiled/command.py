"""``flashspec bench compiled``: its flags, the run they describe, and ``main`` (load, measure,
print the report, write the JSON)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from ...flags import argtypes
from ...loading.gguf import MissingDependencyError
from ...loading.named import ModelNotInstalledError
from ...models import DEMO_NAMES
from .. import common, flags
from ..common import humaneval_prompts, machine_info, write_json
from ..pair import Pair, draft_for, load_pair, quiet_and_threads
from .measure import (
    DEFAULT_NEW_TOKENS,
    DEFAULT_PROMPTS,
    DEFAULT_REPEATS,
    CompiledSettings,
    run_compiled,
)
from .methods import DTYPES, MODES
from .report import text

HELP = "the compiled path vs flashspec eager, HF generate eager and HF static+compile"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench compiled``."""
    flags.models(parser)
    parser.add_argument(
        "--prompts",
        type=argtypes.positive_int,
        default=DEFAULT_PROMPTS,
        help=f"HumanEval prompts, the first N (default {DEFAULT_PROMPTS})",
    )
    parser.add_argument(
        "--max-new-tokens",
        type=argtypes.positive_int,
        default=DEFAULT_NEW_TOKENS,
        help=f"per prompt (default {DEFAULT_NEW_TOKENS})",
    )
    parser.add_argument(
        "--repeats",
        type=argtypes.positive_int,
        default=DEFAULT_REPEATS,
        help=f"passes over the prompts; medians are reported (default {DEFAULT_REPEATS})",
    )
    parser.add_argument(
        "--modes", nargs="+", choices=MODES, default=list(MODES), help="default: both"
    )
    parser.add_argument(
        "--dtype",
        dest="dtypes",
        nargs="+",
        choices=DTYPES,
        default=["float32"],
        help="weights' dtypes, each a run of its own (default float32)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="result file stem (default compiled; for a real model compiled-NAME)",
    )


def result_name(target: str) -> str:
    """``compiled`` for the demo pair, ``compiled-NAME`` for another target."""
    if target in DEMO_NAMES:
        return "compiled"
    return f"compiled-{common.result_name(target)}"


def settings_from_args(args: argparse.Namespace) -> CompiledSettings:
    """The run ``args`` describes (``--quick``: 4 prompts, 16 tokens, one pass)."""
    prompts, max_new, repeats = args.prompts, args.max_new_tokens, args.repeats
    if args.quick:
        prompts, max_new, repeats = min(prompts, 4), min(max_new, 16), 1
    return CompiledSettings(
        prompts=prompts,
        max_new_tokens=max_new,
        max_prompt_tokens=args.max_prompt_tokens,
        gamma=args.gamma,
        repeats=repeats,
        modes=tuple(dict.fromkeys(args.modes)),
        dtypes=tuple(dict.fromkeys(args.dtypes)),
        progress=not args.no_progress,
        extra={"quick": bool(args.quick), "threads": args.threads, "command": " ".join(sys.argv)},
    )


def main(args: argparse.Namespace) -> int:
    """``flashspec bench compiled``: run, print the tables, write the JSON.

    Exit status 1 when a flashspec greedy row differs from HF eager's beyond a floating-point
    tie, or the compiled path compiled again after its warm-up; a target that cannot be loaded
    here (a named model whose package is absent) is skipped, status 0.
    """
    quiet_and_threads(args.threads)
    settings = settings_from_args(args)
    draft = draft_for(args.target, args.draft)

    try:
        loaded = [load_pair(args.target, draft)]  # fail early, before anything is timed
    except (ModelNotInstalledError, MissingDependencyError) as exc:
        print(
            f"flashspec bench compiled: skipped, {args.target!r} is not available: {exc}",
            file=sys.stderr,
        )
        return 0

    def load(dtype: str) -> Pair:
        # The first dtype takes the pair loaded above; each later one loads afresh (HF keeps
        # its compiled call and static cache length on the model object).
        pair = loaded.pop() if loaded else load_pair(args.target, draft)
        to = getattr(torch, dtype)
        pair.target.to(to)
        if pair.draft is not None:
            pair.draft.to(to)
        return pair

    name = args.name or result_name(args.target)
    settings.extra["name"] = name
    machine = machine_info()  # after set_num_threads: it records the threads in use
    started = time.perf_counter()
    data = {
        "machine": machine,
        **run_compiled(load, humaneval_prompts(settings.prompts), settings),
    }
    data["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(text(data))
    write_json(data, Path(args.out_dir) / f"{name}.json")
    check = data["checks"]
    return 0 if check["flashspec_greedy_identical"] and check["no_recompiles"] else 1
