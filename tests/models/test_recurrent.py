"""Recurrent and hybrid models: exact as target and drafter, or refused before generating.

Tiny random configs of each stateful family transformers 5.x ships with its state in the cache.
References are independent of the engine: HF ``generate`` (greedy), the model's own argmax on
the whole sequence without a cache (drafter state), and exact distributions from full forwards
(chi-squared). ``test_cropping_a_recurrent_state_is_detected`` breaks the rollback on purpose
(crop, as attention caches do) and shows the identity test fails; ``check`` mode is shown to
raise on a wrong state.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest
import torch

import flashspec.kv.state as state
from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.bench.recurrent import build
from flashspec.drafters import DraftContext, Drafter, ModelDrafter, PromptLookupDrafter
from flashspec.kv.compat import crop_cache, new_cache
from flashspec.models import Padding
from flashspec.sampling import Warper
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

EXACT = ["mamba2", "qwen3_next", "lfm2", "falcon_h1", "mamba", "falcon_mamba", "jamba"]
# Mamba-1 mixers: exact only because flashspec gives their scan the cached state (kv.mamba1).
STEPWISE = ["mamba", "falcon_mamba", "jamba"]
VOCAB = 58  # the character tokenizer's
MAX_NEW = 24
PROMPTS = ["def quicksort(arr):", "abcabcabc", "x"]


@cache
def tokenizer() -> Any:
    return build_char_tokenizer()


def condition(model: Any) -> Any:
    """Slow state decay (the state carries far back) and sharper logits (greedy ties rare)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.fill_(-3.0)
            elif param.dim() >= 2:
                param.mul_(3.0)
    model.generation_config.eos_token_id = None
    return model


@cache
def target_of(family: str) -> Any:
    return condition(build(family, 4, seed=0, vocab=VOCAB))


@cache
def reference(family: str, prompt: str, max_new: int = MAX_NEW) -> list[int]:
    model = target_of(family)
    ids = torch.tensor([tokenizer()(prompt)["input_ids"]])
    with torch.inference_mode():
        out = model.generate(ids, do_sample=False, max_new_tokens=max_new, pad_token_id=0)
    return list(out[0, ids.shape[1] :].tolist())


def engine_for(family: str, drafter: str, gamma: int = 4) -> SpeculativeEngine:
    model = target_of(family)
    drafters: dict[str, Drafter] = {
        "self": ModelDrafter(model),
        "noisy": ModelDrafter(perturbed_copy(model, 0.05, seed=1)),
        "lookup": PromptLookupDrafter(),
    }
    return SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=gamma)),
        [drafters[drafter]],
        TargetModel(model=model, tokenizer=tokenizer()),
    )


@pytest.mark.parametrize("drafter", ["self", "noisy", "lookup"])
@pytest.mark.parametrize("family", EXACT)
def test_greedy_equals_hf_generate(family: str, drafter: str) -> None:
    engine = engine_for(family, drafter)
    replays = 0
    for prompt in PROMPTS:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
        assert result.tokens[0] == reference(family, prompt), (family, drafter, prompt)
        replays += result.stats.replays
    if drafter == "self":
        assert replays == 0  # every draft accepted: the verify's state is kept, never replayed
    elif family != "lfm2":  # conv-only state crops; the others restore and replay
        assert replays > 0


@pytest.mark.parametrize("family", EXACT)
def test_batches_equal_single_rows(family: str) -> None:
    """Rows ending at different lengths leave the batch (and its recurrent state); rows of
    different prompt lengths are left padded. Each row equals its own generation."""
    engine = engine_for(family, "noisy")
    for prompts, limits in (
        (["def f(x):", "abcabcabc", "hello wor"], [5, 20, 12]),
        (["def quicksort(arr):", "ab", "hello"], [16, 16, 9]),
    ):
        single = [
            engine.generate(p, max_new_tokens=n, ignore_eos=True).tokens[0]
            for p, n in zip(prompts, limits, strict=True)
        ]
        batch = engine.generate(prompts, max_new_tokens=limits, ignore_eos=True).tokens
        assert batch == single, (family, prompts)


@pytest.mark.parametrize("mode", ["check", "replay"])
@pytest.mark.parametrize("family", EXACT)
def test_check_and_replay_modes(family: str, mode: str) -> None:
    """``check`` replays every round one token at a time and compares states (raising on a
    difference); ``replay`` always restores and replays. Both give the same tokens."""
    engine = engine_for(family, "noisy")
    engine.target.state_mode = mode  # type: ignore[assignment]
    for prompt in PROMPTS[:2]:
        result = engine.generate(prompt, max_new_tokens=MAX_NEW, ignore_eos=True)
        assert result.tokens[0] == reference(family, prompt)
        if mode == "replay":
            assert result.stats.replays == result.stats.rounds  # full accepts too


