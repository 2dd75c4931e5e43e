"""The one default-drafter policy (``flashspec.drafters.default_drafters``): the Python API
(``SpeculativeEngine.from_pretrained``) and the command line and server
(``EngineOptions.build``) give an engine built without drafters the same ones."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

import flashspec.loading.drafts as drafts
from flashspec import SpeculativeEngine
from flashspec.drafters import FeatureDrafter, ModelDrafter, PromptLookupDrafter
from flashspec.drafters.shared_head import build_shared_head_draft, save_shared_head_draft
from flashspec.loading.drafts import model_fingerprint
from flashspec.options import EngineOptions
from tests.helpers.models import build_char_tokenizer, build_llama


def chosen(engine: SpeculativeEngine) -> list[tuple[str, str]]:
    return [(type(d).__name__, d.name) for d in engine.drafters]


def both(target: str) -> list[tuple[str, str]]:
    """The default drafters for ``target``, checked equal from both entries."""
    api = chosen(SpeculativeEngine.from_pretrained(target))
    assert chosen(EngineOptions(target=target).build()) == api
    return api


def saved_target(folder: Path) -> Any:
    model = build_llama(0)
    model.save_pretrained(folder)
    build_char_tokenizer().save_pretrained(folder)
    return model


def test_the_demo_target_drafts_with_the_demo_draft() -> None:
    assert both("demo") == [(ModelDrafter.__name__, "demo-draft")]


def test_another_target_drafts_by_prompt_lookup(tmp_path: Path) -> None:
    saved_target(tmp_path / "tiny")
    assert both(str(tmp_path / "tiny")) == [(PromptLookupDrafter.__name__, "prompt_lookup")]


def test_a_named_target_drafts_with_its_shipped_draft_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = saved_target(tmp_path / "tiny")
    vocab = int(model.config.vocab_size)
    draft = build_shared_head_draft(model, list(range(vocab)), layers=1, reads="features")
    save_shared_head_draft(draft, tmp_path / "drafts" / "tiny")
    name = str(tmp_path / "tiny")
    monkeypatch.setattr(drafts, "DRAFTS_DIR", tmp_path / "drafts")
    monkeypatch.setattr(drafts, "BUNDLED_DRAFTS", {name.lower(): "tiny"})
    assert both(name) == [
        (FeatureDrafter.__name__, f"{name.lower()}-draft"),
        (PromptLookupDrafter.__name__, "prompt_lookup"),
    ]


def test_another_file_of_a_shipped_drafts_model_drafts_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A target loaded by another name (another quantization of the model, say) whose width,
    depth and tokens are those the shipped draft's card records gets that draft; a card that
    records other tokens gives none."""
    model = saved_target(tmp_path / "tiny")
    vocab = int(model.config.vocab_size)
    draft = build_shared_head_draft(model, list(range(vocab)), layers=1, reads="features")
    folder = save_shared_head_draft(draft, tmp_path / "drafts" / "tiny")
    fits = model_fingerprint(model, build_char_tokenizer())
    (folder / drafts.CARD_FILE).write_text(json.dumps({drafts.FITS_KEY: fits}))
    monkeypatch.setattr(drafts, "DRAFTS_DIR", tmp_path / "drafts")
    monkeypatch.setattr(drafts, "BUNDLED_DRAFTS", {"tiny-named": "tiny"})
    model.save_pretrained(tmp_path / "copy")
    build_char_tokenizer().save_pretrained(tmp_path / "copy")
    with caplog.at_level(logging.INFO, logger="flashspec"):
        assert both(str(tmp_path / "copy")) == [
            (FeatureDrafter.__name__, "tiny-named-draft"),
            (PromptLookupDrafter.__name__, "prompt_lookup"),
        ]
    assert "the model of the draft shipped for 'tiny-named'" in caplog.text
    # Another tokenizer with the same sizes: the tokens differ, so no shipped draft.
    fits_other = dict(fits, tokens_sha256="0" * 64)
    (folder / drafts.CARD_FILE).write_text(json.dumps({drafts.FITS_KEY: fits_other}))
    assert both(str(tmp_path / "copy")) == [(PromptLookupDrafter.__name__, "prompt_lookup")]


def test_a_target_without_tokens_to_compare_gets_no_shipped_draft(tmp_path: Path) -> None:
    """A model given without a tokenizer has no fingerprint: no shipped draft, no error."""
    from flashspec import TargetModel
    from flashspec.loading.drafts import bundled_drafter

    target = TargetModel("tiny", model=build_llama(0))
    assert target.tokenizer is None
    assert bundled_drafter("not-a-named-target", target) is None
    with pytest.raises(ValueError, match="tokenizer"):
        model_fingerprint(target.model, None)
