"""Drafts that share the target's embedding and head over a subset of the vocabulary
(``flashspec.shared_head``): still exact.

References: the target's own head in float64, HF ``generate`` (greedy identity), and the exact
first/second-token distributions with the chi-squared test of test_engine_distribution (the
draft's q is zero outside its subset, so the residual must cover those tokens).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import flashspec.sampling as sampling
from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import ModelDrafter
from flashspec.shared_head import (
    SubsetHead,
    build_shared_head_draft,
    load_shared_head_draft,
    own_state,
    save_shared_head_draft,
)
from tests.helpers.chi2 import chi_squared
from tests.helpers.distribution import PROMPT, VOCAB, exact, models, sample_two
from tests.helpers.models import build_llama

SUBSET = [0, 2, 3, 5, 8, 11]  # half of the 12-token vocabulary


def shared_draft(target: torch.nn.Module, ids: list[int], seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_shared_head_draft(target, ids, layers=1).eval()


def test_subset_head_is_the_target_head_inside_and_minus_inf_outside() -> None:
    target = build_llama(0, vocab_size=VOCAB, layers=1, hidden=32)
    hidden = torch.randn(2, 3, 32)
    head = SubsetHead(target.lm_head.weight, torch.tensor(SUBSET), VOCAB)
    got = head(hidden)
    reference = hidden.double() @ target.lm_head.weight.double().T
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[SUBSET] = True
    torch.testing.assert_close(
        got[..., inside].double(), reference[..., inside], atol=1e-5, rtol=1e-5
    )
    assert torch.isneginf(got[..., ~inside]).all()
    for bad, match in (([], "at least one"), ([0, 12], r"\[0, 12\)"), ([1, 1], "distinct")):
        with pytest.raises(ValueError, match=match):
            SubsetHead(target.lm_head.weight, torch.tensor(bad, dtype=torch.long), VOCAB)


def test_the_draft_shares_the_target_embedding_and_proposes_only_its_subset() -> None:
    target, _ = models()
    draft = shared_draft(target, SUBSET)
    assert draft.model.embed_tokens is target.get_input_embeddings()
    with torch.inference_mode():
        logits = draft(torch.tensor([PROMPT])).logits
    outside = [t for t in range(VOCAB) if t not in SUBSET]
    assert torch.isneginf(logits[..., outside]).all()
    assert torch.isfinite(logits[..., SUBSET]).all()
    assert all(not name.startswith(("model.embed_tokens", "lm_head")) for name in own_state(draft))


def subset_engine(gamma: int, temperature: float, top_p: float) -> SpeculativeEngine:
    target, _ = models()
    sampling_config = SamplingConfig(gamma=gamma, temperature=temperature, top_p=top_p)
    return SpeculativeEngine(
        FlashSpecConfig(sampling=sampling_config),
        [ModelDrafter(shared_draft(target, SUBSET), name="subset")],
        TargetModel(model=target),
    )


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_with_a_subset_draft_follows_the_target(
    gamma: int, temperature: float, top_p: float
) -> None:
    engine = subset_engine(gamma, temperature, top_p)
    first, second = sample_two(engine, 300, 1, seed=700 + 10 * gamma)
    p_first, p_second = exact(temperature, top_p)
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name}: chi2 {stat:.1f} >= {critical} ({sorted(counts.items())})"
    # Tokens the draft can never propose were emitted (only the residual gives them), and
    # drafts were both accepted and rejected.
    assert any(token not in SUBSET for token in first)
    stats = engine.generate([PROMPT] * 20, max_new_tokens=gamma + 1, ignore_eos=True, seed=7).stats
    assert 0 < stats.accepted < stats.drafted


def test_greedy_with_a_subset_draft_equals_hf_generate(char_tokenizer: object) -> None:
    target = build_llama(0, init_range=0.3)
    vocab = target.config.vocab_size
    ids = list(range(0, vocab, 2))
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)),
        [ModelDrafter(shared_draft(target, ids), name="subset")],
        TargetModel("tiny", model=target, tokenizer=char_tokenizer),
    )
    eos = target.generation_config.eos_token_id
    for prompt in ("def f(x):", "import os", "class A:"):
        ids_in = torch.tensor([char_tokenizer(prompt)["input_ids"]])  # type: ignore[operator]
        with torch.inference_mode():
            out = target.generate(ids_in, max_new_tokens=24, do_sample=False, pad_token_id=0)
        reference = out[0, ids_in.shape[1] :].tolist()
        reference = reference[: reference.index(eos) + 1] if eos in reference else reference
        result = engine.generate(ids_in[0].tolist(), max_new_tokens=24)
        assert result.tokens[0] == reference, prompt
    assert engine.generate("def f(x):", max_new_tokens=24).stats.drafted > 0


def test_save_and_load_keep_only_the_draft_own_layers(tmp_path: Path) -> None:
    target, _ = models()
    draft = shared_draft(target, SUBSET)
    folder = save_shared_head_draft(draft, tmp_path / "draft")
    loaded = load_shared_head_draft(folder, target)
    with torch.inference_mode():
        want = draft(torch.tensor([PROMPT])).logits
        got = loaded(torch.tensor([PROMPT])).logits
    # Saved in float16: equal to that precision, and -inf in the same places.
    assert torch.equal(torch.isneginf(got), torch.isneginf(want))
    finite = torch.isfinite(want)
    torch.testing.assert_close(got[finite], want[finite], atol=2e-2, rtol=2e-2)
    assert loaded.model.embed_tokens is target.get_input_embeddings()
    from safetensors import safe_open

    with safe_open(str(folder / "layers.safetensors"), "pt") as saved:
        names = set(saved.keys())
    assert names == set(own_state(draft)) and not any("embed" in n or "lm_head" in n for n in names)
    wider = build_llama(1, vocab_size=VOCAB, layers=1, hidden=64)
    with pytest.raises(ValueError, match="width 32"):
        load_shared_head_draft(folder, wider)


def test_a_residual_blind_outside_the_subset_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the residual on purpose: draw it only over the draft's support (where q > 0), so
    tokens outside the subset can never be emitted. The chi-squared test must fail."""
    real = sampling.residual_sample

    def blind(p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, backend: str = "auto") -> Any:
        # Rows with a draft only (the bonus token's residual comes with q = 0 everywhere).
        drafted = q.sum(-1, keepdim=True) > 0
        inside = torch.where(drafted, p * (q > 0), p)
        return real(inside / inside.sum(-1, keepdim=True).clamp_min(1e-30), q, u, backend)

    monkeypatch.setattr(sampling, "residual_sample", blind)
    engine = subset_engine(1, 1.0, 1.0)
    first, _ = sample_two(engine, 300, 1, seed=710)
    stat, critical = chi_squared(first, exact(1.0, 1.0)[0])
    assert stat > critical, f"a residual blind outside the subset went unnoticed: chi2 {stat:.1f}"
