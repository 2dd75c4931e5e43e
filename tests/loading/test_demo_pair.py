"""The bundled demo pair: present, small, loadable offline, and lossless under the engine.

The second bundled drafter, ``draft3`` (3 layers, ``"demo-draft3"``), is held to the same checks.

Greedy speculative output must equal the target's own greedy ``generate`` token for token; a
difference is accepted only where the target's top two logits at the first differing position are
within 1e-4 (a floating-point tie between one k-token forward and k one-token forwards).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine  # noqa: E402
from flashspec.drafters import ModelDrafter  # noqa: E402
from flashspec.models import DEMO_DIR, DEMO_DRAFT3_NAME, resolve_model_path  # noqa: E402

TARGET, DRAFT, DRAFT3 = DEMO_DIR / "target", DEMO_DIR / "draft", DEMO_DIR / "draft3"
TIE = 1e-4
MAX_NEW = 40
PROMPTS = [
    "def quicksort(arr):",
    "import os\n\n\ndef main():\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):",
    "    for key, value in sorted(",
]


@cache
def demo_engine(drafter: str = "demo-draft") -> SpeculativeEngine:
    return SpeculativeEngine.from_pretrained(
        target="demo",
        drafters=[drafter],
        config=FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
    )


def test_names_resolve_to_the_bundled_pair() -> None:
    assert Path(resolve_model_path(None)) == TARGET
    assert Path(resolve_model_path("demo")) == TARGET
    assert Path(resolve_model_path("demo-draft")) == DRAFT
    assert DEMO_DRAFT3_NAME == "demo-draft3"
    assert Path(resolve_model_path("demo-draft3")) == DRAFT3
    assert resolve_model_path("some/hub-id") == "some/hub-id"


@pytest.mark.parametrize("name", ["demo-draft", "demo-draft3"])
def test_missing_demo_drafter_is_a_clear_error(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashspec.loading.pretrained

    monkeypatch.setattr(flashspec.loading.pretrained, "DEMO_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"bundled demo model is missing .*drafters="):
        resolve_model_path(name)


def test_files_and_size_budget() -> None:
    for model_dir in (TARGET, DRAFT, DRAFT3):
        for name in ("config.json", "model.safetensors", "generation_config.json"):
            assert (model_dir / name).is_file(), f"{model_dir / name} missing"
        assert (model_dir / "tokenizer.json").is_file()
    total = sum(f.stat().st_size for f in DEMO_DIR.rglob("*") if f.is_file())
    assert total <= 30_000_000, f"demo pair is {total / 1e6:.1f} MB, budget 30 MB"


def test_card_reports_the_measurements() -> None:
    card = json.loads((DEMO_DIR / "card.json").read_text())
    measured = card["measured"]
    assert set(measured["held_out_loss"]) >= {"target", "draft"}
    assert 0 < measured["draft_target_cost_ratio"] <= 1 / 6
    assert 0 <= measured["greedy_acceptance"]["acceptance_rate"] <= 1
    assert card["data"]["held_out_files_count"] == len(card["held_out_files"]) > 0
    assert card["plan"]["target_steps"] > 0 and card["training"]["target"]["wall_s"] > 0


def test_card_reports_the_second_drafter() -> None:
    card = json.loads((DEMO_DIR / "card.json").read_text())
    entry = card["draft3"]
    assert entry["plan"]["draft2_layers"] == 3 and entry["plan"]["draft2_steps"] > 0
    assert "scripts/train_demo_pair.py" in entry["command"] and entry["wall_s"] > 0
    measured = entry["measured"]
    assert set(measured["held_out_loss"]) >= {"target", "draft"}
    # A different arm: dearer than the 1-layer draft, still well below the target's cost.
    assert card["measured"]["draft_target_cost_ratio"] < measured["draft_target_cost_ratio"] < 1
    assert 0 <= measured["greedy_acceptance"]["acceptance_rate"] <= 1
    assert "draft3" in (DEMO_DIR / "CARD.md").read_text()


def test_second_drafter_shares_the_targets_tokenizer() -> None:
    from transformers import AutoConfig

    target, draft3 = AutoConfig.from_pretrained(TARGET), AutoConfig.from_pretrained(DRAFT3)
    assert draft3.num_hidden_layers == 3 != target.num_hidden_layers
    assert draft3.hidden_size == target.hidden_size
    assert draft3.vocab_size == target.vocab_size
    assert (DRAFT3 / "tokenizer.json").read_bytes() == (TARGET / "tokenizer.json").read_bytes()


def test_loads_offline_with_plain_transformers() -> None:
    # A fresh interpreter: HF_HUB_OFFLINE is read when huggingface_hub is imported.
    code = (
        "import sys, torch\n"
        "from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        "for path in sys.argv[1:]:\n"
        "    model = AutoModelForCausalLM.from_pretrained(path)\n"
        "    tok = AutoTokenizer.from_pretrained(path)\n"
        "    assert model.dtype == torch.float32, model.dtype\n"
        "    assert model.config.vocab_size == len(tok), (model.config.vocab_size, len(tok))\n"
        "    ids = tok('def f(x):', return_tensors='pt')['input_ids']\n"
        "    assert ids[0, 0].item() == tok.bos_token_id\n"
        "    assert torch.isfinite(model(input_ids=ids).logits).all()\n"
        "print('ok')\n"
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", code, str(TARGET), str(DRAFT), str(DRAFT3)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "ok"


@pytest.mark.parametrize("drafter", ["demo-draft", "demo-draft3"])
def test_pair_shares_one_vocabulary(drafter: str) -> None:
    engine = demo_engine(drafter)
    assert isinstance(engine.drafters[0], ModelDrafter)
    assert engine.drafters[0].lm.vocab_size == engine.target.vocab_size


def test_second_drafter_loads_by_name() -> None:
    drafter = demo_engine("demo-draft3").drafters[0]
    assert isinstance(drafter, ModelDrafter)
    assert Path(str(drafter.lm.model.config.name_or_path)) == DRAFT3
    assert drafter.lm.model.config.num_hidden_layers == 3


def test_from_pretrained_without_arguments_uses_the_pair() -> None:
    engine = SpeculativeEngine.from_pretrained()
    assert Path(str(engine.target.model.config.name_or_path)) == TARGET
    drafter = engine.drafters[0]
    assert isinstance(drafter, ModelDrafter)
    assert Path(str(drafter.lm.model.config.name_or_path)) == DRAFT


def _first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _top2_gap(model: Any, ids: list[int]) -> float:
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    top = logits.topk(2).values
    return float(top[0] - top[1])


@pytest.mark.parametrize(
    ("drafter", "prompt"),
    [("demo-draft", prompt) for prompt in PROMPTS]
    + [("demo-draft3", prompt) for prompt in PROMPTS[:2]],
)
def test_greedy_output_equals_target_generate(drafter: str, prompt: str) -> None:
    engine = demo_engine(drafter)
    result = engine.generate(prompt, max_new_tokens=MAX_NEW)
    ours = result.tokens[0]

    tokenizer, model = engine.tokenizer, engine.target.model
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    eos = engine.target.eos_token_ids
    with torch.inference_mode():
        output = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=eos,
            pad_token_id=eos[0],
        )
    reference = output[0, ids.shape[1] :].tolist()

    at = _first_difference(ours, reference)
    if at is not None:
        assert at < min(len(ours), len(reference)), (ours, reference)
        gap = _top2_gap(model, ids[0].tolist() + reference[:at])
        assert gap < TIE, f"greedy outputs differ at token {at} with a top-2 logit gap of {gap}"
    assert result.stats.drafted > 0
