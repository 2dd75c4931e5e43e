"""What the OpenAI API's fields cost under speculation: the demo pair's default engine against HF
greedy ``generate`` with the same processors, with nothing on, with logprobs, with penalties,
and with a grammar, on the same prompts in one interleaved run (``api-fields.json``).

    python benchmarks/api_fields.py [--prompts 8] [--max-new-tokens 128]

The target of issue #43: the speedup with logprobs or penalties on stays within 10% of the
speedup without them. HF gets each processor as a ``LogitsProcessor`` (its own
``repetition_penalty``; a reference for OpenAI's presence/frequency penalties; an llguidance
mask for the grammar), so both sides do the same work per token.

What bounds a mode's speedup is recorded beside it: the draft's agreement with the target,
teacher-forced on HF's output (the share of its tokens that the draft model's own logits, with
the same processor applied at that position, would have proposed). A round of gamma drafts
emits about (1 - a^(gamma + 1)) / (1 - a) tokens at agreement a, whatever the engine does.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor

from flashspec import SamplingConfig, SpeculativeEngine
from flashspec.bench.common import humaneval_prompts, machine_info, quiet_timing, write_json
from flashspec.grammar import Grammar
from flashspec.grammar.masks import GrammarState

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("plain", "logprobs", "repetition", "openai_penalties", "json_schema")
# A code model writing its answer into a JSON string: long enough output for speculation to
# matter (a bare JSON object from this model is "{}" and three tokens of prefill-bound time).
SCHEMA = {
    "type": "object",
    "properties": {"code": {"type": "string", "minLength": 200}},
    "required": ["code"],
    "additionalProperties": False,
}


class Penalties:
    """OpenAI's presence/frequency penalties over the generated tokens (HF's side)."""

    def __init__(self, start: int, presence: float, frequency: float) -> None:
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.start :], minlength=scores.shape[-1])
        return scores - self.presence * (counts > 0) - self.frequency * counts


class Mask:
    """A grammar's mask as an HF logits processor (one row)."""

    def __init__(self, state: GrammarState, start: int) -> None:
        state.add_rows([0])
        self.state, self.matcher, self.start, self.seen = state, state.matchers[0], start, 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        new = input_ids[0, self.start :].tolist()
        self.matcher.consume_tokens(new[self.seen :])
        self.seen = len(new)
        allowed = self.state.allowed(self.matcher)[: scores.shape[-1]]
        return scores.masked_fill(~allowed, float("-inf"))


def settings(mode: str) -> tuple[SamplingConfig, dict[str, Any]]:
    """The engine's sampling and generate() extras for a mode."""
    if mode == "repetition":
        return SamplingConfig(repetition_penalty=1.2), {}
    if mode == "openai_penalties":
        return SamplingConfig(presence_penalty=0.5, frequency_penalty=0.3), {}
    if mode == "logprobs":
        return SamplingConfig(), {"logprobs": 5}
    if mode == "json_schema":
        return SamplingConfig(), {"grammar": Grammar.from_schema(SCHEMA)}
    return SamplingConfig(), {}


def hf_run(engine: Any, ids: list[int], n: int, mode: str) -> tuple[list[int], float]:
    model = engine.target.model
    x = torch.tensor([ids])
    kwargs: dict[str, Any] = {}
    if mode == "repetition":
        kwargs["repetition_penalty"] = 1.2
    elif mode == "openai_penalties":
        kwargs["logits_processor"] = LogitsProcessorList([Penalties(len(ids), 0.5, 0.3)])
    elif mode == "logprobs":
        kwargs.update(output_logits=True, return_dict_in_generate=True)
    elif mode == "json_schema":
        eos = list(engine.target.eos_token_ids)
        state = GrammarState(
            Grammar.from_schema(SCHEMA), engine.tokenizer, eos, engine.target.vocab_size
        )
        kwargs["logits_processor"] = LogitsProcessorList([Mask(state, len(ids))])
    with quiet_timing(), torch.inference_mode():
        start = time.perf_counter()
        out = model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
            temperature=None, top_p=None, top_k=None, pad_token_id=0,
            eos_token_id=engine.target.eos_token_ids if mode == "json_schema" else None,
            **kwargs,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    if mode == "logprobs":
        # What the engine reports: the log-softmax of every step's raw logits and the top 5.
        for step in out.logits:
            step.float().log_softmax(-1).topk(5)
        seconds = time.perf_counter() - start
        out = out.sequences
    return [int(t) for t in out[0, len(ids) :]], seconds


def agreement(engine: Any, ids: list[int], output: list[int], mode: str) -> float | None:
    """The share of ``output`` (HF's tokens after ``ids``) that the draft model's greedy
    choice, with the mode's processor, gives at each position (None for the grammar)."""
    if mode == "json_schema" or not output:
        return None
    processor: Any = None
    if mode == "repetition":
        processor = RepetitionPenaltyLogitsProcessor(1.2)
    elif mode == "openai_penalties":
        processor = Penalties(len(ids), 0.5, 0.3)
    draft = engine.drafters[0].lm.model
    sequence = torch.tensor([ids + output])
    with torch.inference_mode():
        logits = draft(input_ids=sequence).logits[0]
        hits = 0
        for i, token in enumerate(output):
            at = len(ids) + i
            scores = logits[at - 1 : at]
            if processor is not None:
                scores = processor(sequence[:, :at], scores)
            hits += int(scores.argmax()) == token
    return hits / len(output)


