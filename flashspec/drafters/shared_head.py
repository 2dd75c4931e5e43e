"""Draft models that share the target's token embedding and LM head, drafting over a subset of
the vocabulary.

A draft of this kind owns only its transformer layers and final norm (a few MB); its input
embedding is the target's own module and its head the target's output rows for ``ids``, the
tokens it may propose (FR-Spec, 2025: the most frequent tokens of the target's own outputs).
Outside ``ids`` its logits are ``-inf``, so its distribution q is exactly zero there: the
rejection step stays exact, since the residual ``max(0, p - q)`` covers every token the draft
cannot propose, and greedy drafting picks the best token inside the subset.

``build_shared_head_draft`` makes one (random layers, for training); ``save_shared_head_draft``
writes only what it owns; ``load_shared_head_draft`` attaches a saved one to a target. The
result is a HuggingFace causal LM: ``ModelDrafter`` drafts with it like any other.

A draft built with ``reads="features"`` takes, at each position, the target's final hidden state
there together with the embedding of the next token (EAGLE, Li et al. 2024, drafts from the
target's features like this), fused by a linear map (``FeatureFuse``) into its layers; its own
final hidden state stands in for the target's at the positions it drafts. ``FeatureDrafter``
(``flashspec.drafters.features``) drafts with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from ..quant.layers import QuantEmbedding, QuantLinear

CONFIG_FILE = "shared_head_draft.json"
WEIGHTS_FILE = "layers.safetensors"
FORMAT = "flashspec-shared-head-draft/1"
INPUTS = ("tokens", "features")
"""What a shared-head draft reads at each position: a token, or the target's hidden state there
with the next token (see the module docstring)."""
# What the draft takes from the target and so never saves.
SHARED_PREFIXES = ("model.embed_tokens.", "lm_head.")


class SubsetHead(torch.nn.Module):
    """The target's LM head restricted to ``ids``: full-width logits, ``-inf`` elsewhere.

    Args:
        weight: the target's output embedding (vocab x hidden), or its quantized head
            (``flashspec.quant.QuantLinear``); rows ``ids`` are copied once, at their exact
            values.
        ids: the token ids the draft may propose (distinct, in range).
        vocab_size: the logits' width (the target's).
    """

    def __init__(
        self, weight: torch.Tensor | QuantLinear, ids: torch.Tensor, vocab_size: int
    ) -> None:
        super().__init__()
        device = weight.blocks.device if isinstance(weight, QuantLinear) else weight.device
        ids = torch.as_tensor(ids, dtype=torch.long, device=device).flatten()
        if ids.numel() == 0:
            raise ValueError("ids: a shared-head draft needs at least one token id")
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            raise ValueError(f"ids: every token id must be in [0, {vocab_size}), got "
                             f"[{int(ids.min())}, {int(ids.max())}]")  # fmt: skip
        if torch.unique(ids).numel() != ids.numel():
            raise ValueError("ids: token ids must be distinct")
        self.vocab_size = vocab_size
        self.hidden = (
            weight.in_features if isinstance(weight, QuantLinear) else int(weight.shape[1])
        )
        self.register_buffer("ids", ids, persistent=False)
        # A quantized head's rows stay blocks: a draft step reads a quarter of the bytes, and
        # their float copy (19 MB for SmolLM2's 8,193 rows) is made only if a step needs it.
        self.quantized = weight.subset(ids) if isinstance(weight, QuantLinear) else None
        # A buffer, not a parameter: the rows are the target's, trained with it, not here.
        rows = None if isinstance(weight, QuantLinear) else weight.detach()[ids].clone()
        self.register_buffer("rows", rows, persistent=False)

    def dense(self) -> torch.Tensor:
        """The subset's rows at their exact float32 values, (len(ids), hidden)."""
        rows = self._buffers.get("rows")
        if rows is None:
            assert self.quantized is not None
            rows = self.quantized.dense_weight()
            self.register_buffer("rows", rows, persistent=False)
        return rows

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: the subset's scores, ``-inf`` elsewhere."""
        ids = self.get_buffer("ids")
        scores: torch.Tensor
        if self.quantized is not None and hidden.dtype == torch.float32:
            scores = self.quantized(hidden)
        else:
            scores = hidden @ self.dense().to(hidden.dtype).T
        logits = scores.new_full((*scores.shape[:-1], self.vocab_size), float("-inf"))
        logits[..., ids] = scores
        return logits


