"""A generation's inputs: prompts in any accepted form as token rows, per-row limits and stop
strings, and the state a generation starts from."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, cast

import torch

from .._validate import is_int
from ..config import FlashSpecConfig, SamplingConfig
from ..grammar import Grammar
from ..grammar.masks import GrammarState
from ..kv.state import UnsupportedModelError
from ..models import Padding, TargetModel, as_id_list
from ..sampling import Warper
from .generation import Generation, Row
from .logprobs import MAX_TOP
from .row_sampling import check_bias_ids, start_sampling

Prompt = str | Sequence[str] | torch.Tensor | Sequence[int] | Sequence[Sequence[int]]
Stop = str | Sequence[str] | Sequence[str | Sequence[str] | None] | None


def prepare(
    target: TargetModel,
    config: FlashSpecConfig,
    prompt: Prompt | None,
    max_new_tokens: int | Sequence[int] | None,
    input_ids: torch.Tensor | None,
    attention_mask: torch.Tensor | None,
    eos_token_id: int | Sequence[int] | None,
    ignore_eos: bool,
    stop: Stop,
    seed: int | Sequence[int | None] | None,
    sampling: SamplingConfig | Sequence[SamplingConfig | None] | None,
    logprobs: int | None = None,
    grammar: Grammar | None = None,
) -> Generation:
    """Check every argument of ``generate``/``stream`` and build the generation's state.

    Raises:
        TypeError / ValueError: naming the argument and what is expected.
    """
    if logprobs is not None and (not is_int(logprobs) or not 0 <= logprobs <= MAX_TOP):
        raise ValueError(
            f"logprobs must be None (off) or an integer in [0, {MAX_TOP}] (the alternatives "
            f"reported per token), got {logprobs!r}"
        )
    if prompt is not None and input_ids is not None:
        raise ValueError("pass the prompt either positionally or as input_ids=, not both")
    rows = tokenize(target, input_ids if input_ids is not None else prompt, attention_mask)
    if max_new_tokens is None:
        max_new_tokens = config.max_new_tokens
    max_new = per_row_limits(128 if max_new_tokens is None else max_new_tokens, len(rows))
    stops = per_row_stops(stop, len(rows))
    decode = decoder(target.tokenizer)
    if any(stops) and decode is None:
        raise ValueError(
            "stop strings need a tokenizer; pass tokenizer= to TargetModel or use eos_token_id"
        )
    limit = target.max_context
    longest = max(len(r) for r in rows)
    if limit is not None and longest >= limit and max(max_new) > 0:
        raise ValueError(
            f"a prompt has {longest} tokens but the target's context limit is {limit}, "
            "leaving no room to generate; shorten the prompt"
        )
    eos = frozenset() if ignore_eos else frozenset(as_id_list(eos_token_id) or target.eos_token_ids)
    pad = pad_id(target)
    device = target.device
    # Rows with nothing to generate never enter the batch.
    live = [i for i, n in enumerate(max_new) if n > 0]
    longest = max((len(rows[i]) for i in live), default=longest)
    tokens = torch.tensor(
        [[pad] * (longest - len(rows[i])) + rows[i] for i in live],
        dtype=torch.int64,
        device=device,
    ).reshape(len(live), longest)
    left = torch.tensor([longest - len(rows[i]) for i in live], dtype=torch.int64, device=device)
    base, generator, row_settings, typical = start_sampling(
        len(rows), sampling, seed, config.sampling, device
    )
    check_bias_ids(row_settings, target.vocab_size)
    state = None
    if grammar is not None:
        if not isinstance(grammar, Grammar):
            raise TypeError(
                f"grammar must be a flashspec.grammar.Grammar or None, got {type(grammar).__name__}"
            )
        eos_ids = sorted(eos) or list(target.eos_token_ids)
        state = GrammarState(grammar, target.tokenizer, eos_ids, target.vocab_size)
        state.add_rows(live)
    gen = Generation(
        tokens=tokens,
        padding=Padding(left),
        live=live,
        rows=[Row() for _ in rows],
        prompt_length=longest,
        max_new_tokens=max_new,
        limit=limit,
        eos=eos,
        stops=stops,
        decode=decode,
        live_text=True,
        generator=generator,
        sampling=base,
        warper=Warper(),  # the first round sets it (Generation.round_warper)
        row_sampling=row_settings,
        typical=typical,
        pad_id=pad,
        logprobs=None if logprobs is None else int(logprobs),
        grammar=state,
    )
    gen.warper = gen.round_warper() if live else Warper(*row_settings[0].warp)
    return gen


def tokenize(
    target: TargetModel, prompt: Prompt | None, attention_mask: torch.Tensor | None
) -> list[list[int]]:
    """Prompt in any accepted form -> one list of token ids per row (padding removed)."""
    if prompt is None:
        raise ValueError("no prompt: pass a string, a list of strings, or token ids (input_ids=)")
    if attention_mask is not None and not isinstance(prompt, torch.Tensor):
        raise ValueError(
            "attention_mask applies to tensor prompts only; other prompts are unpadded"
        )
    if isinstance(prompt, str) or (
        isinstance(prompt, Sequence) and len(prompt) > 0 and all(isinstance(p, str) for p in prompt)
    ):
        texts = [prompt] if isinstance(prompt, str) else list(prompt)
        if target.tokenizer is None:
            raise ValueError(
                "text prompts need a tokenizer; pass tokenizer= to TargetModel or give input_ids"
            )
        encode = target.tokenizer
        rows = [list(encode(text, add_special_tokens=True)["input_ids"]) for text in texts]
    elif isinstance(prompt, torch.Tensor):
        ids = prompt.unsqueeze(0) if prompt.dim() == 1 else prompt
        if ids.dim() != 2 or ids.dtype.is_floating_point:
            raise ValueError(
                "input_ids must be an integer tensor of shape (B, L) or (L,), "
                f"got {prompt.dtype} {tuple(prompt.shape)}"
            )
        ids = ids.cpu()
        if attention_mask is not None:
            mask = (
                attention_mask.unsqueeze(0) if attention_mask.dim() == 1 else attention_mask
            ).cpu()
            if mask.shape != ids.shape:
                raise ValueError(
                    f"attention_mask shape {tuple(mask.shape)} differs from "
                    f"input_ids {tuple(ids.shape)}"
                )
            rows = [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]
        else:
            rows = ids.tolist()
    elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
        rows = [[int(t) for t in cast(Sequence[int], prompt)]]  # [] is one empty row
    elif isinstance(prompt, Sequence) and all(isinstance(r, Sequence) for r in prompt):
        rows = [[int(t) for t in cast(Sequence[int], r)] for r in prompt]
    else:
        raise ValueError(
            f"cannot read a prompt from {type(prompt).__name__}; pass a string, a list of "
            "strings, a list of token ids, or a (B, L) tensor"
        )
    vocab = target.vocab_size
    for i, row in enumerate(rows):
        if any(not 0 <= t < vocab for t in row):
            raise ValueError(
                f"prompt row {i} has token ids outside [0, {vocab}) of the target's vocabulary"
            )
    bos = bos_id(target)
    for i, row in enumerate(rows):
        if not row:
            if bos is None:
                raise ValueError(
                    f"prompt row {i} is empty and the target defines no bos_token_id "
                    "to start from; "
                    "give at least one token"
                )
            row.append(bos)
    return rows


def decoder(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """The tokenizer's decoding of new tokens (None without a tokenizer)."""
    if tokenizer is None:
        return None

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=True))

    return decode


