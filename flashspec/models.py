"""Models: loading by name, the KV-cache bookkeeping shared by target and drafters, and the target.

A ``CausalLM`` wraps a HuggingFace causal LM together with its KV cache and one integer,
``cached``: how many leading columns of the committed token matrix the cache holds. Every
forward feeds the columns after ``cached``; rolling back after a rejection is a crop to the
number of columns still valid. Nothing is ever recomputed from the start of the prompt.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ._compat import ForwardSignature, crop_cache, has_sliding_layers, new_cache, select_cache_rows
from .config import resolve_dtype

DEMO_NAME = "demo"
DEMO_DRAFT_NAME = "demo-draft"
DEMO_DRAFT3_NAME = "demo-draft3"
# The bundled pair (scripts/train_demo_pair.py): package data beside this module.
DEMO_DIR = Path(__file__).resolve().parent / "demo"
# Each bundled drafter's name -> its directory under DEMO_DIR.
_DEMO_DRAFTERS = {DEMO_DRAFT_NAME: "draft", DEMO_DRAFT3_NAME: "draft3"}
# Every name resolve_model_path maps into DEMO_DIR.
DEMO_NAMES = frozenset({DEMO_NAME, *_DEMO_DRAFTERS})


def resolve_model_path(name: str | os.PathLike[str] | None) -> str:
    """Map a user-facing model name to what ``from_pretrained`` accepts.

    Local directories and hub ids pass through unchanged. ``None`` and ``"demo"`` name the
    bundled demo target, ``"demo-draft"`` its distilled 1-layer drafter and ``"demo-draft3"`` a
    second, 3-layer one (``flashspec/demo/``).

    Raises:
        FileNotFoundError: when the demo pair is named but missing from this installation.
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
    return os.fspath(name)


