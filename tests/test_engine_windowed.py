"""Windowed attention (sliding-window, chunked and GPT-Neo's local layers): every windowed family
in ``FAMILIES``, in tiny random configs, is exact against the target's own greedy ``generate`` on
a single row, a ragged batch with drafting forced, and two model drafters, or refused when the
engine is built.

A window counts cache columns. In a ragged batch (``flashspec._layout``) a row's columns include
dead ones (rejected drafts, padding in the middle), so a window over columns would cover fewer of
the row's real tokens than it does alone; such models must run column-aligned batches.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch
from conftest import perturbed_copy

from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec._greedy import compare_greedy
from flashspec._state import UnsupportedModelError
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter

VOCAB = 64
WINDOW = 8
LENGTHS = (7, 23, 41)  # shorter than, about, and several times the window
MAX_NEW = [40, 13, 29]


_SLIDING = {"sliding_window": WINDOW}
_MIXED = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}
_EXPERTS = {"num_local_experts": 4, "num_experts_per_tok": 2}

FAMILIES: dict[str, dict[str, Any]] = {
    "gpt_neo": {},  # local layers by attention_types (see _config)
    # Every layer sliding: a window and no layer_types in the config.
    "mistral": _SLIDING,
    "ministral": _SLIDING,
    "mixtral": {**_SLIDING, **_EXPERTS},
    "phi3": _SLIDING,
    "starcoder2": _SLIDING,
    "qwen2": {**_SLIDING, "use_sliding_window": True, "max_window_layers": 1},
    # Sliding and full layers, by layer_types.
    "gemma2": _MIXED,
    "gemma3_text": _MIXED,
    "cohere2": _MIXED,
    "olmo3": _MIXED,
    "exaone4": _MIXED,
    "vaultgemma": _MIXED,
    "granite_swa": _MIXED,
    "cwm": _MIXED,
    "gpt_oss": {**_MIXED, **_EXPERTS},
    # Chunked attention: a window that restarts every attention_chunk_size positions.
    "llama4_text": {
        "attention_chunk_size": WINDOW,
        "layer_types": ["chunked_attention", "full_attention"],
    },
}
"""Windowed families by model type, with what makes them windowed in a tiny config."""


def _config(family: str) -> Any:
    """A tiny config of ``family`` whose windowed layers see fewer columns than the prompts."""
    from transformers import AutoConfig, GPTNeoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if family == "gpt_neo":
        return GPTNeoConfig(
            vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
            attention_types=[[["global", "local"], 1]], window_size=WINDOW,
            max_position_embeddings=128, initializer_range=0.3, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
    if family not in CONFIG_MAPPING:
        pytest.skip(f"this transformers release does not ship {family}")
    return AutoConfig.for_model(
        family, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=128,
        initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        **FAMILIES[family],
    )  # fmt: skip


@cache
def _models(family: str) -> tuple[Any, Any, Any]:
    """(target, a 1%-noise copy that agrees often, a 30%-noise copy that rarely does)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_config(_config(family)).eval()
    return target, perturbed_copy(target, 0.01, seed=1), perturbed_copy(target, 0.3, seed=2)


@cache
def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, VOCAB, (n,), generator=generator).tolist() for n in LENGTHS]


@cache
def _reference(family: str, row: int) -> tuple[int, ...]:
    """The target's own greedy continuation of prompt ``row`` alone, EOS ignored."""
    target = _models(family)[0]
    prompt = _prompts()[row]
    with torch.inference_mode():
        out = target.generate(
            torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW[row],
            eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    return tuple(out[0, len(prompt) :].tolist())


def _engine(family: str, config: FlashSpecConfig, drafters: list[Drafter]) -> SpeculativeEngine:
    return SpeculativeEngine(config, drafters, TargetModel(family, model=_models(family)[0]))


def _check(family: str, rows: list[int], tokens: list[list[int]]) -> None:
    target = _models(family)[0]
    for row, got in zip(rows, tokens, strict=True):
        ref = list(_reference(family, row))
        result = compare_greedy(target, _prompts()[row], got, ref)
        assert result.status != "mismatch", (
            f"{family} row {row} ({LENGTHS[row]} prompt tokens): {result}\ngot {got}\nref {ref}"
        )


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
