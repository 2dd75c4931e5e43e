"""The lean Llama forward (``flashspec._lean``) gives transformers' own logits and cache bit for
bit: prompts with and without padding, ragged 2-D masks with dead columns in the middle,
explicit positions, several steps on one cache, GQA and plain heads, eager and sdpa attention;
and the engine on it stays greedy-identical to HF ``generate`` on transformers' forward."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec._lean import hf_forward, is_lean, make_lean
from flashspec.drafters import ModelDrafter
from flashspec.kv.compat import new_cache
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy


def _pair(attention: str = "sdpa", kv_heads: int = 2) -> tuple[Any, Any]:
    """(lean model, the same weights on transformers' forward)."""
    stock = build_llama(3, layers=3, hidden=64)
    if kv_heads != stock.config.num_key_value_heads:
        config = copy.deepcopy(stock.config)
        config.num_key_value_heads = kv_heads
        torch.manual_seed(3)
        stock = type(stock)(config).eval()
    stock.config._attn_implementation = attention
    lean = copy.deepcopy(stock)
    assert make_lean(lean) == 1
    assert is_lean(lean.model) and not is_lean(stock.model)
    return lean, stock


def _steps(model: Any, feeds: list[dict[str, torch.Tensor]]) -> tuple[list[torch.Tensor], Any]:
    cache = new_cache(model)
    outs = []
    with torch.inference_mode():
        for feed in feeds:
            outs.append(model(**feed, cache=cache, use_cache=True).logits)
    return outs, cache


def _feeds(kind: str) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(4, 40, (3, 30), generator=g)
    if kind == "plain":
        return [{"input_ids": ids[:1, :20]}, {"input_ids": ids[:1, 20:21]},
                {"input_ids": ids[:1, 21:26]}]  # fmt: skip
    if kind == "left-padded":
        mask = torch.ones(3, 30, dtype=torch.long)
        mask[1, :5] = 0
        mask[2, :11] = 0
        return [{"input_ids": ids[:, :20], "attention_mask": mask[:, :20]},
                {"input_ids": ids[:, 20:25], "attention_mask": mask[:, :25]}]  # fmt: skip
    # ragged: dead columns in the middle of rows, positions continuing each row's own count
    mask = torch.ones(3, 30, dtype=torch.long)
    mask[0, 12:15] = 0
    mask[2, 3:9] = 0
    alive = mask.cumsum(1) - 1
    return [
        {"input_ids": ids[:, :20], "attention_mask": mask[:, :20], "position_ids": alive[:, :20]},
        {"input_ids": ids[:, 20:24], "attention_mask": mask[:, :24],
         "position_ids": alive[:, 20:24]},
    ]  # fmt: skip


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("kv_heads", [2, 4])
@pytest.mark.parametrize("kind", ["plain", "left-padded", "ragged"])
def test_lean_forward_is_bitwise_transformers(attention: str, kv_heads: int, kind: str) -> None:
    lean, stock = _pair(attention, kv_heads)
    feeds = _feeds(kind)
    got, got_cache = _steps(lean, feeds)
    want, want_cache = _steps(stock, feeds)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    for layer_a, layer_b in zip(got_cache.layers, want_cache.layers, strict=True):
        assert torch.equal(layer_a.keys, layer_b.keys)
        assert torch.equal(layer_a.values, layer_b.values)


@pytest.mark.parametrize("kind", ["plain", "ragged"])
def test_embeddings_in_take_the_lean_path_bitwise(kind: str) -> None:
    """Inputs as embeddings (a features draft's fused inputs) run the lean path too, with
    transformers' logits bit for bit; no layer module is called."""
    lean, stock = _pair()
    calls: list[int] = []
    lean.model.layers[0].register_forward_hook(lambda *a: calls.append(1))
    feeds = [
        {**{k: v for k, v in feed.items() if k != "input_ids"},
         "inputs_embeds": stock.model.embed_tokens(feed["input_ids"]).detach() * 0.5}
        for feed in _feeds(kind)
    ]  # fmt: skip
    got, _ = _steps(lean, feeds)
    want, _ = _steps(stock, feeds)
    assert calls == []
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()


def test_lean_path_is_taken_and_hooks_fire() -> None:
    lean, _ = _pair()
    seen: list[tuple[int, ...]] = []
    lean.model.norm.register_forward_hook(lambda m, a, out: seen.append(tuple(out.shape)))
    calls: list[int] = []
    layer = lean.model.layers[0]
    layer.register_forward_hook(lambda *a: calls.append(1))  # a layer call: transformers' path
    with torch.inference_mode():
        lean(input_ids=torch.tensor([[5, 6, 7]]), cache=new_cache(lean), use_cache=True)
    assert seen == [(1, 3, 64)] and calls == []
    with torch.inference_mode():  # asked for hidden states: transformers' own forward
        out = lean(input_ids=torch.tensor([[5, 6]]), output_hidden_states=True)
    assert calls == [1] and out.hidden_states is not None
    with hf_forward(lean), torch.inference_mode():
        lean(input_ids=torch.tensor([[5]]), cache=new_cache(lean), use_cache=True)
    assert calls == [1, 1]
    assert is_lean(lean.model)  # lean again after the block


def test_disabled_by_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLASHSPEC_LEAN_FORWARD", "0")
    model = build_llama(1)
    assert make_lean(model) == 0
    assert not is_lean(model.model)


def test_engine_on_lean_models_equals_hf_generate() -> None:
    target = build_llama(11, layers=3)
    reference = copy.deepcopy(target)  # never made lean
    draft = perturbed_copy(target, 0.02, seed=4)
    tok = build_char_tokenizer()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
        [ModelDrafter(draft, name="draft")],
        TargetModel("tiny", model=target, tokenizer=tok),
    )
    assert is_lean(engine.target.model.model)
    prompts = ["def f(x):", "hello world", "abcabcabc"]
    for text in prompts:
        ids = torch.tensor([tok.encode(text)])
        result = engine.generate(input_ids=ids, max_new_tokens=24)
        with torch.inference_mode():
            want = reference.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
        assert list(result.tokens[0]) == want[: len(result.tokens[0])]
