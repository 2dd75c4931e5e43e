"""Where models come from: the bundled demo pair, real models named by a short name (installed
from the package registry), GGUF files (dequantized once, then cached), local directories and
hub ids. ``load_pretrained`` is the one entry; ``resolve_model_path`` maps names to paths.

The drafts flashspec ships, and drafts in folders, load from ``flashspec.loading.drafts``, which
this package does not import: it builds drafters, and the models they wrap import the loaders
here (importing it from here would make models -> loading -> drafters -> models a cycle).
"""

from __future__ import annotations

from .cache import cache_dir
from .gguf import MissingDependencyError, is_gguf, load_gguf
from .named import NAMED_MODELS, ModelNotInstalledError, NamedModel, resolve_named
from .pretrained import load_pretrained, resolve_model_path

__all__ = [
    "NAMED_MODELS",
    "MissingDependencyError",
    "ModelNotInstalledError",
    "NamedModel",
    "cache_dir",
    "is_gguf",
    "load_gguf",
    "load_pretrained",
    "resolve_model_path",
    "resolve_named",
]
