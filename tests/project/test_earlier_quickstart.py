"""The earlier FlashSpec library's quickstart runs unchanged (local paths for its hub ids).

Its calls are kept as its users wrote them, including the fields flashspec names differently
(``BanditConfig(n_arms=, strategy=)``, ``FlashSpecConfig(drafter_name=, target_name=,
max_new_tokens=)``). The output is checked against the target's own greedy decoding, with the
quickstart's temperature set to 0.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from flashspec.models import resolve_model_path


def run_quickstart(temperature: float) -> tuple[torch.Tensor, Any, str]:
    """The quickstart verbatim, hub ids replaced by the bundled demo pair's directories."""
    from transformers import AutoModelForCausalLM

    from flashspec import TRITON_AVAILABLE, BanditConfig, FlashSpecConfig, SamplingConfig
    from flashspec.bandit import UCB1Selector
    from flashspec.engine import SpeculativeEngine, TargetModel, load_drafters

    assert isinstance(TRITON_AVAILABLE, bool)
    drafter_id = resolve_model_path("demo-draft")
    target_id = resolve_model_path("demo")
    prompt = "def quicksort(arr):"

    config = FlashSpecConfig(device="cpu", dtype="float32", drafter_name=drafter_id,
        target_name=target_id, bandit=BanditConfig(n_arms=1, strategy="ucb1"),
        sampling=SamplingConfig(gamma=4, temperature=temperature), max_new_tokens=16)  # fmt: skip
    drafter_module = AutoModelForCausalLM.from_pretrained(drafter_id, torch_dtype=torch.float32).to(config.device)  # fmt: skip  # noqa: E501
    target_module = AutoModelForCausalLM.from_pretrained(target_id, torch_dtype=torch.float32).to(config.device)  # fmt: skip  # noqa: E501
    drafters = load_drafters([drafter_id], device=config.device, dtype=torch.float32,
        temperature=config.sampling.temperature, models={drafter_id: drafter_module})  # fmt: skip
    target = TargetModel(target_id, torch.device(config.device), torch.float32, model=target_module)  # fmt: skip  # noqa: E501
    engine = SpeculativeEngine(config, drafters, target,
        UCB1Selector(n_arms=1, window_size=config.bandit.window_size))  # fmt: skip
    result = engine.generate(prompt, max_new_tokens=16)
    new_ids = result.output_ids[0]; new_ids = new_ids[new_ids != -1]  # fmt: skip  # noqa: E702
    return new_ids, target_module, prompt


def test_quickstart_runs_and_samples() -> None:
    new_ids, target, _ = run_quickstart(1.0)
    assert 1 <= len(new_ids) <= 16
    assert all(0 <= int(t) < target.config.vocab_size for t in new_ids)


def test_quickstart_greedy_equals_the_target() -> None:
    from transformers import AutoTokenizer

    new_ids, target, prompt = run_quickstart(0.0)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("demo"))
    ids = torch.tensor([tokenizer(prompt)["input_ids"]])
    with torch.inference_mode():
        out = target.generate(ids, do_sample=False, max_new_tokens=16, pad_token_id=0)
    assert new_ids.tolist() == out[0, ids.shape[1] :].tolist()


def test_earlier_field_names() -> None:
    from flashspec import BanditConfig, FlashSpecConfig, SpeculativeEngine
    from flashspec.drafters import PromptLookupDrafter

    assert BanditConfig(strategy="thompson").selector == "thompson"
    with pytest.raises(ValueError, match="strategy='ucb1' and selector='thompson' disagree"):
        BanditConfig(strategy="ucb1", selector="thompson")
    with pytest.raises(ValueError, match=r"BanditConfig\.n_arms must be"):
        BanditConfig(n_arms=0)
    with pytest.raises(ValueError, match=r"FlashSpecConfig\.max_new_tokens must be"):
        FlashSpecConfig(max_new_tokens=-1)
    engine = SpeculativeEngine.from_pretrained(
        config=FlashSpecConfig(
            target_name=resolve_model_path("demo"),
            drafter_name="prompt_lookup",
            max_new_tokens=5,
        )
    )
    assert isinstance(engine.drafters[0], PromptLookupDrafter)
    assert len(engine.generate("def f(x):", ignore_eos=True).tokens[0]) == 5
    with pytest.raises(ValueError, match=r"n_arms is 3 but the engine has 1 arms"):
        SpeculativeEngine(
            FlashSpecConfig(bandit=BanditConfig(n_arms=3)), engine.drafters, engine.target
        )
    assert engine.model is engine.throughput  # the earlier attribute name


def test_ignored_settings_warn() -> None:
    from flashspec import BanditConfig, FlashSpecConfig, SamplingConfig, SpeculativeEngine
    from flashspec.drafters import PromptLookupDrafter

    engine = SpeculativeEngine.from_pretrained(drafters=["prompt_lookup"])
    drafters = [PromptLookupDrafter(), PromptLookupDrafter(max_ngram=2)]
    with pytest.warns(UserWarning, match="dynamic_gamma is ignored"):
        SpeculativeEngine(
            FlashSpecConfig(sampling=SamplingConfig(dynamic_gamma=True)), drafters, engine.target
        )
    with pytest.warns(UserWarning, match="exploration is ignored"):
        SpeculativeEngine(
            FlashSpecConfig(bandit=BanditConfig(selector="thompson", exploration=1.0)),
            drafters,
            engine.target,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # settings that are used warn about nothing
        SpeculativeEngine(
            FlashSpecConfig(
                sampling=SamplingConfig(dynamic_gamma=True),
                bandit=BanditConfig(selector="ucb1", exploration=1.0),
            ),
            drafters,
            engine.target,
        )
