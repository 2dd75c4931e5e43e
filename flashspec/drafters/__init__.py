"""Drafters: cheap proposers of the next few tokens, and the draft models they run.

- ``base``: the contract between the engine and a drafter (``Drafter``, ``DraftContext``,
  ``Proposal``);
- ``model``: ``ModelDrafter``, a small causal LM on its own cache;
- ``lookup``: ``PromptLookupDrafter``, n-gram lookup in the row's own text;
- ``features``: ``FeatureDrafter``, a draft that reads the target's hidden states;
- ``merged``: ``MergedDrafter``, two drafters' token trees verified as one;
- ``shared_head``: draft models that share the target's embedding and head;
- ``registry``: drafters by name (``load_drafters``) and the default ones (``default_drafters``).

The re-exports are lazy (PEP 562): ``flashspec.loading`` reads ``shared_head`` without
importing the drafters, which import the models that import ``flashspec.loading``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "DraftContext": ".base",
    "Drafter": ".base",
    "Proposal": ".base",
    "tree_depth": ".base",
    "with_temperature": ".base",
    "ModelDrafter": ".model",
    "RowStops": ".model",
    "pick_draft": ".model",
    "PromptLookupDrafter": ".lookup",
    "FeatureDrafter": ".features",
    "MergedDrafter": ".merged",
    "PROMPT_LOOKUP_NAMES": ".registry",
    "default_drafters": ".registry",
    "load_drafters": ".registry",
}

__all__ = [
    "PROMPT_LOOKUP_NAMES",
    "DraftContext",
    "Drafter",
    "FeatureDrafter",
    "MergedDrafter",
    "ModelDrafter",
    "PromptLookupDrafter",
    "Proposal",
    "RowStops",
    "default_drafters",
    "load_drafters",
    "pick_draft",
    "tree_depth",
    "with_temperature",
]

if TYPE_CHECKING:
    from .base import DraftContext, Drafter, Proposal, tree_depth, with_temperature
    from .features import FeatureDrafter
    from .lookup import PromptLookupDrafter
    from .merged import MergedDrafter
    from .model import ModelDrafter, RowStops, pick_draft
    from .registry import PROMPT_LOOKUP_NAMES, default_drafters, load_drafters

__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
