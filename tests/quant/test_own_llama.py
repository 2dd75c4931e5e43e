"""``flashspec.quant.llama``: a quantized Llama without transformers' modeling code.

Checked against transformers' own classes (the independent reference): the rotary tables and
the RMS norm bit for bit; a quantized load's logits through the C step and through transformers'
model over the same modules (hidden states asked for, a static cache); that a load from the
metadata cache and a greedy generation import none of ``transformers.modeling_utils``,
``modeling_llama`` or ``torch._dynamo`` (a fresh interpreter); that ``FLASHSPEC_OWN_LLAMA=0``
and configs the module does not repeat get transformers' class.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import torch

import flashspec.quant.ops as quant_ops
from flashspec.quant.decoder import _STORE_ATTR
from flashspec.quant.llama import (
    ENV,
    FusedLlamaForCausalLM,
    RMSNorm,
    RotaryEmbedding,
    fits,
)
from tests.helpers.quant import (
    LOOKUP_PROMPTS,
    MIXED,
    RELATIVE,
    VARIANTS,
    assert_greedy_same,
    hf_greedy,
    make_files,
    max_relative,
)

if not quant_ops.available():
    pytest.skip("flashspec._quant is not built", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
FUSED = VARIANTS["Q4_1"]  # every projection on blocks: the C step runs every layer


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_files(tmp_path_factory.mktemp("own-llama"))


def llama_config(**changes: Any) -> Any:
    from transformers import LlamaConfig

    settings: dict[str, Any] = dict(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, rms_norm_eps=1e-5,
    )  # fmt: skip
    settings.update(changes)
    return LlamaConfig(**settings)


def test_rotary_and_norm_equal_transformers_bit_for_bit() -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding

    config = llama_config(rope_theta=123456.0)
    theirs = LlamaRotaryEmbedding(config)
    ours = RotaryEmbedding(config.hidden_size // config.num_attention_heads, 123456.0)
    assert torch.equal(ours.inv_freq, theirs.inv_freq)
    generator = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4000, (3, 9), generator=generator)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, 9, 64, generator=generator).to(dtype)
        for got, want in zip(ours(x, positions), theirs(x, positions), strict=True):
            assert got.dtype == want.dtype == dtype
            assert torch.equal(got, want)
        norm, reference = RMSNorm(64, 1e-5), LlamaRMSNorm(64, eps=1e-5)
        with torch.no_grad():
            weight = torch.randn(64, generator=generator)
            norm.weight.copy_(weight)
            reference.weight.copy_(weight)
        assert torch.equal(norm(x), reference(x))


def test_fits_names_what_it_does_not_repeat() -> None:
    assert fits(llama_config()) is None
    assert "RoPE" in str(fits(llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0})))
    assert "activation" in str(fits(llama_config(hidden_act="gelu")))
    assert "biases" in str(fits(llama_config(attention_bias=True)))
    assert "model_type" in str(fits(type("C", (), {"model_type": "qwen2"})()))
    with pytest.raises(ValueError, match="RoPE"):
        FusedLlamaForCausalLM(llama_config(rope_scaling={"rope_type": "linear", "factor": 2.0}))


def test_quantized_llama_is_the_own_class_and_env_turns_it_off(
    files: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from transformers import LlamaForCausalLM

    loaded = files(FUSED)
    model, _ = loaded.quantized()
    assert type(model) is FusedLlamaForCausalLM
    monkeypatch.setenv(ENV, "0")
    model, _ = loaded.quantized()
    assert type(model) is LlamaForCausalLM


def test_layers_the_c_step_does_not_run_get_transformers_class(files: Any) -> None:
    """SmolLM2's mix with float32 attention: no fused step, so transformers' own model."""
    from transformers import LlamaForCausalLM

    model, _ = files(MIXED).quantized()
    assert type(model) is LlamaForCausalLM


def test_transformers_model_over_the_same_modules(files: Any) -> None:
    """Calls the C step does not take run transformers' model over the very same modules: the
    same logits as transformers' dequantized load, and as the C step's."""
    from transformers import DynamicCache, StaticCache

    loaded = files(FUSED)
    model, _ = loaded.quantized()
    assert type(model) is FusedLlamaForCausalLM
    ids = torch.tensor([loaded.tokenizer(LOOKUP_PROMPTS[1])["input_ids"]])
    with torch.inference_mode():
        want = loaded.reference(ids).logits
        cache = DynamicCache(config=model.config)
        fused = model(ids, past_key_values=cache).logits
        states = model(ids, output_hidden_states=True)
        static = model(ids, past_key_values=StaticCache(config=model.config, max_cache_len=64))
    assert _STORE_ATTR in cache.__dict__  # the C step ran that call
    twin = model.transformers_model()
    assert twin is model.transformers_model()  # built once
    assert twin.lm_head is model.lm_head and twin.model.layers[1].mlp is not None
    assert twin.model.layers[1].mlp.down_proj is model.model.layers[1].mlp.down_proj
    assert len(states.hidden_states) == model.config.num_hidden_layers + 1
    for got in (fused, states.logits, static.logits):
        assert got.shape == want.shape
        assert max_relative(got, want) <= RELATIVE
    assert max_relative(states.logits, fused) <= RELATIVE


_FRESH = """
import json, sys
from flashspec.flags.options import EngineOptions
engine = EngineOptions(target=sys.argv[1], drafter="prompt-lookup").build()
result = engine.generate(sys.argv[2], max_new_tokens=12)
model = engine.target.model
print(json.dumps({
    "type": type(model).__name__,
    "prompt": engine.tokenizer(sys.argv[2])["input_ids"],
    "tokens": result.tokens[0],
    "imported": sorted(name for name in ("transformers.modeling_utils",
        "transformers.models.llama.modeling_llama", "torch._dynamo") if name in sys.modules),
}))
"""


def test_cached_load_and_generation_import_no_modeling_code(tmp_path: Path) -> None:
    """A fresh interpreter loads the file (its metadata cached by a first load) and generates
    without importing transformers' modeling code or torch's compiler."""
    from tests.helpers.gguf import transformers_gguf_load

    path = FUSED.write(tmp_path)
    env = {**os.environ, "FLASHSPEC_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}  # fmt: skip
    env.pop(ENV, None)
    runs = []
    for _ in range(2):  # the first load writes the metadata cache, the second reads it
        done = subprocess.run(
            [sys.executable, "-c", _FRESH, str(path), LOOKUP_PROMPTS[0]],
            capture_output=True, text=True, env=env, timeout=300, check=False,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[1]["type"] == "FusedLlamaForCausalLM"
    assert runs[1]["imported"] == [], runs[1]
    reference, _ = transformers_gguf_load(path)
    want = hf_greedy(reference, runs[1]["prompt"], 12)
    for run in runs:
        assert_greedy_same(reference, run["prompt"], run["tokens"], want)
