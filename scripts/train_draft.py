#!/usr/bin/env python3
"""Distil a shared-head draft (``flashspec.drafters.shared_head``) from a target: a few decoder
layers on the target's own embedding, drafting over the target's head rows for the K most
frequent tokens.

    python scripts/train_draft.py --target smollm2 --out runs/smollm2-draft --minutes 110
    python scripts/train_draft.py --target smollm2 --out runs/smollm2-draft --minutes 110  # resumes
    python scripts/train_draft.py --target smollm2 --out /tmp/draft --minutes 2 --quick    # smoke
    python scripts/train_draft.py --target smollm2 --out runs/more --minutes 40 \
        --init flashspec/drafts/smollm2          # go on from a saved draft (new optimiser)

Data: the Python standard library's source (the running interpreter's ``Lib/``, tests and
site-packages left out; the split of ``train_demo_pair.py``: about 5% of the files held out by a
hash of their path), and the target's own greedy answers to the instruction prompts of
``draft_chat_data.py``: its templates, ``--self-instruct`` requests the target writes itself and
``--completions`` requests to complete standard-library functions (generated once into
``--out``, answers reused by prompt; ``--chat-repeat`` times in the stream; about 10% of the
prompts held out by a hash). No HumanEval. The vocabulary subset is the K most
frequent tokens of that stream plus the tokenizer's special tokens.

Loss: KL(target || draft) over the subset, the target's next-token distribution renormalised
over the subset (the draft can put mass nowhere else). Only the draft's own layers, norm (and
fuse) train; the target is frozen and runs in inference mode as the teacher, one pass per batch.
A features draft (``--reads features``, the default) reads the target's final hidden states;
its first ``PASSES`` draft steps are unrolled at every position, each read as a round reads it
(``unrolled``), and each also regresses the target's next hidden state.

Resumable: ``--out`` holds ``checkpoint.pt`` (draft, optimiser, step, elapsed seconds, data
cursor); a rerun with the same ``--out`` continues until ``--minutes`` of training in all. The
learning rate follows the budget: warm-up over the first 2% of it, then a cosine decay.

Writes ``--out``: the draft (``save_shared_head_draft``: its layers in float16, the token ids),
and ``card.json``: data, steps, wall time, held-out greedy agreement with the target (the
per-token acceptance of greedy drafting, teacher-forced; per unrolled step, and on held-out
code and chat apart), expected acceptance at temperature 1
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
import draft_chat_data
from train_demo_pair import encode_stream, read_corpus

from flashspec.drafters.shared_head import (
    build_shared_head_draft,
    draft_input,
    feature_hidden,
    load_shared_head_draft,
    own_state,
    save_shared_head_draft,
)
from flashspec.loading.drafts import model_fingerprint

CHECKPOINT = "checkpoint.pt"
CARD = "card.json"
CHAT = "chat.json"
WARMUP_FRACTION = 0.02
MIN_LR_RATIO = 0.1
CHECKPOINT_EVERY_S = 300.0
EVAL_WINDOWS = 32
FEATURE_WEIGHT = 0.1
"""Weight of the features draft's regression of the target's next hidden state (its own final
hidden state is the next step's input), against the KL of its tokens."""
PASSES = 3
"""Draft steps unrolled in training (``unrolled``): the first reads the target's states, the
others the draft's own, as a round's later drafts do."""
PASS_WEIGHTS = (1.0, 0.7, 0.5)
"""Loss weight of each unrolled step: a later draft counts only when the earlier ones were
accepted."""


def spaced_windows(stream: torch.Tensor, span: int) -> torch.Tensor:
    """Up to EVAL_WINDOWS evenly spaced windows of ``span`` tokens (the same every run)."""
    count = min(EVAL_WINDOWS, stream.numel() // span)
    stride = stream.numel() // count
    return torch.stack([stream[i * stride : i * stride + span] for i in range(count)])


def chat_prompts(
    args: argparse.Namespace, target: Any, tokenizer: Any, code: list[str], saved: dict[str, Any]
) -> dict[str, list[str]]:
    """The prompts of each kind (``saved``'s when it has as many of that kind)."""
    templated = draft_chat_data.prompts()
    if args.quick:
        templated = templated[:: max(1, len(templated) // 24)]
    kinds = dict(saved.get("kinds", {}))
    kinds["templates"] = templated
    wanted = min(args.self_instruct, 8) if args.quick else args.self_instruct
    if len(kinds.get("self_instruct", [])) != wanted:
        kinds["self_instruct"] = draft_chat_data.self_instruct(
            target, tokenizer, wanted, seed=args.seed
        ) if wanted else []  # fmt: skip
    completions = min(args.completions, 8) if args.quick else args.completions
    kinds["completions"] = draft_chat_data.completion_prompts(code, completions, args.seed)
    return kinds


def chat_data(
    args: argparse.Namespace, target: Any, tokenizer: Any, code: list[str]
) -> tuple[Any, Any, dict[str, int]]:
    """The chat conversations (train, held out) and the prompts of each kind, generated once
    into ``args.out`` (a prompt answered before is not answered again)."""
    path = args.out / CHAT
    saved = json.loads(path.read_text()) if path.exists() else {}
    answered = dict(zip(saved.get("prompts", []), saved.get("ids", []), strict=True))
    kinds = chat_prompts(args, target, tokenizer, code, saved)
    texts = list(dict.fromkeys(text for group in kinds.values() for text in group))
    missing = [text for text in texts if text not in answered]
    if missing or not path.exists():
        answered.update(zip(missing, draft_chat_data.answers(target, tokenizer, missing),
                            strict=True))  # fmt: skip
        saved = {"prompts": texts, "ids": [answered[t] for t in texts], "kinds": kinds}
        args.out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(saved))
    pairs = [(text, answered[text]) for text in texts]
    train = [ids for text, ids in pairs if not draft_chat_data.held_out(text)]
    held = [ids for text, ids in pairs if draft_chat_data.held_out(text)]
    return train, held, {kind: len(group) for kind, group in kinds.items()}


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


def subset_scores(draft: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The draft's scores over its subset only (no full-vocabulary scatter while training)."""
    rows = draft.lm_head.dense()
    return hidden @ rows.to(hidden.dtype).T


def draft_scores(draft: Any, inputs: torch.Tensor) -> torch.Tensor:
    """A tokens draft's subset scores for each position of ``inputs``."""
    return subset_scores(draft, draft.model(input_ids=inputs).last_hidden_state)


def teacher_pass(target: Any, inputs: torch.Tensor, subset: torch.Tensor) -> tuple[Any, Any]:
    """The target's final hidden states (B, T, d) and its logits over the subset (B, T, K)."""
    hidden = target.model(input_ids=inputs).last_hidden_state
    return hidden, target.lm_head(hidden)[..., subset].float()


def kl(teacher_logits: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """KL(teacher || draft) per position, averaged, both renormalised over the subset."""
    teacher = teacher_logits.log_softmax(-1).flatten(0, 1)
    student = scores.float().log_softmax(-1).flatten(0, 1)
    return F.kl_div(student, teacher, log_target=True, reduction="batchmean")


def unrolled(
    draft: Any, hidden: torch.Tensor, inputs: torch.Tensor, passes: int = PASSES
) -> list[torch.Tensor]:
    """A features draft's first ``passes`` draft steps at every column at once, each read as a
    round reads it (training-time test, as EAGLE-3 calls it).

    Column j of pass 1 reads the target's state at j with token j + 1 and stands for the
    target's state at j + 1. Column j of pass k reads pass k - 1's output at column j - 1 (the
    draft's own state where a round's k-th draft reads it) with token j + 1, and attends to
    what that draft attends to in a round: pass 1's columns up to j - k + 1 (read from the
    target's states) and one column of each pass between (its own earlier drafts). Every pass
    returns (B, T - 1, d); pass k's first k - 1 columns have no such round and are padding.
    """
    from flashspec.kv.compat import ForwardSignature, new_cache

    batch, columns = inputs.shape[0], inputs.shape[1] - 1
    device = inputs.device
    cache = {ForwardSignature.of(draft).cache_arg: new_cache(draft)}
    position = torch.arange(columns, device=device).expand(batch, -1)
    outputs = [feature_hidden(draft, hidden[:, :-1], inputs[:, 1:], **cache,
                              position_ids=position, use_cache=True)]  # fmt: skip
    j = torch.arange(columns, device=device)
    for k in range(2, passes + 1):
        previous = outputs[-1]
        state = torch.cat([previous[:, :1] * 0, previous[:, :-1]], dim=1)
        allowed = [j[None, :] <= (j[:, None] - k + 1)]  # pass 1's columns
        allowed += [j[None, :] == (j[:, None] - k + m) for m in range(2, k + 1)]
        mask = torch.cat(allowed, dim=1)
        mask[: k - 1, 0] = True  # padding rows attend to something (their outputs go unused)
        out = feature_hidden(draft, state, inputs[:, 1:], **cache, position_ids=position,
                             attention_mask=mask[None, None], use_cache=True)  # fmt: skip
        outputs.append(out)
    return outputs


def feature_loss(
    draft: Any, hidden: torch.Tensor, teacher_logits: torch.Tensor, inputs: torch.Tensor
) -> torch.Tensor:
    """KL of every unrolled step's tokens plus the regression of the target's states."""
    loss = hidden.new_zeros((), dtype=torch.float32)
    for k, (out, weight) in enumerate(zip(unrolled(draft, hidden, inputs), PASS_WEIGHTS,
                                          strict=False)):  # fmt: skip
        # Pass k + 1's column j predicts token j + 2 (the target's logits at j + 1).
        step = kl(teacher_logits[:, 1 + k :], subset_scores(draft, out[:, k:]))
        step = step + FEATURE_WEIGHT * F.smooth_l1_loss(out[:, k:].float(),
                                                        hidden[:, 1 + k :].float())  # fmt: skip
        loss = loss + weight * step
    return loss


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
    features = draft_input(draft) == "features"
    agree = accept = covered = total = 0.0
    later = [[0.0, 0.0] for _ in range(PASSES - 1 if features else 0)]  # steps 2, 3...
    for batch in windows.split(8):
        inputs = batch[:, :-1]
        hidden = target.model(input_ids=inputs).last_hidden_state
        p = target.lm_head(hidden).float().softmax(-1)
        if features:
            passes = unrolled(draft, hidden, inputs)
            p = p[:, 1:]  # column t of a pass predicts token t + 2
            scores = subset_scores(draft, passes[0]).float()
            for k, out in enumerate(passes[1:], start=1):
                best_k = p[:, k:].argmax(-1)
                later[k - 1][0] += float((ids[subset_scores(draft, out[:, k:]).argmax(-1)]
                                          == best_k).sum())  # fmt: skip
                later[k - 1][1] += best_k.numel()
        else:
            scores = draft_scores(draft, inputs).float()
        q = torch.zeros_like(p)
        q[..., ids] = scores.softmax(-1)
        best = p.argmax(-1)
        agree += float((ids[scores.argmax(-1)] == best).sum())
        accept += float(torch.minimum(p, q).sum(-1).sum())
        covered += float(torch.isin(best, ids).sum())
        total += best.numel()
    result = {
        "greedy_agreement": agree / total,
        "expected_acceptance_t1": accept / total,
        "subset_covers_greedy": covered / total,
        "positions": total,
    }
    for k, (hits, count) in enumerate(later, start=2):
        # Step k reads the draft's own states as a round's k-th draft does, after the data's
        # tokens (not the draft's): a gauge of a round's later drafts.
        result[f"greedy_agreement_step{k}"] = hits / count if count else 0.0
    return result


@torch.inference_mode()
def step_ms(model: Any, prompt: torch.Tensor, reps: int = 16) -> float:
    """One-token decode step after ``prompt``, best of two timed runs (milliseconds)."""
    from flashspec.kv.compat import ForwardSignature, new_cache

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


@torch.inference_mode()
def feature_step_ms(draft: Any, target: Any, prompt: torch.Tensor, reps: int = 16) -> float:
    """A features draft's one-token step after ``prompt`` (milliseconds, best of two)."""
    from flashspec.kv.compat import ForwardSignature, new_cache

    hidden = target.model(input_ids=prompt).last_hidden_state
    cache_arg = ForwardSignature.of(draft).cache_arg
    best = math.inf
    for _ in range(2):
        cache = {cache_arg: new_cache(draft)}
        out = feature_hidden(draft, hidden[:, :-1], prompt[:, 1:], **cache)
        state = out[:, -1:]
        start = time.perf_counter()
        for _ in range(reps):
            token = draft.lm_head(state).argmax(-1)
            state = feature_hidden(draft, state, token, **cache)
        best = min(best, (time.perf_counter() - start) / reps * 1e3)
    return best


def init_record(folder: Path | None) -> dict[str, Any] | None:
    """What a run that went on from ``folder`` started from: that draft's own card's steps,
    wall time and tokens seen (its training counts towards the whole)."""
    if folder is None:
        return None
    card_path = folder / CARD
    card = json.loads(card_path.read_text()) if card_path.exists() else {}
    earlier = card.get("init") or {}
    return {
        "from": folder.name,
        "steps": card.get("steps", 0) + earlier.get("steps", 0),
        "wall_s": round(card.get("wall_s", 0.0) + earlier.get("wall_s", 0.0), 1),
        "tokens_seen": card.get("data", {}).get("tokens_seen", 0) + earlier.get("tokens_seen", 0),
    }


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
    parser.add_argument("--reads", choices=("features", "tokens"), default="features",
                        help="draft input: the target's hidden states and tokens (features, "
                        "the default) or tokens alone")  # fmt: skip
    parser.add_argument("--vocab", type=int, default=8192, help="subset size K (8192)")
    parser.add_argument("--length", type=int, default=256, help="tokens per window (256)")
    parser.add_argument("--batch", type=int, default=8, help="windows per step (8)")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (1e-3)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--chat-repeat", type=int, default=4,
                        help="times the chat answers appear in the training stream (4; 0: no "
                        "chat data)")  # fmt: skip
    parser.add_argument(
        "--self-instruct",
        type=int,
        default=640,
        help="requests the target writes itself for the chat data (640)",
    )
    parser.add_argument(
        "--completions",
        type=int,
        default=256,
        help="requests to complete a standard-library function (256)",
    )
    parser.add_argument(
        "--init",
        type=Path,
        default=None,
        help="start from this saved shared-head draft (its token subset and "
        "weights; a new optimiser and schedule) instead of from scratch",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a few files only (smoke runs)")
    return parser.parse_args(argv)


def train(
    args: argparse.Namespace,
    target: Any,
    tokenizer: Any,
    train_texts: list[str],
    held_texts: list[str],
    chat_train: list[list[int]] | None = None,
    chat_held: list[list[int]] | None = None,
    chat_kinds: dict[str, int] | None = None,
) -> dict[str, Any]:
    """Distil (or resume distilling) a draft of ``target`` into ``args.out``; returns the card.

    ``chat_train`` / ``chat_held``: token ids of chat conversations (``draft_chat_data``), put
    ``args.chat_repeat`` times into the training stream / evaluated on their own."""
    torch.manual_seed(args.seed)
    target.eval().requires_grad_(False)
    code = encode_stream(tokenizer, train_texts)
    chat = torch.tensor([t for ids in chat_train or [] for t in ids], dtype=torch.int64)
    stream = torch.cat([code, *([chat] * args.chat_repeat)])
    span = args.length + 1
    eval_windows = spaced_windows(encode_stream(tokenizer, held_texts), span)
    held_chat = torch.tensor([t for ids in chat_held or [] for t in ids], dtype=torch.int64)
    chat_windows = spaced_windows(held_chat, span) if held_chat.numel() > span else None

    args.out.mkdir(parents=True, exist_ok=True)
    checkpoint_path = args.out / CHECKPOINT
    saved: dict[str, Any] | None = (
        torch.load(checkpoint_path, weights_only=False) if checkpoint_path.exists() else None
    )
    start: Any = load_shared_head_draft(args.init, target) if args.init else None
    if start is not None:
        ids = [int(i) for i in start.lm_head.ids.tolist()]
        args.layers, args.reads = start.config.num_hidden_layers, draft_input(start)
    elif saved:
        ids = saved["ids"]
    else:
        ids = subset_ids(stream, args.vocab, tokenizer.all_special_ids)
    draft = build_shared_head_draft(target, ids, layers=args.layers, reads=args.reads)
    if start is not None:
        draft.load_state_dict(own_state(start), strict=False)
    features = args.reads == "features"
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
        before, before_chat = saved["before"], saved.get("before_chat")
    elif start is None:
        if features:
            # Its layers start random; the norm maps onto the target's head as the target's does.
            with torch.no_grad():
                draft.model.norm.load_state_dict(target.model.norm.state_dict())
        else:
            init_from_target(draft, target)
    if not saved:
        step, elapsed, cursor = 0, 0.0, 0
        before = evaluate(draft, target, eval_windows)
        before_chat = evaluate(draft, target, chat_windows) if chat_windows is not None else None

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
                "before_chat": before_chat,
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
            hidden, teacher_logits = teacher_pass(target, inputs, subset)
        # Copies outside inference mode: autograd keeps them for the backward pass.
        hidden, teacher_logits = hidden.clone(), teacher_logits.clone()
        if features:
            loss = feature_loss(draft, hidden, teacher_logits, inputs)
        else:
            loss = kl(teacher_logits, draft_scores(draft, inputs))
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
        bar.set_postfix(step=step, loss=f"{smooth:.3f}")
        if time.perf_counter() - last_save > CHECKPOINT_EVERY_S:
            save()
            last_save = time.perf_counter()
    bar.close()
    draft.eval()
    save()
    save_shared_head_draft(draft, args.out)

    prompt = eval_windows[:1, :64]
    draft_ms = feature_step_ms(draft, target, prompt) if features else step_ms(draft, prompt)
    costs = {"target_step_ms": step_ms(target, prompt), "draft_step_ms": draft_ms}
    costs["draft_over_target"] = costs["draft_step_ms"] / costs["target_step_ms"]
    card = {
        "target": args.target,
        # Other files of this model (another quantization) draft with it: loading.drafts.
        "fits": model_fingerprint(target, tokenizer),
        "dtype": args.dtype,
        "layers": args.layers,
        "reads": args.reads,
        "subset_tokens": len(ids),
        "data": {
            "corpus": "Python standard library source (train_demo_pair.py's split), and the "
            "target's greedy answers to draft_chat_data.py's instruction prompts",
            "python": platform.python_version(),
            "train_files": len(train_texts),
            "held_out_files": len(held_texts),
            "code_tokens": int(code.numel()),
            "chat_prompts": chat_kinds or {},
            "chat_conversations": len(chat_train or []),
            "held_out_chat_conversations": len(chat_held or []),
            "chat_tokens": int(chat.numel()),
            "chat_repeat": args.chat_repeat,
            "train_tokens": int(stream.numel()),
            "tokens_seen": int(step * args.batch * args.length),
        },
        "init": init_record(args.init),
        "steps": step,
        "wall_s": round(elapsed, 1),
        "final_train_loss": round(smooth, 4),
        "held_out_before": before,
        "held_out": evaluate(draft, target, eval_windows),
        "held_out_chat_before": before_chat,
        "held_out_chat": (
            evaluate(draft, target, chat_windows) if chat_windows is not None else None
        ),
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
    chat_train, chat_held, kinds = (
        chat_data(args, target, tokenizer, train_texts) if args.chat_repeat else ([], [], {})
    )
    card = train(args, target, tokenizer, train_texts, held_texts, chat_train, chat_held, kinds)
    print(json.dumps(card, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
