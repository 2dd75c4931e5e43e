"""``flashspec bench engine --target smollm2``: flashspec on a real pretrained chat model.

Every method answers the same chat requests (the tokenizer's chat template, greedy, stopping at
EOS), interleaved per prompt with the order rotating, in one process after an untimed warm-up:

- ``hf_greedy``        HF ``generate``, greedy, float32: the baseline and the identity reference.
- ``hf_greedy_bf16``   the same on the bfloat16 weights (the reference of the ``*_bf16`` rows).
- ``hf_lookup``        HF prompt lookup (``prompt_lookup_num_tokens=10``), float32.
- ``fs_default``       the engine ``flashspec generate --target NAME`` builds
                       (``EngineOptions(target=NAME).build()``: prompt lookup and plain
                       decoding, chosen each round by the throughput model, with the length).
- ``fs_default_bf16``  the same with ``--dtype bfloat16``.
- ``fs_lookup``        ``--drafter prompt-lookup --gamma G``: prompt lookup every round, fixed
                       length (the default before it chose per round).
- ``llamacpp``         llama.cpp (``llama_cpp.Llama``) on the same GGUF file and token ids.
- ``llamacpp_lookup``  the same with llama-cpp-python's prompt-lookup draft model.

Then a gamma sweep of fixed-length lookup (``--drafter prompt-lookup --gamma N``) on the first
prompts of each workload, a per-round cost probe (1- and 5-token forwards with a KV cache,
float32 and bfloat16), and the summary per workload (``humaneval``: complete a HumanEval
function; ``copy``: requests whose answer mostly repeats the request: rename a function, add a
docstring, add type hints, restate or quote a text).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..._greedy import compare_greedy
from ..chat_requests import COPY_KINDS, ChatRequest, chat_ids, copy_prompts, humaneval_requests
from ..common import progress
from ..lengths import length_study
from ..pair import Pair, decode_costs
from .methods import (
    HF_LOOKUP_TOKENS,
    LLAMACPP_METHODS,
    METHODS,
    SWEEP_PREFIX,
    WORKLOADS,
    ChatMethods,
    baseline_of,
)

# The defaults of a real-model run (the demo benchmark has its own, see engine.main).
# About 15 minutes on 2 cores: HF greedy runs at ~13 tokens/s there (float32).
DEFAULT_HUMANEVAL = 4
DEFAULT_COPY = 8
DEFAULT_SWEEP_PROMPTS = 2
DEFAULT_SWEEP_GAMMAS = "2,4,6,8,10"
SPEEDUP_TARGET = 1.5
VS_LOOKUP_TARGET = 1.0


# -------------------------------------------------------------------------------- the run


@dataclass
class ChatSettings:
    """What a run measures (recorded in the JSON)."""

    target: str = "smollm2"
    gamma: int = 4
    draft: str | None = None
    max_new_tokens: int = 128
    humaneval: int = DEFAULT_HUMANEVAL
    copy: int = DEFAULT_COPY
    methods: tuple[str, ...] = METHODS
    sweep_gammas: tuple[int, ...] = (2, 4, 6, 8, 10)
    probe_reps: int = 25
    sweep_prompts: int = DEFAULT_SWEEP_PROMPTS
    llamacpp: bool = True
    threads: int | None = None
    progress: bool = True
    lengths: tuple[int, ...] = ()
    length_prompts: int = 3
    extra: dict[str, Any] = field(default_factory=dict)


def identity(model: Any, ids: list[int], got: list[int], ref: list[int]) -> dict[str, Any]:
    """``compare_greedy`` under the tie rule, as a dict (``engine.greedy_identity``)."""
    result = compare_greedy(model, ids, got, ref)
    gap = None if result.gap is None else float(f"{result.gap:.4g}")
    return {"status": result.status, "at": result.at, "gap": gap}


def _rotated(items: list[str], index: int) -> list[str]:
    k = index % len(items)
    return items[k:] + items[:k]


def _measure(
    methods: ChatMethods,
    names: list[str],
    requests: list[ChatRequest],
    encoded: list[list[int]],
    n: int,
    desc: str,
    show: bool,
) -> list[dict[str, Any]]:
    """Every method in ``names`` on every request, interleaved (rotating order)."""
    records: list[dict[str, Any]] = []
    bar = progress(
        list(zip(requests, encoded, strict=True)), desc=desc, unit="prompt", disable=not show
    )
    for index, (request, ids) in enumerate(bar):
        runs = {m: methods.run(m, ids, n) for m in _rotated(names, index)}
        results: dict[str, Any] = {}
        ref32 = runs["hf_greedy"]
        for name in names:
            run = runs[name]
            record = run.record()
            base = runs.get(baseline_of(name), ref32)
            tps = len(run.tokens) / run.seconds
            record["speedup"] = round(tps / (len(base.tokens) / base.seconds), 4)
            record["speedup_vs_hf_greedy"] = round(tps / (len(ref32.tokens) / ref32.seconds), 4)
            if "hf_lookup" in runs:
                look = runs["hf_lookup"]
                record["speedup_vs_hf_lookup"] = round(tps / (len(look.tokens) / look.seconds), 4)
            record["identity"] = identity(methods.model_for(name), ids, run.tokens, base.tokens)
            results[name] = record
        fs = results.get("fs_default", {})
        bar.set_postfix(fs=f"{fs.get('speedup', 0):.2f}x", tokens=fs.get("new_tokens"))
        records.append(
            {
                "id": request.id,
                "workload": request.workload,
                "kind": request.kind,
                "prompt_tokens": len(ids),
                "hf_greedy_text": methods.tokenizer.decode(ref32.tokens)[:400],
                "methods": results,
            }
        )
    return records


def summarise(records: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per method: medians of per-prompt ratios, the ratio of median tokens/s, tokens/s over
    the whole workload, acceptance, tokens per round, identity counts."""
    out: dict[str, Any] = {}
    median_tps = {
        m: statistics.median(r["methods"][m]["tokens_per_second"] for r in records) for m in names
    }
    for m in names:
        recs = [r["methods"][m] for r in records]
        tokens = sum(r["new_tokens"] for r in recs)
        seconds = sum(r["seconds"] for r in recs)
        drafted = [r["drafted"] for r in recs if r["drafted"] is not None]
        accepted = [r["accepted"] for r in recs if r["accepted"] is not None]
        rounds = [r["rounds"] for r in recs if r["rounds"]]
        statuses = [r["identity"]["status"] for r in recs]
        firsts = [r["identity"]["at"] for r in recs if r["identity"]["at"] is not None]
        base = baseline_of(m)
        entry: dict[str, Any] = {
            "prompts": len(recs),
            "baseline": base,
            "new_tokens_mean": round(tokens / len(recs), 1),
            "tokens_per_second": round(tokens / seconds, 2) if seconds else 0.0,
            "tokens_per_second_median": round(median_tps[m], 2),
            "speedup_median": round(statistics.median(r["speedup"] for r in recs), 4),
            "speedup_min": round(min(r["speedup"] for r in recs), 4),
            "speedup_max": round(max(r["speedup"] for r in recs), 4),
            "speedup_vs_hf_greedy_median": round(
                statistics.median(r["speedup_vs_hf_greedy"] for r in recs), 4
            ),
            "ratio_of_medians_vs_hf_greedy": round(median_tps[m] / median_tps["hf_greedy"], 4),
            "acceptance_rate": (
                round(sum(accepted) / sum(drafted), 4)
                if drafted and sum(drafted) and len(accepted) == len(drafted)
                else None
            ),
            "tokens_per_round": (
                round(tokens / sum(rounds), 4) if len(rounds) == len(recs) else None
            ),
            "identity": {s: statuses.count(s) for s in ("identical", "tie", "mismatch")},
            "all_match": statuses.count("mismatch") == 0,
            "first_difference_median": statistics.median(firsts) if firsts else None,
        }
        if all("speedup_vs_hf_lookup" in r for r in recs):
            entry["speedup_vs_hf_lookup_median"] = round(
                statistics.median(r["speedup_vs_hf_lookup"] for r in recs), 4
            )
        arms = [r.get("arm_rounds") for r in recs if r.get("arm_rounds")]
        if arms:
            total: dict[str, int] = {}
            for a in arms:
                for arm, count in a.items():
                    total[arm] = total.get(arm, 0) + count
            entry["arm_rounds"] = total
        out[m] = entry
    return out


