"""Where the adaptive engine's time goes, against one fixed drafter: an ablation on the demo pair.

    python benchmarks/adaptive_ablation.py [--regime sample] [--workload humaneval]
        [--prompts 20] [--seeds 4] [--model-seeds 1]
        [--out benchmarks/results/adaptive_ablation.json]

``flashspec bench adaptive`` says how far the throughput model lands from the best fixed arm;
this says why, by taking the model apart. Every engine below runs every prompt, interleaved in
a fresh random order per prompt, and is compared with the reference engine on the same prompt
and seed (the mean of the per-prompt log ratios, with its standard error):

- ``fixed``: demo-draft at gamma 4 alone (the reference);
- ``model, gamma 4``: the model choosing between demo-draft at gamma 4 and plain decoding, so it
  differs from the reference by the model's own cost per round;
- ``model, 1 drafter``: the model also choosing the draft length;
- ``model, + prompt lookup``: with prompt lookup as a second drafter and the lookup context;
- ``model, 3 drafters``: with demo-draft3 too, as in ``flashspec bench adaptive``.

Each step adds one thing the full engine does, so the differences between neighbours are what
that thing costs or earns here. A model carries what it learns through the whole stream, so
where its early rounds happen to leave it shapes the rest (how often it retries a slower
drafter, which draft length it settles on): two runs of one step can differ by more than their
standard errors. ``--model-seeds K`` runs every model step K times with the model's seeds
0..K-1 and also reports each step's mean over them and their spread. Per engine the file also
keeps milliseconds, drafts and tokens per round and the rounds per arm.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from flashspec import bench
from flashspec.bench import (
    REGIMES,
    SEED_STRIDE,
    copy_prompts,
    encode,
    load_drafters_for,
    load_pair,
    mixed_stream,
)
from flashspec.config import BanditConfig, FlashSpecConfig, SamplingConfig
from flashspec.drafters import Drafter
from flashspec.engine import SpeculativeEngine
from flashspec.models import TargetModel

DRAFTERS = "demo-draft,demo-draft3,prompt_lookup"
REFERENCE = "fixed demo-draft/4"


STEPS = ("model, gamma 4", "model, 1 drafter", "model, + prompt lookup", "model, 3 drafters")


def engines(
    target: TargetModel, drafters: list[Drafter], sampling: SamplingConfig, model_seeds: int = 1
) -> dict[str, SpeculativeEngine]:
    """The reference and the model with one more of the full engine's parts at each step, each
    step once per model seed (named ``"<step> (seed k)"`` when there are several)."""
    draft, draft3, lookup = drafters

    def model(chosen: list[Drafter], seed: int, **bandit: Any) -> SpeculativeEngine:
        config = FlashSpecConfig(
            sampling=sampling, bandit=BanditConfig(plain=True, seed=seed, **bandit)
        )
        return SpeculativeEngine(config, chosen, target)

    built = {REFERENCE: SpeculativeEngine(FlashSpecConfig(sampling=sampling), draft, target)}
    for seed in range(model_seeds):
        suffix = f" (seed {seed})" if model_seeds > 1 else ""
        steps = (
            model([draft], seed, gammas=(4,)),
            model([draft], seed),
            model([draft, lookup], seed, context="lookup"),
            model([draft, draft3, lookup], seed, context="lookup"),
        )
        built.update({name + suffix: engine for name, engine in zip(STEPS, steps, strict=True)})
    return built


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="sample")
    parser.add_argument("--workload", choices=("humaneval", "copy", "mixed"), default="humaneval")
    parser.add_argument("--prompts", type=int, default=20, help="prompts per workload")
    parser.add_argument("--seeds", type=int, default=4, help="passes with fresh seeds")
    parser.add_argument(
        "--model-seeds", type=int, default=1, help="runs of every model step, with seeds 0..K-1"
    )
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=192)
    parser.add_argument("--out", default="benchmarks/results/adaptive_ablation.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if args.prompts < 1 or args.seeds < 1 or args.model_seeds < 1:
        parser.error("--prompts, --seeds and --model-seeds must be >= 1")

    machine = bench.machine_info()
    pair = load_pair("demo", None)
    target = TargetModel(model=pair.target, tokenizer=pair.tokenizer)
    drafters = load_drafters_for(argparse.Namespace(drafters=DRAFTERS))
    humaneval = bench.humaneval_prompts(args.prompts)
    copy = copy_prompts(args.prompts)
    prompts = {
        "humaneval": humaneval,
        "copy": copy,
        "mixed": mixed_stream(humaneval, copy, seed=0),
    }[args.workload]
    ids = [encode(pair, p.text, args.max_prompt_tokens) for p in prompts]
    sampling = REGIMES[args.regime]
    configs = engines(target, drafters, sampling, args.model_seeds)
    for engine in configs.values():
        # Warm-up, then forget it: first calls pay for allocator growth and lazy set-up.
        engine.generate(ids[0], max_new_tokens=8, ignore_eos=True, seed=0)
        if engine.throughput is not None:
            engine.throughput.reset()

    # Greedy output does not depend on the seed.
    seeds = 1 if sampling.temperature == 0 else args.seeds
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in configs}
    arms: dict[str, Counter[str]] = {name: Counter() for name in configs}
    started = time.perf_counter()
    passes = [(seed, position) for seed in range(seeds) for position in range(len(ids))]
    for seed, position in bench.progress(passes, desc="ablation", disable=args.no_progress):
        # The seeds of `flashspec bench adaptive`, so a prompt's passes match there and here.
        generation_seed = 1000 + position + SEED_STRIDE * seed
        order = list(configs.items())
        random.Random(generation_seed).shuffle(order)
        for name, engine in order:
            stats = engine.generate(
                ids[position],
                max_new_tokens=args.max_new_tokens,
                ignore_eos=True,
                seed=generation_seed,
            ).stats
            runs[name].append(
                {
                    "tokens": stats.new_tokens,
                    "seconds": stats.time_total,
                    "rounds": stats.row_rounds,
                    "drafted": stats.drafted,
                    "emitted": stats.emitted,
                }
            )
            arms[name].update(stats.arm_rounds)

    def rate(run: dict[str, float]) -> float:
        return run["tokens"] / run["seconds"]

    results: dict[str, Any] = {}
    for name, those in runs.items():
        logs = [math.log(rate(a) / rate(b)) for a, b in zip(those, runs[REFERENCE], strict=True)]
        totals = {key: sum(run[key] for run in those) for key in those[0]}
        results[name] = {
            "tokens_per_second": round(totals["tokens"] / totals["seconds"], 2),
            "vs_reference": {
                "mean_log_ratio": round(statistics.fmean(logs), 4),
                "standard_error": round(statistics.pstdev(logs) / math.sqrt(len(logs)), 4),
            },
            "per_round": {
                "ms": round(1e3 * totals["seconds"] / totals["rounds"], 3),
                "drafted": round(totals["drafted"] / totals["rounds"], 3),
                "emitted": round(totals["emitted"] / totals["rounds"], 3),
            },
            "arm_rounds": dict(arms[name].most_common()),
        }
        ratio = results[name]["vs_reference"]
        print(
            f"{name:32s} {results[name]['tokens_per_second']:7.1f} tok/s  "
            f"log ratio {ratio['mean_log_ratio']:+.3f} ± {ratio['standard_error']:.3f}  "
            f"{results[name]['per_round']}"
        )
    steps: dict[str, Any] = {}
    if args.model_seeds > 1:
        for step in STEPS:
            means = [
                results[f"{step} (seed {seed})"]["vs_reference"]["mean_log_ratio"]
                for seed in range(args.model_seeds)
            ]
            steps[step] = {
                "mean_log_ratio": round(statistics.fmean(means), 4),
                "spread_over_model_seeds": round(statistics.stdev(means), 4),
                "per_model_seed": means,
            }
            mean, spread = steps[step]["mean_log_ratio"], steps[step]["spread_over_model_seeds"]
            print(
                f"{step:32s} mean over {args.model_seeds} model seeds {mean:+.3f} (sd {spread:.3f})"
            )
    data = {
        "machine": machine,
        "kind": "adaptive_ablation",
        "settings": {
            "regime": args.regime,
            "workload": args.workload,
            "prompts": len(ids),
            "seeds": seeds,
            "model_seeds": args.model_seeds,
            "max_new_tokens": args.max_new_tokens,
            "drafters": DRAFTERS.split(","),
            "reference": REFERENCE,
            "command": " ".join(sys.argv),
        },
        "engines": results,
        **({"steps": steps} if steps else {}),
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    bench.write_json(data, Path(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
