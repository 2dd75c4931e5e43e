"""``flashspec bench engine``: flashspec against HF ``generate``, HF assisted generation and HF
prompt lookup on the same prompts, the ideal speedup, and the gamma sweep (``engine.json``)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._greedy import compare_greedy
from ..compiled import CompileSetting
from ..flags import argtypes
from ..flags.options import compile_setting
from . import flags
from .common import (
    Prompt,
    humaneval_prompts,
    machine_info,
    progress,
    pyplot,
    stdlib_prompts,
    write_json,
)
from .lengths import length_study, report_lengths
from .pair import Pair, decode_costs, encode, setup_pair
from .report import plot_engine, report_engine
from .runner import (
    HF_LOOKUP_TOKENS,
    METHODS,
    MODEL_DRAFTED,
    SAMPLING,
    TEMPERATURE,
    TOP_P,
    Runner,
    baseline_of,
)


def greedy_identity(pair: Pair, ids: list[int], got: list[int], ref: list[int]) -> dict[str, Any]:
    """Compare a greedy output with the target's own greedy output under the tie rule
    (``flashspec._greedy``)."""
    result = compare_greedy(pair.target, ids, got, ref)
    return {"status": result.status, "at": result.at, "gap": result.gap}


# ------------------------------------------------------------------------------- cost model


def ideal_speedup(method: str, record: dict[str, Any], c: float | None) -> float | None:
    """tokens_per_round / (drafts_per_round * cost + 1); None without round counts.

    What the method's measured rounds would give if drafting cost exactly its measured share
    and a (g+1)-token verification cost one decode step; c = the draft's decode cost over the
    target's (one-token forwards with a KV cache, ``decode_costs``). Efficiency = measured
    speedup / ideal.
    """
    tpr = record.get("tokens_per_round")
    if not tpr:
        return None
    if method in MODEL_DRAFTED:
        dpr = record.get("drafts_per_round")
        if dpr is None or c is None:
            return None
        return float(tpr) / (float(dpr) * c + 1.0)
    return float(tpr)  # n-gram lookup: drafting is nearly free


def ideal_seconds_raw(method: str, record: dict[str, Any], costs: dict[str, Any]) -> float | None:
    """Seconds the method's rounds would take at bare forward costs: rounds * (drafts per round
    * draft step + one target step), nothing else (no verification surcharge, no overhead)."""
    rounds = record.get("rounds")
    if not rounds:
        return None
    drafts = 0.0
    if method in MODEL_DRAFTED:
        dpr, draft_ms = record.get("drafts_per_round"), costs.get("draft_ms")
        if dpr is None or draft_ms is None:
            return None
        drafts = float(dpr) * float(draft_ms)
    return float(rounds) * (drafts + float(costs["target_ms"])) / 1000.0


@dataclass
class EngineSettings:
    """What a run measures (recorded in the JSON)."""

    gamma: int = 4
    max_new_tokens: int = 128
    max_prompt_tokens: int = 128
    methods: tuple[str, ...] = METHODS
    sweep_gammas: tuple[int, ...] = (1, 2, 3, 4, 5, 6, 7, 8)
    sweep_prompts: int = 8
    compile: CompileSetting = "auto"
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


def run_engine(pair: Pair, prompts: list[Prompt], settings: EngineSettings) -> dict[str, Any]:
    """Measure every method on every prompt (interleaved), then the gamma sweep; returns the
    result dict that ``engine.json`` holds.

    One process; methods interleaved per prompt (the order rotates from prompt to prompt),
    after an untimed warm-up of each.
    """
    runner = Runner(pair, settings.gamma, settings.max_new_tokens, settings.compile)
    methods = [m for m in settings.methods if runner.available(m)]
    if "hf_greedy" not in methods:
        methods.insert(0, "hf_greedy")  # the reference for speedups and identity
    if "fs_sample" in methods and "hf_sample" not in methods:
        methods.append("hf_sample")
    encoded = [encode(pair, p.text, settings.max_prompt_tokens) for p in prompts]

    # Warm-up, untimed: first calls pay for lazy initialisation and allocator growth.
    for method in methods:
        runner.run(method, encoded[0], max_new_tokens=min(16, settings.max_new_tokens))
    costs = decode_costs(pair, encoded[0], settings.gamma)
    c = costs.get("c")

    records: list[dict[str, Any]] = []
    bar = progress(
        list(zip(prompts, encoded, strict=True)),
        desc="engine",
        unit="prompt",
        disable=not settings.progress,
    )
    for index, (prompt, ids) in enumerate(bar):
        order = methods[index % len(methods) :] + methods[: index % len(methods)]
        runs = {m: runner.run(m, ids, seed=index) for m in order}
        results: dict[str, Any] = {}
        for method in methods:
            record = runs[method].record()
            base = runs[baseline_of(method)]
            record["speedup"] = round(
                (len(runs[method].tokens) / runs[method].seconds)
                / (len(base.tokens) / base.seconds),
                4,
            )
            ideal = ideal_speedup(method, record, c)
            record["ideal_speedup"] = round(ideal, 4) if ideal is not None else None
            record["efficiency"] = (
                round(record["speedup"] / ideal, 4)
                if ideal and method != baseline_of(method)
                else None
            )
            raw = ideal_seconds_raw(method, record, costs)
            record["ideal_seconds_raw"] = round(raw, 5) if raw is not None else None
            record["efficiency_raw"] = round(raw / record["seconds"], 4) if raw else None
            record["identity"] = (
                None
                if method in SAMPLING
                else greedy_identity(pair, ids, runs[method].tokens, runs["hf_greedy"].tokens)
            )
            results[method] = record
        bar.set_postfix(
            fs=f"{results.get('fs_greedy', {}).get('speedup', 0):.2f}x",
            hf_asst=f"{results.get('hf_assisted_gamma', {}).get('speedup', 0):.2f}x",
        )
        text = pair.tokenizer.decode(runs["hf_greedy"].tokens) if pair.tokenizer else None
        records.append(
            {
                "id": prompt.id,
                "source": prompt.source,
                "prompt_tokens": len(ids),
                "hf_greedy_text": text[:300] if text else None,
                "methods": results,
            }
        )

    data: dict[str, Any] = {
        "kind": "engine",
        "pair": {
            "target": pair.target_name,
            "draft": pair.draft_name,
            "target_parameters": _parameters(pair.target),
            "draft_parameters": _parameters(pair.draft) if pair.draft is not None else None,
            "vocab_size": int(pair.target.config.vocab_size),
        },
        "settings": {
            "gamma": settings.gamma,
            "max_new_tokens": settings.max_new_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens,
            "compile": settings.compile,
            "temperature": TEMPERATURE,
            "top_p": TOP_P,
            "hf_lookup_tokens": HF_LOOKUP_TOKENS,
            "methods": methods,
            "prompts": {
                src: sum(p.source == src for p in prompts) for src in ("humaneval", "stdlib")
            },
            "eos": "ignored by every method (fixed-length generations)",
            **settings.extra,
        },
        "costs": costs,
        "prompts": records,
    }
    data["summary"] = summarise(records, methods)
    data["targets"] = check_targets(data["summary"])
    if settings.sweep_prompts > 0 and settings.sweep_gammas and pair.draft is not None:
        data["gamma_sweep"] = gamma_sweep(runner, pair, prompts, encoded, settings, costs)
    return data


LENGTHS = (128, 512, 1024)
"""New tokens of the long-generation study (each cut to what the model's context holds)."""


def run_lengths(
    pair: Pair, prompts: list[Prompt], lengths: tuple[int, ...], settings: EngineSettings
) -> dict[str, Any]:
    """The long-generation study (``bench.lengths``): the engine a user gets for this pair
    without configuring one (its draft and plain decoding, chosen every round), and the draft
    alone at the configured gamma (``fixed``, the demo pair's default before)."""
    from ..config import FlashSpecConfig, SamplingConfig
    from ..drafters import ModelDrafter
    from ..engine import SpeculativeEngine
    from ..models import TargetModel

    def parts() -> tuple[TargetModel, ModelDrafter]:
        target = TargetModel(pair.target_name, model=pair.target, tokenizer=pair.tokenizer)
        return target, ModelDrafter(pair.draft, name="draft", tokenizer=pair.tokenizer)

    target, drafter = parts()
    default = SpeculativeEngine.from_pretrained(target, [drafter])
    target, drafter = parts()
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=settings.gamma))
    engines = {"default": default, "fixed": SpeculativeEngine(config, [drafter], target)}
    # Prompts short enough that the longest generation fits the demo's context after them.
    encoded = [encode(pair, p.text, settings.max_prompt_tokens) for p in prompts]
    for engine in engines.values():
        engine.generate([encoded[0]], max_new_tokens=16, ignore_eos=True)  # warm-up, untimed
    study = length_study(
        engines,
        pair.target,
        encoded,
        lengths,
        pad_id=pair.pad_id,
        max_positions=getattr(pair.target.config, "max_position_embeddings", None),
        show_progress=settings.progress,
    )
    study["engines"] = {name: [arm.label for arm in e.arms] for name, e in engines.items()}
    return study


