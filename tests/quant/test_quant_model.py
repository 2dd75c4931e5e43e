"""Quantized models (``flashspec.quant``) against transformers' dequantized load of the same file.

Each tiny Llama GGUF here is written by the test with every projection (q, k, v, o, gate, up,
down) and the tied embedding in one format: Q8_0, Q4_0, Q4_1 (gguf-py's quantizer) and Q4_K,
Q6_K (``tests.helpers.gguf.quantize_blocks``; those files are 256 wide, the K formats' block). The
reference is transformers' own GGUF load (gguf-py dequantizes every tensor to float32), which
shares no code with the kernels. Checked: logits within 1e-4 of the largest (kernel path and
the dense path of long inputs), the weights the layers hold bit for bit, the load's record,
greedy identity with ``generate`` and through the speculative engine (tie rule of
``flashspec._greedy``), and chi-squared of sampled tokens through the quantized layers.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("gguf")
pytest.importorskip("accelerate")

import numpy as np
import torch

import flashspec.quant.ops as quant_ops
from flashspec import (
    FlashSpecConfig,
    PromptLookupDrafter,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec.quant import QuantEmbedding, QuantLinear
from flashspec.trees import TreeShape
from tests.helpers.chi2 import CHI2_99, first_two_counts
from tests.helpers.quant import (
    HF_PROJECTIONS,
    LAYERS,
    LOADED_AS,
    LOOKUP_PROMPTS,
    MIXED,
    PROJECTIONS,
    Q4_K_M,
    RELATIVE,
    UNTIED,
    VARIANTS,
    Variant,
    assert_greedy_same,
    exact_first_two,
    hf_greedy,
    make_files,
    max_relative,
)
from tests.helpers.trees import OracleTrees

# Every file the load is checked on: one format throughout, SmolLM2's mix, an untied head, and
# a Q4_K_M file's mix (repacked K layers beside Q5_0 and Q8_0 blocks kept as the file has them).
LOADS = [*VARIANTS.values(), MIXED, UNTIED, Q4_K_M]

if not quant_ops.available():
    pytest.skip("flashspec._quant is not built", allow_module_level=True)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``files(variant)``: the written file with transformers' load of it, made once each."""
    return make_files(tmp_path_factory.mktemp("quant-gguf"))


# ----------------------------------------------------------------------------------- logits


@pytest.mark.parametrize("variant", LOADS, ids=lambda v: v.name)
def test_logits_equal_dequantized_load(variant: Variant, files: Any) -> None:
    """One prompt, a batch (left padding in one row) that runs the kernels, and a batch of
    more rows than ``DENSE_ROWS`` (the dequantize-and-BLAS road), on every backend: all within
    1e-4 of the largest logit."""
    loaded = files(variant)
    model, _ = loaded.quantized()
    vocab = loaded.reference.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompt = torch.tensor([loaded.tokenizer(LOOKUP_PROMPTS[0])["input_ids"]])
    small = torch.randint(0, vocab, (2, 7), generator=generator)
    small_mask = torch.ones_like(small)
    small_mask[1, :3] = 0
    large = torch.randint(0, vocab, (3, 17), generator=generator)
    assert large.numel() > quant_ops.DENSE_ROWS >= small.numel()
    kernels = quant_ops.kernels()
    before = kernels.backend()
    try:
        for backend in kernels.available_backends():  # scalar C, AVX2, AVX-512 where present
            kernels.set_backend(backend)
            with torch.inference_mode():
                for ids, mask in ((prompt, None), (small, small_mask), (large, None)):
                    got = model(ids, attention_mask=mask).logits
                    want = loaded.reference(ids, attention_mask=mask).logits
                    assert got.dtype == torch.float32 and got.shape == want.shape
                    error = max_relative(got, want)
                    assert error <= RELATIVE, (
                        f"{variant.name} {backend} {tuple(ids.shape)}: relative {error:.2e}"
                    )
    finally:
        kernels.set_backend(before)


