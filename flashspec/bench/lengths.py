"""Long generations: the default engine against HF greedy at several lengths of new tokens, and
the time of a round (the engine) or a token (HF) against the context length it ran at.

A round's fixed costs must not grow with the generation, and the default engine must notice when
drafting stops paying late in a long answer; both show here and nowhere in a 128-token run.
Shared by ``flashspec bench engine`` (the demo pair, ``engine.json``) and its real-model form
(``flashspec.bench.chat``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from .._greedy import compare_greedy
from .._lean import hf_forward
from .common import progress, quiet_timing

BIN = 128
"""Context lengths are grouped in bins of this many tokens for the per-round times."""


class _TokenClock:
    """An HF streamer that notes when each new token arrives (the first ``put`` is the
    prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _engine_run(engine: Any, ids: list[int], n: int) -> dict[str, Any]:
    """The engine on ``ids`` for ``n`` tokens (EOS ignored), with the start of every round."""
    marks: list[tuple[float, int]] = []  # (time a round starts, context length then)

    def hook(view: Any) -> None:
        left = int(view.padding.lefts[0]) if view.padding.lefts else 0
        marks.append((time.perf_counter(), int(view.tokens.shape[1]) - left))

    engine.before_round.append(hook)
    try:
        with quiet_timing():
            start = time.perf_counter()
            result = engine.generate([ids], max_new_tokens=n, ignore_eos=True)
            end = time.perf_counter()
    finally:
        engine.before_round.remove(hook)
    tokens = list(result.tokens[0])
    # A round's time runs to the next round's start; the first round also reads the prompt.
    rounds = [
        (context, later - at)
        for (at, context), (later, _) in zip(marks[1:], [*marks[2:], (end, 0)], strict=True)
    ]
    return {
        "tokens": tokens,
        "seconds": end - start,
        "rounds": result.stats.rounds,
        "arm_rounds": dict(result.stats.arm_rounds),
        "round_times": rounds,
    }


def _hf_run(model: Any, ids: list[int], n: int, pad_id: int | None) -> dict[str, Any]:
    """HF greedy ``generate`` for exactly ``n`` tokens, with each token's arrival."""
    x = torch.tensor([ids], dtype=torch.int64)
    clock = _TokenClock()
    with hf_forward(model), quiet_timing():
        start = time.perf_counter()
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            temperature=None,
            top_p=None,
            top_k=None,
            pad_token_id=pad_id,
            streamer=clock,
        )
        end = time.perf_counter()
    tokens = [int(t) for t in out[0, len(ids) :].tolist()]
    # clock.times[0] is the prompt's put, [1] the first token (after the prefill).
    steps = [
        (len(ids) + i, later - at)
        for i, (at, later) in enumerate(zip(clock.times[1:], clock.times[2:], strict=False))
    ]
    return {"tokens": tokens, "seconds": end - start, "token_times": steps}


