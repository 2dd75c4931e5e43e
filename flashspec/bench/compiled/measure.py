"""``flashspec bench compiled``: the compiled path (``FlashSpecConfig(compile=True)``) against
flashspec eager, HF ``generate`` eager and HF ``generate`` on a static cache compiled the same
way, a batch of one, greedy and sampled, in each ``--dtype`` (float32, bfloat16)
(``compiled.json``; a real model: ``compiled-NAME.json``).

Every method generates exactly ``--max-new-tokens`` for each of the first ``--prompts``
HumanEval prompts (EOS ignored), one prompt at a time, so tokens/s compare equal work; greedy
rows are checked token for token against HF eager's.

Methods (``METHODS``):

- ``hf_eager``            ``model.generate`` with its default dynamic cache, eager: the
                          reference of the greedy identity check.
- ``hf_static_compiled``  ``model.generate(cache_implementation="static",
                          compile_config=...)``: HF's own compiled decoding, compiled as
                          flashspec's path compiles (``hf_compile_config``: inductor,
                          ``fullgraph=True``, ``dynamic=False``, mode ``"default"``, with
                          ``_compile_all_devices`` set, without which HF compiles on CUDA only).
                          HF compiles the one-token decode step and runs the prefill eager. Its
                          cache is ``max_length - 1`` columns, grown to the longest earlier call's
                          (``_previous_max_cache_length``); a longer cache is a new graph, so
                          the warm-up runs the longest prompt first. The baseline of the ratios.
- ``flashspec_eager``     ``SpeculativeEngine`` with ``FlashSpecConfig(compile=False)``.
- ``flashspec_compiled``  the same with ``compile=True``: static KV caches and compiled draft
                          and verify steps (``flashspec.compiled``).

The demo target drafts with the demo draft model (``ModelDrafter``, gamma fixed); another target
(``--target smollm2``) with prompt lookup, plain decoding chosen round by round by the throughput
model, as the engine's default does for it (``BanditConfig(plain=True, context="lookup")``).
Each flashspec method keeps one engine per dtype for both modes (its compiled graphs with it;
the throughput model's measurements carry over from greedy to sampled).

Per dtype, the pair is loaded and cast (``.to(dtype)``), and per mode every method first runs a
warm-up call on the longest prompt (its time is ``first_call_seconds``; for the compiled methods
it includes the compile), then ``--repeats`` passes over the prompts, every prompt running every
method, the order rotating from prompt to prompt. Tokens/s per pass is new tokens over wall
seconds; medians over the passes, and ratios paired by pass. A first call compiles faster when
inductor's on-disk cache already holds the code from an earlier run (``inductor_cache``, recorded
in the settings).
"""

from __future__ import annotations

import gc
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ...compiled.static import capacity_for
from ...config import FlashSpecConfig
from ..common import Prompt, progress
from ..identity import count_statuses, row_statuses, worst, worst_verdict
from ..pair import Pair, encode
from ..runner import TEMPERATURE, TOP_P
from .methods import (
    BASELINE,
    FLASHSPEC,
    METHODS,
    MODES,
    REFERENCE,
    Call,
    CompiledRunner,
    engine_config,
    hf_compile_config,
    inductor_cache,
    weight_bytes,
)

DEFAULT_PROMPTS = 16
DEFAULT_NEW_TOKENS = 64
DEFAULT_REPEATS = 2

STREAMING_FLOOR = 26e9
"""Bytes per second: a weight-streaming floor quoted from shared/design.md (a 540 MB torch sum
ran at 26 GB/s on the project's earlier 2-core AVX-512 machine), not measured by this
benchmark nor necessarily on the machine it runs on."""


# ------------------------------------------------------------------------------- the sweep