def check_targets(summary: dict[str, Any]) -> dict[str, Any]:
    """The issue's targets on the copy-heavy workload, with the values measured."""
    copy = summary.get("copy", {})
    fs = copy.get("fs_default")
    if fs is None:
        return {}
    out: dict[str, Any] = {
        f"copy: fs_default speedup vs hf_greedy (target >= {SPEEDUP_TARGET})": fs["speedup_median"],
        "copy: fs_default token-identical to hf_greedy (target true)": fs["all_match"],
    }
    if "speedup_vs_hf_lookup_median" in fs:
        out[f"copy: fs_default speedup vs hf_lookup (target >= {VS_LOOKUP_TARGET})"] = fs[
            "speedup_vs_hf_lookup_median"
        ]
    out["met"] = bool(
        fs["speedup_median"] >= SPEEDUP_TARGET
        and fs.get("speedup_vs_hf_lookup_median", VS_LOOKUP_TARGET) >= VS_LOOKUP_TARGET
        and fs["all_match"]
    )
    he = summary.get("humaneval", {}).get("fs_default")
    if he is not None:
        out["humaneval: fs_default speedup vs hf_greedy (no target)"] = he["speedup_median"]
    return out


def cost_probe(model: Any, ids: list[int], gamma: int = 4, reps: int = 25) -> dict[str, Any]:
    """Median ms of a 1-token and a (gamma+1)-token forward with a KV cache after ``ids``."""
    costs = decode_costs(Pair(model, None, None, "", None), ids, gamma, reps=reps)
    return {
        "context_tokens": costs["context_tokens"],
        "step_ms": costs["target_ms"],
        "verify_ms": costs["target_verify_ms"],
        "verify_tokens": costs["verify_tokens"],
        "verify_over_step": costs["verify_over_step"],
    }