def _binned(samples: list[tuple[int, float]]) -> dict[str, float]:
    """Median seconds per bin of context length, keyed by the bin's first position."""
    bins: dict[int, list[float]] = {}
    for context, seconds in samples:
        bins.setdefault(context // BIN * BIN, []).append(seconds)
    return {str(k): round(statistics.median(v) * 1000, 3) for k, v in sorted(bins.items())}


def _growth(binned: dict[str, float]) -> float | None:
    """Last bin over the first: how much a round (or token) slowed as the context grew."""
    values = list(binned.values())
    return round(values[-1] / values[0], 4) if len(values) >= 2 and values[0] > 0 else None


def length_study(
    engines: Any,
    model: Any,
    prompts: Sequence[list[int]],
    lengths: Sequence[int],
    *,
    pad_id: int | None,
    max_positions: int | None,
    show_progress: bool = True,
) -> dict[str, Any]:
    """Engines against HF greedy on ``model`` (their target), at each of ``lengths`` new
    tokens on every prompt, interleaved (the order rotates per prompt). ``engines``: one engine
    (recorded as ``"default"``) or a dict of them by name.

    A length the model's context cannot hold after a prompt is cut to what it can
    (``max_positions``); the record keeps the length run. Returns, per engine and length, the
    speedup (tokens/s over HF's, median over prompts and over the summed time), tokens per
    round, greedy identity; and, from the longest runs, each engine's median round time and
    HF's median token time per bin of ``BIN`` context tokens, with their growth from the
    first bin to the last.
    """
    named: dict[str, Any] = engines if isinstance(engines, dict) else {"default": engines}
    records: list[dict[str, Any]] = []
    rounds: dict[str, list[tuple[int, float]]] = {name: [] for name in named}
    tokens: list[tuple[int, float]] = []
    longest = max(lengths)
    methods = ["hf", *named]
    jobs = [(p, n) for n in lengths for p in range(len(prompts))]
    for index, (p, n) in enumerate(progress(jobs, desc="lengths", disable=not show_progress)):
        ids = prompts[p]
        run_n = n if max_positions is None else max(1, min(n, max_positions - len(ids)))
        order = methods[index % len(methods) :] + methods[: index % len(methods)]
        runs: dict[str, dict[str, Any]] = {}
        for method in order:
            runs[method] = (
                _hf_run(model, ids, run_n, pad_id)
                if method == "hf"
                else _engine_run(named[method], ids, run_n)
            )
        hf = runs["hf"]
        if n == longest:
            tokens += hf["token_times"]
        hf_tps = len(hf["tokens"]) / hf["seconds"]
        for name in named:
            fs = runs[name]
            if n == longest:
                rounds[name] += fs["round_times"]
            records.append(
                {
                    "engine": name,
                    "prompt": p,
                    "prompt_tokens": len(ids),
                    "length": n,
                    "new_tokens": len(fs["tokens"]),
                    "hf_seconds": round(hf["seconds"], 4),
                    "fs_seconds": round(fs["seconds"], 4),
                    "speedup": round(len(fs["tokens"]) / fs["seconds"] / hf_tps, 4),
                    "tokens_per_round": round(len(fs["tokens"]) / max(fs["rounds"], 1), 4),
                    "arm_rounds": fs["arm_rounds"],
                    # Under the tie rule: a long generation may meet a float tie between one
                    # k-token forward and k one-token forwards (``flashspec._greedy``).
                    "identity": compare_greedy(model, ids, fs["tokens"], hf["tokens"]).status,
                }
            )
    summary: dict[str, Any] = {}
    for name in named:
        summary[name] = {}
        for n in lengths:
            group = [r for r in records if r["length"] == n and r["engine"] == name]
            hf_s = sum(r["hf_seconds"] for r in group)
            fs_s = sum(r["fs_seconds"] for r in group)
            summary[name][str(n)] = {
                "new_tokens_median": statistics.median(r["new_tokens"] for r in group),
                "speedup_median": round(statistics.median(r["speedup"] for r in group), 4),
                "speedup_total": round(hf_s / fs_s, 4),
                "tokens_per_round_median": round(
                    statistics.median(r["tokens_per_round"] for r in group), 4
                ),
                "identical": sum(r["identity"] != "mismatch" for r in group),
                "ties": sum(r["identity"] == "tie" for r in group),
                "prompts": len(group),
            }
    token_ms = _binned(tokens)
    round_ms = {name: _binned(samples) for name, samples in rounds.items()}
    return {
        "lengths": list(lengths),
        "bin_tokens": BIN,
        "summary": summary,
        "round_ms_by_context": round_ms,
        "hf_token_ms_by_context": token_ms,
        "round_growth": {name: _growth(binned) for name, binned in round_ms.items()},
        "hf_token_growth": _growth(token_ms),
        "records": records,
    }


def report_lengths(study: dict[str, Any]) -> str:
    """The study as a few lines of text (the command prints it)."""
    lines = ["long generations (against HF greedy):"]
    for name, per_length in study["summary"].items():
        for n, s in per_length.items():
            lines.append(
                f"  {name:>8} {n:>5} new tokens: {s['speedup_total']:.2f}x (median "
                f"{s['speedup_median']:.2f}x), {s['tokens_per_round_median']:.2f} tokens/round, "
                f"identical {s['identical']}/{s['prompts']} ({s['ties']} at a float tie)"
            )
        lines.append(
            f"  {name:>8} round time, first to last {study['bin_tokens']}-token context bin: "
            f"{study['round_growth'][name]}x (HF's token time: {study['hf_token_growth']}x)"
        )
    return "\n".join(lines)
