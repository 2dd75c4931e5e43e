"""``flashspec bench batch``: ragged against lockstep batches, and both against HF's batched
greedy ``generate``, at batch sizes 1 to 32 (``batch.json``; a real model: ``batch-NAME.json``).

Every batch size runs the same prompts (the first ``--prompts`` HumanEval tasks) cut into
batches of consecutive prompts, so each batch mixes prompt lengths and is left padded. Every
method generates exactly ``--max-new-tokens`` per row (EOS ignored), greedy, so tokens/s compare
equal work and every row can be checked token for token against HF's.

Methods (``METHODS``):

- ``hf_batched``       ``model.generate`` on the left-padded batch, greedy: the baseline.
- ``ragged``           flashspec, ``FlashSpecConfig(batching="ragged")``: every row commits its
                       own accepted drafts each round; the draft length fixed at gamma.
- ``lockstep``         flashspec, ``batching="lockstep"``: every row emits as many tokens as the
                       row that accepted fewest, plus one (the earlier engine); gamma fixed.
- ``default``          the engine's default: ragged, and with a draft model the draft length
                       (or plain decoding) chosen by the throughput model in rounds of two or
                       more rows (``BanditConfig.batches="follow"``); with prompt lookup the
                       engine's default for a real target (lookup or plain each round,
                       ``plain=True, context="lookup"``).
- ``ragged_adaptive``  ragged with the throughput model choosing among the drafter at a length
                       it picks and plain decoding in every round, a batch of one included
                       (``BanditConfig(plain=True)``; with prompt lookup also
                       ``context="lookup"``).

The demo target drafts with the demo draft model; another target (``--target smollm2``) with
prompt lookup, as the engine's default does for it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ...compiled import CompileSetting
from ..common import Prompt, progress
from ..identity import count_statuses, row_statuses, worst, worst_verdict
from ..pair import Pair, encode
from .methods import (
    BASELINE,
    DEFAULT_BATCHES,
    METHODS,
    WARMUP_TOKENS,
    BatchRun,
    BatchRunner,
    describe,
    engine_config,
)

DEFAULT_PROMPTS = 32


# ------------------------------------------------------------------------------- the sweep


@dataclass
class BatchSettings:
    """What a run measures (recorded in the JSON); ``prompts``: how many HumanEval prompts
    ``main`` loads (``run_batch`` runs those it is given)."""

    batches: tuple[int, ...] = DEFAULT_BATCHES
    prompts: int = DEFAULT_PROMPTS
    max_new_tokens: int = 64
    max_prompt_tokens: int = 128
    gamma: int = 4
    repeats: int = 3
    methods: tuple[str, ...] = METHODS
    compile: CompileSetting = False
    progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Tally:
    """One method at one batch size in one repeat, summed over its batches."""

    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0
    row_rounds: int = 0
    emitted: int = 0
    drafted: int = 0
    accepted: int = 0
    compile_seconds: float = 0.0
    arm_rounds: dict[str, int] = field(default_factory=dict)

    def add(self, run: BatchRun) -> None:
        self.seconds += run.seconds
        self.compile_seconds += run.compile_seconds
        self.tokens += sum(len(t) for t in run.tokens)
        self.rounds += run.rounds
        self.row_rounds += run.row_rounds
        self.emitted += run.emitted
        self.drafted += run.drafted
        self.accepted += run.accepted
        for arm, count in run.arm_rounds.items():
            self.arm_rounds[arm] = self.arm_rounds.get(arm, 0) + count

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_round(self) -> float:
        return self.emitted / self.row_rounds if self.row_rounds else 0.0


def _chunks(rows: list[list[int]], size: int) -> list[list[list[int]]]:
    return [rows[i : i + size] for i in range(0, len(rows), size)]


def _spread(values: Sequence[float], digits: int) -> dict[str, Any]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def run_batch(pair: Pair, prompts: Sequence[Prompt], settings: BatchSettings) -> dict[str, Any]:
    """Measure every method at every batch size; returns what ``batch.json`` holds (without
    the machine record).

    For each batch size: fresh engines, an untimed warm-up of each method on the first batch,
    then ``repeats`` passes over the prompts, batch by batch, the methods alternating on each
    batch (the order rotates from batch to batch). Medians over the repeats.
    """
    methods = [BASELINE, *(m for m in settings.methods if m != BASELINE)]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        raise ValueError(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    sizes = sorted(set(settings.batches))
    if not prompts or not sizes or min(sizes) < 1 or settings.repeats < 1:
        raise ValueError("need prompts, batch sizes >= 1 and repeats >= 1")
    encoded = [encode(pair, p.text, settings.max_prompt_tokens) for p in prompts]
    runner = BatchRunner(pair, settings.gamma, settings.max_new_tokens, settings.compile)
    jobs = [
        (size, repeat, index)
        for size in sizes
        for repeat in range(settings.repeats)
        for index in range(len(_chunks(encoded, size)))
    ]
    tallies: dict[tuple[int, str, int], _Tally] = {}
    verdicts: dict[tuple[int, str], list[list[dict[str, Any]]]] = {}
    current: int | None = None
    warmups: dict[tuple[int, str], float] = {}  # compile seconds of each warm-up
    bar = progress(jobs, desc="batch", unit="batch", disable=not settings.progress)
    for turn, (size, repeat, index) in enumerate(bar):
        chunks = _chunks(encoded, size)
        if size != current:
            current = size
            runner.reset()
            bar.set_postfix(B=size)
            for method in methods:  # first calls pay for lazy set-up and allocator growth
                warm = runner.run(method, chunks[0], min(WARMUP_TOKENS, settings.max_new_tokens))
                warmups[size, method] = warm.compile_seconds
        rows = chunks[index]
        order = methods[turn % len(methods) :] + methods[: turn % len(methods)]
        runs = {method: runner.run(method, rows) for method in order}
        reference = runs[BASELINE].tokens
        for method in methods:
            tallies.setdefault((size, method, repeat), _Tally()).add(runs[method])
            if method != BASELINE:
                statuses = row_statuses(pair, rows, runs[method].tokens, reference)
                per_prompt = verdicts.setdefault((size, method), [[] for _ in encoded])
                for offset, verdict in enumerate(statuses):
                    per_prompt[index * size + offset].append(verdict)

    results = []
    for size in sizes:
        chunks = _chunks(encoded, size)
        widths = [max(len(r) for r in chunk) for chunk in chunks]
        padded = sum(w * len(c) for w, c in zip(widths, chunks, strict=True))
        entry: dict[str, Any] = {
            "batch_size": size,
            "calls": len(chunks),
            "rows": len(encoded),
            "padding_share": round(1 - sum(len(r) for r in encoded) / padded, 4),
            "methods": {},
        }
        base = [tallies[(size, BASELINE, r)] for r in range(settings.repeats)]
        for method in methods:
            reps = [tallies[(size, method, r)] for r in range(settings.repeats)]
            record: dict[str, Any] = {
                "new_tokens": reps[0].tokens,
                "seconds": _spread([t.seconds for t in reps], 5),
                "tokens_per_second": _spread([t.tokens_per_second for t in reps], 2),
                "tokens_per_round": _spread([t.tokens_per_round for t in reps], 4),
                # Paired by repeat: both ran interleaved on the same batches.
                "speedup": _spread(
                    [
                        t.tokens_per_second / b.tokens_per_second
                        for t, b in zip(reps, base, strict=True)
                    ],
                    4,
                ),
                "rounds": [t.rounds for t in reps],
                "acceptance_rate": (
                    round(sum(t.accepted for t in reps) / sum(t.drafted for t in reps), 4)
                    if sum(t.drafted for t in reps)
                    else None
                ),
            }
            arms: dict[str, int] = {}
            for t in reps:
                for arm, count in t.arm_rounds.items():
                    arms[arm] = arms.get(arm, 0) + count
            if arms:
                record["arm_rounds"] = arms  # over every repeat
            if method != BASELINE and runner.engine(method).compiled.on:
                # Compiling happens in the warm-up (first calls of each shape); a timed run
                # that compiled again would show here.
                record["compile_seconds_warmup"] = round(warmups[size, method], 2)
                record["compile_seconds_timed"] = round(sum(t.compile_seconds for t in reps), 2)
                record["graphs"] = runner.graphs(method)
            if method != BASELINE:
                per_prompt = verdicts[(size, method)]
                worst_of = [worst([v["status"] for v in runs_of]) for runs_of in per_prompt]
                counts = count_statuses(worst_of)
                record["identity"] = {**counts, "rows": len(worst_of)}
                record["all_match"] = counts["mismatch"] == 0
                # Where each differing prompt's worst run first differs, and by what gap.
                record["differences"] = [
                    {"prompt": prompts[i].id, **worst_verdict(runs_of)}
                    for i, runs_of in enumerate(per_prompt)
                    if worst_of[i] != "identical"
                ]
            entry["methods"][method] = record
        results.append(entry)

    data: dict[str, Any] = {
        "kind": "batch",
        "pair": {
            "target": pair.target_name,
            "draft": pair.draft_name,
            "drafter": runner.drafter,
            "target_parameters": _parameters(pair.target),
            "draft_parameters": _parameters(pair.draft) if pair.draft is not None else None,
            "vocab_size": int(pair.target.config.vocab_size),
        },
        "settings": {
            "batches": sizes,
            "prompts": len(prompts),
            "prompt_ids": [p.id for p in prompts],
            "prompt_tokens": [len(r) for r in encoded],
            "max_new_tokens": settings.max_new_tokens,
            "max_prompt_tokens": settings.max_prompt_tokens,
            "gamma": settings.gamma,
            "repeats": settings.repeats,
            "methods": methods,
            "configs": {
                m: describe(engine_config(m, settings.gamma, runner.lookup, settings.compile))
                for m in methods[1:]
            },
            # On the compiled path batches of up to 8 rows run on static caches of fixed
            # slots (flashspec.kv.slots); ``_compiled`` methods take it whatever this says.
            "compile": settings.compile,
            "compiled_path": {m: runner.engine(m).compiled.line() for m in methods[1:]},
            "eos": "ignored by every method (fixed-length generations)",
            "interleaving": "per batch size: fresh engines, a warm-up of each method, then per "
            "repeat each batch runs every method in turn, the order rotating from batch to batch",
            **settings.extra,
        },
        "results": results,
    }
    data["targets"] = check_targets(data)
    return data


def _parameters(model: Any) -> int:
    return sum(int(p.numel()) for p in model.parameters())


# --------------------------------------------------------------------------------- targets


def _by_size(data: dict[str, Any]) -> dict[int, dict[str, Any]]:
    return {entry["batch_size"]: entry["methods"] for entry in data["results"]}


def check_targets(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The issue's targets with each flashspec method's measured value (None where the run
    lacks the batch size a target needs); ``met`` says whether the value reaches it."""
    per = _by_size(data)
    methods = [m for m in data["settings"]["methods"] if m != BASELINE]

    def speedup(size: int, method: str) -> float | None:
        entry = per.get(size)
        return None if entry is None else float(entry[method]["speedup"]["median"])

    def tpr_ratio(method: str) -> float | None:
        if 1 not in per or 16 not in per:
            return None
        one = float(per[1][method]["tokens_per_round"]["median"])
        return round(float(per[16][method]["tokens_per_round"]["median"]) / one, 4)

    def lowest(method: str) -> float | None:
        return min((float(e[method]["speedup"]["median"]) for e in per.values()), default=None)

    checks: list[tuple[str, float, Any]] = [
        ("tokens/round at B=16 over B=1", 0.85, tpr_ratio),
        ("speedup vs HF batched at B=8", 1.6, lambda m: speedup(8, m)),
        ("speedup vs HF batched at B=16", 1.3, lambda m: speedup(16, m)),
        ("speedup vs HF batched at every B (lowest)", 0.95, lowest),
    ]
    out = []
    for name, threshold, measure in checks:
        measured = {m: measure(m) for m in methods}
        out.append(
            {
                "target": name,
                "threshold": threshold,
                "measured": measured,
                "met": {
                    m: (v >= threshold if v is not None else None) for m, v in measured.items()
                },
            }
        )
    return out