@dataclass
class CompiledSettings:
    """What a run measures (recorded in the JSON); ``prompts``: how many HumanEval prompts
    ``main`` loads (``run_compiled`` runs those it is given)."""

    prompts: int = DEFAULT_PROMPTS
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    max_prompt_tokens: int = 128
    gamma: int = 4
    repeats: int = DEFAULT_REPEATS
    modes: tuple[str, ...] = MODES
    dtypes: tuple[str, ...] = ("float32",)
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Tally:
    """One method in one pass, summed over the prompts."""

    seconds: float = 0.0
    tokens: int = 0
    forwards: int = 0
    graphs: int = 0
    drafted: int = 0
    accepted: int = 0

    def add(self, call: Call) -> None:
        self.seconds += call.seconds
        self.tokens += len(call.tokens)
        self.forwards += call.forwards
        self.graphs += call.graphs
        self.drafted += call.drafted
        self.accepted += call.accepted

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def forwards_per_second(self) -> float:
        return self.forwards / self.seconds if self.seconds > 0 else 0.0


def spread(values: Sequence[float], digits: int) -> dict[str, Any]:
    """Median, min, max and every value of ``values``, rounded to ``digits``."""
    if not values:
        raise ValueError("spread of no values")
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def ratios(values: Sequence[float], base: Sequence[float]) -> list[float]:
    """``values[i] / base[i]``, pass by pass (0 where the base is 0)."""
    return [v / b if b > 0 else 0.0 for v, b in zip(values, base, strict=True)]


def warmup_order(encoded: Sequence[Sequence[int]], max_new_tokens: int, gamma: int) -> list[int]:
    """Prompt indices for the warm-up: the longest prompt first (HF's static cache keeps the
    longest length it has seen, so no later call grows it), then the longest of every other
    capacity bucket of flashspec's static caches, then the rest (called while a compiled length
    is still missing)."""
    by_length = sorted(range(len(encoded)), key=lambda i: -len(encoded[i]))
    first: list[int] = []
    buckets: set[int] = set()
    for i in by_length:
        # The columns the engine reserves for a batch of one (SpeculativeEngine._reset).
        bucket = capacity_for(len(encoded[i]) + max_new_tokens + gamma + 2)
        if bucket not in buckets:
            buckets.add(bucket)
            first.append(i)
    return first + [i for i in by_length if i not in first]


def _recompiles(runner: CompiledRunner) -> int:
    """Recompiles so far of the compiled forwards of ``flashspec_compiled``."""
    return sum(f.recompiles for f in runner.compiled_forwards("flashspec_compiled"))


def _compile_record(runner: CompiledRunner, method: str, in_warmup: int) -> dict[str, Any]:
    """The compile counters of a flashspec method's engine (``in_warmup``: recompiles during
    the warm-ups, which ``recompiles_after_warmup`` leaves out)."""
    engine = runner.engine(method)
    forwards = runner.compiled_forwards(method)
    models = [
        {
            "name": f.name,
            "lengths": list(f.lengths),
            "compile_seconds": round(f.compile_seconds, 3),
            "graphs": sorted([list(g) for g in f.graphs]),
            "recompiles": f.recompiles,
            "failed": f.failed,
            "compiled_calls": f.compiled_calls,
            "eager_calls": f.eager_calls,
        }
        for f in forwards
    ]
    recompiles = sum(f.recompiles for f in forwards)
    return {
        "on": engine.compiled.on,
        "reason": engine.compiled.reason,
        "compile_seconds": round(sum(f.compile_seconds for f in forwards), 3),
        "graphs": sum(len(f.graphs) for f in forwards),
        "recompiles": recompiles,
        "recompiles_after_warmup": recompiles - in_warmup,
        "failed": [f.failed for f in forwards if f.failed is not None],
        "models": models,
    }


def _warm_up(
    runner: CompiledRunner,
    encoded: Sequence[Sequence[int]],
    order: Sequence[int],
    buckets: int,
    mode: str,
) -> dict[str, dict[str, Any]]:
    """Each method's untimed warm-up in ``mode``: the first ``buckets`` prompts of ``order``
    (``warmup_order``), then more while one of its compiled lengths has not been compiled."""
    out: dict[str, dict[str, Any]] = {}
    for method in METHODS:
        calls: list[Call] = []
        for i in order:
            if len(calls) >= buckets and not runner.missing_lengths(method):
                break
            calls.append(runner.run(method, encoded[i], mode, seed=i))
        out[method] = {
            "first_call_seconds": round(calls[0].seconds, 3),
            "calls": len(calls),
            "seconds": [round(c.seconds, 3) for c in calls],
            "graphs": sum(c.graphs for c in calls),
            "missing_lengths": runner.missing_lengths(method),
        }
    return out


