"""One method on one prompt, timed: plain HF ``generate``, HF assisted generation, HF prompt
lookup, or a flashspec engine (``Runner``), with the draft and round counts each reports."""

from __future__ import annotations

import copy
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

from .._lean import hf_forward
from ..compiled import CompileSetting
from ..config import FlashSpecConfig, SamplingConfig
from ..drafters import Drafter, ModelDrafter, PromptLookupDrafter
from ..engine import SpeculativeEngine
from ..models import TargetModel
from .common import quiet_timing
from .pair import Pair

TEMPERATURE = 0.8
TOP_P = 0.95
HF_LOOKUP_TOKENS = 10

# Every method decodes the same token ids and generates exactly ``max_new_tokens``: EOS is
# ignored by all of them, so tokens/s compare equal work. gamma = ``--gamma``.
#
# - ``hf_greedy``            ``target.generate``, greedy: the baseline of every greedy method.
# - ``hf_assisted_default``  HF assisted generation with the same draft, HF's defaults
#                            (20 assistant tokens, constant schedule, confidence threshold 0.4).
# - ``hf_assisted_gamma``    the same with gamma assistant tokens, constant schedule, no
#                            confidence stop: HF running flashspec's algorithm.
# - ``hf_lookup``            HF prompt lookup (10 tokens, n-gram 2).
# - ``fs_greedy``            flashspec, model drafter, greedy.
# - ``fs_lookup``            flashspec, prompt-lookup drafter, greedy.
# - ``hf_sample``            ``target.generate`` sampling at temperature 0.8, top-p 0.95.
# - ``fs_sample``            flashspec with the model drafter at the same settings (lossless
#                            rejection sampling); its baseline is ``hf_sample``.
METHODS = (
    "hf_greedy",
    "hf_assisted_default",
    "hf_assisted_gamma",
    "hf_lookup",
    "fs_greedy",
    "fs_lookup",
    "hf_sample",
    "fs_sample",
)
SAMPLING = frozenset({"hf_sample", "fs_sample"})
NEEDS_DRAFT = frozenset({"hf_assisted_default", "hf_assisted_gamma", "fs_greedy", "fs_sample"})
# Drafting cost relative to a target step: the draft model's ratio, or ~0 for n-gram lookup.
MODEL_DRAFTED = frozenset({"hf_assisted_default", "hf_assisted_gamma", "fs_greedy", "fs_sample"})


def baseline_of(method: str) -> str:
    """The plain-HF method a method's speedup is measured against."""
    return "hf_sample" if method in SAMPLING else "hf_greedy"


@dataclass
class Run:
    """One method on one prompt."""

    tokens: list[int]
    seconds: float
    rounds: int | None = None
    drafted: int | None = None
    accepted: int | None = None
    stats: dict[str, float] | None = None

    def record(self) -> dict[str, Any]:
        n = len(self.tokens)
        out: dict[str, Any] = {
            "seconds": round(self.seconds, 5),
            "new_tokens": n,
            "tokens_per_second": round(n / self.seconds, 3) if self.seconds > 0 else 0.0,
            "rounds": self.rounds,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "tokens_per_round": round(n / self.rounds, 4) if self.rounds else None,
            "drafts_per_round": (
                round(self.drafted / self.rounds, 4)
                if self.rounds and self.drafted is not None
                else None
            ),
            "acceptance_rate": (
                round(self.accepted / self.drafted, 4)
                if self.drafted and self.accepted is not None
                else None
            ),
        }
        if self.stats is not None:
            out["engine_stats"] = {k: round(v, 6) for k, v in self.stats.items()}
        return out


@contextmanager
def forward_counter(model: Any) -> Iterator[list[int]]:
    count = [0]

    def hook(*_: Any) -> None:
        count[0] += 1

    handle = model.register_forward_hook(hook)
    try:
        yield count
    finally:
        handle.remove()


