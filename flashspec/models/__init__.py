"""Models: a causal LM with its KV cache (``causal``), the target (``target``) with the hidden
states a features draft reads (``features``), left padding (``padding``), token ids
(``vocab``), and the CPU linear layers' tuning (``linear``).

A target's model runs leaner than transformers ships it (``make_lean``: the same operations
without the module overhead; ``tune_linears``: the same products in a faster form on a CPU);
``untuned(model)`` gives it transformers' forward and torch's linear layers back while inside,
for baselines. ``new_cache``, ``crop_cache`` and ``ForwardSignature`` are the cache helpers
every model here uses, for code that calls a model's forward itself.
"""

from __future__ import annotations

from ..kv.compat import ForwardSignature, crop_cache, new_cache
from ..kv.state import UnsupportedModelError

# Loading lives in flashspec.loading; these names stay importable from here.
from ..loading.pretrained import (
    DEMO_DIR,
    DEMO_DRAFT3_NAME,
    DEMO_DRAFT_NAME,
    DEMO_NAME,
    DEMO_NAMES,
    load_pretrained,
    resolve_model_path,
)
from .causal import CausalLM
from .features import FINAL_NORM_NAMES, final_norm
from .linear import untuned
from .padding import Padding
from .target import TargetModel, place_model
from .vocab import as_id_list, check_same_vocabulary

__all__ = [
    "DEMO_DIR",
    "DEMO_DRAFT3_NAME",
    "DEMO_DRAFT_NAME",
    "DEMO_NAME",
    "DEMO_NAMES",
    "FINAL_NORM_NAMES",
    "CausalLM",
    "ForwardSignature",
    "Padding",
    "TargetModel",
    "UnsupportedModelError",
    "as_id_list",
    "check_same_vocabulary",
    "crop_cache",
    "final_norm",
    "load_pretrained",
    "new_cache",
    "place_model",
    "resolve_model_path",
    "untuned",
]
