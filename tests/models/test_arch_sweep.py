"""Issue #37: every decoder architecture transformers ships, in a tiny random config, is exact
against the target's own greedy ``generate`` or refused with ``UnsupportedModelError``.

For each causal-LM model type (``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``) not swept by
tests/models/test_engine_windowed.py and not in ``SKIP``: a single row drafted by a 1%-noise
copy and prompt lookup, a ragged batch (prompts and limits of different lengths) with drafting
forced, and two model drafters, each row compared with the target's own greedy continuation of
it alone. A family flashspec cannot decode exactly must be refused when the engine is built
(``REFUSED``), or, where only rows of different lengths are the trouble, when such a batch is
asked for (``PADDED_REFUSED``); then an equal-length batch runs instead. Whether a family is
refused is part of the expectation, so a family that starts being refused, or stops, fails.

``test_every_causal_lm_architecture_is_covered`` keeps the sweep complete: a model type a new
transformers release adds is swept without any change here, and fails until it is exact or
refused with a reason.
"""

from __future__ import annotations

import re
from functools import cache

import pytest
import torch

from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from flashspec.kv.state import UnsupportedModelError
from tests.helpers.arch import WINDOWED, mismatch, models, prompts, reference, tiny_config

LENGTHS = (5, 11, 17)
MAX_NEW = [12, 7, 10]  # rows end at different rounds and leave the batch
EQUAL = 5  # prompt length of the equal-length batch run where padded rows are refused

SKIP: dict[str, str] = {
    "blt": (
        "transformers' own generate fails: BltConfig has no num_hidden_layers, which its "
        "DynamicCache needs"
    ),
    "gemma3n": (
        "its vision tower needs timm and Pillow, which are not test dependencies; its text "
        "decoder is swept as gemma3n_text"
    ),
    "musicgen": (
        "a decoder of codebook streams (input ids are batch x codebooks rows with a delay "
        "pattern), built from a musicgen_decoder config that transformers does not register "
        "as a causal LM"
    ),
    "musicgen_melody": "as musicgen (musicgen_melody_decoder config, codebook streams)",
}
"""Causal-LM model types not swept, with the reason."""

_UNVERIFIED = "state handling is not verified"
_OWN_CACHE = "cache class of its own"
_NO_CACHE = "takes neither `cache` nor `past_key_values`"
_STEPWISE = "cannot be a target: its sparse-attention indexer"

REFUSED: dict[str, str] = {
    # Recurrent or linear-attention state flashspec has not verified (flashspec.kv.state).
    "bailing_hybrid": _UNVERIFIED,
    "bamba": _UNVERIFIED,
    "granitemoehybrid": _UNVERIFIED,
    "inkling_text": _UNVERIFIED,
    "inkling2_text": _UNVERIFIED,
    "inkling2_loop_text": _UNVERIFIED,
    "kimi_linear": _UNVERIFIED,
    "lara_mini": _UNVERIFIED,
    "lfm2_moe": _UNVERIFIED,
    "lfm3": _UNVERIFIED,
    "nemotron_h": _UNVERIFIED,
    "olmo_hybrid": _UNVERIFIED,
    "qwen3_5": _UNVERIFIED,
    "qwen3_5_text": _UNVERIFIED,
    "qwen3_5_moe": _UNVERIFIED,
    "qwen3_5_moe_text": _UNVERIFIED,
    "qwen4_exp": _UNVERIFIED,
    "qwen4_exp_text": _UNVERIFIED,
    "zamba": _UNVERIFIED,
    "zamba2": _UNVERIFIED,
    "zaya": _UNVERIFIED,
    "deepseek_v4": "DeepseekV4HCACache layers",
    "recurrent_gemma": "keep their recurrent state inside the model",
    # A cache of the family's own, or none at all.
    "minimax": _OWN_CACHE,
    "reformer": _OWN_CACHE,
    "rwkv": _OWN_CACHE,
    "xlnet": _OWN_CACHE,
    "xlstm": _OWN_CACHE,
    "openai-gpt": _NO_CACHE,
    "gemma4_assistant": _NO_CACHE,
    "gemma4_unified_assistant": _NO_CACHE,
    # Not decoded from the tokens after a cache (flashspec._families.REFUSED).
    "cpmant": "reads the whole sequence on every call",
    "xlm": "appending a mask token",
    "prophetnet": "takes one token at a time after a cached state",
    # Several tokens after a cache are not the model's own decoding: drafters only.
    "axk2": _STEPWISE,
    "deepseek_v32": _STEPWISE,
    "dots3_note": _STEPWISE,
    "dots3_note_text": _STEPWISE,
    "glm_moe_dsa": _STEPWISE,
    "hy_v4": _STEPWISE,
    "moshi": "cannot be a target: its sliding window comes only from the cache",
}
"""Model types refused when the engine is built, with a pattern of the expected reason."""