@pytest.mark.parametrize("variant", LOADS, ids=lambda v: v.name)
def test_record_and_weights(variant: Variant, files: Any) -> None:
    """Every matrix written quantized is a layer on blocks, the record says so, the tied head
    reads the embedding's blocks (one copy), and each layer's weights are transformers'
    dequantized weights bit for bit (q and k rows in transformers' order)."""
    import gguf

    loaded = files(variant)
    model, record = loaded.quantized()
    quantized_kinds = {kind: fmt for kind, fmt in variant.types.items() if kind in PROJECTIONS}
    kept = {kind: LOADED_AS.get(fmt, fmt) for kind, fmt in variant.types.items()}
    expected = {
        f"model.layers.{i}.{hf}": kept[kind]
        for i in range(LAYERS)
        for kind, hf in zip(PROJECTIONS, HF_PROJECTIONS, strict=True)
        if kind in quantized_kinds
    }
    expected["model.embed_tokens"] = kept["token_embd"]
    if variant.untied:
        expected["lm_head"] = kept["output"]
    assert record.quantized == expected
    modules = dict(model.named_modules())
    for name, fmt in expected.items():
        layer = modules[name]
        kind = QuantEmbedding if name == "model.embed_tokens" else QuantLinear
        assert isinstance(layer, kind) and layer.format == fmt, name
    # Layers written in float32 stay plain dense layers.
    dense_linears = {n for n, m in modules.items() if type(m) is torch.nn.Linear}
    assert dense_linears == {
        f"model.layers.{i}.{hf}"
        for i in range(LAYERS)
        for kind, hf in zip(PROJECTIONS, HF_PROJECTIONS, strict=True)
        if kind not in quantized_kinds
    }
    head, embed = model.lm_head, model.model.embed_tokens
    assert isinstance(head, QuantLinear)
    assert record.tied_head is not variant.untied
    if not variant.untied:  # the file holds one copy; so does memory
        assert head.blocks.data_ptr() == embed.blocks.data_ptr()
    assert record.summary().startswith(f"{len(expected)} layers on GGUF blocks")

    reference = loaded.reference.state_dict()
    for name in expected:
        layer = modules[name]
        if isinstance(layer, QuantEmbedding):
            ids = torch.arange(layer.num_embeddings)
            values = layer(ids)
        else:
            values = layer.dense_weight()
        assert torch.equal(values, reference[name + ".weight"]), name
    if not variant.untied:
        assert torch.equal(head.dense_weight(), reference["lm_head.weight"])
    state = model.state_dict()
    for name in record.dense:  # norms, float32 projections: as transformers loads them
        assert torch.equal(state[name], reference[name]), name
    # The blocks are the file's bytes (v_proj: rows in file order, no processing), K formats
    # in their repacked layout.
    tensors = {t.name: t for t in gguf.GGUFReader(loaded.path).tensors}
    v_proj = modules["model.layers.0.self_attn.v_proj"]
    if isinstance(v_proj, QuantLinear):
        raw = np.asarray(tensors["blk.0.attn_v.weight"].data)
        if variant.types["attn_v"] in LOADED_AS:
            qtype = int(tensors["blk.0.attn_v.weight"].tensor_type)
            raw = quant_ops.repack(raw, qtype, v_proj.out_features, v_proj.in_features)
        assert np.array_equal(v_proj.blocks.numpy(), raw)
    # Q5_0 runs on the file's own 22-byte blocks: never repacked, and (rows the load does not
    # reorder: all but q and k) read straight from the file's memory map, not a copy.
    assert "Q5_0" not in record.repacked.values()
    assert "Q5_0" not in record.summary().partition("repacked from")[2]
    by_kind = dict(zip(PROJECTIONS, HF_PROJECTIONS, strict=True))
    for kind, fmt in variant.types.items():
        if fmt != "Q5_0":
            continue
        names = ([f"model.layers.{i}.{by_kind[kind]}" for i in range(LAYERS)]
                 if kind in by_kind else ["model.embed_tokens"])  # fmt: skip
        for name in names:
            layer = modules[name]
            assert layer.qtype == 6 and layer.blocks.shape[1] % 22 == 0, name
            if kind not in ("attn_q", "attn_k") and MAPS.is_file():
                assert mapped_file(layer.blocks.data_ptr()) == str(loaded.path.resolve()), name


MAPS = Path("/proc/self/maps")


def mapped_file(address: int) -> str | None:
    """The file whose mapping holds ``address`` in this process ("" for anonymous memory)."""
    for line in MAPS.read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(v, 16) for v in fields[0].split("-"))
        if low <= address < high:
            return fields[5].strip() if len(fields) == 6 else ""
    return None


