"""Names to models: ``resolve_model_path`` and ``load_pretrained``."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from ..config import AUTO_DTYPE, resolve_dtype
from .gguf import is_gguf, load_gguf
from .heap import release
from .named import resolve_named

DEMO_NAME = "demo"
DEMO_DRAFT_NAME = "demo-draft"
DEMO_DRAFT3_NAME = "demo-draft3"
# The bundled pair (scripts/train_demo_pair.py): package data of flashspec.
DEMO_DIR = Path(__file__).resolve().parent.parent / "demo"
# Each bundled drafter's name -> its directory under DEMO_DIR.
_DEMO_DRAFTERS = {DEMO_DRAFT_NAME: "draft", DEMO_DRAFT3_NAME: "draft3"}
# Every name resolve_model_path maps into DEMO_DIR.
DEMO_NAMES = frozenset({DEMO_NAME, *_DEMO_DRAFTERS})


def resolve_model_path(name: str | os.PathLike[str] | None) -> str:
    """Map a user-facing model name to a path or hub id.

    ``None`` and ``"demo"`` name the bundled demo target, ``"demo-draft"`` its distilled 1-layer
    drafter and ``"demo-draft3"`` a second, 3-layer one (``flashspec/demo/``). A short name of
    ``flashspec.loading.NAMED_MODELS`` (``"smollm2"``) maps to the model file of its installed
    registry package. Local paths (directories, ``.gguf`` files) and hub ids pass through.

    Raises:
        FileNotFoundError: the demo pair is named but missing from this installation.
        ModelNotInstalledError: (a FileNotFoundError) a named model whose package is not
            installed; the message has the command that installs it.
    """
    if name is None or str(name) in DEMO_NAMES:
        path = DEMO_DIR / _DEMO_DRAFTERS.get(str(name), "target")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"the bundled demo model is missing from this installation ({path}); "
                "reinstall flashspec, or pass target= (and drafters=) as a local directory "
                "or a hub id"
            )
        return str(path)
    named = resolve_named(str(name))
    return named if named is not None else os.fspath(name)


def load_pretrained(
    name: str | os.PathLike[str] | None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = AUTO_DTYPE,
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` for a causal LM; tokenizer is None if the checkpoint has none.

    ``name`` is anything ``resolve_model_path`` takes. A GGUF file with ``dtype="auto"`` on a
    CPU keeps its quantized layers as blocks (``flashspec.quant``); with a dtype it is
    dequantized once and cached (``flashspec.loading.gguf``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    model: Any
    tokenizer: Any
    if is_gguf(path):
        on_cpu = torch.device(device).type == "cpu"
        model, tokenizer = load_gguf(path, dtype if on_cpu else _dense_dtype(dtype))
        release()  # the file's parsed metadata and load temporaries
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError, KeyError):
            tokenizer = None
    return model.to(device).eval(), tokenizer


def _dense_dtype(dtype: str | torch.dtype) -> str | torch.dtype:
    """``dtype`` with ``"auto"`` as float32: the quantized kernels run on the CPU only."""
    return torch.float32 if isinstance(dtype, str) and dtype.lower() == AUTO_DTYPE else dtype
