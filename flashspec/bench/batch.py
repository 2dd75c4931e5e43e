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

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._lean import hf_forward
from ..cli import argtypes
from ..cli.options import add_compile_argument, compile_setting
from ..compiled import CompileSetting
from ..config import BanditConfig, FlashSpecConfig, SamplingConfig
from ..drafters import Drafter, ModelDrafter, PromptLookupDrafter
from ..engine import SpeculativeEngine
from ..loading.gguf import MissingDependencyError
from ..loading.named import ModelNotInstalledError
from ..models import DEMO_NAMES, TargetModel
from . import common
from .common import Prompt, humaneval_prompts, machine_info, progress, quiet_timing, write_json
from .identity import count_statuses, row_statuses, worst, worst_verdict
from .pair import Pair, draft_for, encode, load_pair, quiet_and_threads
from .runner import forward_counter

BASELINE = "hf_batched"
METHODS = (BASELINE, "ragged", "lockstep", "default", "ragged_adaptive")
LABELS = {
    BASELINE: "HF batched generate",
    "ragged": "flashspec ragged",
    "lockstep": "flashspec lockstep",
    "default": "flashspec default",
    "ragged_adaptive": "flashspec ragged, adaptive",
}
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)
DEFAULT_PROMPTS = 32
WARMUP_TOKENS = 16


# ---------------------------------------------------------------------------------- running


@dataclass
class BatchRun:
    """One method on one batch: each row's new tokens, the call's wall time and its rounds.

    ``rounds`` counts batch forwards of the target (a round of flashspec, a step of HF);
    ``row_rounds`` and ``emitted`` are ``GenerationStats``'s (for HF: a row per step, one
    token each), so emitted / row_rounds is ``GenerationStats.mean_tokens_per_round``.
    """

    tokens: list[list[int]]
    seconds: float
    rounds: int
    row_rounds: int
    emitted: int
    drafted: int = 0
    accepted: int = 0
    arm_rounds: dict[str, int] = field(default_factory=dict)


def engine_config(
    method: str, gamma: int, lookup: bool, compile: CompileSetting = False
) -> FlashSpecConfig:
    """The engine configuration a flashspec method stands for (greedy, draft length gamma;
    ``compile``: ``FlashSpecConfig.compile``, which runs a batch of one compiled)."""
    sampling = SamplingConfig(gamma=gamma)
    fixed = BanditConfig(batches="fixed")
    if method == "ragged":
        return FlashSpecConfig(sampling=sampling, bandit=fixed, batching="ragged", compile=compile)
    if method == "lockstep":
        return FlashSpecConfig(
            sampling=sampling, bandit=fixed, batching="lockstep", compile=compile
        )
    if method == "default":
        if lookup:
            bandit = BanditConfig(plain=True, context="lookup")
            return FlashSpecConfig(sampling=sampling, bandit=bandit, compile=compile)
        return FlashSpecConfig(sampling=sampling, compile=compile)
    if method == "ragged_adaptive":
        # What SpeculativeEngine.from_pretrained builds by default for a target drafted by
        # prompt lookup; with a draft model the same minus the lookup context.
        bandit = BanditConfig(plain=True, context="lookup" if lookup else "none")
        return FlashSpecConfig(sampling=sampling, bandit=bandit, batching="ragged", compile=compile)
    raise ValueError(f"{method!r} is not a flashspec method; choose from {METHODS[1:]}")


def describe(config: FlashSpecConfig) -> dict[str, Any]:
    """The fields of an engine configuration that tell the methods apart (for the JSON)."""
    bandit = config.bandit
    return {
        "batching": config.batching,
        "gamma": config.sampling.gamma,
        "plain_arm": bandit.plain,
        "selector": bandit.selector if bandit.plain or bandit.gammas else None,
        "context": bandit.context,
        "batches": bandit.batches,
        "compile": config.compile,
    }


