"""Warping, inverse-CDF sampling, the residual (native vs PyTorch) and the accept/reject rules."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from flashspec import sampling
from flashspec.sampling import (
    Warper,
    accept_greedy,
    accept_rejection,
    accept_typical,
    residual_dist_torch,
    residual_sample,
    residual_sample_torch,
    sample_inverse_cdf,
)

CHI2_99 = {7: 18.475, 15: 30.578}


def dirichlet(rng: np.random.Generator, shape: tuple[int, ...], alpha: float = 0.5) -> torch.Tensor:
    return torch.from_numpy(rng.dirichlet(np.full(shape[-1], alpha), size=shape[:-1])).float()


def chi2(samples: list[int], probs: torch.Tensor) -> float:
    counts = Counter(samples)
    n = len(samples)
    assert all(counts[i] == 0 for i in range(len(probs)) if probs[i] == 0)
    return sum(
        (counts[i] - n * float(pi)) ** 2 / (n * float(pi)) for i, pi in enumerate(probs) if pi > 0
    )


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.3, 5, 1.0), (0.5, 20, 0.8), (1.0, 0, 0.3), (2.0, 3, 0.95)],
)
@pytest.mark.parametrize("shape", [(6, 50), (2, 3, 8192)])
def test_warper_matches_hf_warpers(
    temperature: float, top_k: int, top_p: float, shape: tuple[int, ...]
) -> None:
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    hf = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        hf.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        hf.append(TopPLogitsWarper(top_p))
    logits = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    flat = logits.reshape(-1, shape[-1])
    input_ids: Any = torch.zeros((flat.shape[0], 1), dtype=torch.long)
    expected = hf(input_ids, flat.clone()).softmax(-1).reshape(shape)
    got = Warper(temperature, top_k, top_p).probs(logits)
    assert torch.equal(got > 0, expected > 0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-7)


def test_warper_batched_shape_and_keeps_top_token() -> None:
    logits = torch.randn((2, 3, 40), generator=torch.Generator().manual_seed(1))
    probs = Warper(0.7, 0, 1e-6).probs(logits)  # tiny top_p: only the argmax survives
    assert probs.shape == logits.shape
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    torch.testing.assert_close(probs.max(-1).values, torch.ones(2, 3))


def test_inverse_cdf_skips_zero_weights_even_at_the_edges() -> None:
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0, 0.0]] * 4)
    u = torch.tensor([0.0, 0.3, 0.2999999, 1.0 - 2**-53], dtype=torch.float64)
    assert sample_inverse_cdf(weights, u).tolist() == [1, 3, 1, 3]


def test_inverse_cdf_distribution() -> None:
    g = torch.Generator().manual_seed(2)
    probs = dirichlet(np.random.default_rng(2), (16,))
    u = torch.rand((20000,), generator=g, dtype=torch.float64)
    samples = sample_inverse_cdf(probs.expand(20000, -1), u).tolist()
    assert chi2(samples, probs) < CHI2_99[15]


def test_torch_residual_formula() -> None:
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.25, 0.25, 0.25, 0.25]])
    q = torch.tensor([[0.2, 0.5, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    expected = torch.tensor([[1.0, 0.0, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]])  # p == q: p itself
    torch.testing.assert_close(residual_dist_torch(p, q), expected)
    u = torch.tensor([0.99, 0.6], dtype=torch.float64)
    assert residual_sample_torch(p, q, u).tolist() == [0, 2]


native = pytest.mark.skipif(
    sampling.native_residual_sample() is None, reason="flashspec._residual not built"
)


@native
def test_native_and_torch_residual_agree_draw_for_draw() -> None:
    g, rng = torch.Generator().manual_seed(3), np.random.default_rng(3)
    p, q = dirichlet(rng, (2000, 64)), dirichlet(rng, (2000, 64))
    u = torch.rand((2000,), generator=g, dtype=torch.float64)
    a = residual_sample(p, q, u, backend="native")
    b = residual_sample(p, q, u, backend="torch")
    # Identical inverse CDFs; only a u within rounding of a CDF step may land differently.
    assert (a == b).float().mean() > 0.995
    from flashspec._residual import residual_dist

    torch.testing.assert_close(
        torch.from_numpy(residual_dist(p.numpy(), q.numpy())), residual_dist_torch(p, q)
    )


@native
@pytest.mark.parametrize("backend", ["native", "torch"])
def test_residual_backends_follow_the_residual_distribution(backend: str) -> None:
    g, rng = torch.Generator().manual_seed(4), np.random.default_rng(4)
    p, q = dirichlet(rng, (8,), 1.0), dirichlet(rng, (8,), 1.0)
    n = 8000
    u = torch.rand((n,), generator=g, dtype=torch.float64)
    pn, qn = p.expand(n, -1).contiguous(), q.expand(n, -1).contiguous()
    samples = residual_sample(pn, qn, u, "native" if backend == "native" else "torch")
    assert chi2(samples.tolist(), residual_dist_torch(p, q)) < CHI2_99[7]


def test_native_backend_refuses_what_it_cannot_do() -> None:
    p = torch.full((2, 4), 0.25, dtype=torch.float64)
    u = torch.zeros(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="residual='auto'"):
        residual_sample(p, p, u, backend="native")
    assert residual_sample(p, p, u, backend="auto").tolist() == [0, 0]  # falls back to torch


def test_accept_greedy_lockstep() -> None:
    # Target argmax per position: row 0 -> 5 6 7 8, row 1 -> 5 6 1 2.
    best = torch.tensor([[5, 6, 7, 8], [5, 6, 1, 2]])
    logits = torch.nn.functional.one_hot(best, 10).float()
    drafts = torch.tensor([[5, 6, 7], [5, 6, 9]])
    out = accept_greedy(logits, drafts)
    assert out.accepted.tolist() == [3, 2]
    assert out.token.tolist() == [7, 1]  # m = 2: row 0 emits its accepted draft, row 1 the argmax


def test_accept_rejection_full_acceptance_takes_bonus_from_last_position() -> None:
    g = torch.Generator().manual_seed(5)
    p = dirichlet(np.random.default_rng(5), (3, 4, 10))
    drafts = torch.multinomial(p[:, :3].reshape(-1, 10), 1, generator=g).view(3, 3)
    p[:, 3] = torch.nn.functional.one_hot(torch.tensor([4, 7, 9]), 10).float()
    out = accept_rejection(p, p[:, :3], drafts, g)  # q == p: every draft accepted
    assert out.accepted.tolist() == [3, 3, 3]
    assert out.token.tolist() == [4, 7, 9]


def test_accept_rejection_point_mass_rejects_token_with_zero_target_mass() -> None:
    p = torch.tensor([[[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]]])
    out = accept_rejection(p, None, torch.tensor([[0]]), torch.Generator().manual_seed(6))
    assert out.accepted.tolist() == [0]
    assert out.token.item() in (1, 2)  # residual of p against the point mass on 0


def test_accept_rejection_without_drafts_samples_from_p() -> None:
    p = torch.tensor([[[0.0, 0.0, 1.0]]])
    out = accept_rejection(p, None, torch.empty((1, 0), dtype=torch.long), None)
    assert out.accepted.tolist() == [0] and out.token.tolist() == [2]


def test_accept_typical_accepts_likely_and_rejects_unlikely_drafts() -> None:
    p = torch.tensor([[[0.9, 0.05, 0.05], [0.02, 0.18, 0.8], [0.0, 1.0, 0.0]]])
    out = accept_typical(p, torch.tensor([[0, 0]]), torch.Generator().manual_seed(7), 0.09, 0.3)
    assert out.accepted.tolist() == [1]
    assert out.token.shape == (1,)


def test_numpy_views_share_memory() -> None:
    # The native path hands torch CPU tensors to the kernel as NumPy views: no copies.
    t = torch.zeros(8)
    assert np.shares_memory(t.numpy(), t.contiguous().numpy())


# ---------------------------------------------------------------------------------------------
# Temperatures near 0: the limit is the argmax, never NaN


def _logits_with_ties_and_extremes() -> torch.Tensor:
    logits = torch.randn((4, 3, 50), generator=torch.Generator().manual_seed(3)) * 4
    logits[1] -= 1000.0  # all negative: x / T is -inf everywhere without care
    logits[2] += 1000.0  # all positive: x / T is +inf everywhere without care
    logits[3, :, 7] = logits[3, :, 9] = logits[3].amax(-1) + 1.0  # a tie at the top
    return logits


@pytest.mark.parametrize("temperature", [1e-38, 1e-40, 1e-300, 5e-324])
@pytest.mark.parametrize(("top_k", "top_p"), [(0, 1.0), (5, 0.9)])
def test_tiny_temperature_puts_the_mass_on_the_argmax(
    temperature: float, top_k: int, top_p: float
) -> None:
    logits = _logits_with_ties_and_extremes()
    probs = Warper(temperature, top_k, top_p).probs(logits)
    assert torch.isfinite(probs).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(probs.shape[:-1]))
    top = logits == logits.amax(-1, keepdim=True)
    # Ties split the mass evenly: the limit of softmax(x / T) as T -> 0.
    expected = top.float() / top.sum(-1, keepdim=True)
    torch.testing.assert_close(probs, expected)


def test_small_temperature_keeps_the_softmax_it_tends_to() -> None:
    # Logits differ by less than T: at T = 1e-38 the distribution is far from one-hot, and
    # the shift and the power-of-two scaling must keep that exactly as float64 math does.
    base = torch.tensor([[0.0, -1e-38, -3e-38, -1.0]])
    for temperature in (2e-38, 1e-39):
        want = torch.softmax(base.double() / temperature, -1).float()
        got = Warper(temperature).probs(base)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_engine_at_a_tiny_temperature_gives_the_greedy_output() -> None:
    from flashspec import (
        BanditConfig,
        FlashSpecConfig,
        SamplingConfig,
        SpeculativeEngine,
        TargetModel,
    )
    from flashspec.drafters import ModelDrafter
    from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

    target = build_llama(0, init_range=0.3)
    engine = SpeculativeEngine(
        # batches="fixed": the batch drafts every round (the default may choose plain decoding).
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(batches="fixed")),
        [ModelDrafter(perturbed_copy(target, 0.02, seed=1), name="draft")],
        TargetModel("tiny", model=target, tokenizer=build_char_tokenizer()),
    )
    prompts = ["def quicksort(arr):", "x = 1", "hello"]
    greedy = engine.generate(prompts, max_new_tokens=24)
    for temperature in (1e-38, 1e-300):
        # Sampled (rejection rule, draft and target warped), and still the argmax each time.
        sampled = engine.generate(
            prompts, max_new_tokens=24, sampling=SamplingConfig(gamma=3, temperature=temperature)
        )
        assert sampled.tokens == greedy.tokens, temperature
        assert sampled.stats.accepted > 0


@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.95, 0.999])
def test_top_p_sorts_only_its_candidates_and_keeps_hfs_cut(top_p: float) -> None:
    """On a large vocabulary the CPU cut sorts only tokens that can be kept; the kept set must
    be HF's TopPLogitsWarper's on peaked rows (few candidates), flat rows (the full-sort
    fallback) and rows with top-k's -inf, 49,152 tokens as SmolLM2's."""
    from transformers.generation.logits_process import TopPLogitsWarper

    from flashspec.sampling import TOP_P_PARTIAL_VOCAB, _top_p_threshold

    generator = torch.Generator().manual_seed(3)
    vocab = 49152
    assert vocab >= TOP_P_PARTIAL_VOCAB
    peaked = torch.randn((6, vocab), generator=generator) * 6
    flat = torch.randn((2, vocab), generator=generator) * 0.05
    masked = peaked[:2].clone()
    masked[:, ::3] = float("-inf")
    logits = torch.cat([peaked, flat, masked])
    want = TopPLogitsWarper(top_p)(torch.zeros((logits.shape[0], 1), dtype=torch.long), logits)
    got = logits.masked_fill(logits < _top_p_threshold(logits, top_p), float("-inf"))
    assert torch.equal(got > float("-inf"), want > float("-inf"))
    kept = (got > float("-inf")).sum(-1)
    if top_p <= 0.95:  # both roads taken: few candidates, and the fallback
        assert int(kept[:6].max()) < vocab // 8 < int(kept[6:8].min())


@pytest.mark.parametrize(
    "logits",
    [
        torch.tensor([[1.0, 3.0, 3.0, 0.0]]),  # a tie: the first maximum
        torch.tensor([[float("-inf")] * 4]),
        torch.tensor([[1.0, float("nan"), 5.0, float("nan")]]),  # NaN counts as maximal
        torch.randn(7),
        torch.randn(3, 5, 49152),
        torch.randn(4, 9)[:, ::2],  # not contiguous
        torch.randn(2, 6).to(torch.bfloat16),  # torch's own reduction
    ],
    ids=["tie", "all-inf", "nan", "1-d", "rounds", "strided", "bfloat16"],
)
def test_argmax_last_is_torchs_argmax(logits: torch.Tensor) -> None:
    """The greedy argmax through NumPy keeps torch's rule, shape and dtype."""
    with torch.inference_mode():
        got = sampling.argmax_last(logits)
        want = logits.argmax(dim=-1)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert torch.equal(got, want)