# ----------------------------------------------------------------------------------- greedy


@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=lambda v: v.name)
def test_greedy_generate_equals_dequantized_model(variant: Variant, files: Any) -> None:
    """transformers' own ``generate`` on the quantized model = on the dequantized model."""
    loaded = files(variant)
    model, _ = loaded.quantized()
    for text in LOOKUP_PROMPTS:
        ids = loaded.tokenizer(text)["input_ids"]
        got = hf_greedy(model, ids, 24)
        want = hf_greedy(loaded.reference, ids, 24)
        assert_greedy_same(loaded.reference, ids, got, want)


@pytest.mark.parametrize("variant", list(VARIANTS.values()), ids=lambda v: v.name)
def test_speculative_engine_greedy_equals_dequantized_generate(
    variant: Variant, files: Any
) -> None:
    """The engine on the quantized model (prompt lookup, verification of gamma + 1 rows through
    the kernels) reproduces transformers' greedy decoding of the dequantized model."""
    loaded = files(variant)
    model, _ = loaded.quantized()
    target = TargetModel(variant.name, model=model, tokenizer=loaded.tokenizer)
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)), [PromptLookupDrafter()], target
    )
    drafted = accepted = 0
    for text in LOOKUP_PROMPTS:
        ids = loaded.tokenizer(text)["input_ids"]
        result = engine.generate(text, max_new_tokens=32)
        assert_greedy_same(
            loaded.reference, ids, result.tokens[0], hf_greedy(loaded.reference, ids, 32)
        )
        drafted += result.stats.drafted
        accepted += result.stats.accepted
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts accepted, and some rejected
    batch = engine.generate(LOOKUP_PROMPTS, max_new_tokens=16)
    for text, tokens in zip(LOOKUP_PROMPTS, batch.tokens, strict=True):
        ids = loaded.tokenizer(text)["input_ids"]
        assert_greedy_same(loaded.reference, ids, tokens, hf_greedy(loaded.reference, ids, 16))


@pytest.mark.parametrize("variant", [MIXED, Q4_K_M], ids=lambda v: v.name)
def test_tree_rounds_on_the_quantized_target_equal_dequantized_generate(
    variant: Variant, files: Any
) -> None:
    """Token trees verified on the quantized layers (one forward per tree, an ancestor mask per
    query, the accepted path's columns moved next to the committed ones) reproduce
    transformers' greedy decoding of the dequantized model, with trees around the true
    continuation whose true child sits at any rank."""
    loaded = files(variant)
    model, _ = loaded.quantized()
    target = TargetModel(variant.name, model=model, tokenizer=loaded.tokenizer)
    prompts = [loaded.tokenizer(text)["input_ids"] for text in LOOKUP_PROMPTS]
    truth = {tuple(ids): hf_greedy(loaded.reference, ids, 24) for ids in prompts}
    drafter = OracleTrees(truth, hit=0.7, seed=3, vocab=loaded.reference.config.vocab_size)
    shape = TreeShape(depth=5, nodes=16, top_k=3)
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=shape.depth), tree=shape)
    engine = SpeculativeEngine(config, [drafter], target)
    for ids in prompts:
        result = engine.generate(ids, max_new_tokens=24)
        assert_greedy_same(loaded.reference, ids, result.tokens[0], truth[tuple(ids)])
    assert drafter.trees > 3 and drafter.moved > 0, (drafter.trees, drafter.moved)


def test_compiled_path_runs_the_kernels_and_stays_exact(
    files: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compile=True on a quantized target: its graphs call the kernels (custom ops), torch's
    code inside them runs on one thread as the eager forward's does, and greedy decoding is
    transformers' on the dequantized model."""
    from flashspec.compiled import step as compiled_step

    seen: list[int] = []
    real = compiled_step.torch_threads

    def counting(count: int) -> Any:
        seen.append(count)
        return real(count)

    monkeypatch.setattr(compiled_step, "torch_threads", counting)
    loaded = files(MIXED)
    model, _ = loaded.quantized()
    target = TargetModel(MIXED.name, model=model, tokenizer=loaded.tokenizer)
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3), compile=True)
    engine = SpeculativeEngine(config, [PromptLookupDrafter()], target)
    text = LOOKUP_PROMPTS[0]
    ids = loaded.tokenizer(text)["input_ids"]
    result = engine.generate(text, max_new_tokens=24)
    want = hf_greedy(loaded.reference, ids, 24)
    assert_greedy_same(loaded.reference, ids, result.tokens[0], want)
    assert seen and set(seen) == {1}  # the compiled steps ran, on one torch thread


