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

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._greedy import compare_greedy
from .._linear import untuned
from . import runner
from .chat_requests import COPY_KINDS as COPY_KINDS
from .chat_requests import ChatRequest as ChatRequest
from .chat_requests import chat_ids as chat_ids
from .chat_requests import copy_prompts as copy_prompts
from .chat_requests import humaneval_requests as humaneval_requests
from .common import machine_info, progress, quiet_timing, write_json
from .common import result_name as result_name
from .lengths import length_study, report_lengths
from .pair import Pair, decode_costs

WORKLOADS = ("humaneval", "copy")
HF_LOOKUP_TOKENS = 10
LLAMACPP_LOOKUP_TOKENS = 10
LLAMACPP_CONTEXT = 4096
FP32_METHODS = ("hf_greedy", "hf_lookup", "fs_default", "fs_lookup")
BF16_METHODS = ("hf_greedy_bf16", "fs_default_bf16")
LLAMACPP_METHODS = ("llamacpp", "llamacpp_lookup")
METHODS = (
    "hf_greedy",
    "hf_greedy_bf16",
    "hf_lookup",
    "fs_default",
    "fs_default_bf16",
    "fs_lookup",
    "llamacpp",
    "llamacpp_lookup",
)
SWEEP_PREFIX = "fs_lookup_gamma"
# The defaults of a real-model run (the demo benchmark has its own, see engine.main).
# About 15 minutes on 2 cores: HF greedy runs at ~13 tokens/s there (float32).
DEFAULT_HUMANEVAL = 4
DEFAULT_COPY = 8
DEFAULT_SWEEP_PROMPTS = 2
DEFAULT_SWEEP_GAMMAS = "2,4,6,8,10"
SPEEDUP_TARGET = 1.5
VS_LOOKUP_TARGET = 1.0


def baseline_of(method: str) -> str:
    """The HF greedy run a method's identity (and same-dtype speedup) is measured against."""
    return "hf_greedy_bf16" if method.endswith("_bf16") else "hf_greedy"


# ----------------------------------------------------------------------------------- methods


@dataclass
class Run(runner.Run):
    """One method on one prompt, with the rounds per arm of an engine that chooses."""

    arm_rounds: dict[str, int] | None = None

    def record(self) -> dict[str, Any]:
        out = super().record()
        if self.arm_rounds is not None:
            out["arm_rounds"] = dict(self.arm_rounds)
        return out


def llamacpp_module() -> tuple[Any, str | None]:
    """``llama_cpp`` (or None) and why it is unavailable."""
    try:
        return importlib.import_module("llama_cpp"), None
    except ImportError as exc:  # pragma: no cover - depends on the machine
        return None, f"llama_cpp is not importable ({exc}); pip install llama-cpp-python"


