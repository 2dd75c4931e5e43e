"""``flashspec bench profile``: where one speculative round's time goes, with the native
residual kernel, with the PyTorch one, and greedy (``profile.json``).

With a real model as ``--target`` (``smollm2``) and no draft model, the drafter is prompt
lookup (what ``flashspec generate --target smollm2`` drafts with), the prompts are HumanEval
chat requests through the model's chat template, and the file is ``profile-NAME.json``."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import FlashSpecConfig, SamplingConfig
from ..drafters import Drafter, ModelDrafter, PromptLookupDrafter
from ..engine import SpeculativeEngine
from ..flags import argtypes
from ..models import TargetModel
from ..profiling import Spans, profiling
from . import flags
from .common import (
    Prompt,
    humaneval_prompts,
    machine_info,
    progress,
    quiet_timing,
    result_name,
    write_json,
)
from .pair import Pair, encode, setup_pair
from .runner import TEMPERATURE, TOP_P

# Call path -> profile category. Draft-side warping and sampling (which also goes through the
# native kernel: sampling from q is the residual against zero) are kept apart from the
# verification-side residual the earlier claim was about.
CATEGORIES: dict[tuple[str, ...], str] = {
    ("draft", "forward"): "draft forwards",
    ("draft", "warp"): "draft softmax/warping + sampling",
    ("draft", "sample"): "draft softmax/warping + sampling",
    ("draft", "sample", "residual"): "draft softmax/warping + sampling",
    ("draft",): "bookkeeping",
    ("target_forward",): "target forward",
    ("warp",): "target softmax/warping",
    ("accept",): "accept test",
    ("accept", "residual"): "residual (rejection)",
}
CATEGORY_ORDER = (
    "draft forwards",
    "draft softmax/warping + sampling",
    "target forward",
    "target softmax/warping",
    "accept test",
    "residual (rejection)",
    "bookkeeping",
)
# A prompt-lookup drafter has no forwards: its own span is the n-gram search.
LOOKUP_CATEGORIES = {**CATEGORIES, ("draft",): "draft (prompt-lookup search)"}
LOOKUP_ORDER = (
    "draft (prompt-lookup search)",
    *(c for c in CATEGORY_ORDER if not c.startswith("draft")),
)


@dataclass
class _Mode:
    """One profiled configuration: its engine and what its rounds have cost so far."""

    label: str
    sampling: SamplingConfig
    engine: SpeculativeEngine
    timers: Spans = field(default_factory=Spans)
    rounds: int = 0
    total: float = 0.0
    tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    lookup: bool = False


def _profile_mode(pair: Pair, label: str, sampling: SamplingConfig, warm: list[int]) -> _Mode:
    target = TargetModel(pair.target_name, model=pair.target, tokenizer=pair.tokenizer)
    drafter: Drafter = (
        PromptLookupDrafter()
        if pair.draft is None
        else ModelDrafter(pair.draft, name=pair.draft_name, tokenizer=pair.tokenizer)
    )
    engine = SpeculativeEngine(FlashSpecConfig(sampling=sampling), [drafter], target)
    engine.generate(warm, max_new_tokens=16, ignore_eos=True, seed=0)  # warm-up
    return _Mode(label, sampling, engine, lookup=pair.draft is None)


def _mode_result(mode: _Mode) -> dict[str, Any]:
    """Split the mode's round time into categories (ms per round and share of the round)."""
    rounds, total, timers = mode.rounds, mode.total, mode.timers
    categories = LOOKUP_CATEGORIES if mode.lookup else CATEGORIES
    ms: dict[str, float] = dict.fromkeys(LOOKUP_ORDER if mode.lookup else CATEGORY_ORDER, 0.0)
    for path, seconds in timers.exclusive.items():
        ms[categories.get(path, "bookkeeping")] += seconds
    ms["bookkeeping"] += max(0.0, total - sum(ms.values()))
    per_round = {k: v * 1000 / rounds for k, v in ms.items()}
    verification = sum(
        per_round[k]
        for k in ("target forward", "target softmax/warping", "accept test", "residual (rejection)")
    )
    residual_calls = timers.calls.get(("accept", "residual"), 0)
    sampling = mode.sampling
    return {
        "label": mode.label,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "residual_backend": sampling.residual,
        "gamma": sampling.gamma,
        "rounds": rounds,
        "new_tokens": mode.tokens,
        "round_ms": round(total * 1000 / rounds, 4),
        "ms_per_round": {k: round(v, 4) for k, v in per_round.items()},
        "share_of_round": {k: round(v / total, 4) for k, v in ms.items()},
        "residual_share_of_verification": (
            round(per_round["residual (rejection)"] / verification, 4) if verification else None
        ),
        "residual_us_per_call": (
            round(ms["residual (rejection)"] * 1e6 / residual_calls, 2) if residual_calls else None
        ),
        "residual_calls": residual_calls,
        "acceptance_rate": (round(mode.accepted / mode.drafted, 4) if mode.drafted else None),
        "tokens_per_round": round(mode.tokens / rounds, 4),
    }


