"""What ``flashspec bench compiled`` times: the methods (``METHODS``), the engine
configuration of each flashspec method, and ``CompiledRunner``, which runs one generation of a
method and counts what torch compiled."""

from __future__ import annotations

import importlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..._lean import hf_forward
from ...compiled import CompiledForward
from ...config import BanditConfig, FlashSpecConfig, SamplingConfig
from ...drafters import Drafter, ModelDrafter, PromptLookupDrafter
from ...engine import SpeculativeEngine
from ...models import TargetModel
from ..common import quiet_timing
from ..pair import Pair
from ..runner import TEMPERATURE, TOP_P

BASELINE = "hf_static_compiled"
REFERENCE = "hf_eager"
METHODS = (REFERENCE, BASELINE, "flashspec_eager", "flashspec_compiled")
FLASHSPEC = ("flashspec_eager", "flashspec_compiled")
LABELS = {
    REFERENCE: "HF generate (eager)",
    BASELINE: "HF generate (static cache, compiled)",
    "flashspec_eager": "flashspec eager",
    "flashspec_compiled": "flashspec compiled",
}
MODES = ("greedy", "sampled")
DTYPES = ("float32", "bfloat16")


def hf_compile_config() -> Any:
    """HF's ``CompileConfig`` for ``hf_static_compiled``: what ``flashspec.compiled.step``
    passes ``torch.compile`` on a CPU (inductor, ``fullgraph=True``, ``dynamic=False``, mode
    ``"default"``; HF's default mode is ``"reduce-overhead"``, CUDA graphs, which a CPU has
    none of). ``_compile_all_devices`` is a class attribute, not a field, so it is set on the
    instance: without it ``generate`` compiles on CUDA (and a few accelerators) only."""
    from transformers import CompileConfig

    config: Any = CompileConfig(fullgraph=True, dynamic=False, backend="inductor", mode="default")
    config._compile_all_devices = True
    return config


def dynamo_graphs() -> int:
    """Graphs dynamo has compiled in this process so far (every model, every method)."""
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def inductor_cache() -> dict[str, Any]:
    """Inductor's on-disk cache of compiled code: whether it is on and already holds entries.
    A warm cache shortens a later process's first calls (``first_call_seconds``) by the code
    generation it saves; dynamo still traces every graph. For a cold compile, run with a fresh
    ``TORCHINDUCTOR_CACHE_DIR`` (or ``TORCHINDUCTOR_FX_GRAPH_CACHE=0``)."""
    config: Any = importlib.import_module("torch._inductor.config")
    directory = Path(importlib.import_module("torch._inductor.runtime.cache_dir_utils").cache_dir())
    return {
        "fx_graph_cache": bool(config.fx_graph_cache),
        "dir": str(directory),
        "warm_at_start": directory.is_dir() and any(directory.iterdir()),
    }


def weight_bytes(model: Any) -> int:
    """Bytes of ``model``'s parameters (a tied embedding counted once): what one forward
    streams from memory."""
    return sum(int(p.numel()) * p.element_size() for p in model.parameters())


def engine_config(method: str, gamma: int, lookup: bool) -> FlashSpecConfig:
    """The engine configuration of a flashspec method (the draft length ``gamma``; the sampling
    settings come per call, ``mode_sampling``)."""
    if method not in FLASHSPEC:
        raise ValueError(f"{method!r} is not a flashspec method; choose from {FLASHSPEC}")
    compile_ = method == "flashspec_compiled"
    sampling = SamplingConfig(gamma=gamma)
    if lookup:
        # What SpeculativeEngine.from_pretrained builds for a target drafted by prompt lookup.
        bandit = BanditConfig(plain=True, context="lookup")
        return FlashSpecConfig(sampling=sampling, bandit=bandit, compile=compile_)
    return FlashSpecConfig(sampling=sampling, compile=compile_)


def mode_sampling(mode: str, gamma: int) -> SamplingConfig:
    """The sampling settings of a mode: greedy, or the engine benchmark's temperature/top-p."""
    if mode == "greedy":
        return SamplingConfig(gamma=gamma)
    if mode == "sampled":
        return SamplingConfig(gamma=gamma, temperature=TEMPERATURE, top_p=TOP_P)
    raise ValueError(f"unknown mode {mode!r}; choose from {MODES}")


# ---------------------------------------------------------------------------------- running


@dataclass
class Call:
    """One method on one prompt: its new tokens, wall seconds, target forwards (a flashspec
    round is one; HF runs one per token) and the dynamo graphs compiled during the call."""

    tokens: list[int]
    seconds: float
    forwards: int
    graphs: int = 0
    drafted: int = 0
    accepted: int = 0


