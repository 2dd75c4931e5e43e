"""Speculative sampling is lossless: emitted tokens follow the (warped) target distribution.

Chi-squared goodness of fit, alpha = 0.01, of the first and second emitted tokens against the
exact distributions computed from the target, with a draft model that differs from it. Seeds
are fixed, so every run is the same run. ``test_wrong_residual_is_detected`` shows that the test
fails when the residual is wrong.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import flashspec.sampling as sampling
from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import Drafter, ModelDrafter, PromptLookupDrafter
from tests.helpers.chi2 import chi_squared
from tests.helpers.distribution import PROMPT, exact, models, sample_two


def engine_for(
    gamma: int, temperature: float, top_p: float, drafter: str = "model"
) -> SpeculativeEngine:
    target, draft = models()
    drafters: list[Drafter] = [PromptLookupDrafter()]
    if drafter != "lookup":
        drafters = [ModelDrafter(draft, temperature=1.4 if drafter == "hot" else None)]
    sampling_config = SamplingConfig(gamma=gamma, temperature=temperature, top_p=top_p)
    return SpeculativeEngine(
        FlashSpecConfig(sampling=sampling_config), drafters, TargetModel(model=target)
    )


SETTINGS = [(1.0, 1.0), (0.7, 0.9)]


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize(("temperature", "top_p"), SETTINGS)
@pytest.mark.parametrize(("batch", "n"), [(1, 300), (50, 1500)])
def test_emitted_tokens_follow_target(
    gamma: int, temperature: float, top_p: float, batch: int, n: int
) -> None:
    engine = engine_for(gamma, temperature, top_p)
    first, second = sample_two(engine, n, batch, seed=100 * gamma + batch)
    p_first, p_second = exact(temperature, top_p)
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, (
            f"{name} token: chi2 {stat:.1f} >= {critical} (counts {sorted(counts.items())})"
        )
    # The draft must matter: some drafts rejected (residual path) and some accepted.
    stats = engine.generate([PROMPT] * 20, max_new_tokens=gamma + 1, ignore_eos=True, seed=7).stats
    assert 0 < stats.accepted < stats.drafted


@pytest.mark.parametrize("drafter", ["lookup", "hot"])
def test_point_mass_and_own_temperature_drafters_are_lossless(drafter: str) -> None:
    """Prompt lookup (deterministic drafts, q = point mass) and a drafter sampling at its own
    temperature: both stay exact because q is what the drafts were drawn from."""
    engine = engine_for(4, 0.7, 0.9, drafter)
    first, second = sample_two(engine, 1500, 50, seed=5)
    p_first, p_second = exact(0.7, 0.9)
    for counts, p in ((first, p_first), (second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"chi2 {stat:.1f} >= {critical}"


def test_wrong_residual_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Break the residual on purpose (sample from p, ignoring q): the chi-squared test must fail."""

    def from_p(
        p: torch.Tensor, q: torch.Tensor, u: torch.Tensor, backend: str = "auto"
    ) -> torch.Tensor:
        return sampling.sample_inverse_cdf(p, u)

    monkeypatch.setattr(sampling, "residual_sample", from_p)
    engine = engine_for(1, 1.0, 1.0)
    first, _ = sample_two(engine, 1500, 50, seed=150)
    stat, critical = chi_squared(first, exact(1.0, 1.0)[0])
    assert stat > critical, f"a wrong residual went unnoticed: chi2 {stat:.1f} < {critical}"


def test_raw_logit_q_is_detected(monkeypatch: pytest.MonkeyPatch) -> None:
    """The known peer bug: q taken from raw logits while drafts come from warped ones. Lossy, and
    the test sees it."""
    real = sampling.accept_rejection

    def raw_q(p: torch.Tensor, q: torch.Tensor | None, *args: Any, **kwargs: Any) -> Any:
        if q is None:  # a round without drafts
            return real(p, q, *args, **kwargs)
        unwarped = q.clamp_min(1e-3) ** 0.7  # undo temperature 0.7 (roughly), as raw logits would
        return real(p, unwarped / unwarped.sum(-1, keepdim=True), *args, **kwargs)

    monkeypatch.setattr("flashspec.engine.accept.accept_rejection", raw_q)
    engine = engine_for(4, 0.7, 0.9)
    first, _ = sample_two(engine, 3000, 50, seed=9)
    stat, critical = chi_squared(first, exact(0.7, 0.9)[0])
    assert stat > critical, f"raw-logit q went unnoticed: chi2 {stat:.1f} < {critical}"
