"""``flashspec.models.linear``: the transposed form of a few-row product equals a float64 reference,
the form is chosen per row count by what was timed, and a target whose every layer takes it
still decodes greedily as HF's ``generate`` does on the untouched model and samples its
distribution (chi-squared)."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch

from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine
from flashspec._greedy import compare_greedy
from flashspec.drafters import ModelDrafter
from flashspec.models import TargetModel
from flashspec.models.linear import DISABLE_ENV, TunedLinear, faster_rows, tune_linears, untuned
from tests.helpers import distribution
from tests.helpers.chi2 import chi_squared
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 48), (3, 48), (2, 5, 48), (16, 48), (40, 48)])
def test_the_transposed_form_equals_a_float64_reference(bias: bool, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    layer = torch.nn.Linear(48, 80, bias=bias)
    layer.__class__ = TunedLinear
    layer.transposed_rows = frozenset(range(2, 17))  # type: ignore[assignment]
    x = torch.randn(shape)
    reference = x.double() @ layer.weight.double().T
    if bias:
        reference = reference + layer.bias.double()
    with torch.inference_mode():
        got = layer(x)
    assert got.shape == (*shape[:-1], 80) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5)


def test_faster_rows_keeps_what_was_timed_faster() -> None:
    rows = range(2, 9)
    weight = torch.randn(32, 16)
    assert faster_rows(weight, rows, _always({2, 5})) == {2, 5}
    assert faster_rows(weight, rows, _always(set())) == frozenset()


def test_tune_linears_changes_big_float32_layers_only_and_untuned_restores_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model = build_llama(0)
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    rows = range(2, 5)
    assert tune_linears(model, rows=rows, timer=_always({3})) == 0  # all below MIN_WEIGHT
    assert tune_linears(model, min_weight=0, rows=rows, timer=_always(set())) == 0  # none faster
    changed = tune_linears(model, min_weight=0, rows=rows, timer=_always({3}))
    assert changed == len(linears)
    assert all(getattr(m, "transposed_rows", None) == {3} for m in linears)
    with untuned(model):
        assert all(type(m) is torch.nn.Linear for m in linears)
    assert all(type(m) is TunedLinear for m in linears)
    fresh = build_llama(0)
    monkeypatch.setenv(DISABLE_ENV, "0")
    assert tune_linears(fresh, min_weight=0, rows=rows, timer=_always({3})) == 0


def _always(faster: set[int]) -> Callable[[Callable[[], object]], float]:
    """A timer that answers per row count however many shapes ask: the row count is read off
    the product's input as ``faster_rows`` builds it (torch's form first, then transposed)."""
    state = {"calls": 0}

    def timer(call: Callable[[], object]) -> float:
        out = call()
        assert isinstance(out, torch.Tensor)
        state["calls"] += 1
        transposed = state["calls"] % 2 == 0
        return 0.5 if transposed and out.shape[0] in faster else 1.0

    return timer


@pytest.mark.parametrize("batch", [1, 3])
def test_a_target_with_every_layer_transposed_decodes_as_hf_greedy(batch: int) -> None:
    tokenizer = build_char_tokenizer()
    stock = build_llama(0, init_range=0.3)
    model = copy.deepcopy(stock)
    draft = perturbed_copy(stock, 0.02, seed=1)
    target = TargetModel("tiny", model=model, tokenizer=tokenizer)
    assert tune_linears(model, min_weight=0, timer=_always(set(range(2, 17)))) > 0
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(batches="fixed"))
    engine = SpeculativeEngine(config, [ModelDrafter(draft, name="draft")], target)
    prompts = ["def f(x):", "for i in range(10):", "[1, 2, 3]", "print('hi')", "zz", "abcabc"]
    verdicts = []
    accepted = 0
    for start in range(0, len(prompts), batch):
        group = prompts[start : start + batch]
        result = engine.generate(group if batch > 1 else group[0], max_new_tokens=24)
        accepted += result.stats.accepted
        for prompt, tokens in zip(group, result.tokens, strict=True):
            ids = tokenizer(prompt)["input_ids"]
            with torch.inference_mode():
                out = stock.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=24,
                                     pad_token_id=0)  # fmt: skip
            reference = out[0, len(ids) :].tolist()
            eos = stock.generation_config.eos_token_id
            reference = reference[: reference.index(eos) + 1] if eos in reference else reference
            verdicts.append(compare_greedy(stock, ids, list(tokens), reference).status)
    assert "mismatch" not in verdicts, verdicts
    assert verdicts.count("tie") <= 1, verdicts
    assert accepted > 0  # verification took several rows: the transposed form ran


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_a_target_with_every_layer_transposed_samples_the_targets_distribution(
    temperature: float, top_p: float
) -> None:
    """Chi-squared of the first two emitted tokens against the exact distributions of the
    untouched target (``tests.helpers.distribution``), the verify's rows taking the transposed
    form."""
    stock, draft = distribution.models()
    model = copy.deepcopy(stock)
    assert tune_linears(model, min_weight=0, timer=_always(set(range(2, 17)))) > 0
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=4, temperature=temperature, top_p=top_p))
    engine = SpeculativeEngine(config, [ModelDrafter(draft)], TargetModel(model=model))
    first, second = distribution.sample_two(engine, 600, 2, seed=11)  # 2 rows x 5: 10 rows
    p_first, p_second = distribution.exact(temperature, top_p)
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name} token: chi2 {stat:.1f} >= {critical}"
