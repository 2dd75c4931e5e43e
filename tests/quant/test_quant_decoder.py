"""The fused quantized decoder step (``flashspec.quant.decoder``, ``ext/quant_step.c``).

Each tiny Llama GGUF is written by the test with every projection quantized (grouped-query
attention: 4 heads over 2 key/value heads). The references share no code with the C step:
transformers' own load of the same file (gguf-py dequantizes it) run over the whole sequence
without a cache, and the float64 decoder of ``wheels/check_kernel.py`` on random layers,
caches and rotary tables. Checked, on every backend: logits of a prefill and steps of 1, 5 and 3
positions with a rollback between them within 1e-4 of the largest; that the C step really ran
and keeps the cache in its store (views, no copy); a prompt longer than one C call; a cache
that transformers' own forward replaced, copied back in; greedy identity with ``generate``
and through the speculative engine; the models it must leave alone; bad arguments refused
with errors that name them; token trees (a 4-D mask, a mask row per query) equal to the
module-by-module forward, each node equal to its path fed as a chain, on every backend.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import numpy as np
import torch

import flashspec.quant.decoder as decoder
import flashspec.quant.ops as quant_ops
import flashspec.quant.threads as quant_threads
from flashspec import (
    BanditConfig,
    FlashSpecConfig,
    PromptLookupDrafter,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec._greedy import compare_greedy
from flashspec._lean import hf_forward
from flashspec.models import Padding
from tests.helpers.chi2 import assert_first_two_follow
from tests.helpers.drafters import CutLookup
from tests.helpers.gguf import EOS_ID
from tests.helpers.quant import (
    LOOKUP_PROMPTS,
    MIXED,
    Q4_K_M,
    RELATIVE,
    Variant,
    every_matrix,
    exact_first_two,
    hf_greedy,
    make_files,
    max_relative,
)

if not quant_ops.available():
    pytest.skip("flashspec._quant is not built", allow_module_level=True)

PROMPTS = LOOKUP_PROMPTS[:2]
# head_dim 16 (64 wide) and 64 (256 wide: the K formats' block, and SmolLM2's head size).
VARIANTS = [every_matrix("Q8_0"), every_matrix("Q4_1"), every_matrix("Q4_K"), Q4_K_M]
DENSE_ATTENTION = MIXED  # SmolLM2's mix: the feed-forward quantized, attention float32


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return make_files(tmp_path_factory.mktemp("fused-gguf"))


class Counting:
    """``flashspec._quant`` with its ``decoder_step`` calls counted."""

    def __init__(self) -> None:
        self.steps = 0
        self.module = quant_ops.kernels()
        self.stores: list[tuple[int, int]] = []  # (rows, address) of each step's cache array

    def __getattr__(self, name: str) -> Any:
        return getattr(self.module, name)

    def decoder_step(self, *args: Any) -> None:
        self.steps += 1
        kv = args[4]
        self.stores.append((kv.shape[2], kv.__array_interface__["data"][0]))
        self.module.decoder_step(*args)


@pytest.fixture
def counting(monkeypatch: pytest.MonkeyPatch) -> Counting:
    counter = Counting()
    monkeypatch.setattr(decoder, "kernels", lambda: counter)
    return counter


@pytest.fixture
def every_backend() -> Any:
    """Runs the test body once per backend the CPU has (scalar C, AVX2, AVX-512)."""
    kernels = quant_ops.kernels()
    before = kernels.backend()
    yield kernels.available_backends()
    kernels.set_backend(before)


def inner(model: Any) -> Any:
    return model.model


def reference_logits(reference: Any, ids: list[int], last: int) -> torch.Tensor:
    with torch.inference_mode():
        return reference(torch.tensor([ids])).logits[:, -last:]


def run_steps(target: TargetModel, prompt: list[int], steps: list[list[int]]) -> list[Any]:
    """Prefill, then each step (after the second, a rollback of 2 positions): the logits of
    each call with the token ids that led to them."""
    pad = Padding(torch.zeros(1, dtype=torch.int64))
    target.reset()
    seen = list(prompt)
    out = []
    with torch.inference_mode():
        out.append((list(seen), target.forward(torch.tensor([prompt]), pad, len(prompt))))
        for index, step in enumerate(steps):
            seen += step
            out.append((list(seen), target.forward(torch.tensor([step]), pad, len(step))))
            if index == 1:
                target.rollback(len(seen) - 2)
                seen = seen[:-2]
    return out


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_steps_match_dequantized_load_on_every_backend(
    variant: Variant, files: Any, counting: Counting, every_backend: list[str]
) -> None:
    loaded = files(variant)
    model, _ = loaded.quantized()
    assert decoder.fused_of(inner(model)) is not None
    if variant is Q4_K_M:  # the plan takes the file's Q5_0 blocks as they are (no repack)
        first = inner(model).layers[0]
        assert [first.self_attn.q_proj.qtype, first.mlp.gate_proj.qtype] == [6, 6]
    target = TargetModel(variant.name, model=model, tokenizer=loaded.tokenizer)
    vocab = loaded.reference.config.vocab_size
    generator = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (9,), generator=generator).tolist()
    steps = [torch.randint(0, vocab, (m,), generator=generator).tolist() for m in (1, 5, 3, 1)]
    for backend in every_backend:
        quant_ops.kernels().set_backend(backend)
        counting.steps = 0
        for ids, logits in run_steps(target, prompt, steps):
            want = reference_logits(loaded.reference, ids, logits.shape[1])
            error = max_relative(logits, want)
            assert error <= RELATIVE, f"{backend} after {len(ids)} tokens: relative {error:.2e}"
        assert counting.steps == 1 + len(steps), backend


def test_cache_lives_in_the_store_and_is_copied_back_after_another_path(
    files: Any, counting: Counting, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decoder, "CHUNK_ROWS", 64)  # the tiny model's context is 256
    loaded = files(VARIANTS[1])
    model, _ = loaded.quantized()
    target = TargetModel("q", model=model, tokenizer=loaded.tokenizer)
    vocab = loaded.reference.config.vocab_size
    generator = torch.Generator().manual_seed(2)
    # A prompt longer than one C call takes (two pieces), fused steps, one step through
    # transformers' own forward (its torch.cat replaces every layer's tensors), then fused
    # steps that must copy the cache back into the store.
    prompt = torch.randint(0, vocab, (decoder.CHUNK_ROWS + 37,), generator=generator).tolist()
    sizes = [1, 2, 1, 3, 1, 4]
    through_hf = 3
    steps = [torch.randint(0, vocab, (m,), generator=generator).tolist() for m in sizes]
    pad = Padding(torch.zeros(1, dtype=torch.int64))
    target.reset()
    seen = list(prompt)
    with torch.inference_mode():
        logits = target.forward(torch.tensor([prompt]), pad, 3)
        assert max_relative(logits, reference_logits(loaded.reference, seen, 3)) <= RELATIVE
        assert counting.steps == 2
        for index, step in enumerate(steps):
            seen += step
            with hf_forward(model) if index == through_hf else contextlib.nullcontext():
                logits = target.forward(torch.tensor([step]), pad, len(step))
            want = reference_logits(loaded.reference, seen, len(step))
            assert max_relative(logits, want) <= RELATIVE, len(seen)
            store = target.cache.__dict__.get("_flashspec_kv")
            layer = target.cache.layers[0]
            in_store = store is not None and layer.keys.data_ptr() == store.pointers[0]
            assert in_store == (index != through_hf), index
            assert layer.keys.shape[-2] == len(seen)
    assert counting.steps == 2 + len(sizes) - 1


def test_a_layer_given_tensors_of_its_own_is_read_from_them_not_the_store(
    files: Any, counting: Counting
) -> None:
    # A step that finds every layer holding the views the last step left trusts the store;
    # one layer given tensors of its own (here copies, while the store's columns of that
    # layer are wiped) must be copied back in, not read stale.
    loaded = files(VARIANTS[1])
    model, _ = loaded.quantized()
    target = TargetModel("q", model=model, tokenizer=loaded.tokenizer)
    vocab = loaded.reference.config.vocab_size
    generator = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, vocab, (12,), generator=generator).tolist()
    first, second = torch.randint(0, vocab, (2,), generator=generator).tolist()
    pad = Padding(torch.zeros(1, dtype=torch.int64))
    target.reset()
    with torch.inference_mode():
        target.forward(torch.tensor([prompt]), pad, 1)
        target.forward(torch.tensor([[first]]), pad, 1)
        store = target.cache.__dict__["_flashspec_kv"]
        layer = target.cache.layers[-1]
        layer.keys, layer.values = layer.keys.clone(), layer.values.clone()
        store.buf[-2:].zero_()
        logits = target.forward(torch.tensor([[second]]), pad, 1)
    want = reference_logits(loaded.reference, [*prompt, first, second], 1)
    assert max_relative(logits, want) <= RELATIVE
    assert counting.steps == 3


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: v.name)
def test_greedy_equals_dequantized_generate(
    variant: Variant, files: Any, counting: Counting
) -> None:
    """``generate`` on the quantized model (a mask of ones: the C step), and the speculative
    engine with prompt lookup (verifications of gamma + 1 rows and rollbacks), against the
    dequantized model's ``generate``, under the tie rule of ``flashspec._greedy``."""
    loaded = files(variant)
    model, _ = loaded.quantized()
    target = TargetModel(variant.name, model=model, tokenizer=loaded.tokenizer)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)), [PromptLookupDrafter()], target
    )
    for text in PROMPTS:
        ids = loaded.tokenizer(text)["input_ids"]
        want = hf_greedy(loaded.reference, ids, 40)
        for got in (hf_greedy(model, ids, 40), engine.generate(text, max_new_tokens=40).tokens[0]):
            verdict = compare_greedy(loaded.reference, ids, got, want)
            assert verdict.status != "mismatch", (verdict.at, verdict.gap, got, want)
    assert counting.steps > 40


