"""Windowed attention (sliding-window, chunked and GPT-Neo's local layers): every windowed family
in ``FAMILIES``, in tiny random configs, is exact against the target's own greedy ``generate`` on
a single row, a ragged batch with drafting forced, and two model drafters, or refused when the
engine is built.

A window counts cache columns. In a ragged batch (``flashspec.kv.layout``) a row's columns include
dead ones (rejected drafts, padding in the middle), so a window over columns would cover fewer of
the row's real tokens than it does alone; such models must run column-aligned batches.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest

from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from flashspec.kv.state import UnsupportedModelError
from tests.helpers.arch import WINDOWED, mismatch, models, prompts, reference

LENGTHS = (7, 23, 41)  # shorter than, about, and several times the window (8 columns)
MAX_NEW = [40, 13, 29]

FAMILIES: dict[str, dict[str, Any]] = WINDOWED
"""Windowed families by model type, with what makes them windowed in a tiny config
(``tests.helpers.arch.WINDOWED``, which ``tests.helpers.arch.tiny_config`` applies)."""


def _models(family: str) -> tuple[Any, Any, Any]:
    """(target, a 1%-noise copy that agrees often, a 30%-noise copy that rarely does)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family not in CONFIG_MAPPING:
        pytest.skip(f"this transformers release does not ship {family}")
    return models(family)


@cache
def _prompts() -> list[list[int]]:
    return prompts(LENGTHS)


@cache
def _reference(family: str, row: int) -> tuple[int, ...]:
    """The target's own greedy continuation of prompt ``row`` alone, EOS ignored."""
    return tuple(reference(_models(family)[0], _prompts()[row], MAX_NEW[row]))


def _engine(family: str, config: FlashSpecConfig, drafters: list[Drafter]) -> SpeculativeEngine:
    return SpeculativeEngine(config, drafters, TargetModel(family, model=_models(family)[0]))


def _check(family: str, rows: list[int], tokens: list[list[int]]) -> None:
    target = _models(family)[0]
    for row, got in zip(rows, tokens, strict=True):
        why = mismatch(target, _prompts()[row], got, _reference(family, row))
        assert why is None, f"{family} row {row}: {why}"


def _forced(gamma: int = 4) -> FlashSpecConfig:
    # batches="fixed": every batch drafts gamma tokens (the default may decode plainly).
    return FlashSpecConfig(
        sampling=SamplingConfig(gamma=gamma), bandit=BanditConfig(batches="fixed")
    )


def _built_or_refused(
    family: str, build: Callable[[], SpeculativeEngine]
) -> SpeculativeEngine | None:
    """The engine, or None where the build refused the model with a clear error."""
    try:
        return build()
    except UnsupportedModelError as error:
        assert type(_models(family)[0]).__name__ in str(error), str(error)
        return None


def test_gpt_neo_local_attention_ragged_batch_is_exact() -> None:
    """Issue #37: GPT-Neo's local layers window by column, so a ragged batch, whose rows keep
    dead columns between their tokens, gave rows a narrower window than alone (mismatches with
    top-2 gaps up to 3, no ties). Such a model now runs column-aligned batches."""
    _, draft, _ = _models("gpt_neo")
    engine = _engine("gpt_neo", _forced(), [ModelDrafter(draft, name="draft")])
    result = engine.generate(_prompts(), max_new_tokens=MAX_NEW, ignore_eos=True)
    assert result.stats.accepted > 0
    _check("gpt_neo", [0, 1, 2], result.tokens)
    assert not engine.shiftable


@pytest.mark.parametrize("lookup", [False, True])
def test_two_model_drafters_on_sliding_window_layers(lookup: bool) -> None:
    """Issue #37: with two model drafters, the one a round did not run was rolled back, and a
    sliding layer that held no keys yet crashed in transformers' ``crop``."""
    _, agrees, disagrees = _models("mistral")
    drafters: list[Drafter] = [ModelDrafter(agrees, name="a"), ModelDrafter(disagrees, name="b")]
    if lookup:
        drafters.append(PromptLookupDrafter())
    engine = _engine("mistral", FlashSpecConfig(), drafters)
    for row in range(len(LENGTHS)):
        result = engine.generate(_prompts()[row], max_new_tokens=MAX_NEW[row], ignore_eos=True)
        _check("mistral", [row], result.tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_windowed_family_is_exact_or_refused(family: str) -> None:
    """Single row, ragged batch with drafting forced, two model drafters under the defaults."""
    _, agrees, disagrees = _models(family)
    single = _built_or_refused(
        family, lambda: _engine(family, _forced(), [ModelDrafter(agrees, name="a")])
    )
    if single is None:
        return
    last = len(LENGTHS) - 1
    result = single.generate(_prompts()[last], max_new_tokens=MAX_NEW[last], ignore_eos=True)
    _check(family, [last], result.tokens)
    assert result.stats.accepted > 0

    batch = single.generate(_prompts(), max_new_tokens=MAX_NEW, ignore_eos=True)
    _check(family, [0, 1, 2], batch.tokens)
    # Windowed attention counts columns: its batches must keep them aligned.
    assert not single.shiftable

    drafters: list[Drafter] = [ModelDrafter(agrees, name="a"), ModelDrafter(disagrees, name="b")]
    two = _engine(family, FlashSpecConfig(), drafters)
    both = two.generate(_prompts(), max_new_tokens=MAX_NEW, ignore_eos=True)
    _check(family, [0, 1, 2], both.tokens)