def _record(
    reps: Sequence[_Tally],
    base: Sequence[_Tally],
    eager: Sequence[_Tally],
    target_bytes: int,
    warm: dict[str, Any],
) -> dict[str, Any]:
    """One method in one mode over the passes ``reps`` (``base``, ``eager``: the baseline's
    and HF eager's passes, for the paired ratios)."""
    tps = [t.tokens_per_second for t in reps]
    fps = [t.forwards_per_second for t in reps]
    achieved = target_bytes * statistics.median(fps)
    drafted = sum(t.drafted for t in reps)
    return {
        "new_tokens": reps[0].tokens,
        "seconds": spread([t.seconds for t in reps], 5),
        "tokens_per_second": spread(tps, 2),
        "vs_hf_static_compiled": spread(ratios(tps, [t.tokens_per_second for t in base]), 4),
        "vs_hf_eager": spread(ratios(tps, [t.tokens_per_second for t in eager]), 4),
        "target_forwards": [t.forwards for t in reps],
        "forwards_per_second": spread(fps, 2),
        "tokens_per_forward": (
            round(reps[0].tokens / reps[0].forwards, 4) if reps[0].forwards else None
        ),
        "weight_bytes_per_second": round(achieved),
        "share_of_streaming_floor": round(achieved / STREAMING_FLOOR, 4),
        "first_call_seconds": warm["first_call_seconds"],
        "warmup": {k: v for k, v in warm.items() if k != "first_call_seconds"},
        "graphs_after_warmup": sum(t.graphs for t in reps),
        "acceptance_rate": (round(sum(t.accepted for t in reps) / drafted, 4) if drafted else None),
    }


