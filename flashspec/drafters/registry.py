"""Drafters by name, and the drafters an engine gets when it is given none.

``load_drafters`` turns names, models and ready drafters into drafters; ``default_drafters`` is
the one default policy, which ``SpeculativeEngine.from_pretrained`` and ``EngineOptions.build``
(``flashspec generate``, ``flashspec serve``) both follow.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ..config import AUTO_DTYPE
from ..models import DEMO_DRAFT_NAME, DEMO_NAME, TargetModel, load_pretrained, place_model
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


def default_drafters(
    target_name: str | None,
    target: TargetModel,
    *,
    shipped: Callable[[str, TargetModel], Drafter | None],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    models: Mapping[str, torch.nn.Module] | None = None,
) -> list[Drafter]:
    """The drafters of an engine given none, for the target named ``target_name`` (None: one
    given as a model) and loaded as ``target``: the demo draft for the demo target; otherwise
    prompt lookup, after the draft flashspec ships for a named target, if it has one.

    Args:
        shipped: the draft shipped for a named target, attached to ``target``, or None
            (``flashspec.loading.bundled_drafter``; passed in, because the loaders import the
            drafters).
        device, dtype, models: as for ``load_drafters``.
    """
    demo = target_name == DEMO_NAME
    names = [DEMO_DRAFT_NAME] if demo else [PROMPT_LOOKUP_NAMES[0]]
    drafters = load_drafters(names, device=device, dtype=dtype, models=models)
    bundled = None if demo or target_name is None else shipped(target_name, target)
    return drafters if bundled is None else [bundled, *drafters]