# ------------------------------------------------------------------------------- sampling


def chi_squared(counts: Counter[int], p: torch.Tensor, max_cells: int = 20) -> tuple[float, float]:
    """(statistic, 1% critical value). Tokens are pooled, least likely first, into cells of
    expected count at least max(5, n / max_cells), so the table's degrees of freedom (up to
    20) suffice and every cell's expectation is large enough for the test."""
    n = sum(counts.values())
    assert all(p[t] > 0 for t in counts), "a token of probability 0 was sampled"
    floor = max(5.0, n / max_cells)
    cells: list[tuple[float, int]] = []
    pending_e, pending_o = 0.0, 0
    for token in torch.argsort(p).tolist():  # ascending probability
        pending_e += n * float(p[token])
        pending_o += counts[token]
        if pending_e >= floor:
            cells.append((pending_e, pending_o))
            pending_e, pending_o = 0.0, 0
    if pending_e > 0 or pending_o:  # leftovers join the last (largest) cell
        e, o = cells.pop()
        cells.append((e + pending_e, o + pending_o))
    assert 2 <= len(cells) <= len(CHI2_99)
    stat = sum((o - e) ** 2 / e for e, o in cells)
    return stat, CHI2_99[len(cells) - 1]


@pytest.mark.parametrize("fmt", ["Q4_1", "Q4_K"])
def test_sampled_tokens_follow_dequantized_distribution(
    fmt: str, files: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Speculative sampling (T = 1, prompt lookup) through the quantized layers: the first and
    second tokens follow the exact distributions of the dequantized model (chi-squared, 1%)."""
    # Every product through the kernels, prefill included (none takes the dense road).
    monkeypatch.setattr(quant_ops, "DENSE_ROWS", 1 << 30)
    loaded = files(VARIANTS[fmt])
    model, _ = loaded.quantized()
    target = TargetModel(fmt, model=model, tokenizer=loaded.tokenizer)
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3, temperature=1.0))
    engine = SpeculativeEngine(config, [PromptLookupDrafter()], target)
    ids = loaded.tokenizer("the dog the dog")["input_ids"]
    first, second = first_two_counts(engine, ids, batch=8, calls=200, seed=1000, max_new_tokens=2)
    p_first, p_second = exact_first_two(loaded.reference, ids)
    # Spread enough for the test to see something: not a point mass.
    assert float(p_first.max()) < 0.8 and float(p_second.max()) < 0.8
    for label, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{fmt} {label} token: chi2 {stat:.1f} >= {critical}"


# ------------------------------------------------------------------------------- the layer


def _layer(fmt: str = "Q8_0", n: int = 24, k: int = 64, bias: bool = False) -> QuantLinear:
    from tests.helpers.gguf import quantize_blocks

    rng = np.random.default_rng(3)
    weights = (rng.standard_normal((n, k)) * 0.2).astype(np.float32)
    blocks = torch.from_numpy(np.ascontiguousarray(quantize_blocks(weights, fmt)))
    qtype = {name: number for number, (name, _, _) in quant_ops.formats().items()}[fmt]
    b = torch.from_numpy(rng.standard_normal(n).astype(np.float32)) if bias else None
    return QuantLinear(blocks, qtype, k, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64, torch.float16])
def test_quant_linear_rejects_other_activation_dtypes(dtype: torch.dtype) -> None:
    layer = _layer()
    with pytest.raises(TypeError, match=r"float32[\s\S]*dtype='float32'"):
        layer(torch.ones(2, 64, dtype=dtype))


def test_quant_linear_matches_dense_linear() -> None:
    """Any leading shape, with a bias: the dense layer of the exact weights, to rounding."""
    layer = _layer("Q4_1", bias=True)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(1))
    got = layer(x)
    assert got.shape == (2, 3, 24)
    want = torch.nn.functional.linear(
        x.double(), layer.dense_weight().double(), layer.bias.double()
    )
    assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max())


def test_subset_head_over_a_quantized_head() -> None:
    """A shared-head draft's head over a quantized target head: the subset rows' exact values,
    multiplied on their blocks, and -inf outside the subset."""
    from flashspec.shared_head import SubsetHead

    layer = _layer("Q8_0", n=40, k=64)
    ids = torch.tensor([3, 17, 0, 39, 8])
    head = SubsetHead(layer, ids, 40)
    assert torch.equal(head.dense(), layer.dense_weight()[ids])
    hidden = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(2))
    logits = head(hidden)
    want = hidden.double() @ layer.dense_weight()[ids].double().T
    assert float((logits[..., ids].double() - want).abs().max()) < 1e-5 * float(want.abs().max())
    outside = torch.ones(40, dtype=torch.bool)
    outside[ids] = False
    assert bool(torch.isneginf(logits[..., outside]).all())


def test_quant_linear_takes_an_empty_batch() -> None:
    """Zero rows in, zero rows out, as ``nn.Linear`` does (a batch whose rows all finished)."""
    layer = _layer()
    assert layer(torch.empty(0, 64)).shape == (0, 24)
    assert layer(torch.empty(2, 0, 64)).shape == (2, 0, 24)


# -------------------------------------------------------------------------- torch.compile


def test_custom_op_opcheck() -> None:
    """torch's own checks of the custom op: schema, fake implementation, autograd
    registration, and the op under AOT dispatch with dynamic shapes."""
    layer = _layer("Q4_0")
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2))
    torch.library.opcheck(quant_ops.qmatmul_op, (x, layer.blocks, layer.qtype, 24, 64))


def test_compiled_layer_calls_the_op() -> None:
    """A compiled function over a ``QuantLinear`` traces through the fake implementation in
    one graph (fullgraph: no break at the kernel) and computes what eager does, bit for bit,
    for several row counts (the fake's shape follows x)."""
    layer = _layer("Q4_1", bias=True)

    def step(x: torch.Tensor) -> torch.Tensor:
        return torch.relu(layer(x)) * 2.0

    compiled = torch.compile(step, backend="aot_eager", fullgraph=True, dynamic=True)
    generator = torch.Generator().manual_seed(4)
    for rows in (1, 3, 7):
        x = torch.randn(rows, 64, generator=generator)
        assert torch.equal(compiled(x), step(x)), rows
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake_x = mode.from_tensor(torch.empty(6, 64))
        fake_blocks = mode.from_tensor(layer.blocks)
        out = quant_ops.qmatmul_op(fake_x, fake_blocks, layer.qtype, 24, 64)
        assert out.shape == (6, 24) and out.dtype == torch.float32


# -------------------------------------------------------------------------- the default load


def test_default_load_keeps_only_formats_with_a_fast_kernel(
    files: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``load_pretrained`` (dtype "auto") keeps Q4_0/Q4_1/Q5_0/Q8_0 layers as blocks where a
    SIMD kernel runs them, and Q4_K/Q6_K in their repacked layouts; on a CPU without SIMD kernels
    it dequantizes everything (the C kernels are slower than a dense product); the logits
    stay the model's."""
    from flashspec.loading import load_pretrained
    from flashspec.quant.ops import kernels

    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path))
    ids = torch.tensor([[5, 6, 7, 8, 9]])
    if kernels().backend() != "scalar":
        for variant, fmt in ((MIXED, "Q8_0"), (VARIANTS["Q4_K"], "Q4_KR"),
                             (VARIANTS["Q6_K"], "Q6_KR"), (VARIANTS["Q5_0"], "Q5_0")):  # fmt: skip
            loaded = files(variant)
            model, _ = load_pretrained(str(loaded.path))
            head = model.get_output_embeddings()
            assert isinstance(head, QuantLinear) and head.format == fmt, variant.name
            with torch.inference_mode():
                got, want = model(ids).logits, loaded.reference(ids).logits
            assert max_relative(got, want) < RELATIVE, variant.name
    start = kernels().backend()
    kernels().set_backend("scalar")
    try:
        for variant in (MIXED, VARIANTS["Q4_K"]):
            fallback, _ = load_pretrained(str(files(variant).path))
            assert not any(isinstance(m, QuantLinear) for m in fallback.modules()), variant.name
    finally:
        kernels().set_backend(start)