PADDED_REFUSED = frozenset(
    {
        # Positions counted from the cache's length (no position_ids in their forward).
        "bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
        "pegasus", "plbart", "trocr", "whisper", "moss_transcribe_diarize",
        # A padding mask widened over image tokens a text generation does not have.
        "git",
    }
)  # fmt: skip
"""Model types whose rows of different lengths are refused in one batch (equal lengths run)."""


def _causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


SWEPT = [f for f in _causal_lm_types() if f not in WINDOWED and f not in SKIP]


@cache
def _prompts() -> list[list[int]]:
    return prompts(LENGTHS)


@cache
def _reference(family: str, prompt: tuple[int, ...], max_new: int) -> tuple[int, ...]:
    return tuple(reference(models(family)[0], prompt, max_new))


def _check(family: str, rows: list[list[int]], limits: list[int], got: list[list[int]]) -> None:
    """Each row of ``got`` is the target's own greedy continuation of its prompt alone."""
    target = models(family)[0]
    for prompt, limit, tokens in zip(rows, limits, got, strict=True):
        why = mismatch(target, prompt, tokens, _reference(family, tuple(prompt), limit))
        assert why is None, f"{family}: {why}"


def _engine(family: str, config: FlashSpecConfig, drafters: list[Drafter]) -> SpeculativeEngine:
    return SpeculativeEngine(config, drafters, TargetModel(family, model=models(family)[0]))


def _forced() -> FlashSpecConfig:
    # batches="fixed": every round of a batch drafts (the default may decode plainly).
    return FlashSpecConfig(sampling=SamplingConfig(gamma=4), bandit=BanditConfig(batches="fixed"))


@pytest.mark.parametrize("family", SWEPT)
def test_family_is_exact_or_refused(family: str) -> None:
    """Single row with a model draft and prompt lookup, a ragged batch with drafting forced,
    two model drafters; or the refusal ``REFUSED`` expects, raised when the engine is built."""
    target, agrees, disagrees = models(family)
    expected = REFUSED.get(family)
    try:
        single = _engine(family, _forced(), [ModelDrafter(agrees), PromptLookupDrafter()])
    except UnsupportedModelError as error:
        assert expected is not None, f"{family} is refused, not expected: {error}"
        assert re.search(re.escape(expected), str(error)), f"{family}: {error}"
        assert type(target).__name__ in str(error), str(error)
        return
    assert expected is None, f"{family} was built; expected a refusal ({expected!r})"

    rows, limits = _prompts(), MAX_NEW
    last = len(rows) - 1
    result = single.generate(rows[last], max_new_tokens=limits[last], ignore_eos=True)
    _check(family, [rows[last]], [limits[last]], result.tokens)
    accepted = result.stats.accepted

    if family in PADDED_REFUSED:
        with pytest.raises(UnsupportedModelError, match="rows of different lengths"):
            single.generate(rows, max_new_tokens=limits, ignore_eos=True)
        assert not single.shiftable
        rows = [row[:EQUAL] for row in rows]  # equal lengths: no padding, a batch all the same
    batch = single.generate(rows, max_new_tokens=limits, ignore_eos=True)
    _check(family, rows, limits, batch.tokens)
    accepted += batch.stats.accepted
    assert accepted > 0, f"{family}: no draft accepted, nothing was verified"

    two = _engine(family, FlashSpecConfig(), [ModelDrafter(agrees), ModelDrafter(disagrees)])
    both = two.generate(rows, max_new_tokens=limits, ignore_eos=True)
    _check(family, rows, limits, both.tokens)