ROUNDS: list[int] = []  # the rounds of fs_run's latest call


def fs_run(engine: Any, ids: list[int], n: int, mode: str) -> tuple[list[int], float]:
    sampling, extra = settings(mode)
    with quiet_timing():
        start = time.perf_counter()
        result = engine.generate(
            [ids], max_new_tokens=n, ignore_eos=mode != "json_schema", sampling=sampling,
            **extra,
        )  # fmt: skip
        seconds = time.perf_counter() - start
    ROUNDS[:] = [result.stats.rounds]
    return list(result.tokens[0]), seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=RESULTS / "api-fields.json")
    args = parser.parse_args()
    engine = SpeculativeEngine.from_pretrained()
    tokenizer = engine.tokenizer
    prompts = [tokenizer(p.text)["input_ids"][-128:] for p in humaneval_prompts(args.prompts)]
    for mode in MODES:  # warm-up, untimed
        hf_run(engine, prompts[0], 8, mode)
        fs_run(engine, prompts[0], 8, mode)
    records: list[dict[str, Any]] = []
    started = time.perf_counter()
    for index, ids in enumerate(prompts):
        for offset in range(len(MODES)):
            mode = MODES[(index + offset) % len(MODES)]
            first, second = (hf_run, fs_run) if (index + offset) % 2 else (fs_run, hf_run)
            a, a_s = first(engine, ids, args.max_new_tokens, mode)
            b, b_s = second(engine, ids, args.max_new_tokens, mode)
            (hf, hf_s), (fs, fs_s) = (
                ((a, a_s), (b, b_s)) if first is hf_run else ((b, b_s), (a, a_s))
            )
            records.append(
                {
                    "prompt": index, "mode": mode, "hf_tokens": len(hf), "fs_tokens": len(fs),
                    "hf_seconds": round(hf_s, 4), "fs_seconds": round(fs_s, 4),
                    "speedup": round((len(fs) / fs_s) / (len(hf) / hf_s), 4),
                    "identical": fs == hf,
                    "draft_agreement": agreement(engine, ids, hf, mode),
                    "fs_rounds": ROUNDS[0],
                    "fs_tokens_per_round": round(len(fs) / ROUNDS[0], 4),
                    "fs_ms_per_round": round(1000 * fs_s / ROUNDS[0], 3),
                    "hf_ms_per_token": round(1000 * hf_s / max(1, len(hf)), 3),
                }
            )  # fmt: skip
        print(f"prompt {index + 1}/{len(prompts)}", file=sys.stderr)
    summary = {}
    for mode in MODES:
        group = [r for r in records if r["mode"] == mode]
        agreements = [r["draft_agreement"] for r in group if r["draft_agreement"] is not None]
        summary[mode] = {
            "speedup_median": round(statistics.median(r["speedup"] for r in group), 4),
            "draft_agreement_median": (
                round(statistics.median(agreements), 4) if agreements else None
            ),
            "identical": sum(r["identical"] for r in group),
            "prompts": len(group),
        }
    base = summary["plain"]["speedup_median"]
    plain = {r["prompt"]: r for r in records if r["mode"] == "plain"}
    for mode in MODES:
        group = [r for r in records if r["mode"] == mode]
        row = summary[mode]
        row["over_plain_speedup"] = round(row["speedup_median"] / base, 4)
        for key in ("fs_tokens_per_round", "fs_ms_per_round", "hf_ms_per_token"):
            row[f"{key}_median"] = round(statistics.median(r[key] for r in group), 4)
        # The most a mode's speedup can keep of the plain one, prompt by prompt, when a round
        # costs what it costs without the mode (fs_ms_per_round says it does): a round of g
        # drafts emits E(a, g) = (1 - a^(g + 1)) / (1 - a) tokens at agreement a, the plain run
        # does at least as well at its own g as at the mode's, and E(a, g) / E(a0, g) for
        # a < a0 is largest at g = 1: (1 + a) / (1 + a0).
        bounds = [
            (1 + r["draft_agreement"]) / (1 + plain[r["prompt"]]["draft_agreement"])
            for r in group
            if r["draft_agreement"] is not None and plain[r["prompt"]]["draft_agreement"]
        ]
        row["bound_of_plain_speedup_median"] = (
            round(statistics.median(bounds), 4) if bounds else None
        )
    data = {
        "kind": "api-fields",
        "machine": machine_info(),
        "settings": {
            "prompts": len(prompts),
            "max_new_tokens": args.max_new_tokens,
            "engine": [arm.label for arm in engine.arms],
            "command": " ".join(sys.argv),
            "modes": {
                "repetition": "repetition_penalty 1.2",
                "logprobs": "logprobs 5",
                "openai_penalties": "presence 0.5, frequency 0.3",
                "json_schema": 'json_schema {"code": string of 200+ characters} (ends at EOS)',
            },
        },
        "summary": summary,
        "records": records,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    write_json(data, args.out)
    for mode, row in summary.items():
        print(
            f"{mode:>17}: {row['speedup_median']:.2f}x HF with the same processors "
            f"({row['over_plain_speedup']:.2f} of the plain speedup), identical "
            f"{row['identical']}/{row['prompts']}, draft agreement "
            f"{row['draft_agreement_median']}",
            file=sys.stderr,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
