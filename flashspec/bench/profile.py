"""``flashspec bench profile``: where one speculative round's time goes, with the native
residual kernel, with the PyTorch one, and greedy (``profile.json``)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import FlashSpecConfig, SamplingConfig
from ..drafters import ModelDrafter
from ..engine import SpeculativeEngine
from ..models import TargetModel
from ..profiling import Spans, profiling
from .common import Prompt, humaneval_prompts, machine_info, progress, quiet_timing, write_json
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


def _profile_mode(pair: Pair, label: str, sampling: SamplingConfig, warm: list[int]) -> _Mode:
    target = TargetModel(pair.target_name, model=pair.target, tokenizer=pair.tokenizer)
    drafter = ModelDrafter(pair.draft, name=pair.draft_name, tokenizer=pair.tokenizer)
    engine = SpeculativeEngine(FlashSpecConfig(sampling=sampling), [drafter], target)
    engine.generate(warm, max_new_tokens=16, ignore_eos=True, seed=0)  # warm-up
    return _Mode(label, sampling, engine)


def _mode_result(mode: _Mode) -> dict[str, Any]:
    """Split the mode's round time into categories (ms per round and share of the round)."""
    rounds, total, timers = mode.rounds, mode.total, mode.timers
    ms: dict[str, float] = dict.fromkeys(CATEGORY_ORDER, 0.0)
    for path, seconds in timers.exclusive.items():
        ms[CATEGORIES.get(path, "bookkeeping")] += seconds
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
    }


def run_profile(
    pair: Pair,
    prompts: list[Prompt],
    gamma: int,
    max_new_tokens: int,
    max_prompt_tokens: int,
    show_progress: bool,
) -> dict[str, Any]:
    """Profile rounds with the native residual, the PyTorch residual, and greedy."""
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
    results = [_mode_result(mode) for mode in profiled]
    return {
        "kind": "profile",
        "pair": {
            "target": pair.target_name,
            "draft": pair.draft_name,
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


def main(args: argparse.Namespace) -> int:
    """``flashspec bench profile``."""
    if args.quick:
        args.prompts = min(args.prompts, 2)
        args.max_new_tokens = min(args.max_new_tokens, 64)
    machine = machine_info()
    pair = setup_pair(args)
    if pair.draft is None:
        raise SystemExit("the profile needs a draft model (--draft)")
    prompts = humaneval_prompts(args.prompts)
    data = {
        "machine": machine,
        **run_profile(
            pair,
            prompts,
            args.gamma,
            args.max_new_tokens,
            args.max_prompt_tokens,
            not args.no_progress,
        ),
    }
    for mode in data["modes"]:
        print(
            f"\n[{mode['label']}] {mode['round_ms']:.3f} ms per round "
            f"({mode['rounds']} rounds, {mode['new_tokens']} tokens)"
        )
        for key in CATEGORY_ORDER:
            print(
                f"  {key:34s} {mode['ms_per_round'][key]:8.4f} ms  "
                f"{mode['share_of_round'][key]:6.1%}"
            )
        share = mode["residual_share_of_verification"]
        if mode["residual_calls"]:
            print(
                f"  residual: {mode['residual_us_per_call']} µs per call, "
                f"{share:.2%} of verification (target forward + warping + accept + residual)"
            )
    write_json(data, Path(args.out_dir) / f"{args.name}.json")
    return 0