def test_dense_attention_keeps_the_torch_path(files: Any) -> None:
    dense, _ = files(DENSE_ATTENTION).quantized()
    assert decoder.fused_of(inner(dense)) is None  # attention stayed float32: no plan


@pytest.mark.parametrize("variant", VARIANTS[1:], ids=lambda v: v.name)
def test_ragged_batches_take_the_c_step_and_every_row_equals_its_own_generate(
    variant: Variant, files: Any, counting: Counting
) -> None:
    """Prompts of different lengths in one ragged batch of the speculative engine (left
    padding, rows accepting different counts: dead columns the mask hides, compaction, rows
    finishing early) and HF's padded ``generate`` on the quantized model: every row equal to
    the dequantized model's ``generate`` of that prompt alone, with every forward batched in
    the C step."""
    loaded = files(variant)
    model, _ = loaded.quantized()
    target = TargetModel(variant.name, model=model, tokenizer=loaded.tokenizer)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)), [PromptLookupDrafter()], target
    )
    prompts = [loaded.tokenizer(text)["input_ids"] for text in LOOKUP_PROMPTS]
    assert len({len(p) for p in prompts}) > 1
    limits = [40, 25, 40]
    result = engine.generate(prompts, max_new_tokens=limits)
    assert result.stats.rounds > 0 and counting.steps >= result.stats.rounds
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[EOS_ID] * (width - len(p)) + p for p in prompts])
    mask = torch.arange(width) >= torch.tensor([width - len(p) for p in prompts])[:, None]
    counting.steps = 0
    with torch.inference_mode():
        padded = model.generate(ids, attention_mask=mask.long(), do_sample=False,
                                max_new_tokens=20, pad_token_id=EOS_ID)  # fmt: skip
    assert counting.steps == padded.shape[1] - width
    for row, (prompt, limit) in enumerate(zip(prompts, limits, strict=True)):
        want = hf_greedy(loaded.reference, prompt, limit)
        tail = padded[row, width:].tolist()
        tail = tail[: tail.index(EOS_ID) + 1] if EOS_ID in tail else tail
        for got in (result.tokens[row], tail):
            verdict = compare_greedy(loaded.reference, prompt, got, want[: len(got)])
            assert verdict.status != "mismatch", (row, verdict.at, got, want)