def spread(items: list[Any], k: int) -> list[Any]:
    """``k`` items evenly spaced from the first to the last (all of them if ``k >= len``): the
    copy workload's kinds alternate, so the sweep sees more than one kind."""
    if k >= len(items):
        return list(items)
    if k <= 1:
        return items[:k]
    return [items[round(i * (len(items) - 1) / (k - 1))] for i in range(k)]


def gamma_sweep(
    methods: ChatMethods,
    requests: list[ChatRequest],
    encoded: list[list[int]],
    settings: ChatSettings,
) -> dict[str, Any]:
    """The default engine at each ``--gamma`` against HF greedy and HF lookup, on
    ``sweep_prompts`` requests of each workload spread over it (``spread``), interleaved per
    prompt."""
    gammas = [g for g in settings.sweep_gammas]
    names = ["hf_greedy", "hf_lookup", *(f"{SWEEP_PREFIX}{g}" for g in gammas)]
    out: dict[str, Any] = {"gammas": gammas, "workloads": {}}
    for workload in WORKLOADS:
        chosen = spread(
            [(r, ids) for r, ids in zip(requests, encoded, strict=True) if r.workload == workload],
            settings.sweep_prompts,
        )
        if not chosen:
            continue
        records = _measure(
            methods,
            names,
            [r for r, _ in chosen],
            [ids for _, ids in chosen],
            settings.max_new_tokens,
            f"gamma sweep ({workload})",
            settings.progress,
        )
        summary = summarise(records, names)
        rows = []
        for g in gammas:
            s = summary[f"{SWEEP_PREFIX}{g}"]
            rows.append(
                {
                    "gamma": g,
                    "prompts": s["prompts"],
                    "speedup_median": s["speedup_median"],
                    "speedup_vs_hf_lookup_median": s.get("speedup_vs_hf_lookup_median"),
                    "tokens_per_second": s["tokens_per_second"],
                    "acceptance_rate": s["acceptance_rate"],
                    "tokens_per_round": s["tokens_per_round"],
                    "all_match": s["all_match"],
                }
            )
        best = max(rows, key=lambda row: row["speedup_median"])
        out["workloads"][workload] = {
            "prompts": [r.id for r, _ in chosen],
            "rows": rows,
            "best_gamma": best["gamma"],
            "hf_lookup_speedup_median": summary["hf_lookup"]["speedup_median"],
        }
    # One gamma for both workloads: the best by the geometric mean of the medians.
    scores: dict[int, float] = {}
    for g in gammas:
        values = [
            row["speedup_median"]
            for w in out["workloads"].values()
            for row in w["rows"]
            if row["gamma"] == g
        ]
        if values:
            scores[g] = statistics.geometric_mean(values)
    if scores:
        out["best_gamma_overall"] = max(scores, key=lambda g: scores[g])
        out["geometric_mean_speedup"] = {str(g): round(v, 4) for g, v in scores.items()}
    return out


