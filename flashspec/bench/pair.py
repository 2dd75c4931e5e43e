"""The model pair the model benchmarks run: a target, an optional draft and the target's
tokenizer, loaded with EOS switched off, prompts encoded as the engine encodes them, and what a
forward of each costs (``decode_costs``, the cost model's input)."""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..models import CausalLM, Padding, load_pretrained, resolve_model_path


@dataclass
class Pair:
    """A target and (optionally) a draft model with the target's tokenizer, on CPU, float32."""

    target: Any
    draft: Any
    tokenizer: Any
    target_name: str
    draft_name: str | None

    @property
    def pad_id(self) -> int:
        for source in (self.tokenizer, self.target.config):
            value = getattr(source, "pad_token_id", None)
            if isinstance(value, int):
                return value
        return 0


def load_pair(target: str, draft: str | None) -> Pair:
    """Load both models (local paths, or ``demo``/``demo-draft``) and switch EOS off in their
    generation configs, so that HF generates the full length like the engine with
    ``ignore_eos``."""
    target_model, tokenizer = load_pretrained(target)
    draft_model = None
    if draft is not None and draft.lower() != "none":
        draft_model, _ = load_pretrained(draft)
    return make_pair(
        target_model,
        draft_model,
        tokenizer,
        resolve_model_path(target),
        resolve_model_path(draft) if draft_model is not None and draft else None,
    )


def make_pair(
    target: Any, draft: Any, tokenizer: Any, target_name: str, draft_name: str | None
) -> Pair:
    """Wrap loaded models; EOS is switched off in their generation configs (see load_pair)."""
    for model in (target, draft):
        if model is not None:
            model.eval()
            model.generation_config.eos_token_id = None
    return Pair(target, draft, tokenizer, target_name, draft_name)


def encode(pair: Pair, text: str, max_tokens: int) -> list[int]:
    """Token ids of ``text`` as the engine encodes it, keeping the last ``max_tokens`` (and a
    leading BOS, if the tokenizer adds one)."""
    ids = [int(t) for t in pair.tokenizer(text, add_special_tokens=True)["input_ids"]]
    if len(ids) <= max_tokens:
        return ids
    bos = getattr(pair.tokenizer, "bos_token_id", None)
    if bos is not None and ids[0] == bos:
        return [bos, *ids[len(ids) - max_tokens + 1 :]]
    return ids[len(ids) - max_tokens :]


def setup_pair(args: argparse.Namespace) -> Pair:
    """Quiet HF's logging, set ``args.threads`` torch threads (if given) and load
    ``args.target`` / ``args.draft`` (``load_pair``)."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    # HF's assisted generation warns about its own internal arguments on every call.
    hf_logging.set_verbosity_error()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    return load_pair(args.target, args.draft)


def quiet_and_threads(threads: int | None) -> None:
    """Quiet HF's logging and progress bars, and set ``threads`` torch threads (if given)."""
    hf_logging: Any = importlib.import_module("transformers.utils.logging")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    if threads is not None:
        torch.set_num_threads(threads)


def draft_for(target: str, draft: str | None) -> str | None:
    """The draft model a model benchmark loads for ``target``: the parser's default draft
    belongs to the demo target; another one drafts by prompt lookup (None), as the engine's
    default does, unless a draft model is named."""
    from ..models import DEMO_NAMES

    if target not in DEMO_NAMES or (draft is not None and draft.lower() == "none"):
        return None if draft is None or draft.lower() in ("none", "demo-draft") else draft
    return draft


def decode_costs(pair: Pair, ids: list[int], gamma: int, reps: int = 25) -> dict[str, Any]:
    """Median ms of a one-token forward with a KV cache after ``ids`` (target, draft), and of
    the target's (gamma+1)-token verification forward; c = draft / target."""

    def timed(model: Any, width: int) -> float:
        lm = CausalLM(model)
        padding = Padding(torch.zeros(1, dtype=torch.int64))
        context = torch.tensor([ids], dtype=torch.int64)
        step = torch.tensor([ids[-width:] if len(ids) >= width else ids[:1] * width])
        times = []
        with torch.inference_mode():
            lm.reset()
            lm.forward(context, padding, keep=1)
            for i in range(reps + 3):
                start = time.perf_counter()
                lm.forward(step, padding, keep=width)
                elapsed = time.perf_counter() - start
                lm.rollback(len(ids))
                if i >= 3:
                    times.append(elapsed)
        return statistics.median(times) * 1000

    target_ms = timed(pair.target, 1)
    out: dict[str, Any] = {
        "context_tokens": len(ids),
        "target_ms": round(target_ms, 4),
        "target_verify_ms": round(timed(pair.target, gamma + 1), 4),
        "verify_tokens": gamma + 1,
    }
    out["verify_over_step"] = round(out["target_verify_ms"] / target_ms, 4)
    if pair.draft is not None:
        draft_ms = timed(pair.draft, 1)
        out["draft_ms"] = round(draft_ms, 4)
        out["c"] = round(draft_ms / target_ms, 4)
    return out