def test_check_mode_catches_a_wrong_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restore a stale state on purpose: ``check`` mode must raise, not return tokens."""
    real = state.restore_snapshot

    def stale(cache_: Any, snapshot: state.Snapshot, cached: int, *, copy: bool = False) -> None:
        real(cache_, snapshot, cached, copy=copy)
        for layer in state._stateful_layers(cache_):
            for i in range(layer.number_of_states):
                if layer.is_recurrent_states_initialized[i]:
                    layer.recurrent_states[i] = layer.recurrent_states[i] * 0.5

    monkeypatch.setattr("flashspec.models.target.restore_snapshot", stale)
    engine = engine_for("qwen3_next", "noisy")
    engine.target.state_mode = "check"
    with pytest.raises(RuntimeError, match="differs from a token-by-token replay"):
        engine.generate(PROMPTS[0], max_new_tokens=MAX_NEW, ignore_eos=True)


# Falcon-H1's tiny random config barely reads its recurrent state (zeroing it moves the logits
# by ~1e-4), so a stale state goes unnoticed there; these two depend on theirs.
@pytest.mark.parametrize("family", ["mamba2", "qwen3_next"])
def test_cropping_a_recurrent_state_is_detected(
    monkeypatch: pytest.MonkeyPatch, family: str
) -> None:
    """The bug this module fixes: crop the cache as for attention (the recurrent state keeps
    the rejected drafts). The greedy identity test must then fail."""

    def crop_only(self: TargetModel, tokens: torch.Tensor, padding: Padding) -> None:
        valid = tokens.shape[1] - 1
        if self.cached > valid:
            crop_cache(self.cache, self.cached - valid)
            self.cached = valid
        self._marks.clear()

    monkeypatch.setattr(TargetModel, "commit", crop_only)
    engine = engine_for(family, "noisy")
    outputs = [
        engine.generate(p, max_new_tokens=MAX_NEW, ignore_eos=True).tokens[0] for p in PROMPTS
    ]
    assert any(out != reference(family, p) for out, p in zip(outputs, PROMPTS, strict=True))


def test_env_var_sets_the_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(state.STATE_MODE_ENV, "replay")
    assert TargetModel(model=target_of("lfm2")).state_mode == "replay"
    monkeypatch.setenv(state.STATE_MODE_ENV, "sometimes")
    with pytest.raises(ValueError, match=r"FLASHSPEC_RECURRENT='sometimes'.*keep"):
        TargetModel(model=target_of("lfm2"))


@pytest.mark.parametrize("family", EXACT)
def test_stateful_drafter_state_follows_commits(family: str) -> None:
    """After rounds that accept a random number of drafts and add a token of their own, each
    new draft is the drafter model's own argmax over the whole sequence (no cache)."""
    model = build(family, 2 if family in ("qwen3_next", "lfm2") else 3, seed=3, vocab=VOCAB)
    drafter = ModelDrafter(model)
    drafter.reset()
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(3, VOCAB, (2, 9), generator=generator)
    padding = Padding(torch.zeros(2, dtype=torch.int64))
    for _ in range(8):
        ctx = DraftContext(tokens=tokens, padding=padding, warper=Warper(0.0), generator=None)
        with torch.inference_mode():
            drafts = drafter.propose(ctx, 4).tokens
            fed = torch.cat([tokens, drafts[:, :-1]], dim=1)
            own = model(input_ids=fed).logits[:, tokens.shape[1] - 1 :].argmax(-1)
        assert torch.equal(drafts, own), family
        accepted = int(torch.randint(0, 5, (1,), generator=generator))
        extra = torch.randint(3, VOCAB, (2, 1), generator=generator)
        tokens = torch.cat([tokens, drafts[:, :accepted], extra], dim=1)
        drafter.keep([tokens.shape[1] - 1] * tokens.shape[0], padding)


@pytest.mark.parametrize("family", STEPWISE)
def test_mamba_mixers_draft_for_an_attention_target(family: str) -> None:
    target = build_llama(0, init_range=0.3)
    draft = build(family, 2, seed=0, vocab=VOCAB)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
        [ModelDrafter(draft)],
        TargetModel(model=target, tokenizer=tokenizer()),
    )
    ids = torch.tensor([tokenizer()(PROMPTS[0])["input_ids"]])
    with torch.inference_mode():
        ref = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
    result = engine.generate(input_ids=ids, max_new_tokens=MAX_NEW, ignore_eos=True)
    assert result.tokens[0] == ref[0, ids.shape[1] :].tolist()[: len(result.tokens[0])]


@pytest.mark.parametrize("family", STEPWISE)
def test_mamba_mixers_are_made_exact_on_flashspec_caches_only(family: str) -> None:
    """transformers' Mamba-1 mixers restart the scan from zero on a multi-token input after a
    cached state (so a verify forward would be wrong); the patched mixers start the scan from
    the cached state on caches flashspec made, and leave every other cache as shipped."""
    from transformers import DynamicCache

    model = condition(build(family, 2, seed=0, vocab=VOCAB))
    ids = torch.randint(3, VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))

    def chunked(cache_: Any) -> torch.Tensor:
        with torch.inference_mode():
            model(input_ids=ids[:, :7], cache=cache_, use_cache=True)
            logits: torch.Tensor = model(input_ids=ids[:, 7:], cache=cache_, use_cache=True).logits
        return logits

    with torch.inference_mode():
        full = model(input_ids=ids).logits[:, 7:]
    shipped = (chunked(DynamicCache(config=model.config)) - full).abs().max()
    assert shipped > 1e-5  # the reason for the patch (if this fails, transformers fixed it)
    TargetModel(model=model)  # patches the mixers
    patched = chunked(new_cache(model))
    assert (patched - full).abs().max() < 1e-5
    unchanged = (chunked(DynamicCache(config=model.config)) - full).abs().max()
    assert torch.equal(unchanged, shipped)