def test_rows_drafting_different_lengths_in_the_c_step_equal_their_own_generate(
    files: Any, counting: Counting
) -> None:
    """Rows proposing 0 to gamma drafts in one verification: the C step skips each row's dead
    draft columns (no product reads them), and every row still equals its own ``generate``."""
    loaded = files(VARIANTS[1])
    model, _ = loaded.quantized()
    target = TargetModel("q", model=model, tokenizer=loaded.tokenizer)
    drafter = CutLookup()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4), bandit=BanditConfig(batches="fixed")),
        [drafter],
        target,
    )
    prompts = [loaded.tokenizer(text)["input_ids"] for text in LOOKUP_PROMPTS]
    result = engine.generate(prompts, max_new_tokens=30)
    assert any(0 in lengths and max(lengths) > 0 for lengths in drafter.lengths)
    assert counting.steps >= result.stats.rounds > 0
    for row, prompt in enumerate(prompts):
        got = result.tokens[row]
        want = hf_greedy(loaded.reference, prompt, 30)
        verdict = compare_greedy(loaded.reference, prompt, got, want)
        assert verdict.status != "mismatch", (row, verdict.at, got, want)


def test_a_row_joining_a_running_quantized_batch_equals_its_own_generate(
    files: Any, counting: Counting
) -> None:
    """Continuous batching on the C step: a prompt joins after the first round (its prefill
    read into a running batch, the store rebuilt for three rows), and a row that finishes
    early leaves (rebuilt again for two, in the buffer it had: no new allocation); every row
    equal to the dequantized model's ``generate`` of its prompt alone."""
    loaded = files(VARIANTS[1])
    model, _ = loaded.quantized()
    target = TargetModel("q", model=model, tokenizer=loaded.tokenizer)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)), [PromptLookupDrafter()], target
    )
    prompts = [loaded.tokenizer(text)["input_ids"] for text in LOOKUP_PROMPTS]
    stream = engine.stream(prompts[:2], max_new_tokens=[30, 8])
    joined = None
    for _ in stream:
        if joined is None:
            joined = stream.join(prompts[2], 30)
    assert joined == 2 and stream.result is not None
    assert counting.steps >= stream.result.stats.rounds
    assert target.cache.__dict__.get("_flashspec_kv") is not None
    rows_at = {}
    for rows, address in counting.stores:
        rows_at.setdefault(address, set()).add(rows)
    assert any(len(rows) > 1 for rows in rows_at.values()), counting.stores
    for row, (prompt, limit) in enumerate(zip(prompts, [30, 8, 30], strict=True)):
        got = stream.result.tokens[row]
        want = hf_greedy(loaded.reference, prompt, limit)
        verdict = compare_greedy(loaded.reference, prompt, got, want)
        assert verdict.status != "mismatch", (row, verdict.at, got, want)


