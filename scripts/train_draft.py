#!/usr/bin/env python3
"""Distil a shared-head draft (``flashspec.shared_head``) from a target: a few decoder layers on
the target's own embedding, drafting over the target's head rows for the K most frequent tokens.

    python scripts/train_draft.py --target smollm2 --out runs/smollm2-draft --minutes 110
    python scripts/train_draft.py --target smollm2 --out runs/smollm2-draft --minutes 110  # resumes
    python scripts/train_draft.py --target smollm2 --out /tmp/draft --minutes 2 --quick    # smoke

Data: the Python standard library's source (the running interpreter's ``Lib/``, tests and
site-packages left out; the split of ``train_demo_pair.py``: about 5% of the files held out by a
hash of their path). No HumanEval. The vocabulary subset is the K most frequent tokens of the
training text plus the tokenizer's special tokens.

Loss: KL(target || draft) over the subset, the target's next-token distribution renormalised
over the subset (the draft can put mass nowhere else). Only the draft's own layers and norm
train; the target is frozen and runs in inference mode as the teacher, one pass per batch.

Resumable: ``--out`` holds ``checkpoint.pt`` (draft, optimiser, step, elapsed seconds, data
cursor); a rerun with the same ``--out`` continues until ``--minutes`` of training in all. The
learning rate follows the budget: warm-up over the first 2% of it, then a cosine decay.

Writes ``--out``: the draft (``save_shared_head_draft``: its layers in float16, the token ids),
and ``card.json``: data, steps, wall time, held-out greedy agreement with the target (the
per-token acceptance of greedy drafting, teacher-forced), expected acceptance at temperature 1
(the mean of sum(min(p, q))), the subset's coverage of the target's greedy tokens, and the
draft's and target's one-token step times.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see train_demo_pair.py

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from train_demo_pair import encode_stream, read_corpus

from flashspec.shared_head import (
    build_shared_head_draft,
    own_state,
    save_shared_head_draft,
)

CHECKPOINT = "checkpoint.pt"
CARD = "card.json"
WARMUP_FRACTION = 0.02
MIN_LR_RATIO = 0.1
CHECKPOINT_EVERY_S = 300.0
EVAL_WINDOWS = 32


def subset_ids(stream: torch.Tensor, k: int, special: list[int]) -> list[int]:
    """The ``k`` most frequent tokens of ``stream``, and every special token, sorted."""
    counts = Counter(stream.tolist())
    chosen = {token for token, _ in counts.most_common(k)} | set(special)
    return sorted(chosen)


def init_from_target(draft: Any, target: Any) -> None:
    """Start the draft's layers and norm from the target's first layers and final norm."""
    with torch.no_grad():
        for mine, theirs in zip(draft.model.layers, target.model.layers, strict=False):
            mine.load_state_dict(theirs.state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())


def draft_scores(draft: Any, inputs: torch.Tensor) -> torch.Tensor:
    """The draft's scores over its subset only (no full-vocabulary scatter while training)."""
    hidden = draft.model(input_ids=inputs).last_hidden_state
    rows = draft.lm_head.get_buffer("rows")
    return hidden @ rows.to(hidden.dtype).T


def lr_at(fraction: float, peak: float) -> float:
    """Warm-up over the first WARMUP_FRACTION of the budget, then cosine to MIN_LR_RATIO."""
    if fraction < WARMUP_FRACTION:
        return peak * max(fraction, 1e-3) / WARMUP_FRACTION
    progress = min(1.0, (fraction - WARMUP_FRACTION) / (1 - WARMUP_FRACTION))
    return peak * (MIN_LR_RATIO + (1 - MIN_LR_RATIO) * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.inference_mode()
def evaluate(draft: Any, target: Any, windows: torch.Tensor) -> dict[str, float]:
    """Teacher-forced on held-out windows: greedy agreement, expected acceptance at T=1, and
    how often the target's greedy token is inside the subset."""
    ids = draft.lm_head.get_buffer("ids")
    agree = accept = covered = total = 0.0
    for batch in windows.split(8):
        inputs = batch[:, :-1]
        p = target(input_ids=inputs).logits.float().softmax(-1)
        scores = draft_scores(draft, inputs).float()
        q = torch.zeros_like(p)
        q[..., ids] = scores.softmax(-1)
        best = p.argmax(-1)
        agree += float((ids[scores.argmax(-1)] == best).sum())
        accept += float(torch.minimum(p, q).sum(-1).sum())
        covered += float(torch.isin(best, ids).sum())
        total += best.numel()
    return {
        "greedy_agreement": agree / total,
        "expected_acceptance_t1": accept / total,
        "subset_covers_greedy": covered / total,
        "positions": total,
    }


@torch.inference_mode()
def step_ms(model: Any, prompt: torch.Tensor, reps: int = 16) -> float:
    """One-token decode step after ``prompt``, best of two timed runs (milliseconds)."""
    from flashspec._compat import ForwardSignature, new_cache

    cache_arg = ForwardSignature.of(model).cache_arg
    best = math.inf
    for _ in range(2):
        cache = new_cache(model)
        out = model(input_ids=prompt, **{cache_arg: cache}, use_cache=True)
        token = out.logits[:, -1:].argmax(-1)
        start = time.perf_counter()
        for _ in range(reps):
            model(input_ids=token, **{cache_arg: cache}, use_cache=True)
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def load_target(name: str, dtype: torch.dtype) -> tuple[Any, Any]:
    """The target and its tokenizer, by flashspec's names (``smollm2``) or a path."""
    from flashspec.loading import resolve_named
    from flashspec.models import load_pretrained

    path = resolve_named(name) or name
    return load_pretrained(str(path), "cpu", dtype)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="smollm2", help="target: a flashspec name or path")
    parser.add_argument("--out", type=Path, required=True, help="output (and resume) folder")
    parser.add_argument("--minutes", type=float, default=110.0, help="training budget (110)")
    parser.add_argument("--layers", type=int, default=1, help="draft decoder layers (1)")
    parser.add_argument("--vocab", type=int, default=8192, help="subset size K (8192)")
    parser.add_argument("--length", type=int, default=256, help="tokens per window (256)")
    parser.add_argument("--batch", type=int, default=8, help="windows per step (8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (1e-3)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few files only (smoke runs)")
    return parser.parse_args(argv)


