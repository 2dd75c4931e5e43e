"""Tiny seeded models and an in-memory character tokenizer (no downloads): the builders every
folder's tests share (``tests/conftest.py`` serves two of them as fixtures)."""

from __future__ import annotations

import string
from typing import Any

CHARS = string.ascii_lowercase + string.digits + " .,:;()[]=+-*/_'\"\n"
SPECIALS = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0..3, matching LlamaConfig's bos=1, eos=2


def build_char_tokenizer(extra: str = "") -> Any:
    """A character-level PreTrainedTokenizerFast over CHARS (58 tokens) and the ``extra``
    characters after them (ids 58...), built in memory."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + list(CHARS + extra))}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
    )


def build_llama(
    seed: int,
    vocab_size: int = len(SPECIALS) + len(CHARS),
    layers: int = 2,
    hidden: int = 64,
    init_range: float = 0.15,
    max_positions: int = 256,
) -> Any:
    """A seeded random LlamaForCausalLM in eval mode (float32, CPU)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        initializer_range=init_range,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def perturbed_copy(model: Any, noise: float, seed: int) -> Any:
    """A copy of ``model`` with Gaussian noise on every weight: a drafter that mostly agrees."""
    import copy

    import torch

    clone = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in clone.parameters():
            # A one-element parameter has no spread (its std is NaN, which would poison the
            # copy); it gets the floor like a constant one.
            spread = param.std() if param.numel() > 1 else param.new_zeros(())
            param.add_(
                torch.randn(param.shape, generator=generator) * noise * spread.clamp_min(1e-3)
            )
    return clone
