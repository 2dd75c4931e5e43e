"""The target's tokenizer as llguidance sees it: the bytes of every token id.

llguidance reads a fast HF tokenizer's own description where it can (byte-level BPE,
SentencePiece); for any other (a character-level tokenizer, a decoder it does not know) the
bytes of each id are taken from the tokenizer's own decoding, one id at a time.
"""

from __future__ import annotations

import threading
from typing import Any

_CACHE: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, LLTokenizer)
_LOCK = threading.Lock()


class _Decoded:
    """A tokenizer described by decoding each id (llguidance's ``TokenizerWrapper`` input)."""

    def __init__(self, tokenizer: Any, vocab: int, eos: list[int]) -> None:
        self.eos_token_id = eos[0]
        self.bos_token_id = getattr(tokenizer, "bos_token_id", None)
        special = {int(i) for i in getattr(tokenizer, "all_special_ids", ())} | set(eos)
        self.special_token_ids = sorted(i for i in special if 0 <= i < vocab)
        self.tokens = [
            b"" if i in special else tokenizer.decode([i]).encode("utf-8") for i in range(vocab)
        ]
        self._tokenizer = tokenizer

    def __call__(self, text: bytes | str) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        return list(self._tokenizer.encode(text, add_special_tokens=False))


def ll_tokenizer(tokenizer: Any, eos: list[int]) -> Any:
    """The ``llguidance.LLTokenizer`` of an HF tokenizer (built once per tokenizer: ~1 s for
    a 50k vocabulary), with ``eos`` as its end tokens.

    Raises:
        ImportError: llguidance is not installed (the message says how to install it).
    """
    try:
        import llguidance
        import llguidance.hf
    except ImportError:
        raise ImportError(
            "structured output needs llguidance: pip install 'flashspec[grammar]' "
            "(or pip install llguidance)"
        ) from None
    with _LOCK:
        hit = _CACHE.get(id(tokenizer))
        if hit is not None and hit[0] is tokenizer:
            return hit[1]
        vocab = len(tokenizer)
        try:
            built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos)
        except (ValueError, TypeError):
            wrapper = llguidance.TokenizerWrapper(_Decoded(tokenizer, vocab, eos))
            built = llguidance.LLTokenizer(wrapper, n_vocab=vocab, eos_token=eos)
        _CACHE[id(tokenizer)] = (tokenizer, built)
        return built