def test_every_causal_lm_architecture_is_covered() -> None:
    """Every causal-LM model type is swept here, swept by the windowed tests, or skipped with a
    reason; the tables name only model types this transformers release ships."""
    shipped = set(_causal_lm_types())
    covered = set(SWEPT) | set(WINDOWED) | set(SKIP)
    assert shipped <= covered, f"not swept, windowed or skipped: {sorted(shipped - covered)}"
    assert all(reason.strip() for reason in SKIP.values())
    stale = (set(SKIP) | set(REFUSED) | PADDED_REFUSED) - shipped
    assert not stale, f"tables name model types transformers does not ship: {sorted(stale)}"
    assert not set(SKIP) & set(WINDOWED) and not set(REFUSED) & PADDED_REFUSED


def test_encoder_lm_head_without_is_decoder_is_refused() -> None:
    """An encoder family's LM head built as an encoder (``is_decoder=False``) attends both
    ways: verification would let each draft see the ones after it. Refused when built; the
    same model with ``is_decoder=True`` is swept above."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    bert = AutoModelForCausalLM.from_config(tiny_config("bert", is_decoder=False)).eval()
    with pytest.raises(UnsupportedModelError, match=r"BertLMHeadModel.*not causal"):
        TargetModel(model=bert)
    with pytest.raises(UnsupportedModelError, match=r"BertLMHeadModel.*not causal"):
        ModelDrafter(bert)
    # A family whose attention is causal whatever the flag (GPT-NeoX keeps is_decoder=False
    # in its configs) passes the probe.
    neox = AutoModelForCausalLM.from_config(tiny_config("gpt_neox", is_decoder=False)).eval()
    assert TargetModel(model=neox).shiftable


def test_stepwise_models_draft_one_token_per_forward() -> None:
    """A model refused as a target because a forward over several tokens after its cache is
    not its own decoding (Moshi here) drafts exactly for another target, one token per
    forward after its cache."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    moshi = AutoModelForCausalLM.from_config(tiny_config("moshi")).eval()
    drafter = ModelDrafter(moshi, name="moshi")
    assert not drafter.lm.support.chunked_exact and not drafter.shiftable
    target = models("llama")[0]
    engine = SpeculativeEngine(_forced(), [drafter], TargetModel("llama", model=target))
    rows = _prompts()
    result = engine.generate(rows, max_new_tokens=MAX_NEW, ignore_eos=True)
    _check("llama", rows, MAX_NEW, result.tokens)


def test_server_batches_equal_length_prompts_of_a_model_that_refuses_padding() -> None:
    """The server's worker takes jobs of the head's prompt length only when the engine refuses
    rows of different lengths in one batch (``SpeculativeEngine.padded_batches``); others wait
    for a batch of their own."""
    from flashspec.serve.metrics import server_metrics
    from flashspec.serve.worker import EngineWorker, Job

    engine = _engine("bart", FlashSpecConfig(), [PromptLookupDrafter()])
    assert engine.padded_batches is not None and "bart" in engine.padded_batches
    worker = EngineWorker(engine, max_batch=4, max_queue=8, metrics=server_metrics())
    lengths = [5, 7, 5, 7, 5]
    jobs = [
        Job(prompt_ids=[3] * n, max_tokens=2, stop=(), sampling=None, seed=None, group="greedy",
            deliver=lambda event: None)
        for n in lengths
    ]  # fmt: skip
    worker.submit(jobs)
    batches = [worker._next_batch() for _ in range(2)]
    assert [[len(job.prompt_ids) for job in batch or []] for batch in batches] == [
        [5, 5, 5],
        [7, 7],
    ]
