"""Flag groups that several ``flashspec bench`` commands share: the model pair, and the engine
benchmark's workloads (``bench engine`` and ``bench all``)."""

from __future__ import annotations

import argparse

from ..flags import argtypes
from ..flags.options import EngineOptions, add_compile_argument


def models(p: argparse.ArgumentParser) -> None:
    """``--target``, ``--draft``, ``--gamma``, ``--threads``, ``--max-prompt-tokens``."""
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


def engine(p: argparse.ArgumentParser) -> None:
    """The engine benchmark's workloads, gamma sweep and long-generation study."""
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