def train(
    args: argparse.Namespace,
    target: Any,
    tokenizer: Any,
    train_texts: list[str],
    held_texts: list[str],
) -> dict[str, Any]:
    """Distil (or resume distilling) a draft of ``target`` into ``args.out``; returns the card."""
    torch.manual_seed(args.seed)
    target.eval().requires_grad_(False)
    stream = encode_stream(tokenizer, train_texts)
    held = encode_stream(tokenizer, held_texts)
    span = args.length + 1
    count = min(EVAL_WINDOWS, held.numel() // span)
    stride = held.numel() // count
    eval_windows = torch.stack([held[i * stride : i * stride + span] for i in range(count)])

    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = args.out / CHECKPOINT
    saved: dict[str, Any] | None = (
        torch.load(checkpoint_path, weights_only=False) if checkpoint_path.exists() else None
    )
    ids = saved["ids"] if saved else subset_ids(stream, args.vocab, tokenizer.all_special_ids)
    draft = build_shared_head_draft(target, ids, layers=args.layers)
    draft.requires_grad_(False)
    names = set(own_state(draft))
    trainable = [p for n, p in draft.named_parameters() if n in names]
    for parameter in trainable:
        parameter.requires_grad_(True)
    opt = torch.optim.AdamW(trainable, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    if saved:
        draft.load_state_dict(saved["draft"], strict=False)
        opt.load_state_dict(saved["optimizer"])
        step, elapsed, cursor = saved["step"], saved["elapsed_s"], saved["cursor"]
        before = saved["before"]
    else:
        init_from_target(draft, target)
        step, elapsed, cursor = 0, 0.0, 0
        before = evaluate(draft, target, eval_windows)

    budget = args.minutes * 60
    order = torch.randperm(stream.numel() // span, generator=torch.Generator().manual_seed(1))
    windows = stream[: order.numel() * span].view(-1, span)
    subset = torch.tensor(ids)
    bar = tqdm(total=int(budget), initial=int(elapsed), unit="s", desc="train", file=sys.stderr)
    smooth = float("nan")
    last_save = time.perf_counter()

    def save() -> None:
        torch.save(
            {
                "ids": ids,
                "draft": own_state(draft),
                "optimizer": opt.state_dict(),
                "step": step,
                "elapsed_s": elapsed,
                "cursor": cursor,
                "before": before,
            },
            checkpoint_path,
        )

    draft.train()
    while elapsed < budget:
        began = time.perf_counter()
        rows = order[torch.arange(cursor, cursor + args.batch) % order.numel()]
        cursor += args.batch
        inputs = windows[rows][:, :-1]
        with torch.inference_mode():
            teacher_logits = target(input_ids=inputs).logits[..., subset].float()
        # A copy outside inference mode: autograd keeps the target for the backward pass.
        teacher = teacher_logits.clone().log_softmax(-1)
        student = draft_scores(draft, inputs).float().log_softmax(-1)
        loss = F.kl_div(student.flatten(0, 1), teacher.flatten(0, 1), log_target=True,
                        reduction="batchmean")  # fmt: skip
        for group in opt.param_groups:
            group["lr"] = lr_at(elapsed / budget, args.lr)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        smooth = value if math.isnan(smooth) else 0.95 * smooth + 0.05 * value
        elapsed += time.perf_counter() - began
        bar.update(min(int(elapsed), int(budget)) - bar.n)
        bar.set_postfix(step=step, kl=f"{smooth:.3f}")
        if time.perf_counter() - last_save > CHECKPOINT_EVERY_S:
            save()
            last_save = time.perf_counter()
    bar.close()
    draft.eval()
    save()
    save_shared_head_draft(draft, args.out)

    prompt = eval_windows[:1, :64]
    costs = {"target_step_ms": step_ms(target, prompt), "draft_step_ms": step_ms(draft, prompt)}
    costs["draft_over_target"] = costs["draft_step_ms"] / costs["target_step_ms"]
    card = {
        "target": args.target,
        "dtype": args.dtype,
        "layers": args.layers,
        "subset_tokens": len(ids),
        "data": {
            "corpus": "Python standard library source (train_demo_pair.py's split)",
            "python": platform.python_version(),
            "train_files": len(train_texts),
            "held_out_files": len(held_texts),
            "train_tokens": int(stream.numel()),
            "tokens_seen": int(step * args.batch * args.length),
        },
        "steps": step,
        "wall_s": round(elapsed, 1),
        "final_train_kl": round(smooth, 4),
        "held_out_before": before,
        "held_out": evaluate(draft, target, eval_windows),
        "costs": costs,
        "machine": platform.processor() or platform.machine(),
        "torch_threads": torch.get_num_threads(),
    }
    (args.out / CARD).write_text(json.dumps(card, indent=2))
    return card


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    target, tokenizer = load_target(args.target, getattr(torch, args.dtype))
    train_texts, held_texts, _ = read_corpus()
    if args.quick:
        train_texts, held_texts = train_texts[:40], held_texts[:4]
    card = train(args, target, tokenizer, train_texts, held_texts)
    print(json.dumps(card, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
