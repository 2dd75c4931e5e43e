"""Logprobs as the OpenAI API shows them: the engine's ``TokenLogprob`` (ids and numbers) with
each token's text and bytes, then the completions and chat forms.

The numbers are the target's own (log-softmax of the raw logits that verified each token,
before penalties, bias, temperature, top-k/top-p and grammar masks), the same with speculation
as without it. A token's text is the tokenizer's decoding of that id alone, and its bytes that
text's UTF-8: a token holding part of a multi-byte character shows as U+FFFD.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from ..engine import TokenLogprob

# JSON has no -Infinity: a token the model gives probability 0 reports this instead (vLLM's).
FLOOR = -9999.0


@dataclass(frozen=True)
class TokenInfo:
    """One emitted token's logprob with its text, and its alternatives (text, bytes,
    logprob), most likely first. An echoed prompt's first token has no logprob (None)."""

    token: str
    bytes: list[int]
    logprob: float | None
    top: tuple[tuple[str, list[int], float], ...] = ()


def describe(tokenizer: Any, entries: Sequence[TokenLogprob]) -> list[TokenInfo]:
    """The engine's logprobs of a chunk with each token's text."""
    text = _decoder(tokenizer)
    out: list[TokenInfo] = []
    for entry in entries:
        token = text(entry.token)
        top = tuple((text(t), list(text(t).encode()), _finite(v)) for t, v in entry.top)
        out.append(TokenInfo(token, list(token.encode()), _finite(entry.logprob), top))
    return out


def token_info(tokenizer: Any, token: int) -> TokenInfo:
    """A token with its text and no logprob (an echoed prompt's first token)."""
    text = _decoder(tokenizer)(token)
    return TokenInfo(text, list(text.encode()), None)


def completion_logprobs(infos: Sequence[TokenInfo], top: bool) -> dict[str, Any]:
    """The ``logprobs`` object of a ``text_completion`` choice (or chunk): tokens, their
    logprobs, the alternatives as {text: logprob} (when asked; null for a token without a
    logprob), each token's offset in the choice's text."""
    offsets: list[int] = []
    at = 0
    for info in infos:
        offsets.append(at)
        at += len(info.token)
    return {
        "tokens": [info.token for info in infos],
        "token_logprobs": [info.logprob for info in infos],
        "top_logprobs": [
            None if info.logprob is None else {t: v for t, _, v in info.top} for info in infos
        ]
        if top
        else None,
        "text_offset": offsets,
    }


def chat_logprobs(infos: Sequence[TokenInfo]) -> dict[str, Any]:
    """The ``logprobs`` object of a ``chat.completion`` choice (or chunk)."""
    return {
        "content": [
            {
                "token": info.token,
                "logprob": info.logprob,
                "bytes": info.bytes,
                "top_logprobs": [{"token": t, "logprob": v, "bytes": b} for t, b, v in info.top],
            }
            for info in infos
        ],
        "refusal": None,
    }


def _finite(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


_DECODERS: dict[int, tuple[Any, Any]] = {}  # id(tokenizer) -> (tokenizer, cached decode)


def _decoder(tokenizer: Any) -> Any:
    """A cached id -> text of one tokenizer (decoding is the cost of logprobs otherwise)."""
    hit = _DECODERS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]

    @lru_cache(maxsize=65536)
    def text(token: int) -> str:
        return f"<{token}>" if tokenizer is None else str(tokenizer.decode([token]))

    _DECODERS[id(tokenizer)] = (tokenizer, text)
    return text
