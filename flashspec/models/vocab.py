"""Token ids a model reads from its configs: end-of-sequence ids, and whether a drafter's
vocabulary is its target's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .causal import CausalLM


def eos_ids(*sources: Any) -> list[int]:
    """The end-of-sequence ids of the first of ``sources`` (configs, a tokenizer) that has any."""
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else [int(v) for v in value]
        if ids:
            return ids
    return []


def check_same_vocabulary(target: CausalLM, drafter: CausalLM) -> None:
    """Refuse a drafter whose vocabulary differs from the target's.

    Raises:
        ValueError: naming both models, both sizes and what to use instead.
    """
    hint = (
        "a model drafter must use the target's tokenizer and vocabulary; pick a drafter "
        "from the same "
        "model family, or use the prompt-lookup drafter, which needs no model"
    )
    if drafter.vocab_size != target.vocab_size:
        raise ValueError(
            f"drafter {drafter.name!r} has a vocabulary of {drafter.vocab_size} tokens but "
            f"target {target.name!r} has {target.vocab_size}; {hint}"
        )
    both = target.tokenizer is not None and drafter.tokenizer is not None
    if both and _vocab(target.tokenizer) != _vocab(drafter.tokenizer):
        raise ValueError(
            f"drafter {drafter.name!r} and target {target.name!r} have vocabularies of the same "
            f"size ({target.vocab_size}) but different tokens; {hint}"
        )


def _vocab(tokenizer: Any) -> dict[str, int] | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    return dict(get_vocab()) if callable(get_vocab) else None


def as_id_list(value: int | Sequence[int] | None) -> list[int]:
    """``None`` -> [], ``5`` -> [5], ``[5, 7]`` -> [5, 7]."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]