def run_profile(
    pair: Pair,
    prompts: list[Prompt],
    gamma: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    show_progress: bool,
    encoded: list[list[int]] | None = None,
) -> dict[str, Any]:
    """Profile rounds with the native residual, the PyTorch residual, and greedy.

    ``encoded``: the prompts' token ids (default: ``encode`` of each prompt's text, the last
    ``max_prompt_tokens``); with no draft model in ``pair`` the drafter is prompt lookup."""
    if encoded is None:
        encoded = [encode(pair, p.text, max_prompt_tokens) for p in prompts]
    modes = [
        (
            "sampling, native residual",
            SamplingConfig(gamma=gamma, temperature=TEMPERATURE, top_p=TOP_P, residual="native"),
        ),
        (
            "sampling, torch residual",
            SamplingConfig(gamma=gamma, temperature=TEMPERATURE, top_p=TOP_P, residual="torch"),
        ),
        ("greedy", SamplingConfig(gamma=gamma)),
    ]
    profiled = [_profile_mode(pair, label, cfg, encoded[0]) for label, cfg in modes]
    # Modes interleaved per prompt: this VM's speed drifts, and a drift must not be billed
    # to whichever mode happened to run last.
    for index, ids in enumerate(progress(encoded, desc="profile", disable=not show_progress)):
        for mode in profiled:
            with profiling(mode.timers), quiet_timing():
                result = mode.engine.generate(
                    ids, max_new_tokens=max_new_tokens, ignore_eos=True, seed=index
                )
            mode.rounds += result.stats.rounds
            mode.total += result.stats.time_total
            mode.tokens += result.stats.new_tokens
            mode.drafted += result.stats.drafted
            mode.accepted += result.stats.accepted
    results = [_mode_result(mode) for mode in profiled]
    return {
        "kind": "profile",
        "pair": {
            "target": pair.target_name,
            "draft": pair.draft_name,
            "drafter": "prompt lookup" if pair.draft is None else "draft model",
            "vocab_size": int(pair.target.config.vocab_size),
        },
        "settings": {
            "gamma": gamma,
            "max_new_tokens": max_new_tokens,
            "prompts": [p.id for p in prompts],
            "max_prompt_tokens": max_prompt_tokens,
        },
        "modes": results,
    }


HELP = "where one round's time goes"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench profile`` (besides ``--quick``, ``--out-dir`` and
    ``--no-progress``)."""
    flags.models(parser)
    parser.add_argument(
        "--prompts", type=argtypes.positive_int, default=6, help="HumanEval prompts profiled"
    )
    parser.add_argument("--max-new-tokens", type=argtypes.positive_int, default=128)
    parser.add_argument(
        "--name",
        default="profile",
        help="result file stem (default profile; for a real model profile-NAME)",
    )


def main(args: argparse.Namespace) -> int:
    """``flashspec bench profile``."""
    from ..models import DEMO_NAMES

    if args.quick:
        args.prompts = min(args.prompts, 2)
        args.max_new_tokens = min(args.max_new_tokens, 64)
    real = args.target not in DEMO_NAMES
    name = args.name
    if real:
        from .chat_requests import chat_ids, humaneval_requests

        if args.draft is not None and args.draft.lower() == "demo-draft":
            args.draft = None  # the parser's default draft belongs to the demo target
        if name == "profile":
            name = f"profile-{result_name(args.target)}"
    machine = machine_info()
    pair = setup_pair(args)
    prompts = humaneval_prompts(args.prompts)
    encoded = None
    if real:
        requests = humaneval_requests(args.prompts)
        encoded = [chat_ids(pair.tokenizer, r) for r in requests]
        prompts = [Prompt(r.id, "humaneval", r.user) for r in requests]
    data = {
        "machine": machine,
        **run_profile(
            pair,
            prompts,
            args.gamma,
            args.max_new_tokens,
            args.max_prompt_tokens,
            not args.no_progress,
            encoded=encoded,
        ),
    }
    if real:
        data["settings"]["prompt_format"] = "chat template (HumanEval chat requests)"
    print_profile(data)
    write_json(data, Path(args.out_dir) / f"{name}.json")
    return 0


def print_profile(data: dict[str, Any]) -> None:
    """Print each mode's round split."""
    for mode in data["modes"]:
        print(
            f"\n[{mode['label']}] {mode['round_ms']:.3f} ms per round "
            f"({mode['rounds']} rounds, {mode['new_tokens']} tokens, "
            f"{mode['tokens_per_round']:.2f} tokens/round)"
        )
        for key, ms in mode["ms_per_round"].items():
            print(f"  {key:34s} {ms:8.4f} ms  {mode['share_of_round'][key]:6.1%}")
        share = mode["residual_share_of_verification"]
        if mode["residual_calls"]:
            print(
                f"  residual: {mode['residual_us_per_call']} µs per call, "
                f"{share:.2%} of verification (target forward + warping + accept + residual)"
            )
