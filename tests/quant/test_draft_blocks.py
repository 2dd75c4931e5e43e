"""A features draft beside a quantized target runs on Q8_0 blocks in the C decoder step
(``flashspec.quant.draft_blocks``): its blocks are GGML's Q8_0, the C step computes what the
draft's own modules compute on them, and the engine's output stays the target's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import numpy as np
import torch

import flashspec.quant.decoder as decoder_module
from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import FeatureDrafter
from flashspec.drafters.base import Proposal
from flashspec.drafters.shared_head import (
    build_shared_head_draft,
    load_shared_head_draft,
    save_shared_head_draft,
)
from flashspec.loading.drafts import shared_head_drafter
from flashspec.quant import QuantLinear
from flashspec.quant.decoder import fused_of
from flashspec.quant.draft_blocks import ENV, q8_0_blocks, run_on_blocks
from flashspec.trees import TreeShape
from tests.helpers.quant import (
    LOOKUP_PROMPTS,
    VARIANTS,
    assert_greedy_same,
    hf_greedy,
    make_files,
)

VARIANT = VARIANTS["Q4_1"]  # every projection quantized: the target runs the C step


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_files(tmp_path_factory.mktemp("draft-blocks-gguf"))


def test_q8_0_blocks_are_ggml_s_quantizer_s() -> None:
    """Bit for bit gguf-py's Q8_0 quantization: scales, halves rounded away from zero, an
    all-zero block, and values that land on 127 exactly."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(0)
    weight = rng.standard_normal((7, 96)).astype(np.float32)
    weight[1, :32] = 0.0
    weight[2, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves after scaling
    weight[3, 32:64] = 127.0 * np.sign(rng.standard_normal(32)).astype(np.float32)
    want = quantize(weight, GGMLQuantizationType.Q8_0)
    got = q8_0_blocks(torch.from_numpy(weight)).numpy()
    assert got.dtype == np.uint8 and got.shape == want.shape
    assert np.array_equal(got, want)
    with pytest.raises(ValueError, match="multiple of 32"):
        q8_0_blocks(torch.zeros(4, 40))


def _features_draft(model: Any, folder: Path) -> Path:
    torch.manual_seed(5)
    vocab = int(model.config.vocab_size)
    draft = build_shared_head_draft(model, list(range(vocab)), layers=1, reads="features")
    # Random layers draft at random. Small layers over an input that is mostly the target's
    # own state repeat the target's last prediction, which the tiny target's loops accept.
    with torch.no_grad():
        for p in draft.model.layers.parameters():
            if p.dim() > 1:
                p.mul_(0.05)
        hidden = int(model.config.hidden_size)
        proj = draft.fuse.proj
        proj.weight[:, :hidden] = torch.eye(hidden)
        proj.weight[:, hidden:] *= 0.05
        proj.bias.zero_()
    return save_shared_head_draft(draft, folder)


class Recording(FeatureDrafter):
    """A features drafter that records every proposal's tokens."""

    seen: list[list[list[int]]]

    def propose(self, ctx: Any, gamma: int) -> Proposal:
        proposal = super().propose(ctx, gamma)
        self.seen.append(proposal.tokens.tolist())
        return proposal


def _engine(target: TargetModel, draft: Any, tree: TreeShape | None = None) -> Any:
    drafter = Recording(draft, name="draft")
    drafter.seen = []
    gamma = 3 if tree is None else tree.depth
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=gamma), tree=tree)
    return SpeculativeEngine(config, [drafter], target), drafter