def load_pretrained(
    name: str | None, device: str | torch.device = "cpu", dtype: str | torch.dtype = torch.float32
) -> tuple[torch.nn.Module, Any]:
    """Load ``(model, tokenizer)`` for a causal LM; tokenizer is None if the checkpoint has none."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = resolve_model_path(name)
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(dtype))
    model = model.to(device).eval()
    try:
        tokenizer: Any = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        tokenizer = None
    return model, tokenizer


class Padding:
    """Left padding of a batch: where each row's real tokens start.

    Row b's token in column j sits at position ``j - left[b]``; columns before ``left[b]`` are
    padding, masked out and given position 0 (as HF ``generate`` does).
    """

    def __init__(self, left: torch.Tensor) -> None:
        self.left = left
        # Without padding the models can take their faster unmasked causal path.
        self.any = bool(left.numel() and int(left.max()) > 0)

    def position_ids(self, start: int, length: int) -> torch.Tensor:
        """(B, length) positions of columns ``start .. start + length - 1``."""
        columns = torch.arange(start, start + length, device=self.left.device)
        if not self.any:
            return columns.unsqueeze(0).expand(self.left.shape[0], -1)
        return (columns.unsqueeze(0) - self.left.unsqueeze(1)).clamp_min(0)

    def attention_mask(self, total: int) -> torch.Tensor | None:
        """(B, total) mask of columns ``0 .. total - 1``, or None when no row is padded."""
        if not self.any:
            return None
        columns = torch.arange(total, device=self.left.device)
        return (columns.unsqueeze(0) >= self.left.unsqueeze(1)).to(torch.int64)

    def select(self, index: torch.Tensor) -> Padding:
        """The layout of the rows in ``index``."""
        return Padding(self.left.index_select(0, index))


def _eos_ids(*sources: Any) -> list[int]:
    for source in sources:
        value = getattr(source, "eos_token_id", None)
        if value is None:
            continue
        ids = [value] if isinstance(value, int) else [int(v) for v in value]
        if ids:
            return ids
    return []


def _logit_width(model: torch.nn.Module) -> int:
    get_head = getattr(model, "get_output_embeddings", None)
    weight = getattr(get_head() if callable(get_head) else None, "weight", None)
    if isinstance(weight, torch.Tensor):
        return int(weight.shape[0])
    config: Any = getattr(model, "config", None)
    return int(
        config.get_text_config().vocab_size
        if hasattr(config, "get_text_config")
        else config.vocab_size
    )


def _max_positions(config: Any) -> int | None:
    value = getattr(config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


class CausalLM:
    """A causal LM plus its KV cache, with rollback by cropping.

    Wrap the model after moving it to its device and dtype.

    Attributes:
        model: the HuggingFace model (in eval mode).
        name: a label for messages and stats.
        tokenizer: the model's tokenizer, if known.
        vocab_size: width of the logits (rows of the output embedding).
        max_context: positions the model can attend over (``max_position_embeddings``), or None.
        cached: committed columns whose keys/values are in ``cache``.
    """

    def __init__(
        self, model: torch.nn.Module, name: str | None = None, tokenizer: Any = None
    ) -> None:
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            raise TypeError(
                "model must be a HuggingFace causal LM (torch.nn.Module with .config), "
                f"got {type(model).__name__}"
            )
        self.model = model.eval()
        self.name = name or str(getattr(model.config, "name_or_path", "") or type(model).__name__)
        self.tokenizer = tokenizer
        self.signature = ForwardSignature.of(model)
        # Read once: HF config attribute access is slow enough to show up per round.
        self.vocab_size = _logit_width(model)
        self.max_context = _max_positions(self.config)
        self.cache: Any = None
        self.cached = 0
        self._sliding = False

    @property
    def config(self) -> Any:
        """The model's (text) config."""
        model: Any = self.model
        config = model.config
        return config.get_text_config() if hasattr(config, "get_text_config") else config

    @property
    def device(self) -> torch.device:
        """Device of the model's parameters."""
        return next(self.model.parameters()).device

    @property
    def eos_token_ids(self) -> list[int]:
        """End-of-sequence ids from the generation config, model config or tokenizer."""
        return _eos_ids(getattr(self.model, "generation_config", None), self.config, self.tokenizer)

    def reset(self) -> None:
        """Start a new generation: empty cache."""
        self.cache = new_cache(self.model)
        self.cached = 0
        self._sliding = has_sliding_layers(self.cache)

    def forward(self, input_ids: torch.Tensor, padding: Padding, keep: int) -> torch.Tensor:
        """Feed the columns after ``cached``; return the last ``keep`` logits, (B, keep, V)."""
        start, length = self.cached, input_ids.shape[1]
        kwargs: dict[str, Any] = {self.signature.cache_arg: self.cache, "use_cache": True}
        if self.signature.position_ids:
            kwargs["position_ids"] = padding.position_ids(start, length)
        if self.signature.attention_mask and padding.any:
            kwargs["attention_mask"] = padding.attention_mask(start + length)
        if self.signature.logits_to_keep:
            kwargs["logits_to_keep"] = keep
        # The cache object is updated in place (every transformers release since 4.56).
        output = self.model(input_ids=input_ids, **kwargs)
        self.cached = start + length
        logits: torch.Tensor = output.logits
        return logits[:, -keep:]

    def rollback(self, valid: int) -> None:
        """Keep only the first ``valid`` columns in the cache (no-op if it holds fewer)."""
        if self.cached > valid:
            crop_cache(self.cache, self.cached - valid)
            self.cached = valid
        elif self._sliding:
            # Sliding layers keep every state until a crop (so rollbacks work); trim them.
            crop_cache(self.cache, 0)

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep only the batch rows in ``index`` (finished rows leave the batch)."""
        if self.cached > 0:
            select_cache_rows(self.cache, index)


class TargetModel(CausalLM):
    """The model whose output distribution the engine reproduces.

    Args:
        hub_id: local directory or hub id; only a label when ``model`` is given.
        device: device to load onto (or to move ``model`` to, if given).
        dtype: dtype to load with (or to cast ``model`` to, if given).
        model: an already-loaded causal LM; nothing is downloaded.
        tokenizer: the model's tokenizer (loaded from ``hub_id`` when the model is loaded by name,
            or when ``hub_id`` is a local directory).
    """

    def __init__(
        self,
        hub_id: str | None = None,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        model: torch.nn.Module | None = None,
        tokenizer: Any = None,
    ) -> None:
        if model is None:
            model, loaded_tokenizer = load_pretrained(
                hub_id, device or "cpu", dtype if dtype is not None else torch.float32
            )
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        else:
            model = place_model(model, device, dtype)
            if tokenizer is None and hub_id is not None and os.path.isdir(hub_id):
                tokenizer = _try_tokenizer(hub_id)
        super().__init__(model, name=hub_id, tokenizer=tokenizer)

    def verify(self, pending: torch.Tensor, drafts: torch.Tensor, padding: Padding) -> torch.Tensor:
        """Score the uncached committed tokens plus the drafts in one forward.

        Returns:
            (B, g + 1, V) logits: entry i predicts the token after draft i - 1 (entry 0 follows
            the last committed token, entry g is the bonus position).
        """
        tokens = torch.cat([pending, drafts], dim=1) if drafts.shape[1] else pending
        return self.forward(tokens, padding, keep=drafts.shape[1] + 1)


def place_model(
    model: torch.nn.Module, device: str | torch.device | None, dtype: str | torch.dtype | None
) -> torch.nn.Module:
    """Move/cast ``model`` only where a device or dtype is given."""
    if device is not None:
        model = model.to(device)
    if dtype is not None:
        model = model.to(resolve_dtype(dtype))
    return model


def _try_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, KeyError):
        return None


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
