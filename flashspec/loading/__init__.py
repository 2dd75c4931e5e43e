"""Where models come from: the bundled demo pair, real models named by a short name (installed
from the package registry), GGUF files (dequantized once, then cached), local directories and
hub ids. ``load_pretrained`` is the one entry; ``resolve_model_path`` maps names to paths."""

from __future__ import annotations

from .cache import cache_dir
from .drafts import bundled_draft, bundled_drafter, is_shared_head_folder, shared_head_drafter
from .gguf import MissingDependencyError, is_gguf, load_gguf
from .named import NAMED_MODELS, ModelNotInstalledError, NamedModel, resolve_named
from .pretrained import load_pretrained, resolve_model_path

__all__ = [
    "NAMED_MODELS",
    "MissingDependencyError",
    "ModelNotInstalledError",
    "NamedModel",
    "bundled_draft",
    "bundled_drafter",
    "cache_dir",
    "is_gguf",
    "is_shared_head_folder",
    "load_gguf",
    "load_pretrained",
    "resolve_model_path",
    "resolve_named",
    "shared_head_drafter",
]