def bos_id(target: TargetModel) -> int | None:
    """The id an empty prompt starts from, if the target defines one."""
    for source in (
        getattr(target.model, "generation_config", None),
        target.config,
        target.tokenizer,
    ):
        value = getattr(source, "bos_token_id", None)
        if isinstance(value, int):
            return value
    return None


def pad_id(target: TargetModel) -> int:
    """The id padded columns hold."""
    # Any valid id works: padded columns are masked out.
    for source in (target.tokenizer, target.config):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int) and 0 <= value < target.vocab_size:
            return value
    return 0


def per_row_limits(max_new_tokens: int | Sequence[int], rows: int) -> list[int]:
    """``max_new_tokens`` (one number, or one per row) as one limit per row."""

    def valid(n: object) -> bool:
        return is_int(n, minimum=0)

    if valid(max_new_tokens):
        return [cast(int, max_new_tokens)] * rows
    if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
        limits = list(max_new_tokens)
        if len(limits) != rows or not all(valid(n) for n in limits):
            raise ValueError(
                f"max_new_tokens as a list needs one integer >= 0 per prompt row ({rows}), "
                f"got {max_new_tokens!r}"
            )
        return [int(n) for n in limits]
    raise ValueError(
        f"max_new_tokens must be an integer >= 0 (or one per row), got {max_new_tokens!r}"
    )


def per_row_stops(stop: Stop, rows: int) -> list[tuple[str, ...]]:
    """``stop`` (shared, or one entry per row) as one tuple of stop strings per row."""

    def strings(item: object) -> tuple[str, ...]:
        if item is None:
            return ()
        items = (item,) if isinstance(item, str) else item
        if not isinstance(items, Sequence) or any(not isinstance(s, str) or not s for s in items):
            raise ValueError(
                "stop must be a non-empty string, a list of them, or one such entry (or None) "
                f"per row, got {stop!r}"
            )
        return tuple(cast(Sequence[str], items))

    if stop is None or isinstance(stop, str):
        return [strings(stop)] * rows
    entries = list(stop) if isinstance(stop, Sequence) else None
    if entries is None:
        return [strings(stop)] * rows  # raises: not a sequence
    if all(isinstance(entry, str) for entry in entries):
        return [strings(entries)] * rows
    if len(entries) != rows:
        raise ValueError(
            f"stop given per row needs {rows} entries (None, a string or a list of strings), "
            f"got {len(entries)}"
        )
    return [strings(entry) for entry in entries]


def refuse_padded_batch(reason: str | None) -> None:
    """Refuse a generation whose rows differ in length when a model cannot batch them
    (``reason``: ``SpeculativeEngine.padded_batches``; None: they can).

    Raises:
        UnsupportedModelError: naming the model, the reason and what to do instead.
    """
    if reason is not None:
        raise UnsupportedModelError(
            f"rows of different lengths cannot share a batch here ({reason}); generate "
            "them one at a time, or in batches of prompts of equal length"
        )
