"""scripts/train_draft.py on a tiny target: the draft learns (its expected acceptance on held-out
text rises), a rerun resumes from the checkpoint, and the saved draft loads onto the target.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import build_llama

from flashspec.shared_head import load_shared_head_draft

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "train_draft.py"
pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="no scripts/ in this tree")

TEXTS = [
    "def add(a, b):\n    return a + b\n\n" * 30,
    "for i in range(10):\n    print(i)\n\n" * 30,
    "class A:\n    def f(self, x):\n        return x\n\n" * 30,
]
HELD = ["def sub(a, b):\n    return a - b\n\n" * 20]


def script() -> Any:
    spec = importlib.util.spec_from_file_location("train_draft", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_draft"] = module
    spec.loader.exec_module(module)
    return module


def settings(out: Path, seconds: float) -> argparse.Namespace:
    return argparse.Namespace(
        target="tiny", out=out, minutes=seconds / 60, layers=1, vocab=24, length=32, batch=4,
        lr=3e-3, dtype="float32", seed=0,
    )  # fmt: skip


def test_the_draft_learns_resumes_and_loads(tmp_path: Path, char_tokenizer: Any) -> None:
    train_draft = script()
    target = build_llama(0, init_range=0.3)
    out = tmp_path / "draft"
    first = train_draft.train(settings(out, 4), target, char_tokenizer, TEXTS, HELD)
    before, after = first["held_out_before"], first["held_out"]
    assert first["steps"] > 5
    assert after["expected_acceptance_t1"] > before["expected_acceptance_t1"] + 0.05, first
    assert 0 < after["subset_covers_greedy"] <= 1 and first["subset_tokens"] >= 24
    second = train_draft.train(settings(out, 8), target, char_tokenizer, TEXTS, HELD)
    assert second["steps"] > first["steps"] and second["held_out_before"] == before  # resumed
    draft = load_shared_head_draft(out, target)
    with torch.inference_mode():
        logits = draft(torch.tensor([char_tokenizer(HELD[0][:40])["input_ids"]])).logits
    assert torch.isneginf(logits).any() and torch.isfinite(logits).any()
