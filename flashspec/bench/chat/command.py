"""``flashspec bench engine --target NAME`` for a real model: the run its flags describe, and
``main`` (measure, print the report, write the JSON). Its tables are ``flashspec.bench.report``'s,
with the demo pair's: both are ``bench engine``."""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..common import machine_info, result_name, write_json
from ..lengths import report_lengths
from .measure import (
    DEFAULT_COPY,
    DEFAULT_HUMANEVAL,
    DEFAULT_SWEEP_GAMMAS,
    DEFAULT_SWEEP_PROMPTS,
    ChatSettings,
    run_chat,
)
from .methods import METHODS


def settings_from_args(args: argparse.Namespace) -> ChatSettings:
    """The run ``flashspec bench engine --target NAME`` describes (``--quick``: a short one)."""
    humaneval = DEFAULT_HUMANEVAL if args.humaneval is None else args.humaneval
    copy = DEFAULT_COPY if getattr(args, "copy", None) is None else args.copy
    sweep_prompts = DEFAULT_SWEEP_PROMPTS if args.sweep_prompts is None else args.sweep_prompts
    gammas = args.sweep_gammas or DEFAULT_SWEEP_GAMMAS
    max_new = args.max_new_tokens
    if args.quick:
        humaneval, copy = min(humaneval, 1), min(copy, 2)
        max_new = min(max_new, 48)
        sweep_prompts = min(sweep_prompts, 1)
        gammas = args.sweep_gammas or "4,8"
    methods = tuple(args.methods.split(",")) if args.methods else METHODS
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    draft = args.draft
    if draft is not None and draft.lower() in ("none", "demo-draft"):
        draft = None  # the bench parsers' default draft belongs to the demo target
    return ChatSettings(
        target=args.target,
        gamma=args.gamma,
        draft=draft,
        max_new_tokens=max_new,
        humaneval=humaneval,
        copy=copy,
        methods=methods,
        sweep_gammas=() if args.no_sweep else tuple(int(g) for g in gammas.split(",")),
        sweep_prompts=0 if args.no_sweep else sweep_prompts,
        llamacpp=not getattr(args, "no_llamacpp", False),
        probe_reps=10 if args.quick else 25,
        threads=args.threads,
        progress=not args.no_progress,
        lengths=(
            args.lengths
            if getattr(args, "lengths", None) is not None
            else ((32, 96) if args.quick else (128, 512, 1024))
        ),
        length_prompts=getattr(args, "length_prompts", None) or (1 if args.quick else 3),
        extra={"quick": bool(args.quick), "command": " ".join(sys.argv)},
    )


def main(args: argparse.Namespace) -> int:
    """``flashspec bench engine --target NAME`` for a real model (not the demo pair)."""
    from ..report import report_chat

    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    settings = settings_from_args(args)
    name = args.name if args.name not in (None, "engine") else result_name(args.target)
    settings.extra["name"] = name
    machine = machine_info()
    started = time.perf_counter()
    data = {"machine": machine, **run_chat(settings)}
    data["wall_seconds"] = round(time.perf_counter() - started, 1)
    report_chat(data)
    if "lengths" in data:
        print(report_lengths(data["lengths"]), file=sys.stderr)
    write_json(data, Path(args.out_dir) / f"{name}.json")
    greedy_ok = all(
        s["all_match"]
        for workload, per in data["summary"].items()
        if workload != "all"
        for m, s in per.items()
        if m.startswith(("fs_", "hf_"))
    )
    return 0 if greedy_ok else 1
