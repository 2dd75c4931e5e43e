"""Building an engine: its target, drafters (with the draft flashspec ships for a named target)
and default settings from names (``SpeculativeEngine.from_pretrained``), and the models put on
the compiled path when ``config.compile`` resolves on."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..compiled import CompileDecision, resolve_compile
from ..config import FlashSpecConfig
from ..drafters import Drafter, load_drafters
from ..drafters.registry import default_drafters
from ..loading.drafts import bundled_drafter
from ..models import DEMO_NAME, TargetModel
from ..select.policy import default_bandit

if TYPE_CHECKING:
    from .loop import SpeculativeEngine

LOG = logging.getLogger("flashspec")


def engine_parts(
    target: str | torch.nn.Module | TargetModel | None,
    drafters: Sequence[str | torch.nn.Module | Drafter] | None,
    config: FlashSpecConfig | None,
    models: Mapping[str, torch.nn.Module] | None,
    tokenizer: Any,
) -> tuple[FlashSpecConfig, list[Drafter], TargetModel]:
    """(config, drafters, target) of ``SpeculativeEngine.from_pretrained`` (see it)."""
    demo = target is None or target == DEMO_NAME
    configured = config is not None
    config = config or FlashSpecConfig()
    models = models or {}
    if target is None and config.target_name is not None:
        target = config.target_name
    if drafters is None and config.drafter_name is not None:
        drafters = [config.drafter_name]
    if isinstance(target, TargetModel):
        target_model = target
    elif isinstance(target, torch.nn.Module):
        target_model = TargetModel(
            None, config.device, config.dtype, model=target, tokenizer=tokenizer
        )
    else:
        target_model = TargetModel(
            target,
            config.device,
            config.dtype,
            model=models.get(target or ""),
            tokenizer=tokenizer,
        )
    if drafters is None:
        name = DEMO_NAME if demo else target if isinstance(target, str) else None
        drafter_list = default_drafters(name, target_model, shipped=bundled_drafter,
                                        device=config.device, dtype=config.dtype,
                                        models=models)  # fmt: skip
    else:
        drafter_list = load_drafters(
            drafters, device=config.device, dtype=config.dtype, models=models
        )
    if not configured:
        config = dataclasses.replace(config, bandit=default_bandit(drafter_list))
    return config, drafter_list, target_model


def compile_seconds(engine: SpeculativeEngine) -> float:
    """Seconds the compiled path has spent compiling, over the target and drafters."""
    lms = [engine.target, *(d.lm for d in engine.drafters if d.lm is not None)]
    return sum(lm.compiled.compile_seconds for lm in lms if lm.compiled is not None)


def compile_models(engine: SpeculativeEngine, long_lived: bool) -> CompileDecision:
    """Resolve ``config.compile``, log it, and put the models on the compiled path if on:
    the drafters' one-token step and the target's verification of each draft length the
    arms use (plain decoding verifies one token)."""
    lms = [d.lm for d in engine.drafters if d.lm is not None]
    decision = resolve_compile(engine.config.compile, [engine.target, *lms], long_lived=long_lived)
    LOG.info(decision.line())
    if decision.on:
        bandit = engine.config.bandit
        gammas = bandit.gammas or [engine.config.sampling.gamma]
        lengths = {g + 1 for g in gammas}
        if bandit.plain:
            lengths.add(1)  # (the batch policy's plain rounds have several rows: eager)
        engine.target.compile_steps(sorted(lengths))
        tree = engine.config.tree
        if tree is not None and engine.target.compiled is not None:
            # A tree's forward is one graph of its own, padded up to the shape's node count.
            engine.target.compiled.compile_trees(tree.nodes)
        for lm in lms:
            lm.compile_steps([1])
        if engine.throughput is not None:
            # Each verification length is a graph of its own (a compile on first use):
            # the model drafts up to the compiled lengths, shorter ones padded up to them.
            engine.throughput.max_gamma = min(engine.throughput.max_gamma, max(gammas))
    return decision