def _parameters(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters())


def summarise(records: list[dict[str, Any]], methods: list[str]) -> dict[str, Any]:
    """Per split (``humaneval``, ``stdlib``, ``all``) and method: medians of per-prompt ratios,
    aggregate tokens/s and acceptance, identity counts."""
    splits = {
        "humaneval": [r for r in records if r["source"] == "humaneval"],
        "stdlib": [r for r in records if r["source"] == "stdlib"],
        "all": records,
    }
    summary: dict[str, Any] = {}
    for split, rows in splits.items():
        if not rows:
            continue
        per: dict[str, Any] = {}
        for method in methods:
            recs = [r["methods"][method] for r in rows]
            tokens = sum(r["new_tokens"] for r in recs)
            seconds = sum(r["seconds"] for r in recs)
            drafted = [r["drafted"] for r in recs if r["drafted"] is not None]
            accepted = [r["accepted"] for r in recs if r["accepted"] is not None]
            rounds = [r["rounds"] for r in recs if r["rounds"]]
            ideals = [r["ideal_speedup"] for r in recs if r["ideal_speedup"] is not None]
            effs = [r["efficiency"] for r in recs if r["efficiency"] is not None]
            raws = [r["efficiency_raw"] for r in recs if r.get("efficiency_raw") is not None]
            statuses = [r["identity"]["status"] for r in recs if r["identity"] is not None]
            entry: dict[str, Any] = {
                "prompts": len(recs),
                "tokens_per_second": round(tokens / seconds, 2) if seconds else 0.0,
                "speedup_median": round(statistics.median(r["speedup"] for r in recs), 4),
                "speedup_min": round(min(r["speedup"] for r in recs), 4),
                "speedup_max": round(max(r["speedup"] for r in recs), 4),
                "acceptance_rate": (
                    round(sum(accepted) / sum(drafted), 4)
                    if drafted and sum(drafted) and len(accepted) == len(drafted)
                    else None
                ),
                "tokens_per_round": (
                    round(tokens / sum(rounds), 4) if len(rounds) == len(recs) else None
                ),
                "ideal_speedup_median": round(statistics.median(ideals), 4) if ideals else None,
                "efficiency_median": round(statistics.median(effs), 4) if effs else None,
                "efficiency_raw_median": round(statistics.median(raws), 4) if raws else None,
            }
            if statuses:
                entry["identity"] = {s: statuses.count(s) for s in ("identical", "tie", "mismatch")}
                entry["all_match"] = statuses.count("mismatch") == 0
            per[method] = entry
        summary[split] = per
    return summary