class Runner:
    """Runs each method on token ids; owns one flashspec engine per (method, gamma)."""

    def __init__(
        self, pair: Pair, gamma: int, max_new_tokens: int, compile: CompileSetting = "auto"
    ) -> None:
        self.pair = pair
        self.gamma = gamma
        self.max_new_tokens = max_new_tokens
        self.compile = compile
        self._engines: dict[tuple[str, int], SpeculativeEngine] = {}
        draft = pair.draft
        # Two assistant configurations, swapped in before each HF assisted call. HF copies
        # the assistant's generation config per call, so nothing carries over between calls.
        self._assistant_configs: dict[str, Any] = {}
        if draft is not None:
            base = copy.deepcopy(draft.generation_config)
            default = copy.deepcopy(base)
            default.num_assistant_tokens = 20
            default.num_assistant_tokens_schedule = "constant"
            default.assistant_confidence_threshold = 0.4
            matched = copy.deepcopy(base)
            matched.num_assistant_tokens = gamma
            matched.num_assistant_tokens_schedule = "constant"
            matched.assistant_confidence_threshold = 0.0  # 0 switches HF's confidence stop off
            self._assistant_configs = {"default": default, "gamma": matched}

    def available(self, method: str) -> bool:
        return self.pair.draft is not None or method not in NEEDS_DRAFT

    def engine(self, method: str, gamma: int | None = None) -> SpeculativeEngine:
        gamma = self.gamma if gamma is None else gamma
        key = (method, gamma)
        if key not in self._engines:
            pair = self.pair
            drafter: Drafter = (
                PromptLookupDrafter()
                if method == "fs_lookup"
                else ModelDrafter(pair.draft, name=pair.draft_name, tokenizer=pair.tokenizer)
            )
            sampling = (
                SamplingConfig(gamma=gamma, temperature=TEMPERATURE, top_p=TOP_P)
                if method == "fs_sample"
                else SamplingConfig(gamma=gamma)
            )
            target = TargetModel(pair.target_name, model=pair.target, tokenizer=pair.tokenizer)
            self._engines[key] = SpeculativeEngine(
                FlashSpecConfig(sampling=sampling, compile=self.compile), [drafter], target
            )
        return self._engines[key]

    def run(
        self,
        method: str,
        ids: list[int],
        seed: int = 0,
        gamma: int | None = None,
        max_new_tokens: int | None = None,
    ) -> Run:
        n = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if method.startswith("fs_"):
            engine = self.engine(method, gamma)
            with quiet_timing():
                start = time.perf_counter()
                result = engine.generate(ids, max_new_tokens=n, ignore_eos=True, seed=seed)
                seconds = time.perf_counter() - start
            stats = result.stats
            return Run(
                result.tokens[0],
                seconds,
                rounds=stats.rounds,
                drafted=stats.drafted,
                accepted=stats.accepted,
                stats=stats.as_dict(),
            )
        return self._run_hf(method, ids, seed, n)

    def _run_hf(self, method: str, ids: list[int], seed: int, n: int) -> Run:
        pair = self.pair
        x = torch.tensor([ids], dtype=torch.int64)
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(x),
            "max_new_tokens": n,
            "do_sample": method == "hf_sample",
            "pad_token_id": pair.pad_id,
        }
        if method == "hf_sample":
            kwargs.update(temperature=TEMPERATURE, top_p=TOP_P, top_k=0)
            torch.manual_seed(seed)
        else:
            kwargs.update(temperature=None, top_p=None, top_k=None)
        if method.startswith("hf_assisted"):
            pair.draft.generation_config = self._assistant_configs[method.rsplit("_", 1)[1]]
            kwargs["assistant_model"] = pair.draft
        elif method == "hf_lookup":
            kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
        counting = method.startswith(("hf_assisted", "hf_lookup"))
        # HF's own decoder forward (not flashspec's lean one) for HF's methods.
        with hf_forward(pair.target), forward_counter(pair.target) as target_calls, quiet_timing():
            if counting and pair.draft is not None:
                with hf_forward(pair.draft), forward_counter(pair.draft) as draft_calls:
                    start = time.perf_counter()
                    out = pair.target.generate(x, **kwargs)
                    seconds = time.perf_counter() - start
            else:
                draft_calls = [0]
                start = time.perf_counter()
                out = pair.target.generate(x, **kwargs)
                seconds = time.perf_counter() - start
        tokens = [int(t) for t in out[0, len(ids) :].tolist()]
        rounds = target_calls[0]
        if method.startswith("hf_assisted"):
            # Each round emits its accepted drafts plus one token of the target's own.
            drafted = draft_calls[0]
            return Run(tokens, seconds, rounds, drafted, max(0, len(tokens) - rounds))
        return Run(tokens, seconds, rounds)