def run_chat(settings: ChatSettings, build: Callable[..., Any] | None = None) -> dict[str, Any]:
    """Build every method, measure them on both workloads, sweep gamma, probe the costs.

    ``build(gamma=..., dtype=..., drafter=...)``: makes an engine (default:
    ``EngineOptions(target=settings.target, ...).build()``; tests pass tiny models)."""
    sweep = settings.sweep_gammas if settings.sweep_prompts > 0 else ()
    methods = ChatMethods(
        settings.target,
        gamma=settings.gamma,
        draft=settings.draft,
        sweep_gammas=tuple(sweep),
        llamacpp=settings.llamacpp and any(m in LLAMACPP_METHODS for m in settings.methods),
        threads=settings.threads,
        build=build,
    )
    names = [m for m in settings.methods if methods.available(m)]
    for required in ("hf_greedy", "hf_greedy_bf16"):
        needed = required == "hf_greedy" or any(m.endswith("_bf16") for m in names)
        if needed and required not in names:
            names.insert(0, required)
    requests = humaneval_requests(settings.humaneval) + copy_prompts(settings.copy)
    if not requests:
        raise SystemExit("no prompts: give --humaneval or --copy > 0")
    encoded = [chat_ids(methods.tokenizer, r) for r in requests]

    # Warm-up, untimed: first calls pay for lazy initialisation and allocator growth.
    sweep_names = [n for n in methods.engines if n.startswith(SWEEP_PREFIX)]
    for name in [*names, *sweep_names, *(["hf_lookup"] if sweep_names else [])]:
        methods.run(name, encoded[0], min(16, settings.max_new_tokens))

    records: list[dict[str, Any]] = []
    for workload in WORKLOADS:
        chosen = [
            (r, ids) for r, ids in zip(requests, encoded, strict=True) if r.workload == workload
        ]
        if chosen:
            records += _measure(
                methods,
                names,
                [r for r, _ in chosen],
                [ids for _, ids in chosen],
                settings.max_new_tokens,
                f"engine ({workload})",
                settings.progress,
            )
    summary: dict[str, Any] = {}
    for workload in WORKLOADS:
        rows = [r for r in records if r["workload"] == workload]
        if rows:
            summary[workload] = summarise(rows, names)
    if len(summary) > 1:
        summary["all"] = summarise(records, names)
    kinds = sorted({r["kind"] for r in records if r["workload"] == "copy"})
    by_kind = {
        kind: {
            m: s["speedup_median"]
            for m, s in summarise([r for r in records if r["kind"] == kind], names).items()
        }
        for kind in kinds
    }

    probe_ids = encoded[-1]
    costs = {
        "float32": cost_probe(methods.model, probe_ids, settings.gamma, settings.probe_reps),
        "bfloat16": cost_probe(methods.model_bf16, probe_ids, settings.gamma, settings.probe_reps),
        "vocab_size": int(methods.model.config.vocab_size),
    }
    data: dict[str, Any] = {
        "kind": "chat",
        "model": {
            "target": settings.target,
            "gguf": methods.gguf,
            "model_type": str(methods.model.config.model_type),
            "layers": int(methods.model.config.num_hidden_layers),
            "hidden_size": int(methods.model.config.hidden_size),
            "vocab_size": int(methods.model.config.vocab_size),
            "parameters": sum(int(p.numel()) for p in methods.model.parameters()),
            "eos_token_ids": methods.eos,
        },
        "settings": {
            "gamma": settings.gamma,
            "max_new_tokens": settings.max_new_tokens,
            "methods": names,
            "engines": methods.flags,
            "drafters": methods.drafters,
            "hf_lookup_tokens": HF_LOOKUP_TOKENS,
            "prompts": {w: sum(r.workload == w for r in requests) for w in WORKLOADS},
            "copy_kinds": {k: sum(r.kind == k for r in requests) for k in COPY_KINDS},
            "eos": "every method stops at EOS (the chat template's end of turn)",
            "speedup": "median over prompts of tokens/s ratios (new tokens / wall seconds of "
            "the whole call, prefill included); the *_bf16 rows against hf_greedy_bf16, all "
            "rows also against hf_greedy (speedup_vs_hf_greedy)",
            "notes": methods.notes,
            **settings.extra,
        },
        "costs": costs,
        "prompts": records,
        "summary": summary,
        "speedup_by_kind": by_kind,
    }
    data["targets"] = check_targets(summary)
    if sweep:
        data["gamma_sweep"] = gamma_sweep(methods, requests, encoded, settings)
    if settings.lengths:
        default = methods.engines["fs_default"]
        data["lengths"] = length_study(
            default,
            methods.model,
            spread(encoded, settings.length_prompts),
            settings.lengths,
            pad_id=methods.eos[0] if methods.eos else None,
            max_positions=getattr(methods.model.config, "max_position_embeddings", None),
            show_progress=settings.progress,
        )
        data["lengths"]["engines"] = {"default": [arm.label for arm in default.arms]}
    return data