class FeatureFuse(torch.nn.Module):
    """The input of a features draft: ``[feature; embedding]`` mapped to the hidden width."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(2 * hidden, hidden)

    def forward(self, features: torch.Tensor, embeds: torch.Tensor) -> torch.Tensor:
        """(B, n, hidden) features and (B, n, hidden) embeddings to (B, n, hidden) inputs."""
        fused: torch.Tensor = self.proj(torch.cat([features.to(embeds.dtype), embeds], dim=-1))
        return fused


def draft_input(draft: torch.nn.Module) -> str:
    """What ``draft`` reads: ``"features"`` if it has a ``FeatureFuse``, else ``"tokens"``."""
    return "features" if isinstance(getattr(draft, "fuse", None), FeatureFuse) else "tokens"


def feature_hidden(
    draft: torch.nn.Module, features: torch.Tensor, next_ids: torch.Tensor, **kwargs: Any
) -> torch.Tensor:
    """A features draft's final hidden states (B, n, hidden) for the target's ``features`` at
    n positions and the tokens after them (``next_ids`` (B, n)); ``kwargs`` go to its decoder
    (cache, positions, mask)."""
    model: Any = draft
    embeds = model.model.embed_tokens(next_ids)
    hidden: torch.Tensor = model.model(
        inputs_embeds=model.fuse(features, embeds), **kwargs
    ).last_hidden_state
    return hidden


class _Head:
    """The target's LM head as a draft sees it: its (vocab, hidden) shape, its device and the
    dtype the draft's layers take, and the head itself (a weight, or quantized blocks)."""

    def __init__(self, head: Any) -> None:
        self.source: torch.Tensor | QuantLinear
        if isinstance(head, QuantLinear):
            # Quantized layers run float32 activations: the draft's layers do too.
            self.source = head
            self.shape = (head.out_features, head.in_features)
            self.device, self.dtype = head.blocks.device, torch.float32
        else:
            self.source = head.weight
            self.shape = (int(head.weight.shape[0]), int(head.weight.shape[1]))
            self.device, self.dtype = head.weight.device, head.weight.dtype


def _target_parts(target: torch.nn.Module) -> tuple[torch.nn.Module, _Head, Any]:
    embed = target.get_input_embeddings()  # type: ignore[operator]
    head = target.get_output_embeddings()  # type: ignore[operator]
    weight = getattr(head, "weight", None)
    linear = isinstance(head, QuantLinear) or isinstance(weight, torch.Tensor)
    if not isinstance(embed, (torch.nn.Embedding, QuantEmbedding)) or not linear:
        raise ValueError(
            f"target {type(target).__name__}: a shared-head draft needs a token embedding and "
            "a linear LM head (get_input_embeddings / get_output_embeddings)"
        )
    config: Any = target.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return embed, _Head(head), text


class _Defaults:
    """A config read attribute by attribute, None where it has none."""

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name, None)


def build_shared_head_draft(
    target: torch.nn.Module,
    ids: torch.Tensor | list[int],
    *,
    layers: int = 1,
    intermediate_size: int | None = None,
    reads: str = "tokens",
) -> torch.nn.Module:
    """A new draft for ``target``: ``layers`` Llama decoder layers of the target's width on the
    target's embedding, and its head over ``ids``. The layers start random (train them).
    ``reads="features"`` adds the ``FeatureFuse`` of a draft that reads the target's hidden
    states (see the module docstring).

    Raises:
        ValueError: the target has no embedding/linear head, ``ids`` are bad, or ``reads`` is
            not one of ``INPUTS``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if reads not in INPUTS:
        raise ValueError(f"reads must be one of {INPUTS}, got {reads!r}")

    _, head, text = _target_parts(target)
    text = _Defaults(text)
    vocab, hidden = head.shape
    heads = int(text.num_attention_heads or max(1, hidden // 64))
    settings: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": int(intermediate_size or text.intermediate_size or 4 * hidden),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(text.num_key_value_heads or heads),
        "head_dim": int(text.head_dim or hidden // heads),
        "max_position_embeddings": int(text.max_position_embeddings or 2048),
        "rms_norm_eps": float(text.rms_norm_eps or 1e-5),
        "tie_word_embeddings": False,
        "bos_token_id": text.bos_token_id,
        "eos_token_id": text.eos_token_id,
        "pad_token_id": text.pad_token_id,
    }
    # The draft's positions rotate as the target's do (transformers 5 keeps RoPE settings in
    # rope_parameters).
    rope = text.rope_parameters
    if isinstance(rope, dict) and rope:
        settings["rope_parameters"] = dict(rope)
    config: Any = LlamaConfig(**settings)
    config._attn_implementation = "sdpa"
    draft: Any = LlamaForCausalLM(config)
    if reads == "features":
        draft.fuse = FeatureFuse(hidden)
    draft = draft.to(device=head.device, dtype=head.dtype)
    attach(draft, target, ids)
    built: torch.nn.Module = draft
    return built


def attach(draft: torch.nn.Module, target: torch.nn.Module, ids: torch.Tensor | list[int]) -> None:
    """Make ``draft`` use ``target``'s embedding module and its head rows for ``ids``."""
    embed, head, _ = _target_parts(target)
    draft.model.embed_tokens = embed  # type: ignore[union-attr]
    draft.lm_head = SubsetHead(head.source, torch.as_tensor(ids), head.shape[0])