class BatchRunner:
    """Runs each method on a batch of token rows, all on the pair's own model objects."""

    def __init__(
        self, pair: Pair, gamma: int, max_new_tokens: int, compile: CompileSetting = False
    ) -> None:
        self.pair = pair
        self.gamma = gamma
        self.max_new_tokens = max_new_tokens
        self.compile = compile
        self.lookup = pair.draft is None
        self._engines: dict[str, SpeculativeEngine] = {}

    @property
    def drafter(self) -> str:
        """What the flashspec methods draft with: the draft model's name, or prompt lookup."""
        return "prompt_lookup" if self.lookup else str(self.pair.draft_name)

    def reset(self) -> None:
        """Drop the engines: the next runs build fresh ones (the adaptive engine forgets what
        it learned, so a batch size's result does not depend on those run before it)."""
        self._engines.clear()

    def engine(self, method: str) -> SpeculativeEngine:
        """The engine of ``method``, built on first use; each has its own drafter and target
        wrapper (their caches), around the shared models."""
        if method not in self._engines:
            pair = self.pair
            drafter: Drafter = (
                PromptLookupDrafter()
                if self.lookup
                else ModelDrafter(pair.draft, name=pair.draft_name, tokenizer=pair.tokenizer)
            )
            target = TargetModel(pair.target_name, model=pair.target, tokenizer=pair.tokenizer)
            config = engine_config(method, self.gamma, self.lookup, self.compile)
            self._engines[method] = SpeculativeEngine(config, [drafter], target)
        return self._engines[method]

    def run(
        self, method: str, rows: Sequence[Sequence[int]], max_new_tokens: int | None = None
    ) -> BatchRun:
        """Time ``method`` on the batch ``rows`` (unpadded prompts)."""
        n = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if method == BASELINE:
            return self._run_hf(rows, n)
        engine = self.engine(method)
        prompts = [list(r) for r in rows]
        with quiet_timing():
            start = time.perf_counter()
            result = engine.generate(prompts, max_new_tokens=n, ignore_eos=True, seed=0)
            seconds = time.perf_counter() - start
        stats = result.stats
        return BatchRun(
            [list(t) for t in result.tokens],
            seconds,
            rounds=stats.rounds,
            row_rounds=stats.row_rounds,
            emitted=stats.emitted,
            drafted=stats.drafted,
            accepted=stats.accepted,
            arm_rounds=dict(stats.arm_rounds),
        )

    def _run_hf(self, rows: Sequence[Sequence[int]], n: int) -> BatchRun:
        pair = self.pair
        ids, mask = left_pad(rows, pair.pad_id)
        # EOS is off in the generation config (make_pair): it neither stops a row nor, as
        # min_new_tokens alone would, gets masked out of the argmax, so HF's tokens are the
        # engine's with ignore_eos. min_new_tokens says the same should EOS be set again.
        kwargs: dict[str, Any] = {
            "attention_mask": mask,
            "max_new_tokens": n,
            "min_new_tokens": n,
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "pad_token_id": pair.pad_id,
        }
        with (
            hf_forward(pair.target),
            forward_counter(pair.target) as steps,
            torch.inference_mode(),
            quiet_timing(),
        ):
            start = time.perf_counter()
            out = pair.target.generate(ids, **kwargs)
            seconds = time.perf_counter() - start
        width = ids.shape[1]
        tokens = [[int(t) for t in row[width:].tolist()] for row in out]
        return BatchRun(
            tokens,
            seconds,
            rounds=steps[0],
            row_rounds=steps[0] * len(rows),
            emitted=sum(len(t) for t in tokens),
        )