def check_targets(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets for flashspec greedy on HumanEval, with the values measured."""
    he = summary.get("humaneval")
    if not he or "fs_greedy" not in he:
        return {}
    fs = he["fs_greedy"]
    out: dict[str, Any] = {
        "speedup_vs_hf_greedy (target >= 1.5)": fs["speedup_median"],
        "token_identical (target true)": fs.get("all_match"),
        "efficiency (target >= 0.85)": fs["efficiency_median"],
    }
    assisted = {m: he[m]["speedup_median"] for m in he if m.startswith("hf_assisted")}
    if assisted:
        best = max(assisted, key=lambda m: assisted[m])
        out["best_hf_assisted"] = best
        out["speedup_vs_best_hf_assisted (target >= 1.15)"] = round(
            fs["speedup_median"] / assisted[best], 4
        )
    return out


def gamma_sweep(
    runner: Runner,
    pair: Pair,
    prompts: list[Prompt],
    encoded: list[list[int]],
    settings: EngineSettings,
    costs: dict[str, Any],
) -> list[dict[str, Any]]:
    """flashspec greedy at each gamma against plain HF greedy, on the first ``sweep_prompts``
    prompts (interleaved per prompt like the main run)."""
    chosen = list(zip(prompts, encoded, strict=True))[: settings.sweep_prompts]
    gammas = list(settings.sweep_gammas)
    per: dict[int, list[dict[str, Any]]] = defaultdict(list)
    c = costs.get("c")
    for g in gammas:  # warm every engine once
        runner.run("fs_greedy", encoded[0], gamma=g, max_new_tokens=16)
    jobs: list[tuple[str, int]] = [("hf_greedy", 0), *(("fs_greedy", g) for g in gammas)]
    for index, (_, ids) in enumerate(
        progress(chosen, desc="gamma sweep", unit="prompt", disable=not settings.progress)
    ):
        order = jobs[index % len(jobs) :] + jobs[: index % len(jobs)]
        runs = {job: runner.run(job[0], ids, gamma=job[1] or None) for job in order}
        base = runs[("hf_greedy", 0)]
        for g in gammas:
            run = runs[("fs_greedy", g)]
            record = run.record()
            record["speedup"] = (len(run.tokens) / run.seconds) / (len(base.tokens) / base.seconds)
            ideal = ideal_speedup("fs_greedy", record, c)
            record["ideal_speedup"] = ideal
            record["identity"] = greedy_identity(pair, ids, run.tokens, base.tokens)["status"]
            per[g].append(record)
    out = []
    for g in gammas:
        recs = per[g]
        drafted = sum(r["drafted"] for r in recs)
        ideals = [r["ideal_speedup"] for r in recs if r["ideal_speedup"] is not None]
        out.append(
            {
                "gamma": g,
                "prompts": len(recs),
                "speedup_median": round(statistics.median(r["speedup"] for r in recs), 4),
                "speedups": [round(r["speedup"], 4) for r in recs],
                "tokens_per_second": round(
                    sum(r["new_tokens"] for r in recs) / sum(r["seconds"] for r in recs), 2
                ),
                "acceptance_rate": round(sum(r["accepted"] for r in recs) / drafted, 4)
                if drafted
                else None,
                "tokens_per_round": round(
                    sum(r["new_tokens"] for r in recs) / sum(r["rounds"] for r in recs), 4
                ),
                "ideal_speedup_median": round(statistics.median(ideals), 4) if ideals else None,
                "all_match": all(r["identity"] != "mismatch" for r in recs),
            }
        )
    return out


HELP = "flashspec vs HF generate / assisted generation / prompt lookup"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench engine`` (besides ``--quick``, ``--out-dir`` and
    ``--no-progress``)."""
    flags.models(parser)
    flags.engine(parser)
    parser.add_argument(
        "--name",
        default="engine",
        help="result file stem (default engine; for a real model its name, e.g. smollm2)",
    )
    parser.add_argument(
        "--copy",
        type=argtypes.nonnegative_int,
        default=None,
        help="a real model: copy-heavy chat requests (rename, docstring, type hints, quote a "
        "text; default 16)",
    )
    parser.add_argument(
        "--no-llamacpp",
        action="store_true",
        help="a real model: skip the llama.cpp rows (they need llama-cpp-python and a GGUF)",
    )


def main(args: argparse.Namespace) -> int:
    """``flashspec bench engine``: the demo pair here; any other target (a real model such
    as ``smollm2``) runs the chat benchmark (``flashspec.bench.chat``)."""
    from ..models import DEMO_NAMES

    if args.target not in DEMO_NAMES:
        from .chat.command import main as chat_main

        return chat_main(args)
    # The demo pair's defaults (the parser leaves them None: a real model has its own).
    if args.humaneval is None:
        args.humaneval = 20
    if args.sweep_prompts is None:
        args.sweep_prompts = 8
    if args.sweep_gammas is None:
        args.sweep_gammas = "1,2,3,4,5,6,7,8"
    if args.quick:
        args.humaneval, args.stdlib = min(args.humaneval, 3), min(args.stdlib, 1)
        args.max_new_tokens = min(args.max_new_tokens, 64)
        args.sweep_prompts = min(args.sweep_prompts, 2)
        args.sweep_gammas = "1,4,8"
    machine = machine_info()
    pair = setup_pair(args)
    card = Path(pair.target_name).parent / "card.json"
    prompts = humaneval_prompts(args.humaneval) + stdlib_prompts(args.stdlib, card)
    if not prompts:
        raise SystemExit("no prompts: give --humaneval or --stdlib > 0")
    methods = tuple(args.methods.split(",")) if args.methods else METHODS
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise SystemExit(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    settings = EngineSettings(
        gamma=args.gamma,
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        methods=methods,
        sweep_gammas=() if args.no_sweep else tuple(int(g) for g in args.sweep_gammas.split(",")),
        sweep_prompts=0 if args.no_sweep else args.sweep_prompts,
        compile=compile_setting(args.compile),
        progress=not args.no_progress,
        extra={"name": args.name, "quick": bool(args.quick), "command": " ".join(sys.argv)},
    )
    started = time.perf_counter()
    data = {"machine": machine, **run_engine(pair, prompts, settings)}
    lengths = args.lengths if args.lengths is not None else ((32, 96) if args.quick else LENGTHS)
    if lengths and pair.draft is not None:
        count = args.length_prompts or (1 if args.quick else 4)
        data["lengths"] = run_lengths(pair, prompts[:count], lengths, settings)
        print(report_lengths(data["lengths"]), file=sys.stderr)
    data["wall_seconds"] = round(time.perf_counter() - started, 1)
    report_engine(data)
    out = Path(args.out_dir)
    write_json(data, out / f"{args.name}.json")
    plt = pyplot()
    if plt is not None:
        plot_engine(data, out / f"{args.name}.png", plt)
        print(f"wrote {out / f'{args.name}.png'}", file=sys.stderr)
    return (
        0
        if all(
            s.get("all_match", True) for split in data["summary"].values() for s in split.values()
        )
        else 1
    )
