"""Drafters by name: ``load_drafters`` turns names, models and ready drafters into drafters."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..config import AUTO_DTYPE
from ..models import load_pretrained, place_model
from .base import Drafter
from .lookup import PromptLookupDrafter
from .model import ModelDrafter

PROMPT_LOOKUP_NAMES = ("prompt_lookup", "prompt-lookup", "ngram")


def load_drafters(
    names: Sequence[str | torch.nn.Module | Drafter],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    temperature: float | None = None,
    models: Mapping[str, torch.nn.Module] | None = None,
    tokenizers: Mapping[str, Any] | None = None,
) -> list[Drafter]:
    """Build drafters from names.

    Args:
        names: for each drafter, a local path / hub id, ``"prompt_lookup"``, a key of ``models``,
            a loaded model, or a ready ``Drafter``.
        device, dtype: where and how to load models given by name (models in ``models`` are moved
            or cast only when these are given).
        temperature: optional drafting temperature of model drafters (default: the engine's).
        models: already-loaded models by name, so nothing is downloaded.
        tokenizers: tokenizers by name, used for the vocabulary check.

    Raises:
        TypeError / ValueError: for entries that are none of the above.
    """
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"load_drafters expects a list of names, got the string {names!r}; use [{names!r}]"
        )
    models = models or {}
    tokenizers = tokenizers or {}
    drafters: list[Drafter] = []
    for entry in names:
        if isinstance(entry, Drafter):
            drafters.append(entry)
        elif isinstance(entry, torch.nn.Module):
            drafters.append(
                ModelDrafter(place_model(entry, device, dtype), temperature=temperature)
            )
        elif isinstance(entry, str) and entry in PROMPT_LOOKUP_NAMES:
            drafters.append(PromptLookupDrafter())
        elif isinstance(entry, str) and entry in models:
            model = place_model(models[entry], device, dtype)
            drafters.append(
                ModelDrafter(
                    model, name=entry, tokenizer=tokenizers.get(entry), temperature=temperature
                )
            )
        elif isinstance(entry, str):
            model, tokenizer = load_pretrained(
                entry, device or "cpu", dtype if dtype is not None else AUTO_DTYPE
            )
            drafters.append(
                ModelDrafter(model, name=entry, tokenizer=tokenizer, temperature=temperature)
            )
        else:
            raise TypeError(
                f"load_drafters: cannot make a drafter from {type(entry).__name__}; pass a path "
                f"or hub id, one of {PROMPT_LOOKUP_NAMES}, a key of models=, a model or a Drafter"
            )
    return drafters