def _module_twin(folder: Path, loaded: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The same Q8_0 draft, run module by module (no C step for it), on its own target."""
    target = TargetModel(VARIANT.name, model=loaded.quantized()[0], tokenizer=loaded.tokenizer)
    monkeypatch.setenv(decoder_module.ENV, "0")
    draft = load_shared_head_draft(folder, target.model)
    assert not run_on_blocks(draft)  # quantized, but the C step is off
    monkeypatch.delenv(decoder_module.ENV)
    assert isinstance(draft.model.layers[0].mlp.up_proj, QuantLinear)
    assert fused_of(draft.model) is None
    return target, draft


def test_the_draft_runs_the_c_step_and_proposes_what_its_modules_would(
    files: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped-draft loader quantizes the draft and attaches the C step beside a quantized
    target; one row's proposals in every round (catch-up reads, drafts, drops) are those of
    the same Q8_0 draft run module by module, and the output is transformers' greedy one,
    alone and in a batch."""
    loaded = files(VARIANT)
    model, _ = loaded.quantized()
    target = TargetModel(VARIANT.name, model=model, tokenizer=loaded.tokenizer)
    folder = _features_draft(model, tmp_path / "draft")
    drafter = shared_head_drafter(folder, target)
    assert isinstance(drafter, FeatureDrafter)
    layer = drafter.draft.model.layers[0]
    assert isinstance(layer.mlp.up_proj, QuantLinear) and layer.mlp.up_proj.qtype == 8
    fused = fused_of(drafter.draft.model)
    assert fused is not None
    calls = {"n": 0}
    real_step = fused.step

    def counted(*args: Any, **kwargs: Any) -> bool:
        calls["n"] += 1
        return real_step(*args, **kwargs)

    monkeypatch.setattr(fused, "step", counted)
    fast, fast_drafter = _engine(target, drafter.draft)
    slow, slow_drafter = _engine(*_module_twin(folder, loaded, monkeypatch))
    accepted = 0
    for text in LOOKUP_PROMPTS:
        ids = loaded.tokenizer(text)["input_ids"]
        result = fast.generate(text, max_new_tokens=24)
        assert_greedy_same(loaded.reference, ids, result.tokens[0],
                           hf_greedy(loaded.reference, ids, 24))  # fmt: skip
        slow.generate(text, max_new_tokens=24)
        accepted += result.stats.accepted
    assert calls["n"] > 0 and accepted > 0, (calls, accepted)
    assert fast_drafter.seen == slow_drafter.seen
    # A batch's rows draft lengths chosen per row (from measured costs: not compared here).
    batch = fast.generate(LOOKUP_PROMPTS, max_new_tokens=12)
    for text, tokens in zip(LOOKUP_PROMPTS, batch.tokens, strict=True):
        ids = loaded.tokenizer(text)["input_ids"]
        assert_greedy_same(loaded.reference, ids, tokens, hf_greedy(loaded.reference, ids, 12))


def test_ragged_reads_through_the_c_step_equal_the_modules(
    files: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ragged reads (rows with dead leading columns), drafted columns dropped, and reads
    after: the draft's states through the C step equal its modules' within float32 sums."""
    loaded = files(VARIANT)
    model, _ = loaded.quantized()
    target = TargetModel(VARIANT.name, model=model, tokenizer=loaded.tokenizer)
    folder = _features_draft(model, tmp_path / "draft")
    fast = shared_head_drafter(folder, target)
    assert isinstance(fast, FeatureDrafter) and fused_of(fast.draft.model) is not None
    slow = FeatureDrafter(_module_twin(folder, loaded, monkeypatch)[1], name="slow")
    hidden = int(model.config.hidden_size)
    gen = torch.Generator().manual_seed(9)
    steps = [([0, 3, 5], 6), ([1, 0, 0], 2), ([0, 0, 1], 3)]  # (dead per row, columns)
    for drafter in (fast, slow):
        drafter.reset()
        drafter._kv.start(3, torch.device("cpu"))
    with torch.inference_mode():
        for dead, count in steps:
            features = torch.randn(3, count, hidden, generator=gen)
            tokens = torch.randint(0, 64, (3, count), generator=gen)
            got = fast._read_columns(features, tokens, dead)
            want = slow._read_columns(features, tokens, dead)
            for row, d in enumerate(dead):
                scale = float(want[row, d:].abs().max())
                assert float((got[row, d:] - want[row, d:]).abs().max()) <= 1e-5 * scale
            # One drafted column in every row, then dropped, as a round does.
            for drafter in (fast, slow):
                drafter._read_columns(features[:, -1:], tokens[:, -1:], [0, 0, 0])
                drafter._kv.drop(1)


def test_tree_rounds_with_the_draft_on_blocks_stay_exact(files: Any, tmp_path: Path) -> None:
    """Draft trees read with a per-node mask through the draft's C step: the output is
    transformers' greedy decoding."""
    loaded = files(VARIANT)
    model, _ = loaded.quantized()
    target = TargetModel(VARIANT.name, model=model, tokenizer=loaded.tokenizer)
    drafter = shared_head_drafter(_features_draft(model, tmp_path / "draft"), target)
    assert fused_of(drafter.draft.model) is not None
    engine, _ = _engine(target, drafter.draft, TreeShape(depth=3, nodes=8, top_k=3))
    for text in LOOKUP_PROMPTS:
        ids = loaded.tokenizer(text)["input_ids"]
        result = engine.generate(text, max_new_tokens=20)
        assert_greedy_same(loaded.reference, ids, result.tokens[0],
                           hf_greedy(loaded.reference, ids, 20))  # fmt: skip


def test_switched_off_the_draft_keeps_its_float_layers(
    files: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    loaded = files(VARIANT)
    model, _ = loaded.quantized()
    target = TargetModel(VARIANT.name, model=model, tokenizer=loaded.tokenizer)
    folder = _features_draft(model, tmp_path / "draft")
    monkeypatch.setenv(ENV, "0")
    drafter = shared_head_drafter(folder, target)
    assert isinstance(drafter, FeatureDrafter)
    assert type(drafter.draft.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert fused_of(drafter.draft.model) is None