class ChatMethods:
    """The models, engines and llama.cpp instances of a run; ``run(method, ids)`` times one.

    Every flashspec engine is built by ``EngineOptions(...).build()`` from the flags the
    method stands for, so the measured engine is the one ``flashspec generate`` builds.
    """

    def __init__(
        self,
        target: str,
        *,
        gamma: int = 4,
        draft: str | None = None,
        sweep_gammas: tuple[int, ...] = (),
        llamacpp: bool = True,
        threads: int | None = None,
        build: Callable[..., Any] | None = None,
    ) -> None:
        from ..cli.options import EngineOptions
        from ..loading import is_gguf, resolve_model_path

        self.target = target
        self.gamma = gamma
        self.notes: dict[str, str] = {}

        def options(**kw: Any) -> Any:
            # Fixed-length lookup takes no draft model; everything else gets the run's draft.
            return EngineOptions(target=target, draft=None if "drafter" in kw else draft, **kw)

        make = build or (lambda **kw: options(**kw).build())
        fixed = f"flashspec generate --target {target} --drafter prompt-lookup --gamma"
        self.flags: dict[str, str] = {
            "fs_default": f"flashspec generate --target {target}",
            "fs_default_bf16": f"flashspec generate --target {target} --dtype bfloat16",
            "fs_lookup": f"{fixed} {gamma}",
        }
        self.engines: dict[str, Any] = {
            "fs_default": make(gamma=gamma),
            "fs_default_bf16": make(gamma=gamma, dtype="bfloat16"),
            "fs_lookup": make(gamma=gamma, drafter="prompt-lookup"),
        }
        for g in sweep_gammas:
            name = f"{SWEEP_PREFIX}{g}"
            if g == gamma:
                self.engines[name] = self.engines["fs_lookup"]
            else:
                self.engines[name] = make(gamma=g, drafter="prompt-lookup")
            self.flags[name] = f"{fixed} {g}"
        default = self.engines["fs_default"]
        self.tokenizer = default.tokenizer
        self.model = default.target.model  # HF methods share the default engine's weights
        self.model_bf16 = self.engines["fs_default_bf16"].target.model
        self.eos: list[int] = list(default.target.eos_token_ids)
        self.drafters = {
            name: [d.name for d in engine.drafters] for name, engine in self.engines.items()
        }
        self.llamas: dict[str, Any] = {}
        self.gguf: str | None = None
        if llamacpp:
            self._setup_llamacpp(resolve_model_path(target), is_gguf, threads)
        else:
            self.notes["llamacpp"] = "skipped (--no-llamacpp)"

    def _setup_llamacpp(
        self, path: str, is_gguf: Callable[[str], bool], threads: int | None
    ) -> None:
        if not is_gguf(path):
            self.notes["llamacpp"] = f"skipped: {path} is not a GGUF file"
            return
        llama_cpp, why = llamacpp_module()
        if llama_cpp is None:
            self.notes["llamacpp"] = f"skipped: {why}"
            return
        self.gguf = path
        n_threads = threads or torch.get_num_threads()
        try:
            lookup = importlib.import_module("llama_cpp.llama_speculative")
            common: dict[str, Any] = {
                "model_path": path,
                "n_threads": n_threads,
                "n_threads_batch": n_threads,
                "n_ctx": LLAMACPP_CONTEXT,
                "logits_all": False,
                "verbose": False,
            }
            self.llamas["llamacpp"] = llama_cpp.Llama(**common)
            self.llamas["llamacpp_lookup"] = llama_cpp.Llama(
                **common,
                draft_model=lookup.LlamaPromptLookupDecoding(
                    num_pred_tokens=LLAMACPP_LOOKUP_TOKENS
                ),
            )
        except Exception as exc:  # a broken build must not take the benchmark down
            self.llamas.clear()
            self.notes["llamacpp"] = f"skipped: llama.cpp failed to load the model ({exc})"
            return
        self.notes["llamacpp"] = (
            f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, {n_threads} threads, "
            f"n_ctx {LLAMACPP_CONTEXT}, greedy (temp 0, top_k 1); lookup: "
            f"LlamaPromptLookupDecoding(num_pred_tokens={LLAMACPP_LOOKUP_TOKENS})"
        )

    def available(self, method: str) -> bool:
        if method in LLAMACPP_METHODS:
            return method in self.llamas
        return method in METHODS or method in self.engines

    def model_for(self, method: str) -> Any:
        """The HF model whose logits decide a tie for ``method``'s identity check."""
        return self.model_bf16 if method.endswith("_bf16") else self.model

    def run(self, method: str, ids: list[int], max_new_tokens: int) -> Run:
        if method in self.engines:
            return self._run_engine(method, ids, max_new_tokens)
        if method in self.llamas:
            return self._run_llamacpp(method, ids, max_new_tokens)
        return self._run_hf(method, ids, max_new_tokens)

    def _run_engine(self, method: str, ids: list[int], n: int) -> Run:
        engine = self.engines[method]
        x = torch.tensor([ids], dtype=torch.int64)
        with quiet_timing():
            start = time.perf_counter()
            result = engine.generate(input_ids=x, max_new_tokens=n)
            seconds = time.perf_counter() - start
        stats = result.stats
        return Run(
            [int(t) for t in result.tokens[0]],
            seconds,
            rounds=stats.rounds,
            drafted=stats.drafted,
            accepted=stats.accepted,
            arm_rounds=dict(stats.arm_rounds) if method.startswith("fs_default") else None,
        )

    def _run_hf(self, method: str, ids: list[int], n: int) -> Run:
        model = self.model_bf16 if method == "hf_greedy_bf16" else self.model
        x = torch.tensor([ids], dtype=torch.int64)
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(x),
            "max_new_tokens": n,
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "eos_token_id": self.eos or None,
            "pad_token_id": self.eos[0] if self.eos else 0,
        }
        if method == "hf_lookup":
            kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
        # HF as users have it: torch's own linear layers, not the target's tuned ones.
        with (
            untuned(model),
            runner.forward_counter(model) as calls,
            quiet_timing(),
            torch.inference_mode(),
        ):
            start = time.perf_counter()
            out = model.generate(x, **kwargs)
            seconds = time.perf_counter() - start
        tokens = [int(t) for t in out[0, len(ids) :].tolist()]
        return Run(tokens, seconds, rounds=calls[0] if method == "hf_lookup" else None)

    def _run_llamacpp(self, method: str, ids: list[int], n: int) -> Run:
        llm = self.llamas[method]
        tokens: list[int] = []
        with quiet_timing():
            start = time.perf_counter()
            llm.reset()  # no reuse of the previous prompt's cache: every run pays its prefill
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
                tokens.append(int(token))
                if int(token) in self.eos or len(tokens) >= n:
                    break
            seconds = time.perf_counter() - start
        return Run(tokens, seconds)


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


# -------------------------------------------------------------------------------------- CLI


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
    from .report import report_chat

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