def test_mamba_mixers_not_found_are_refused_as_targets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("flashspec.kv.mamba1.MIXERS", frozenset())
    model = build("mamba", 2, seed=0, vocab=VOCAB)
    with pytest.raises(state.UnsupportedModelError) as info:
        TargetModel(model=model)
    message = str(info.value)
    assert "MambaForCausalLM cannot be a target" in message and "restarts its scan" in message
    drafter = ModelDrafter(model)  # still a drafter: fed one token at a time after a state
    assert not drafter.lm.support.chunked_exact


@pytest.mark.parametrize("role", ["target", "drafter"])
def test_state_inside_the_model_is_refused(role: str) -> None:
    model = build("recurrent_gemma", 3, seed=0, vocab=VOCAB)
    with pytest.raises(state.UnsupportedModelError, match=r"RecurrentGemma.*inside the model"):
        if role == "target":
            TargetModel(model=model)
        else:
            ModelDrafter(model)


def test_unverified_stateful_family_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(state._CHUNKED_EXACT, "mamba2")
    with pytest.raises(state.UnsupportedModelError, match=r"model_type 'mamba2'.*not verified"):
        TargetModel(model=build("mamba2", 2, seed=0, vocab=VOCAB))


def test_unknown_cache_layer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    class OddLayer:
        pass

    class OddCache:
        def __init__(self) -> None:
            self.layers = [OddLayer()]

    monkeypatch.setattr("flashspec.models.causal.new_cache", lambda model: OddCache())
    with pytest.raises(state.UnsupportedModelError, match="OddLayer layers"):
        TargetModel(model=build_llama(0))


# -- sampling on a hybrid: chi-squared of the first two emitted tokens ------------------------

SMALL_VOCAB = 12
PROMPT_IDS = [1, 5, 7, 3, 9, 5, 7]


@cache
def sampling_pair(family: str) -> tuple[Any, Any]:
    """A conditioned target (its state carries far back) and a draft that disagrees with it."""
    target = condition(build(family, 2, seed=10, vocab=SMALL_VOCAB))
    draft = build(family, 2, seed=11, vocab=SMALL_VOCAB)
    return target, draft


def second_token_chi2(family: str) -> list[tuple[float, float]]:
    """(statistic, critical value) of the first and second emitted tokens, gamma = 1: when
    round one rejects its draft, the second token comes from a round after a restore and
    replay, so a wrong state moves the second token's distribution."""
    from collections import Counter

    from tests.helpers.chi2 import chi_squared

    target, draft = sampling_pair(family)
    warper = Warper(temperature=1.0)
    with torch.inference_mode():
        first_p = warper.probs(target(torch.tensor([PROMPT_IDS])).logits[0, -1]).double()
        extended = torch.tensor([[*PROMPT_IDS, x] for x in range(SMALL_VOCAB)])
        second_p = first_p @ warper.probs(target(extended).logits[:, -1]).double()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=1, temperature=1.0)),
        [ModelDrafter(draft)],
        TargetModel(model=target),
    )
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    replays = 0
    batch = 50
    for call in range(30):
        result = engine.generate([PROMPT_IDS] * batch, max_new_tokens=2, ignore_eos=True, seed=call)
        replays += result.stats.replays
        for row in result.tokens:
            first[row[0]] += 1
            second[row[1]] += 1
    assert replays > 0
    return [chi_squared(counts, p) for counts, p in ((first, first_p), (second, second_p))]


@pytest.mark.parametrize("family", ["qwen3_next", "mamba2", "mamba"])
def test_sampling_follows_the_target(family: str) -> None:
    for stat, critical in second_token_chi2(family):
        assert stat < critical, f"{family}: chi2 {stat:.1f} >= {critical}"


def test_a_stale_state_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Restore everything but the recurrent state on purpose (it keeps the rejected draft):
    the second token's chi-squared test must fail."""
    real = state.restore_snapshot

    def stale(cache_: Any, snapshot: state.Snapshot, cached: int, *, copy: bool = False) -> None:
        kept = [dict(layer.recurrent_states) for layer in state._stateful_layers(cache_)]
        real(cache_, snapshot, cached, copy=copy)
        for layer, recurrent in zip(state._stateful_layers(cache_), kept, strict=True):
            layer.recurrent_states.update(recurrent)

    monkeypatch.setattr("flashspec.models.target.restore_snapshot", stale)
    (_, _), (stat, critical) = second_token_chi2("mamba2")
    assert stat > critical, f"a stale state went unnoticed: chi2 {stat:.1f} < {critical}"