def test_switched_off_by_environment(files: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(decoder.ENV, "0")
    assert decoder.fused_of(inner(files(VARIANTS[0]).quantized()[0])) is None


def test_a_copied_model_has_no_plan_of_the_original(files: Any) -> None:
    model, _ = files(VARIANTS[0]).quantized()
    assert decoder.fused_of(inner(model)) is not None
    twin = copy.deepcopy(model)
    assert decoder.fused_of(inner(twin)) is None
    assert decoder.attach(twin) == 1


# ----------------------------------------------------------------------- bad arguments


def tiny_plan() -> tuple[Any, list[Any]]:
    """A one-layer plan over random Q8_0 blocks (dim 32, 2 heads of 16, 1 kv head, ffn 32)."""
    rng = np.random.default_rng(0)

    def blocks(n: int, k: int) -> np.ndarray:
        raw = rng.integers(0, 255, (n, k // 32 * 34), dtype=np.uint8)
        raw.reshape(n, k // 32, 34)[:, :, 1] = 0x2C  # fp16 scales near 0.06: finite sums
        return raw

    norm = np.ones(32, np.float32)
    layer = [norm, norm]
    for n, k in ((32, 32), (16, 32), (16, 32), (32, 32), (32, 32), (32, 32), (32, 32)):
        layer += [blocks(n, k), 8]
    plan = quant_ops.kernels().decoder_plan([tuple(layer)], 32, 2, 1, 16, 32, 1e-5, 0.25)
    return plan, layer


def test_plan_and_step_refuse_bad_arguments() -> None:
    k = quant_ops.kernels()
    plan, layer = tiny_plan()
    bad_plans = [
        (([tuple(layer)], 32, 3, 2, 16, 32, 1e-5, 0.25), ValueError, "multiple of kv_heads"),
        (([tuple(layer)], 32, 2, 1, 15, 32, 1e-5, 0.25), ValueError, "even"),
        (([], 32, 2, 1, 16, 32, 1e-5, 0.25), ValueError, "empty"),
        ((7, 32, 2, 1, 16, 32, 1e-5, 0.25), TypeError, "sequence"),
        (([tuple(layer[:5])], 32, 2, 1, 16, 32, 1e-5, 0.25), TypeError, "tuple of 16"),
        (([tuple(layer)], 64, 2, 1, 16, 32, 1e-5, 0.25), ValueError, "layers[0] input norm"),
        (([(*layer[:2], layer[4], *layer[3:])], 32, 2, 1, 16, 32, 1e-5, 0.25), ValueError,
         "layers[0] q_proj"),
        (([(*layer[:15], 99)], 32, 2, 1, 16, 32, 1e-5, 0.25), ValueError, "down_proj"),
        (([tuple(layer)], 32, 2, 1, 16, 32, 1e-5, 0.0), ValueError, "scaling"),
    ]  # fmt: skip
    for args, error, words in bad_plans:
        with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
            k.decoder_plan(*args)
    hidden = np.zeros((2, 32), np.float32)
    rope = np.ones((2, 16), np.float32)
    kv = np.zeros((1, 2, 1, 8, 16), np.float32)
    bad_steps = [
        ((None, hidden, rope, rope, kv, 0), TypeError, "plan"),
        ((plan, hidden.astype(np.float64), rope, rope, kv, 0), TypeError, "hidden"),
        ((plan, np.zeros((2, 31), np.float32), rope, rope, kv, 0), ValueError, "dim = 32"),
        ((plan, hidden, rope[:1], rope, kv, 0), ValueError, "cos and sin"),
        ((plan, hidden, rope, rope, kv[:, :1], 0), ValueError, "kv must have shape"),
        ((plan, hidden, rope, rope, kv, 7), ValueError, "past"),
        ((plan, hidden, rope, rope, kv, -1), ValueError, "past"),
        ((plan, hidden, rope, rope, kv.view(np.float32)[..., ::2], 0), ValueError, "contiguous"),
        ((plan, kv.reshape(-1)[:64].reshape(2, 32), rope, rope, kv, 0), ValueError, "overlap"),
    ]  # fmt: skip
    for args, error, words in bad_steps:
        with pytest.raises(error, match=words):
            k.decoder_step(*args)
    k.decoder_step(plan, hidden, rope, rope, kv, 6)  # well formed: the last two positions
    hidden.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        k.decoder_step(plan, hidden, rope, rope, kv, 0)


def test_step_writes_only_its_positions_and_a_plan_outlives_its_arrays() -> None:
    """Positions past .. past + m - 1 of the cache change, nothing else; the plan holds its
    buffers (the layer list dropped, memory reused) and still computes the same."""
    k = quant_ops.kernels()
    plan, layer = tiny_plan()
    kv = np.full((1, 2, 1, 8, 16), 7.0, np.float32)
    kv[:, :, :, :3] = np.random.default_rng(1).standard_normal((1, 2, 1, 3, 16))
    before = kv.copy()
    hidden = np.random.default_rng(2).standard_normal((2, 32)).astype(np.float32)
    angle = np.random.default_rng(3).uniform(0, 6, (2, 16)).astype(np.float32)
    cos, sin = np.cos(angle), np.sin(angle)
    first = hidden.copy()
    k.decoder_step(plan, first, cos, sin, kv, 3)
    changed = np.any(kv != before, axis=-1)[0, :, 0]  # (2, 8): keys/values x position
    assert changed[:, 3:5].all() and not changed[:, :3].any() and not changed[:, 5:].any()
    assert np.isfinite(first).all() and not np.array_equal(first, hidden)
    del layer
    [np.ones(4096) for _ in range(64)]
    again = hidden.copy()
    kv2 = before.copy()
    k.decoder_step(plan, again, cos, sin, kv2, 3)
    assert np.array_equal(again, first) and np.array_equal(kv2, kv)


def test_one_row_rounds_of_a_fused_target_run_torch_on_one_thread(files: Any) -> None:
    """A drafter's torch ops between the target's calls must not leave torch's threads
    spinning on the kernels' cores: a one-row round of a fused target runs torch at one
    thread (drafting included), a batch's rounds keep the setting, and torch's count is
    restored after."""
    loaded = files(VARIANTS[0])
    model, _ = loaded.quantized()
    target = TargetModel("q", model=model, tokenizer=loaded.tokenizer)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)), [PromptLookupDrafter()], target
    )
    seen: list[tuple[int, int]] = []  # (torch threads, live rows)
    engine.before_round.append(
        lambda view: seen.append((torch.get_num_threads(), int(view.tokens.shape[0])))
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine.generate(PROMPTS[0], max_new_tokens=6)
        one_row = {threads for threads, _ in seen}
        seen.clear()
        engine.generate(PROMPTS, max_new_tokens=6)
        batch = {threads for threads, rows in seen if rows > 1}
        after = torch.get_num_threads()
    finally:
        torch.set_num_threads(before)
    assert one_row == {1}
    assert batch == {2}
    assert after == 2
    dense, _ = files(DENSE_ATTENTION).quantized()  # quantized, not fused: rounds left alone
    assert isinstance(quant_threads.round_threads(dense, 1), contextlib.nullcontext)
    assert isinstance(quant_threads.round_threads(object(), 1), contextlib.nullcontext)


def _check_kernel() -> Any:
    """wheels/check_kernel.py, whose float64 decoder reference the wheels are checked with."""
    path = Path(__file__).resolve().parents[2] / "wheels" / "check_kernel.py"
    spec = importlib.util.spec_from_file_location("flashspec_check_kernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# (dim, heads, kv heads, head size, feed-forward, layers): query heads per kv head 2, 3
# (SmolLM2's), 5 and 9 (past the grouped AVX-512 path's 8: head by head), head sizes 16, 32
# and 64 (the grouped path's 64 columns a pass), and 8, which AVX-512 leaves to the portable
# loops.
SHAPES = [
    (64, 4, 2, 16, 96, 2),
    (128, 2, 1, 64, 64, 1),
    (64, 4, 2, 8, 64, 1),
    (192, 3, 1, 64, 64, 1),
    (160, 5, 1, 32, 64, 1),
    (288, 9, 1, 32, 64, 1),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_step_matches_a_float64_reference_on_every_backend(
    shape: tuple[int, ...], every_backend: list[str]
) -> None:
    """Random layers, a cache holding random past positions, random rotary tables: steps of 1,
    3, 17 (two kernel passes) and 40 positions after 0 and 5 cached ones, against the float64
    decoder of wheels/check_kernel.py, which shares no code with the C step."""
    ck = _check_kernel()
    dim, heads, kv_heads, hd, ffn, count = shape
    rng = np.random.default_rng(7)
    k = quant_ops.kernels()
    for qtype in (8, 3, 6):  # Q8_0, Q4_1 and Q5_0 (its own blocks) layers
        layers, dense = ck.decoder_case(rng, qtype, shape)
        plan = k.decoder_plan(layers, dim, heads, kv_heads, hd, ffn, ck.DECODER_EPS, hd**-0.5)
        for backend in every_backend:
            k.set_backend(backend)
            for m, past in ((1, 0), (1, 5), (3, 5), (17, 0), (40, 5)):
                kv = (0.5 * rng.standard_normal((count, 2, kv_heads, 48, hd))).astype(np.float32)
                hidden = rng.standard_normal((m, dim)).astype(np.float32)
                angles = rng.uniform(0.0, 6.0, (m, hd)).astype(np.float32)
                cos, sin = np.cos(angles), np.sin(angles)
                want_h, want_kv = ck.decoder_reference(
                    dense, hidden, cos, sin, kv, past, heads, ck.DECODER_EPS, hd**-0.5
                )
                got_h, got_kv = hidden.copy(), kv.copy()
                k.decoder_step(plan, got_h, cos, sin, got_kv, past)
                where = f"{backend} qtype {qtype} m={m} past={past}"
                assert np.abs(got_h - want_h).max() <= 1e-4 * np.abs(want_h).max(), where
                assert np.abs(got_kv - want_kv).max() <= 1e-4 * np.abs(want_kv).max(), where


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "x".join(map(str, s)))
def test_batched_masked_step_matches_each_row_alone_in_float64_on_every_backend(
    shape: tuple[int, ...], every_backend: list[str]
) -> None:
    """Three rows stepping together against the float64 decoder of each row alone, with the
    ragged layout's masks (``batch_mask``: dead cached columns, a dead new column, a query
    that sees nothing); the dead cached slots hold NaN, which a masked key must never let
    through."""
    ck = _check_kernel()
    dim, heads, kv_heads, hd, ffn, count = shape
    rng = np.random.default_rng(11)
    k = quant_ops.kernels()
    layers, dense = ck.decoder_case(rng, 3, shape)
    plan = k.decoder_plan(layers, dim, heads, kv_heads, hd, ffn, ck.DECODER_EPS, hd**-0.5)
    rows, past = 3, 6
    for backend in every_backend:
        k.set_backend(backend)
        for m in (1, 4, 9):
            kv = (0.5 * rng.standard_normal((count, 2, rows, kv_heads, 24, hd))).astype(np.float32)
            mask = ck.batch_mask(rows, past + m + 2, past)  # wider than needed: a stride
            kv[:, :, 1, :, 1:past:2] = np.nan
            kv[:, :, rows - 1, :, :past] = np.nan
            hidden = rng.standard_normal((rows * m, dim)).astype(np.float32)
            angles = rng.uniform(0.0, 6.0, (rows * m, hd)).astype(np.float32)
            cos, sin = np.cos(angles), np.sin(angles)
            want_h, want_kv = ck.decoder_reference(
                dense, hidden, cos, sin, kv, past, heads, ck.DECODER_EPS, hd**-0.5, mask
            )
            got_h, got_kv = hidden.copy(), kv.copy()
            k.decoder_step(plan, got_h, cos, sin, got_kv, past, mask)
            where = f"{backend} m={m}"
            assert np.isfinite(got_h).all(), where
            assert np.abs(got_h - want_h).max() <= 1e-4 * np.abs(want_h).max(), where
            written = np.s_[:, :, :, :, past : past + m]
            assert np.abs(got_kv[written] - want_kv[written]).max() <= 1e-4, where
            untouched = np.s_[:, :, :, :, :past]
            np.testing.assert_array_equal(got_kv[untouched], kv[untouched])  # NaN equal NaN


def test_batched_step_refuses_a_mask_that_does_not_fit() -> None:
    k = quant_ops.kernels()
    plan, _ = tiny_plan()
    hidden = np.zeros((4, 32), dtype=np.float32)  # 2 rows of 2 positions
    rope = np.zeros((4, 16), dtype=np.float32)
    kv = np.zeros((1, 2, 2, 1, 8, 16), dtype=np.float32)
    for bad in (
        np.ones((2, 4), dtype=np.uint8),  # narrower than past + m
        np.ones((3, 8), dtype=np.uint8),  # another batch
        np.ones((2, 8), dtype=np.float32),  # not bytes
    ):
        with pytest.raises(ValueError, match="mask"):
            k.decoder_step(plan, hidden, rope, rope, kv, 3, bad)
    with pytest.raises(ValueError, match="batch"):
        k.decoder_step(plan, hidden[:3], rope[:3], rope[:3], kv, 3)
    k.decoder_step(plan, hidden, rope, rope, kv, 3, np.ones((2, 5), dtype=np.uint8))


def test_sampled_tokens_through_the_c_step_follow_the_dequantized_model(
    files: Any, counting: Counting, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative sampling one sequence at a time, so every forward (prefill, verification)
    is the C step: at T = 0.9 with top-p 0.8 (its candidate-only cut, lowered to this tiny
    vocabulary) the first two tokens follow the dequantized model's distributions warped by
    HF's own processors (chi-squared, 1%)."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    import flashspec.sampling as sampling

    monkeypatch.setattr(sampling, "TOP_P_PARTIAL_VOCAB", 64)
    loaded = files(VARIANTS[1])
    model, _ = loaded.quantized()
    target = TargetModel("q", model=model, tokenizer=loaded.tokenizer)
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3, temperature=0.9, top_p=0.8))
    engine = SpeculativeEngine(config, [PromptLookupDrafter()], target)
    ids = loaded.tokenizer("the dog the dog")["input_ids"]
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    for call in range(1200):
        tokens = engine.generate([ids], max_new_tokens=2, ignore_eos=True, seed=call).tokens[0]
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    assert counting.steps >= 2400  # a prefill and at least one step a call, all in C
    hf = LogitsProcessorList([TemperatureLogitsWarper(0.9), TopPLogitsWarper(0.8)])
    dummy = torch.zeros((1, 1), dtype=torch.long)
    p_first, p_second = exact_first_two(
        loaded.reference, ids, lambda logits: torch.cat([hf(dummy, row[None]) for row in logits])
    )
    assert float(p_first.max()) < 0.8 and int((p_first > 0).sum()) >= 3  # a real choice
    assert_first_two_follow(first, second, p_first, p_second)


# ------------------------------------------------------------------ token-tree masks


def tree_rows(parents: list[int], past: int, width: int) -> np.ndarray:
    """(N, width) uint8: node i's visible columns, the ``past`` committed ones and its own and
    its ancestors' (node j at column past + j); written here from the parents alone, sharing
    no code with ``flashspec.trees``."""
    rows = np.zeros((len(parents), width), np.uint8)
    rows[:, :past] = 1
    for i, parent in enumerate(parents):
        if parent >= 0:
            rows[i] = rows[parent]
        rows[i, past + i] = 1
    return rows


def tree_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return depths


def tree_path(parents: list[int], node: int) -> list[int]:
    """The nodes from depth 1 down to ``node``."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


@pytest.mark.parametrize("shape", SHAPES[:4], ids=lambda s: "x".join(map(str, s)))
def test_tree_masked_step_matches_float64_on_every_backend(
    shape: tuple[int, ...], every_backend: list[str]
) -> None:
    """Three rows, each verifying a token tree of m nodes in one step with a mask row per
    query ((batch * m, columns): node i sees the committed columns and its ancestors), against
    the float64 decoder of each row alone; row 1 also has dead cached columns (NaN in their
    slots) and a dead last node (its own column hidden, a smaller tree's padding: skipped, its
    slots zeroed)."""
    ck = _check_kernel()
    dim, heads, kv_heads, hd, ffn, count = shape
    rng = np.random.default_rng(13)
    k = quant_ops.kernels()
    layers, dense = ck.decoder_case(rng, 3, shape)
    plan = k.decoder_plan(layers, dim, heads, kv_heads, hd, ffn, ck.DECODER_EPS, hd**-0.5)
    rows, past = 3, 6
    trees = {
        5: [[-1, 0, 0, 1, -1], [-1, -1, 1, 2, 0], [-1, 0, 1, 2, 3]],  # the last one a chain
        9: [[-1, 0, 0, 1, 1, 2, -1, 6, 3], [-1, -1, -1, 0, 1, 2, 3, 4, 5], [-1] * 9],
    }
    for backend in every_backend:
        k.set_backend(backend)
        for m, parents in trees.items():
            width = past + m + 3  # wider than needed: a stride
            mask = np.stack([tree_rows(p, past, width) for p in parents])  # (rows, m, width)
            mask[1, :, 1:past:2] = 0
            mask[1, m - 1, past + m - 1] = 0  # row 1's last node (a leaf) dead: padding
            kv = (0.5 * rng.standard_normal((count, 2, rows, kv_heads, 24, hd))).astype(np.float32)
            kv[:, :, 1, :, 1:past:2] = np.nan
            hidden = rng.standard_normal((rows * m, dim)).astype(np.float32)
            angles = rng.uniform(0.0, 6.0, (rows * m, hd)).astype(np.float32)
            cos, sin = np.cos(angles), np.sin(angles)
            want_h, want_kv = ck.decoder_reference(
                dense, hidden, cos, sin, kv, past, heads, ck.DECODER_EPS, hd**-0.5, mask
            )
            got_h, got_kv = hidden.copy(), kv.copy()
            k.decoder_step(plan, got_h, cos, sin, got_kv, past, mask.reshape(rows * m, width))
            where = f"{backend} m={m}"
            assert np.isfinite(got_h).all(), where
            assert np.abs(got_h - want_h).max() <= 1e-4 * np.abs(want_h).max(), where
            written = np.s_[:, :, :, :, past : past + m]
            assert np.abs(got_kv[written] - want_kv[written]).max() <= 1e-4, where
            assert not got_kv[:, :, 1, :, past + m - 1].any(), where  # the dead node's slots


def test_step_refuses_a_per_query_mask_that_does_not_fit() -> None:
    k = quant_ops.kernels()
    plan, _ = tiny_plan()
    hidden = np.zeros((4, 32), dtype=np.float32)  # 2 rows of 2 positions
    rope = np.zeros((4, 16), dtype=np.float32)
    kv = np.zeros((1, 2, 2, 1, 8, 16), dtype=np.float32)
    for bad in (
        np.ones((4, 4), dtype=np.uint8),  # a row a query, narrower than past + m
        np.ones((5, 8), dtype=np.uint8),  # neither batch nor batch * m rows
        np.ones((2, 2, 8), dtype=np.uint8),  # (batch, m, columns): the rows must be flat
        np.ones((4, 8), dtype=np.int32),  # not bytes
    ):
        with pytest.raises(ValueError, match=r"mask must .* \(batch \* m, columns\) = \(4, >= 5\)"):
            k.decoder_step(plan, hidden, rope, rope, kv, 3, bad)
    k.decoder_step(plan, hidden, rope, rope, kv, 3, np.ones((4, 5), dtype=np.uint8))


TREE = [-1, 0, 0, 1, -1]  # two roots; node 0 has two children, node 1 one


def tree_call(
    model: Any, cache: Any, tokens: torch.Tensor, parents: list[list[int]], past: int, kind: str
) -> torch.Tensor:
    """One forward of a batch of trees (row b: ``tokens[b]`` with ``parents[b]``) after ``past``
    cached positions, the 4-D mask the eager transformers path takes (``kind``: "additive",
    0 / the float32 min, or "bool") with positions by depth; the logits (B, N, V)."""
    from flashspec.kv.compat import ForwardSignature

    n = int(tokens.shape[1])
    visible = torch.from_numpy(np.stack([tree_rows(p, past, past + n) for p in parents]) != 0)
    mask: torch.Tensor = visible[:, None]
    if kind == "additive":
        hidden = torch.full(mask.shape, torch.finfo(torch.float32).min)
        mask = torch.where(mask, torch.zeros(()), hidden)
    positions = torch.tensor([[past - 1 + d for d in tree_depths(p)] for p in parents])
    arg = ForwardSignature.of(model).cache_arg
    with torch.inference_mode():
        out = model(input_ids=tokens, attention_mask=mask, position_ids=positions,
                    use_cache=True, **{arg: cache})  # fmt: skip
    logits: torch.Tensor = out.logits
    return logits


def chain_call(model: Any, cache: Any, tokens: torch.Tensor) -> torch.Tensor:
    """A plain causal forward of ``tokens`` (B, n) after what ``cache`` holds: no mask, the
    positions following the cache's; the logits (B, n, V)."""
    from flashspec.kv.compat import ForwardSignature

    arg = ForwardSignature.of(model).cache_arg
    with torch.inference_mode():
        logits: torch.Tensor = model(input_ids=tokens, use_cache=True, **{arg: cache}).logits
    return logits


def prefilled(model: Any, prompts: torch.Tensor) -> Any:
    """A fresh cache holding ``prompts`` (B, P)."""
    from flashspec.kv.compat import new_cache

    cache = new_cache(model)
    chain_call(model, cache, prompts)
    return cache


@pytest.mark.parametrize("kind", ["additive", "bool"])
def test_tree_forward_in_the_c_step_equals_the_module_path(
    kind: str, files: Any, counting: Counting
) -> None:
    """Two rows' trees (different shapes) in one forward with a 4-D mask: the C step (one
    call, a mask row per query) and transformers' module-by-module forward with the same mask
    give the same logits and the same cached keys and values."""
    from flashspec._lean import make_lean

    loaded = files(VARIANTS[1])
    model, _ = loaded.quantized()
    make_lean(model)
    vocab = loaded.reference.config.vocab_size
    generator = torch.Generator().manual_seed(5)
    prompts = torch.randint(0, vocab, (2, 9), generator=generator)
    tokens = torch.randint(0, vocab, (2, len(TREE)), generator=generator)
    parents = [TREE, [-1, -1, 1, 2, 0]]
    got_cache = prefilled(model, prompts)
    before = counting.steps
    got = tree_call(model, got_cache, tokens, parents, 9, kind)
    assert counting.steps == before + 1  # the tree took the C step
    want_cache = prefilled(model, prompts)
    with hf_forward(model):
        want = tree_call(model, want_cache, tokens, parents, 9, kind)
    assert counting.steps == before + 2  # the second prefill only
    assert max_relative(got, want) <= RELATIVE
    for mine, theirs in zip(got_cache.layers, want_cache.layers, strict=True):
        for a, b in ((mine.keys, theirs.keys), (mine.values, theirs.values)):
            assert a.shape == b.shape == (2, 2, 9 + len(TREE), 16)
            assert max_relative(a, b) <= RELATIVE


@pytest.mark.parametrize("variant", VARIANTS[1:3], ids=lambda v: v.name)
def test_each_tree_node_equals_its_path_fed_as_a_chain_on_every_backend(
    variant: Variant, files: Any, counting: Counting, every_backend: list[str]
) -> None:
    """Node i's logits from one tree forward after a cached prompt equal those of the prompt
    followed by node i's path as a plain chain, fed in a fresh cache (the C step, no mask),
    and those of the dequantized model over the whole sequence: a node sees exactly its
    ancestors, at positions by depth. On every backend."""
    from flashspec._lean import make_lean

    loaded = files(variant)
    model, _ = loaded.quantized()
    make_lean(model)
    vocab = loaded.reference.config.vocab_size
    generator = torch.Generator().manual_seed(6)
    prompt = torch.randint(0, vocab, (1, 9), generator=generator)
    tokens = torch.randint(0, vocab, (1, len(TREE)), generator=generator)
    for backend in every_backend:
        quant_ops.kernels().set_backend(backend)
        before = counting.steps
        tree = tree_call(model, prefilled(model, prompt), tokens, [TREE], 9, "additive")[0]
        assert counting.steps == before + 2, backend  # prefill and tree, both in C
        for node in range(len(TREE)):
            path = tokens[:, tree_path(TREE, node)]
            chain = chain_call(model, prefilled(model, prompt), path)[0, -1]
            ids = torch.cat([prompt, path], 1)[0].tolist()
            where = f"{backend} node {node}"
            assert max_relative(tree[node], chain) <= RELATIVE, where
            want = reference_logits(loaded.reference, ids, 1)[0, -1]
            assert max_relative(tree[node], want) <= RELATIVE, where


def test_a_tree_mask_the_c_step_cannot_take_goes_module_by_module(
    files: Any, counting: Counting
) -> None:
    """A 4-D mask whose key length is not the cache's plus the new positions, or with a finite
    bias (a partial weight, not hidden), is left to the module path; a mask of one row for the
    batch is the same for every row."""
    from flashspec._lean import _fused_mask

    loaded = files(VARIANTS[0])
    model, _ = loaded.quantized()
    cache = prefilled(model, torch.zeros((2, 4), dtype=torch.int64))
    embeds = torch.zeros((2, 3, 64))
    visible = torch.ones((1, 1, 3, 7), dtype=torch.bool).tril(4)
    takes, rows = _fused_mask(visible, embeds, cache)
    assert takes and rows is not None and rows.shape == (2, 3, 7)
    assert torch.equal(rows[1], visible[0, 0])
    for bad in (visible[..., :6], torch.ones((2, 1, 3, 8), dtype=torch.bool),
                torch.ones((2, 2, 3, 7), dtype=torch.bool), torch.full((2, 1, 3, 7), -1.0),
                torch.ones((2, 1, 3, 7), dtype=torch.int64)):  # fmt: skip
        assert _fused_mask(bad, embeds, cache) == (False, None)
    fused = decoder.fused_of(inner(model))
    assert fused is not None
    before = counting.steps
    hidden = torch.zeros((2, 3, 64))
    rope = torch.ones((1, 3, 16))
    assert not fused.step(cache, hidden, rope, rope, torch.ones((2, 3, 8), dtype=torch.bool))
    assert counting.steps == before


def _engine_logits(loaded: Any, model: Any) -> list[torch.Tensor]:
    """Every verification's logits of a ragged speculative batch (3 prompts of different
    lengths, lookup drafts of different lengths: 2-D masks, several positions kept)."""
    target = TargetModel("q", model=model, tokenizer=loaded.tokenizer)
    seen: list[torch.Tensor] = []
    verify = target.verify

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        logits = verify(*args, **kwargs)
        seen.append(logits.clone())
        return logits

    target.verify = spy  # type: ignore[method-assign]
    # Fixed arms: the same rounds in every run (measured costs choose nothing).
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=4), bandit=BanditConfig(batches="fixed", plain=False)
    )
    engine = SpeculativeEngine(config, [PromptLookupDrafter()], target)
    prompts = [loaded.tokenizer(text)["input_ids"] for text in LOOKUP_PROMPTS]
    engine.generate(prompts, max_new_tokens=[30, 18, 30])
    engine.generate(prompts[0], max_new_tokens=20)  # one row: no mask
    return seen


def test_direct_logits_are_the_models_own_call_bit_for_bit(
    files: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fused target's forwards skip transformers' call plumbing (``lean_logits``): every
    logit of a ragged engine run, one-row rounds included, is bit for bit what the model's own
    call gives; hooks on the model send calls back to it (and fire)."""
    import flashspec.models.causal as causal

    loaded = files(VARIANTS[1])
    model, _ = loaded.quantized()
    taken: list[int] = []
    direct = causal.lean_logits

    def counted(*args: Any) -> Any:
        out = direct(*args)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(causal, "lean_logits", counted)
    fast = _engine_logits(loaded, model)
    assert taken and all(taken)
    monkeypatch.setattr(causal, "lean_logits", lambda *args: None)
    slow = _engine_logits(loaded, model)
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow, strict=True):
        assert torch.equal(a, b)

    monkeypatch.setattr(causal, "lean_logits", counted)
    taken.clear()
    calls: list[int] = []
    handle = model.register_forward_hook(lambda *args: calls.append(1))
    try:
        hooked = _engine_logits(loaded, model)
    finally:
        handle.remove()
    assert taken and not any(taken) and len(calls) == len(hooked)
    for a, b in zip(hooked, slow, strict=True):
        assert torch.equal(a, b)
