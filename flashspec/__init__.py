"""flashspec: lossless speculative decoding for HuggingFace causal language models.

The native residual kernel is ``flashspec._residual`` (see its ``residual_dist`` and
``residual_sample``); the engine API is re-exported here.

The re-exports are lazy (PEP 562): ``import flashspec._residual`` must work with numpy
alone (wheel checks, kernel tests), so nothing here imports torch until an engine name
is used.

Earlier names (``TRITON_AVAILABLE`` among them) are listed in ``flashspec.legacy``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._lazy import lazy_exports

__version__ = "0.1.0"

_EXPORTS: dict[str, str] = {
    "TRITON_AVAILABLE": ".legacy",
    "Selector": ".select.bandit",
    "ThompsonSelector": ".select.bandit",
    "UCB1Selector": ".select.bandit",
    "make_selector": ".select.bandit",
    "BanditConfig": ".config",
    "FlashSpecConfig": ".config",
    "SamplingConfig": ".config",
    "Drafter": ".drafters",
    "ModelDrafter": ".drafters",
    "PromptLookupDrafter": ".drafters",
    "load_drafters": ".drafters",
    "Arm": ".engine",
    "GenerationResult": ".engine",
    "GenerationStats": ".engine",
    "SpeculativeEngine": ".engine",
    "StreamChunk": ".engine",
    "TokenLogprob": ".engine",
    "TokenStream": ".engine",
    "TargetModel": ".models",
    "resolve_model_path": ".models",
    "ThroughputModel": ".select.throughput",
}

__all__ = [
    "TRITON_AVAILABLE",
    "Arm",
    "BanditConfig",
    "Drafter",
    "FlashSpecConfig",
    "GenerationResult",
    "GenerationStats",
    "ModelDrafter",
    "PromptLookupDrafter",
    "SamplingConfig",
    "Selector",
    "SpeculativeEngine",
    "StreamChunk",
    "TargetModel",
    "ThompsonSelector",
    "ThroughputModel",
    "TokenLogprob",
    "TokenStream",
    "UCB1Selector",
    "__version__",
    "load_drafters",
    "make_selector",
    "resolve_model_path",
]

if TYPE_CHECKING:
    from .config import BanditConfig, FlashSpecConfig, SamplingConfig
    from .drafters import Drafter, ModelDrafter, PromptLookupDrafter, load_drafters
    from .engine import (
        Arm,
        GenerationResult,
        GenerationStats,
        SpeculativeEngine,
        StreamChunk,
        TokenLogprob,
        TokenStream,
    )
    from .legacy import TRITON_AVAILABLE
    from .models import TargetModel, resolve_model_path
    from .select.bandit import Selector, ThompsonSelector, UCB1Selector, make_selector
    from .select.throughput import ThroughputModel


__getattr__, __dir__ = lazy_exports(globals(), _EXPORTS)