def own_state(draft: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The draft's own tensors: its layers and norm (what training changes and saving keeps)."""
    return {
        name: tensor
        for name, tensor in draft.state_dict().items()
        if not name.startswith(SHARED_PREFIXES)
    }


def save_shared_head_draft(draft: torch.nn.Module, directory: str | Path) -> Path:
    """Write ``draft``'s own layers (float16), its config and its token ids to ``directory``."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in own_state(draft).items()}
    save_file(tensors, str(out / WEIGHTS_FILE))
    model: Any = draft
    ids = model.lm_head.ids
    meta = {
        "format": FORMAT,
        "input": draft_input(draft),
        "config": model.config.to_dict(),
        "ids": [int(i) for i in ids.tolist()],
    }
    (out / CONFIG_FILE).write_text(json.dumps(meta))
    return out


def _llama_config(settings: dict[str, Any]) -> Any:
    from transformers import LlamaConfig

    config: Any = LlamaConfig.from_dict(settings)
    config._attn_implementation = "sdpa"
    return config


def _transformers_llama(config: Any) -> Any:
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM(config)


def _own_llama(target: torch.nn.Module, settings: dict[str, Any]) -> Any:
    """The draft as ``flashspec.quant.llama``'s Llama (parameters on the meta device, to be
    filled), when the target is one too and the draft's layers will run the C step beside it
    (``flashspec.quant.draft_blocks``): the draft then needs none of transformers' modeling
    code either. None otherwise (transformers' ``LlamaForCausalLM`` is built)."""
    from transformers import PretrainedConfig

    from ..quant import draft_blocks
    from ..quant.llama import FusedLlamaForCausalLM, fits

    if type(target) is not FusedLlamaForCausalLM or not draft_blocks.enabled():
        return None
    config: Any = PretrainedConfig.from_dict(settings)
    if fits(config) is not None:
        return None
    config._attn_implementation = "sdpa"
    return FusedLlamaForCausalLM(config)


def load_shared_head_draft(directory: str | Path, target: torch.nn.Module) -> torch.nn.Module:
    """The draft saved in ``directory``, attached to ``target`` (its device and dtype).

    Raises:
        ValueError: not a shared-head draft, or one made for another width or vocabulary.
    """
    from safetensors.torch import load_file

    folder = Path(directory)
    meta = json.loads((folder / CONFIG_FILE).read_text())
    if meta.get("format") != FORMAT:
        raise ValueError(f"{folder}: not a flashspec shared-head draft ({meta.get('format')!r})")
    own = _own_llama(target, meta["config"])
    config: Any = own.config if own is not None else _llama_config(meta["config"])
    _, head, _ = _target_parts(target)
    if (config.vocab_size, config.hidden_size) != head.shape:
        raise ValueError(
            f"{folder}: made for a vocabulary of {config.vocab_size} and width "
            f"{config.hidden_size}, but the target's head is {head.shape}"
        )
    draft: Any = own if own is not None else _transformers_llama(config)
    kind = meta.get("input", "tokens")
    if kind not in INPUTS:
        raise ValueError(f"{folder}: unknown draft input {kind!r} (this flashspec reads {INPUTS})")
    if kind == "features":
        draft.fuse = FeatureFuse(config.hidden_size)
    state = load_file(str(folder / WEIGHTS_FILE))
    if own is not None:  # built without storage: its parameters take the file's tensors
        state = {name: tensor.to(head.dtype) for name, tensor in state.items()}
    missing, unexpected = draft.load_state_dict(state, strict=False, assign=own is not None)
    lost = [k for k in missing if not k.startswith(SHARED_PREFIXES)]
    if lost or unexpected:
        raise ValueError(f"{folder}: weights do not match the config (missing {lost}, "
                         f"unexpected {unexpected})")  # fmt: skip
    if own is None:
        draft = draft.to(device=head.device, dtype=head.dtype)
    draft = draft.eval()
    attach(draft, target, meta["ids"])
    loaded: torch.nn.Module = draft
    return loaded
