"""What ``flashspec bench batch`` times: the methods (``METHODS``), the engine configuration
of each flashspec method, and ``BatchRunner``, which runs one batch of a method."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..._lean import hf_forward
from ...compiled import CompileSetting
from ...config import BanditConfig, FlashSpecConfig, SamplingConfig
from ...drafters import Drafter, ModelDrafter, PromptLookupDrafter
from ...engine import SpeculativeEngine
from ...models import TargetModel
from ..common import quiet_timing
from ..pair import Pair
from ..runner import forward_counter

BASELINE = "hf_batched"
METHODS = (
    BASELINE, "ragged", "lockstep", "default", "ragged_adaptive", "ragged_compiled",
    "default_compiled",
)  # fmt: skip
LABELS = {
    BASELINE: "HF batched generate",
    "ragged": "flashspec ragged",
    "lockstep": "flashspec lockstep",
    "default": "flashspec default",
    "ragged_adaptive": "flashspec ragged, adaptive",
    "ragged_compiled": "flashspec ragged, compiled",
    "default_compiled": "flashspec default, compiled",
}
COMPILED_SUFFIX = "_compiled"
"""A method whose name ends so is its stem on the compiled path (``compile=True``: static
caches of fixed slots, graphs per slot bucket), whatever ``--compile`` says."""
DEFAULT_BATCHES = (1, 2, 4, 8, 16, 32)
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
    compile_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    arm_rounds: dict[str, int] = field(default_factory=dict)


def engine_config(
    method: str, gamma: int, lookup: bool, compile: CompileSetting = False
) -> FlashSpecConfig:
    """The engine configuration a flashspec method stands for (greedy, draft length gamma;
    ``compile``: ``FlashSpecConfig.compile``; a ``_compiled`` method compiles anyway)."""
    if method.endswith(COMPILED_SUFFIX):
        method, compile = method.removesuffix(COMPILED_SUFFIX), True
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
            compile_seconds=stats.time_compile,
        )

    def graphs(self, method: str) -> int:
        """Graphs the compiled path of ``method``'s engine holds (target and drafters)."""
        engine = self.engine(method)
        lms = [engine.target, *(d.lm for d in engine.drafters if d.lm is not None)]
        parts = [lm.compiled for lm in lms if lm.compiled is not None]
        return sum(len(p.graphs) + len(p.tree_graphs) + len(p.batch_graphs) for p in parts)

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