class CompiledRunner:
    """Runs each method on one prompt, all on the pair's own model objects; one engine per
    flashspec method, kept for every call (its compiled graphs with it)."""

    def __init__(self, pair: Pair, gamma: int, max_new_tokens: int) -> None:
        self.pair = pair
        self.gamma = gamma
        self.max_new_tokens = max_new_tokens
        self.lookup = pair.draft is None
        self.compile_config = hf_compile_config()
        self._engines: dict[str, SpeculativeEngine] = {}

    @property
    def drafter(self) -> str:
        """What the flashspec methods draft with: the draft model's name, or prompt lookup."""
        return "prompt_lookup" if self.lookup else str(self.pair.draft_name)

    def engine(self, method: str) -> SpeculativeEngine:
        """The engine of a flashspec method, built on first use."""
        if method not in self._engines:
            pair = self.pair
            drafter: Drafter = (
                PromptLookupDrafter()
                if self.lookup
                else ModelDrafter(pair.draft, name=pair.draft_name, tokenizer=pair.tokenizer)
            )
            target = TargetModel(pair.target_name, model=pair.target, tokenizer=pair.tokenizer)
            config = engine_config(method, self.gamma, self.lookup)
            self._engines[method] = SpeculativeEngine(config, [drafter], target)
        return self._engines[method]

    def compiled_forwards(self, method: str) -> list[CompiledForward]:
        """The compiled forwards of a flashspec method's engine (target first), once built."""
        engine = self._engines.get(method)
        if engine is None:
            return []
        forwards = [engine.target.compiled]
        forwards += [d.lm.compiled for d in engine.drafters if d.lm is not None]
        return [f for f in forwards if f is not None]

    def missing_lengths(self, method: str) -> list[int]:
        """Token counts a compiled forward of ``method`` compiles that no call has compiled yet
        (each a compile still to come)."""
        missing: list[int] = []
        for forward in self.compiled_forwards(method):
            seen = {tokens for _, tokens, _ in forward.graphs}
            missing += [n for n in forward.lengths if n not in seen]
        return missing

    def run(
        self,
        method: str,
        ids: Sequence[int],
        mode: str,
        seed: int,
        max_new_tokens: int | None = None,
    ) -> Call:
        """Time ``method`` on the prompt ``ids`` in ``mode``."""
        n = self.max_new_tokens if max_new_tokens is None else max_new_tokens
        if method not in METHODS:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
        if method in FLASHSPEC:
            return self._run_engine(method, ids, mode, seed, n)
        return self._run_hf(method, ids, mode, seed, n)

    def _run_engine(self, method: str, ids: Sequence[int], mode: str, seed: int, n: int) -> Call:
        engine = self.engine(method)
        sampling = mode_sampling(mode, self.gamma)
        with quiet_timing():
            before = dynamo_graphs()
            start = time.perf_counter()
            result = engine.generate(
                list(ids), max_new_tokens=n, ignore_eos=True, seed=seed, sampling=sampling
            )
            seconds = time.perf_counter() - start
        stats = result.stats
        return Call(
            [int(t) for t in result.tokens[0]],
            seconds,
            forwards=stats.rounds,
            graphs=dynamo_graphs() - before,
            drafted=stats.drafted,
            accepted=stats.accepted,
        )

    def _run_hf(self, method: str, ids: Sequence[int], mode: str, seed: int, n: int) -> Call:
        pair = self.pair
        x = torch.tensor([list(ids)], dtype=torch.int64)
        # EOS is off in the generation config (make_pair); min_new_tokens says the same should
        # it be set again, so HF's tokens are the engine's with ignore_eos.
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(x),
            "max_new_tokens": n,
            "min_new_tokens": n,
            "pad_token_id": pair.pad_id,
        }
        if mode == "sampled":
            kwargs.update(do_sample=True, temperature=TEMPERATURE, top_p=TOP_P, top_k=0)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        if method == BASELINE:
            kwargs.update(cache_implementation="static", compile_config=self.compile_config)
        torch.manual_seed(seed)
        with hf_forward(pair.target), torch.inference_mode(), quiet_timing():
            before = dynamo_graphs()
            start = time.perf_counter()
            out = pair.target.generate(x, **kwargs)
            seconds = time.perf_counter() - start
        tokens = [int(t) for t in out[0, len(ids) :].tolist()]
        # A prefill and a one-token step per later token: a forward per token.
        return Call(tokens, seconds, forwards=len(tokens), graphs=dynamo_graphs() - before)