def left_pad(rows: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of ``rows`` padded on the left to the longest."""
    width = max(len(r) for r in rows)
    ids = torch.tensor([[pad_id] * (width - len(r)) + list(r) for r in rows], dtype=torch.int64)
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], dtype=torch.int64)
    return ids, mask


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
    arm_rounds: dict[str, int] = field(default_factory=dict)

    def add(self, run: BatchRun) -> None:
        self.seconds += run.seconds
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
    bar = progress(jobs, desc="batch", unit="batch", disable=not settings.progress)
    for turn, (size, repeat, index) in enumerate(bar):
        chunks = _chunks(encoded, size)
        if size != current:
            current = size
            runner.reset()
            bar.set_postfix(B=size)
            for method in methods:  # first calls pay for lazy set-up and allocator growth
                runner.run(method, chunks[0], min(WARMUP_TOKENS, settings.max_new_tokens))
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
            # The compiled path runs a batch of one compiled; larger batches run eager.
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


# ---------------------------------------------------------------------------------- report


def table(data: dict[str, Any]) -> str:
    """The results as a Markdown table: one line per batch size and method."""
    lines = [
        "| B | method | tokens/s | tokens/round | vs HF batched | rows identical to HF |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    repeats = int(data["settings"]["repeats"])
    for entry in data["results"]:
        for method, record in entry["methods"].items():
            speed = record["speedup"]
            if method == BASELINE:
                vs = "1 (baseline)"
            elif repeats > 1:
                vs = f"{speed['median']:.2f}x ({speed['min']:.2f}-{speed['max']:.2f})"
            else:
                vs = f"{speed['median']:.2f}x"
            identity = record.get("identity")
            if identity is None:
                same = "(reference)"
            else:
                same = f"{identity['identical']}/{identity['rows']}"
                if identity["tie"]:
                    same += f" (+{identity['tie']} tie)"
                if identity["mismatch"]:
                    same += f", {identity['mismatch']} MISMATCH"
            lines.append(
                f"| {entry['batch_size']} | {LABELS.get(method, method)} "
                f"| {record['tokens_per_second']['median']:.1f} "
                f"| {record['tokens_per_round']['median']:.2f} | {vs} | {same} |"
            )
    return "\n".join(lines)


def target_lines(data: dict[str, Any]) -> list[str]:
    """One line per target: the threshold and each flashspec method's measured value."""
    lines = []
    for check in data["targets"]:
        values = []
        for method, value in check["measured"].items():
            met = check["met"][method]
            mark = "" if met is None else (" ✓" if met else " ✗")
            shown = "not measured" if value is None else f"{value:.2f}"
            values.append(f"{method} {shown}{mark}")
        lines.append(f"- {check['target']} (target >= {check['threshold']}): {', '.join(values)}")
    return lines


def report(data: dict[str, Any]) -> str:
    """The table and the targets, for the terminal."""
    return "\n".join(
        [table(data), "", "targets (not claims; measured in this run):", *target_lines(data)]
    )


# ------------------------------------------------------------------------------ the command


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench batch`` (besides the model options the parser shares)."""
    parser.add_argument(
        "--batches",
        type=argtypes.positive_int,
        nargs="+",
        default=list(DEFAULT_BATCHES),
        help=f"batch sizes (default {' '.join(map(str, DEFAULT_BATCHES))})",
    )
    parser.add_argument(
        "--prompts",
        type=argtypes.positive_int,
        default=DEFAULT_PROMPTS,
        help=f"HumanEval prompts, the first N (default {DEFAULT_PROMPTS}); each batch size runs "
        "them all, in batches of consecutive prompts",
    )
    parser.add_argument(
        "--max-new-tokens", type=argtypes.positive_int, default=64, help="per row (default 64)"
    )
    parser.add_argument(
        "--repeats",
        type=argtypes.positive_int,
        default=3,
        help="passes over the prompts at each batch size; medians are reported (default 3)",
    )
    parser.add_argument(
        "--methods",
        nargs="+",
        choices=METHODS,
        default=list(METHODS),
        help=f"methods (default all; {BASELINE}, the reference, always runs)",
    )
    parser.add_argument(
        "--name",
        default=None,
        help="result file stem (default batch; for a real model batch-NAME, e.g. batch-smollm2)",
    )
    add_compile_argument(parser)


def result_name(target: str) -> str:
    """``batch`` for the demo pair, ``batch-NAME`` for another target."""
    if target in DEMO_NAMES:
        return "batch"
    return f"batch-{common.result_name(target)}"


def settings_from_args(args: argparse.Namespace) -> BatchSettings:
    """The run ``args`` describes (``--quick``: a short one)."""
    batches, prompts = tuple(args.batches), args.prompts
    max_new, repeats = args.max_new_tokens, args.repeats
    if args.quick:
        prompts, max_new, repeats = min(prompts, 8), min(max_new, 32), 1
        batches = tuple(b for b in batches if b <= prompts) or (1,)
    too_big = [b for b in batches if b > prompts]
    if too_big:
        raise SystemExit(f"--batches {too_big} exceed the {prompts} prompts (--prompts)")
    return BatchSettings(
        batches=batches,
        prompts=prompts,
        max_new_tokens=max_new,
        max_prompt_tokens=args.max_prompt_tokens,
        gamma=args.gamma,
        repeats=repeats,
        methods=tuple(args.methods),
        compile=compile_setting(getattr(args, "compile", "auto")),
        progress=not args.no_progress,
        extra={"quick": bool(args.quick), "threads": args.threads, "command": " ".join(sys.argv)},
    )


def main(args: argparse.Namespace) -> int:
    """``flashspec bench batch``: run, print the table and the targets, write the JSON.

    Exit status 1 when a flashspec row differs from HF's beyond a floating-point tie; a target
    that cannot be loaded here (a named model whose package is absent) is skipped, status 0.
    """
    quiet_and_threads(args.threads)
    settings = settings_from_args(args)
    draft = draft_for(args.target, args.draft)
    try:
        pair = load_pair(args.target, draft)
    except (ModelNotInstalledError, MissingDependencyError) as exc:
        print(
            f"flashspec bench batch: skipped, {args.target!r} is not available: {exc}",
            file=sys.stderr,
        )
        return 0
    name = args.name or result_name(args.target)
    settings.extra["name"] = name
    machine = machine_info()  # after set_num_threads: it records the threads in use
    started = time.perf_counter()
    data = {"machine": machine, **run_batch(pair, humaneval_prompts(settings.prompts), settings)}
    data["wall_seconds"] = round(time.perf_counter() - started, 1)
    print(report(data))
    write_json(data, Path(args.out_dir) / f"{name}.json")
    matched = all(
        record.get("all_match", True)
        for entry in data["results"]
        for record in entry["methods"].values()
    )
    return 0 if matched else 1