def _identity(prompts: Sequence[Prompt], per_prompt: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """A method's greedy verdicts: counts of each prompt's worst over the passes, and where
    each prompt that is not identical differs first."""
    worst_of = [worst([v["status"] for v in runs_of]) for runs_of in per_prompt]
    counts = count_statuses(worst_of)
    return {
        "identity": {**counts, "rows": len(worst_of)},
        "all_match": counts["mismatch"] == 0,
        "differences": [
            {"prompt": prompts[i].id, **worst_verdict(runs_of)}
            for i, runs_of in enumerate(per_prompt)
            if worst_of[i] != "identical"
        ],
    }


def _fastest(modes: dict[str, dict[str, Any]], method: str) -> dict[str, Any]:
    """``method``'s weight streaming in its faster mode."""
    mode = max(modes, key=lambda m: float(modes[m][method]["tokens_per_second"]["median"]))
    record = modes[mode][method]
    return {
        "method": method,
        "mode": mode,
        "tokens_per_second": record["tokens_per_second"]["median"],
        "forwards_per_second": record["forwards_per_second"]["median"],
        "weight_bytes_per_second": record["weight_bytes_per_second"],
        "share_of_streaming_floor": record["share_of_streaming_floor"],
    }


def run_dtype(pair: Pair, prompts: Sequence[Prompt], settings: CompiledSettings) -> dict[str, Any]:
    """Every mode and method on ``pair`` (already in its dtype): one entry of the JSON's
    ``runs``.

    Per mode: a warm-up of each method (``_warm_up``), then ``repeats`` passes over the
    prompts, each prompt running every method, the order rotating from prompt to prompt;
    greedy rows are checked against HF eager's of the same pass.
    """
    if not prompts or settings.repeats < 1 or not settings.modes:
        raise ValueError("need prompts, modes and repeats >= 1")
    n, repeats = settings.max_new_tokens, settings.repeats
    encoded = [encode(pair, p.text, settings.max_prompt_tokens) for p in prompts]
    runner = CompiledRunner(pair, settings.gamma, n)
    dtype = str(next(pair.target.parameters()).dtype).removeprefix("torch.")
    target_bytes = weight_bytes(pair.target)
    order = warmup_order(encoded, n, settings.gamma)
    buckets = len({capacity_for(len(r) + n + settings.gamma + 2) for r in encoded})
    jobs = [
        (mode, r, i) for mode in settings.modes for r in range(repeats) for i in range(len(encoded))
    ]
    bar = progress(jobs, desc=f"compiled {dtype}", unit="prompt", disable=not settings.progress)
    warmups: dict[str, dict[str, dict[str, Any]]] = {}
    in_warmup = 0
    tallies: dict[tuple[str, str, int], _Tally] = {}
    verdicts: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    for turn, (mode, repeat, index) in enumerate(bar):
        if mode not in warmups:
            bar.set_postfix(mode=mode)
            before = _recompiles(runner)
            warmups[mode] = _warm_up(runner, encoded, order, buckets, mode)
            in_warmup += _recompiles(runner) - before
        ids = encoded[index]
        k = turn % len(METHODS)
        rotated = METHODS[k:] + METHODS[:k]
        calls = {method: runner.run(method, ids, mode, seed=index) for method in rotated}
        for method in METHODS:
            tallies.setdefault((mode, method, repeat), _Tally()).add(calls[method])
        if mode == "greedy":
            reference = calls[REFERENCE].tokens
            for method in METHODS[1:]:
                (verdict,) = row_statuses(pair, [ids], [calls[method].tokens], [reference])
                verdicts.setdefault((mode, method), [[] for _ in encoded])[index].append(verdict)

    modes: dict[str, dict[str, Any]] = {}
    for mode in settings.modes:

        def passes(method: str, mode: str = mode) -> list[_Tally]:
            return [tallies[(mode, method, r)] for r in range(repeats)]

        records: dict[str, Any] = {}
        for method in METHODS:
            warm = warmups[mode][method]
            record = _record(
                passes(method), passes(BASELINE), passes(REFERENCE), target_bytes, warm
            )
            if (mode, method) in verdicts:
                record.update(_identity(prompts, verdicts[(mode, method)]))
            records[method] = record
        modes[mode] = records

    hf_cache = getattr(pair.target, "_previous_max_cache_length", None)
    eager_engine = runner.engine("flashspec_eager")
    return {
        "dtype": dtype,
        "target_weight_bytes": target_bytes,
        "draft_weight_bytes": weight_bytes(pair.draft) if pair.draft is not None else None,
        "modes": modes,
        "compile": {
            "flashspec_compiled": _compile_record(runner, "flashspec_compiled", in_warmup),
            "flashspec_eager": {
                "on": eager_engine.compiled.on,
                "reason": eager_engine.compiled.reason,
            },
            BASELINE: {
                # HF's static cache length after every call: the longest it was asked for.
                "max_cache_len": int(hf_cache) if isinstance(hf_cache, int) else None,
                "graphs": sum(warm[BASELINE]["graphs"] for warm in warmups.values()),
                "graphs_after_warmup": graphs_after_warmup(modes, BASELINE),
            },
        },
        "weight_streaming": {
            "target_weight_bytes": target_bytes,
            "floor_bytes_per_second": STREAMING_FLOOR,
            "floor_source": "shared/design.md: a 540 MB torch sum at 26 GB/s on the project's "
            "earlier 2-core AVX-512 machine (quoted, not measured in this run)",
            "rows": [_fastest(modes, "flashspec_compiled"), _fastest(modes, REFERENCE)],
        },
    }


def run_compiled(
    load: Callable[[str], Pair], prompts: Sequence[Prompt], settings: CompiledSettings
) -> dict[str, Any]:
    """Measure every dtype, mode and method; returns what ``compiled.json`` holds (without the
    machine record). ``load(dtype)`` gives the pair in that dtype (a fresh one each: HF keeps
    its compiled call and cache length on the model)."""
    if not settings.dtypes:
        raise ValueError("need at least one dtype")
    cache = inductor_cache()  # before anything compiles
    runs: list[dict[str, Any]] = []
    described: dict[str, Any] = {}
    for dtype in settings.dtypes:
        pair = load(dtype)
        runs.append(run_dtype(pair, prompts, settings))
        lookup = pair.draft is None
        described = {
            "target": pair.target_name,
            "draft": pair.draft_name,
            "drafter": "prompt_lookup" if lookup else str(pair.draft_name),
            "target_parameters": sum(int(p.numel()) for p in pair.target.parameters()),
            "draft_parameters": (
                sum(int(p.numel()) for p in pair.draft.parameters()) if not lookup else None
            ),
            "vocab_size": int(pair.target.config.vocab_size),
        }
        configs = {m: describe(engine_config(m, settings.gamma, lookup)) for m in FLASHSPEC}
        encoded = [encode(pair, p.text, settings.max_prompt_tokens) for p in prompts]
        del pair
        gc.collect()
    data: dict[str, Any] = {
        "kind": "compiled",
        "pair": described,
        "settings": {
            "prompts": len(prompts),
            "prompt_ids": [p.id for p in prompts],
            "prompt_tokens": [len(r) for r in encoded],
            "max_new_tokens": settings.max_new_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens,
            "gamma": settings.gamma,
            "repeats": settings.repeats,
            "modes": list(settings.modes),
            "dtypes": list(settings.dtypes),
            "methods": list(METHODS),
            "baseline": BASELINE,
            "reference": REFERENCE,
            "sampled": {"temperature": TEMPERATURE, "top_p": TOP_P, "top_k": 0},
            "configs": configs,
            "hf_compile_config": {
                **hf_compile_config().to_dict(),
                "_compile_all_devices": True,
                "cache_implementation": "static",
            },
            "batch": 1,
            "inductor_cache": cache,
            "eos": "ignored by every method (fixed-length generations)",
            "warmup": "per dtype and mode, each method runs the longest prompt first (then one "
            "prompt of each other static-cache bucket, and more while a compiled length has "
            "not been compiled); first_call_seconds is its first call",
            "interleaving": "per pass, each prompt runs every method in turn, the order "
            "rotating from prompt to prompt",
            "weight_bytes_per_second": "target weight bytes x target forwards per second (HF: "
            "one forward per token; flashspec: one per round)",
            **settings.extra,
        },
        "runs": runs,
    }
    data["checks"] = checks(data)
    return data


def graphs_after_warmup(modes: dict[str, Any], method: str) -> int:
    """Graphs ``method`` compiled in the timed passes of every mode."""
    return sum(int(records[method]["graphs_after_warmup"]) for records in modes.values())


def describe(config: FlashSpecConfig) -> dict[str, Any]:
    """The fields of an engine configuration that tell the methods apart (for the JSON)."""
    bandit = config.bandit
    return {
        "compile": config.compile,
        "gamma": config.sampling.gamma,
        "plain_arm": bandit.plain,
        "context": bandit.context,
    }


def checks(data: dict[str, Any]) -> dict[str, Any]:
    """What must hold for the run to count: every flashspec greedy row identical to HF eager's
    (or a tie), and no compile of flashspec_compiled after its warm-up."""
    mismatches = [
        f"{run['dtype']} {mode} {method}"
        for run in data["runs"]
        for mode, records in run["modes"].items()
        for method in FLASHSPEC
        if not records[method].get("all_match", True)
    ]
    recompiles = {
        run["dtype"]: run["compile"]["flashspec_compiled"]["recompiles_after_warmup"]
        for run in data["runs"]
    }
    return {
        "flashspec_greedy_identical": not mismatches,
        "mismatches": mismatches,
        "recompiles_after_warmup": recompiles,
        "no_recompiles": not any(recompiles.values()),
    }
