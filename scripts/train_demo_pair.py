#!/usr/bin/env python3
"""Train the bundled demo pair: a byte-level BPE tokenizer, a Llama target and distilled drafts.

Everything is trained on the Python standard library's own source (the running interpreter's
``Lib/`` .py files, tests and site-packages excluded), so the pair needs no download. About 5% of
the files, chosen by a hash of their relative path, are held out for evaluation.

    python scripts/train_demo_pair.py                # everything shipped (~1 h on 2 CPU cores)
    python scripts/train_demo_pair.py --quick        # a 1-2 minute smoke run into /tmp
    python scripts/train_demo_pair.py --draft-only   # keep the saved target, distil the draft again
    python scripts/train_demo_pair.py --draft2-only  # keep the saved target, distil draft3 again
    python scripts/train_demo_pair.py --measure-only # re-measure the saved models, rewrite the card

Two drafters are distilled from the one target: ``draft`` (1 layer, ``"demo-draft"``) and
``draft3`` (3 layers, ``"demo-draft3"``), so adaptive drafter selection has real arms of different
cost and quality to choose between. The card records draft3 under its own key.

Every hyper-parameter, seed and step count is pinned below, so a rerun on the same Python
version reproduces the pair (the stdlib differs between Python versions; the card records it).
The weights are stored as float16 to keep the package small; the config says float32, so
``from_pretrained`` loads them as float32, and every number on the card is measured on those
reloaded weights.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# The machine this runs on is shared: with spinning OpenMP threads, two busy processes on two
# cores slow each other down several-fold. Sleeping waits keep that to about 2x. (Must be set
# before torch starts its thread pool.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch
import torch.nn.functional as F
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "flashspec" / "demo"
EOS = "<|endoftext|>"
# Directory names whose files never enter the corpus: test suites (mostly data and boilerplate
# asserts, a poor model of library code) and third-party packages.
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})
HOLDOUT_MODULUS = 20  # sha256(relative path) % 20 == 0 -> held out (about 5%)


@dataclass(frozen=True)
class Plan:
    """Every number that shapes the result; the card records it."""

    seed: int = 1234
    vocab_size: int = 8192
    seq_len: int = 256
    batch_size: int = 16
    # Target: deep and narrow, because decode cost on CPU grows with depth, not width, and the
    # draft/target cost ratio is what speculative decoding pays for.
    hidden: int = 128
    heads: int = 4
    intermediate: int = 384
    target_layers: int = 16
    target_steps: int = 600
    target_lr: float = 3e-3
    target_warmup: int = 40
    # Draft: one layer of the same width, so it can start from the target's embedding,
    # first layer and final norm instead of from noise.
    draft_layers: int = 1
    draft_steps: int = 700
    draft_lr: float = 2e-3
    draft_warmup: int = 20
    # Second drafter (flashspec/demo/draft3): three layers, initialised the same way from the
    # target's first three. Fewer steps than the draft: a step costs ~1.4x as much (2.0 s vs
    # 1.4 s on 2 idle cores; the 16-layer teacher forward dominates both), and --draft2-only is
    # budgeted at ~25 min on 2 shared cores (450 steps took 20.8 min with other jobs running).
    draft2_layers: int = 3
    draft2_steps: int = 450
    draft2_lr: float = 2e-3
    draft2_warmup: int = 20
    weight_decay: float = 0.1
    min_lr_ratio: float = 0.1
    max_positions: int = 1024
    eval_windows: int = 96
    accept_prompts: int = 12
    accept_prompt_tokens: int = 48
    accept_new_tokens: int = 96
    gamma: int = 4


QUICK = Plan(
    target_layers=4,
    target_steps=12,
    target_warmup=3,
    draft_steps=6,
    draft_warmup=2,
    draft2_steps=4,
    draft2_warmup=2,
    eval_windows=8,
    accept_prompts=2,
    accept_new_tokens=24,
    batch_size=8,
)


# ------------------------------------------------------------------------------------ corpus


def stdlib_files() -> list[tuple[str, Path]]:
    """(relative path, absolute path) of every stdlib .py file that belongs in the corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if SKIP_DIRS.intersection(rel.split("/")[:-1]):
            continue
        found.append((rel, path))
    return found


def is_held_out(rel: str) -> bool:
    """The stable split: a file is held out iff sha256 of its relative path is 0 mod 20."""
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HOLDOUT_MODULUS == 0


def read_corpus() -> tuple[list[str], list[str], list[str]]:
    """Training texts, held-out texts, held-out relative paths."""
    train, held, held_names = [], [], []
    for rel, path in stdlib_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if not text.strip():
            continue
        if is_held_out(rel):
            held.append(text)
            held_names.append(rel)
        else:
            train.append(text)
    return train, held, held_names


# --------------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], plan: Plan, out: Path) -> Any:
    """Byte-level BPE; every encoding starts with EOS, which doubles as BOS (as in training)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=plan.vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    eos_id = tok.token_to_id(EOS)
    # Documents are separated by EOS in training, so a prompt is "EOS + text" at inference too.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOS} $A", pair=f"{EOS} $A {EOS} $B", special_tokens=[(EOS, eos_id)]
    )
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        unk_token=None,
        model_max_length=plan.max_positions,
        clean_up_tokenization_spaces=False,
    )
    out.mkdir(parents=True, exist_ok=True)
    wrapped.save_pretrained(out)
    return wrapped


def encode_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """All documents as one token stream: EOS doc EOS doc ... (int64)."""
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=True)["input_ids"])
    return torch.tensor(ids, dtype=torch.int64)


def windows(stream: torch.Tensor, plan: Plan, gen: torch.Generator) -> Iterator[torch.Tensor]:
    """Endless random (batch, seq_len + 1) windows, drawn from a seeded generator."""
    span = plan.seq_len + 1
    while True:
        starts = torch.randint(0, stream.numel() - span, (plan.batch_size,), generator=gen)
        yield torch.stack([stream[s : s + span] for s in starts.tolist()])


def eval_batches(stream: torch.Tensor, plan: Plan) -> list[torch.Tensor]:
    """Evenly spaced, non-overlapping held-out windows (the same for every model)."""
    span = plan.seq_len + 1
    count = min(plan.eval_windows, stream.numel() // span)
    stride = stream.numel() // count
    rows = torch.stack([stream[i * stride : i * stride + span] for i in range(count)])
    return list(rows.split(16))


# ------------------------------------------------------------------------------------ models


def llama(plan: Plan, layers: int, tokenizer: Any) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=plan.hidden,
        intermediate_size=plan.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=plan.heads,
        num_key_value_heads=plan.heads,
        max_position_embeddings=plan.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


def lr_at(step: int, total: int, warmup: int, peak: float, floor: float) -> float:
    """Linear warm-up, then cosine decay to floor * peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def optimizer(model: torch.nn.Module, plan: Plan, lr: float) -> torch.optim.Optimizer:
    # No weight decay on norms (1-D weights): decaying a gain towards 0 only hurts.
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": plan.weight_decay},
        {"params": rest, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def _optimise(
    model: Any,
    stream: torch.Tensor,
    plan: Plan,
    *,
    name: str,
    seed: int,
    steps: int,
    warmup: int,
    lr: float,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[float, float]:
    """The loop both models train with: AdamW, warmup + cosine, clipping, a smoothed loss bar.

    Returns (smoothed final loss, wall seconds). ``loss_of`` maps a batch of token windows to the
    scalar loss; the model is left in eval mode.
    """
    gen = torch.Generator().manual_seed(seed)
    opt = optimizer(model, plan, lr)
    model.train()
    batches = windows(stream, plan, gen)
    start, smooth = time.perf_counter(), float("nan")
    bar = tqdm(range(steps), desc=name, mininterval=10, file=sys.stdout)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, warmup, lr, plan.min_lr_ratio)
        loss = loss_of(next(batches))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()
        smooth = value if math.isnan(smooth) else 0.95 * smooth + 0.05 * value
        bar.set_postfix(loss=f"{smooth:.3f}")
    model.eval()
    return smooth, time.perf_counter() - start


def train_target(model: Any, stream: torch.Tensor, plan: Plan) -> dict[str, float]:
    """Next-token cross-entropy on the training text."""

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        logits = model(input_ids=batch[:, :-1]).logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    smooth, wall = _optimise(
        model,
        stream,
        plan,
        name="target",
        seed=plan.seed + 1,
        steps=plan.target_steps,
        warmup=plan.target_warmup,
        lr=plan.target_lr,
        loss_of=loss_of,
    )
    return {"final_train_loss": smooth, "wall_s": wall}


def init_draft_from_target(draft: Any, target: Any) -> None:
    """Start the draft from the target's embedding, first layer(s) and final norm."""
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
        draft.model.norm.weight.copy_(target.model.norm.weight)
        for i, layer in enumerate(draft.model.layers):
            layer.load_state_dict(target.model.layers[i].state_dict())


@dataclass(frozen=True)
class Drafter:
    """One distilled drafter: where it is saved and the Plan fields that shape it."""

    dir: str  # under the output directory
    layers: int
    steps: int
    lr: float
    warmup: int
    seed: int  # the batch order
    init_seed: int  # torch's global seed when the model is built


def drafters(plan: Plan) -> dict[str, Drafter]:
    """The drafters distilled from the target, by directory name, in training order."""
    return {
        "draft": Drafter(
            "draft",
            plan.draft_layers,
            plan.draft_steps,
            plan.draft_lr,
            plan.draft_warmup,
            seed=plan.seed + 2,
            init_seed=plan.seed + 3,
        ),
        "draft3": Drafter(
            "draft3",
            plan.draft2_layers,
            plan.draft2_steps,
            plan.draft2_lr,
            plan.draft2_warmup,
            seed=plan.seed + 4,
            init_seed=plan.seed + 5,
        ),
    }


def distil_draft(
    draft: Any, target: Any, stream: torch.Tensor, plan: Plan, spec: Drafter
) -> dict[str, float]:
    """Minimise KL(target || draft) over the next-token distributions of the training text."""

    def loss_of(batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher = F.log_softmax(target(input_ids=inputs).logits, dim=-1)
        student = F.log_softmax(draft(input_ids=inputs).logits, dim=-1)
        vocab = student.shape[-1]
        return F.kl_div(
            student.reshape(-1, vocab),
            teacher.reshape(-1, vocab),
            log_target=True,
            reduction="batchmean",
        )

    smooth, wall = _optimise(
        draft,
        stream,
        plan,
        name=spec.dir,
        seed=spec.seed,
        steps=spec.steps,
        warmup=spec.warmup,
        lr=spec.lr,
        loss_of=loss_of,
    )
    return {"final_train_kl": smooth, "wall_s": wall}


def train_drafter(
    spec: Drafter, target: Any, tokenizer: Any, stream: torch.Tensor, plan: Plan, out: Path
) -> tuple[Any, dict[str, float]]:
    """Build a drafter, start it from the target, distil it and save it to ``out / spec.dir``."""
    torch.manual_seed(spec.init_seed)
    draft = llama(plan, spec.layers, tokenizer)
    init_draft_from_target(draft, target)
    log = distil_draft(draft, target, stream, plan, spec)
    save_model(draft, tokenizer, out / spec.dir)
    return draft, log


def save_model(model: Any, tokenizer: Any, out: Path) -> None:
    """HF format, weights in float16; config.json says float32 so loads come back as float32."""
    from transformers import GenerationConfig

    out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    model.to(torch.float16).save_pretrained(out, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    for key in ("dtype", "torch_dtype"):
        if key in config:
            config[key] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # A tokenizer reloaded from disk (--draft-only) records where it came from; drop that so
    # both ways of running write the same files.
    tok_path = out / "tokenizer_config.json"
    tok_config = json.loads(tok_path.read_text())
    for key in ("is_local", "local_files_only"):
        tok_config.pop(key, None)
    tok_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    # safetensors writes 0600; package data must be readable by every user of an install.
    for path in out.iterdir():
        path.chmod(0o644)


def load_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


# ---------------------------------------------------------------------------------- measuring


@torch.inference_mode()
def held_out_loss(model: Any, batches: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for batch in batches:
        logits = model(input_ids=batch[:, :-1]).logits
        total += float(
            F.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum"
            )
        )
        count += batch[:, 1:].numel()
    return total / count


@torch.inference_mode()
def decode_ms_once(model: Any, ids: torch.Tensor, context: int) -> float:
    """Milliseconds per cached single-token decode step (batch 1) after a ``context`` prompt."""
    out = model(input_ids=ids[:, :context], use_cache=True)
    cache = out.past_key_values
    start = time.perf_counter()
    for i in range(context, ids.shape[1]):
        out = model(input_ids=ids[:, i : i + 1], cache=cache, use_cache=True)
        cache = out.past_key_values
    return (time.perf_counter() - start) * 1000 / (ids.shape[1] - context)


def decode_costs(
    target: Any, draft: Any, context: int = 64, steps: int = 48, repeats: int = 9
) -> tuple[float, float]:
    """(target, draft) decode milliseconds per token: the best of interleaved repeats.

    Interleaving exposes both models to the same background load, and the minimum is the
    estimate least disturbed by other processes on a shared machine.
    """
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(1, target.config.vocab_size, (1, context + steps), generator=gen)
    target_ms, draft_ms = [], []
    for _ in range(repeats):
        target_ms.append(decode_ms_once(target, ids, context))
        draft_ms.append(decode_ms_once(draft, ids, context))
    return min(target_ms), min(draft_ms)


def acceptance(
    target_dir: Path, draft_dir: Path, prompts: list[list[int]], plan: Plan
) -> dict[str, Any]:
    """Greedy speculative decoding with the flashspec engine at gamma = plan.gamma."""
    sys.path.insert(0, str(REPO))
    from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine

    engine = SpeculativeEngine.from_pretrained(
        target=str(target_dir),
        drafters=[str(draft_dir)],
        config=FlashSpecConfig(sampling=SamplingConfig(gamma=plan.gamma, temperature=0.0)),
    )
    drafted = accepted = emitted = rounds = 0
    for ids in prompts:
        result = engine.generate(ids, max_new_tokens=plan.accept_new_tokens, ignore_eos=True)
        stats = result.stats
        drafted += stats.drafted
        accepted += stats.accepted
        emitted += stats.emitted
        rounds += stats.row_rounds
    return {
        "gamma": plan.gamma,
        "prompts": len(prompts),
        "prompt_tokens": plan.accept_prompt_tokens,
        "new_tokens_per_prompt": plan.accept_new_tokens,
        "drafted": drafted,
        "accepted": accepted,
        "acceptance_rate": accepted / drafted if drafted else 0.0,
        "tokens_per_round": emitted / rounds if rounds else 0.0,
    }


@torch.inference_mode()
def next_token_agreement(
    target: Any, draft: Any, prompts: list[list[int]], new_tokens: int
) -> float:
    """How often the draft's argmax equals the target's along the target's greedy output.

    This is the per-position probability a greedy draft is accepted; the engine's acceptance
    rate at gamma 4 is lower because a round stops at its first rejection.
    """
    agree = total = 0
    for ids in prompts:
        prompt = torch.tensor([ids])
        full = target.generate(
            prompt,
            attention_mask=torch.ones_like(prompt),
            do_sample=False,
            max_new_tokens=new_tokens,
            eos_token_id=None,
            pad_token_id=target.config.pad_token_id,
        )
        positions = slice(len(ids) - 1, full.shape[1] - 1)
        want = target(input_ids=full).logits[0, positions].argmax(-1)
        got = draft(input_ids=full).logits[0, positions].argmax(-1)
        agree += int((want == got).sum())
        total += want.numel()
    return agree / total


def held_out_prompts(stream: torch.Tensor, plan: Plan) -> list[list[int]]:
    """Prompts cut from the held-out stream at evenly spaced offsets."""
    stride = stream.numel() // (plan.accept_prompts + 1)
    return [
        stream[(i + 1) * stride : (i + 1) * stride + plan.accept_prompt_tokens].tolist()
        for i in range(plan.accept_prompts)
    ]


def measure(
    out: Path, plan: Plan, held_stream: torch.Tensor, drafter: str = "draft"
) -> dict[str, Any]:
    """Numbers for the card, all measured on the saved (float16-stored) weights.

    ``drafter`` is the directory of the drafter measured against the target; the result calls
    it "draft" whichever it is, so every drafter's numbers have the same shape.
    """
    target, draft = load_model(out / "target"), load_model(out / drafter)
    batches = eval_batches(held_stream, plan)
    print(f"measuring {drafter}: held-out loss, decode cost and acceptance", flush=True)
    target_ms, draft_ms = decode_costs(target, draft)
    return {
        "held_out_loss": {
            "target": round(held_out_loss(target, batches), 4),
            "draft": round(held_out_loss(draft, batches), 4),
            "tokens": sum(b[:, 1:].numel() for b in batches),
        },
        "decode_ms_per_token": {
            "target": round(target_ms, 3),
            "draft": round(draft_ms, 3),
            "how": "batch 1, 64-token prompt, 48 cached steps, best of 9 interleaved runs",
        },
        "draft_target_cost_ratio": round(draft_ms / target_ms, 4),
        "greedy_acceptance": safe_acceptance(out, held_stream, plan, drafter),
        "greedy_next_token_agreement": round(
            next_token_agreement(
                target, draft, held_out_prompts(held_stream, plan), plan.accept_new_tokens
            ),
            4,
        ),
    }


def safe_acceptance(
    out: Path, held_stream: torch.Tensor, plan: Plan, drafter: str = "draft"
) -> dict[str, Any]:
    # The engine is developed alongside this script: a failure here must not throw away an
    # hour of training. The card records the error; --measure-only fills it in later.
    try:
        prompts = held_out_prompts(held_stream, plan)
        return acceptance(out / "target", out / drafter, prompts, plan)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}


def dir_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def write_card(out: Path, card: dict[str, Any]) -> None:
    card["size_mb"] = {
        "target": round(dir_mb(out / "target"), 2),
        "draft": round(dir_mb(out / "draft"), 2),
    }
    if "draft3" in card:
        card["draft3"]["size_mb"] = round(dir_mb(out / "draft3"), 2)
    (out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    (out / "CARD.md").write_text(card_markdown(card))
    print(json.dumps({k: v for k, v in card.items() if k != "held_out_files"}, indent=2))


def measured_rows(measured: dict[str, Any], name: str) -> list[tuple[str, str]]:
    """Card rows for one drafter's measurements against the target."""
    loss, ms = measured["held_out_loss"], measured["decode_ms_per_token"]
    accept = measured["greedy_acceptance"]
    rows = [
        ("held-out loss (nats/token)", f"target {loss['target']:.3f}, {name} {loss['draft']:.3f}"),
        (
            "decode ms/token",
            f"target {ms['target']:.2f}, {name} {ms['draft']:.2f}: "
            f"cost ratio {measured['draft_target_cost_ratio']:.3f}",
        ),
    ]
    if "greedy_next_token_agreement" in measured:
        rows.append(
            (
                "greedy next-token agreement",
                f"{measured['greedy_next_token_agreement']:.3f} ({name} argmax = target argmax "
                "along the target's greedy output, same prompts)",
            )
        )
    rows.append(
        (
            f"greedy acceptance, gamma = {accept.get('gamma', 4)}",
            f"{accept.get('acceptance_rate', float('nan')):.3f} "
            f"({accept.get('tokens_per_round', float('nan')):.2f} tokens/round; "
            f"{accept.get('prompts', 0)} held-out prompts x "
            f"{accept.get('new_tokens_per_prompt', 0)} tokens)",
        )
    )
    return rows


def table(rows: list[tuple[str, str]]) -> str:
    return "\n".join(["| | |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)]) + "\n"


def card_markdown(card: dict[str, Any]) -> str:
    """The card's headline numbers as Markdown tables (card.json has everything)."""
    plan, data, measured = card["plan"], card["data"], card["measured"]
    train = card["training"]
    rows = [
        (
            "data",
            f"Python {card['python']} stdlib: {data['train_files']} files, "
            f"{data['train_bytes'] / 1e6:.1f} MB, {data['train_tokens']:,} tokens; "
            f"{data['held_out_files_count']} files ({data['held_out_tokens']:,} tokens) held out "
            f"by `{data['holdout_rule']}`",
        ),
        (
            "target",
            f"Llama {plan['target_layers']} layers x d {plan['hidden']}, "
            f"{card['params']['target']:,} parameters, {plan['target_steps']} steps of "
            f"{plan['batch_size']} x {plan['seq_len']} tokens, "
            f"{train['target']['wall_s'] / 60:.1f} min",
        ),
        (
            "draft",
            f"Llama {plan['draft_layers']} layer x d {plan['hidden']}, "
            f"{card['params']['draft']:,} parameters, distilled (KL) {plan['draft_steps']} steps, "
            f"{train['draft']['wall_s'] / 60:.1f} min",
        ),
        *measured_rows(measured, "draft"),
        (
            "size",
            f"target {card['size_mb']['target']:.1f} MB, draft {card['size_mb']['draft']:.1f} "
            "MB (float16 on disk, float32 loaded)",
        ),
        (
            "total wall time",
            f"{card.get('total_wall_s', 0) / 60:.1f} min, "
            f"{card['threads']} threads, torch {card['torch']}",
        ),
    ]
    text = table(rows)
    if "draft3" in card:
        text += "\n" + draft3_markdown(card["draft3"], plan["hidden"])
    return text


def draft3_markdown(entry: dict[str, Any], hidden: int) -> str:
    """The second drafter's own table: what it is, how it measures, what produced it."""
    plan = entry["plan"]
    rows = [
        (
            "draft3",
            f"Llama {plan['draft2_layers']} layers x d {hidden}, {entry['params']:,} parameters, "
            f"distilled (KL) from the same target, {plan['draft2_steps']} steps, "
            f"{entry['training']['wall_s'] / 60:.1f} min",
        ),
        *measured_rows(entry["measured"], "draft3"),
        ("size", f"{entry.get('size_mb', 0):.1f} MB (float16 on disk, float32 loaded)"),
        (
            "produced by",
            f"`{entry['command']}`: {entry.get('wall_s', 0) / 60:.1f} min wall, "
            f"{entry['threads']} threads, torch {entry['torch']}",
        ),
    ]
    return (
        '## Second drafter: `"demo-draft3"` (`flashspec/demo/draft3`)\n\n'
        "Distilled from the same target as the draft, to give adaptive drafter selection a "
        "slower, more accurate arm; its numbers are under `draft3` in card.json.\n\n" + table(rows)
    )


def draft3_entry(
    out: Path,
    plan: Plan,
    target: Any,
    tokenizer: Any,
    train_stream: torch.Tensor,
    held_stream: torch.Tensor,
    command: str,
) -> dict[str, Any]:
    """Distil the second drafter into ``out / "draft3"`` and measure it: its card entry."""
    spec = drafters(plan)["draft3"]
    draft, log = train_drafter(spec, target, tokenizer, train_stream, plan, out)
    return {
        "what": f'second demo drafter: Llama {spec.layers} layers, name "demo-draft3"; distilled '
        "(KL) from the same target as the draft, started from the target's embedding, first "
        f"{spec.layers} layers and final norm",
        "command": command,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "plan": {k: v for k, v in asdict(plan).items() if k.startswith("draft2_")},
        "params": sum(p.numel() for p in draft.parameters()),
        "training": log,
        "measured": measure(out, plan, held_stream, spec.dir),
    }


# --------------------------------------------------------------------------------------- main

WHAT = (
    "flashspec demo pair: Llama target + distilled 1-layer draft on the Python stdlib "
    "(and a second, 3-layer drafter under draft3)"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help=f"default: {DEFAULT_OUT}")
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (into /tmp)")
    modes = parser.add_mutually_exclusive_group()
    modes.add_argument(
        "--measure-only", action="store_true", help="re-measure the saved models, rewrite the card"
    )
    modes.add_argument(
        "--draft-only",
        action="store_true",
        help="keep the saved target and tokenizer; distil the draft again, re-measure",
    )
    modes.add_argument(
        "--draft2-only",
        action="store_true",
        help="keep the saved target, tokenizer and draft; distil the second drafter (draft3) "
        "again and measure it",
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else Plan()
    out: Path = args.out or (Path("/tmp/flashspec-demo-quick") if args.quick else DEFAULT_OUT)
    quick = " --quick" if args.quick else ""

    # Two threads: the machines this is meant for have two cores; also makes timings comparable.
    torch.set_num_threads(2)
    torch.manual_seed(plan.seed)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    wall = time.perf_counter()

    train_texts, held_texts, held_names = read_corpus()
    print(f"corpus: {len(train_texts)} training files, {len(held_texts)} held out", flush=True)

    if args.measure_only:
        from transformers import AutoTokenizer

        card = json.loads((out / "card.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(out / "target")
        held_stream = encode_stream(tokenizer, held_texts)
        card["measured"] = measure(out, plan, held_stream)
        if "draft3" in card:
            card["draft3"]["measured"] = measure(out, plan, held_stream, "draft3")
        write_card(out, card)
        print(card_markdown(card))
        return

    keep_target = args.draft_only or args.draft2_only
    if keep_target:
        from transformers import AutoTokenizer

        # The tokenizer and target a full run would train again, byte for byte (same data,
        # seeds and steps): the same drafts come out either way.
        previous = json.loads((out / "card.json").read_text())
        tokenizer = AutoTokenizer.from_pretrained(out / "target")
        target_log = previous["training"]["target"]
    else:
        tokenizer = train_tokenizer(train_texts, plan, out / "tokenizer-tmp")
    train_stream = encode_stream(tokenizer, train_texts)
    held_stream = encode_stream(tokenizer, held_texts)
    print(f"tokens: {train_stream.numel():,} train, {held_stream.numel():,} held out", flush=True)

    if not keep_target:
        target = llama(plan, plan.target_layers, tokenizer)
        target_log = train_target(target, train_stream, plan)
        save_model(target, tokenizer, out / "target")

    # Distil from the saved weights as they will ship (float16-rounded), not the fp32 originals.
    target = load_model(out / "target")
    for p in target.parameters():
        p.requires_grad_(False)

    if args.draft2_only:
        # What a full run costs: the earlier estimate less any earlier draft3, plus this one.
        earlier = previous.get("draft3", {}).get("wall_s", 0.0)
        card = previous
        card["what"] = WHAT
        command = f"python scripts/train_demo_pair.py --draft2-only{quick}"
        card["draft3"] = draft3_entry(
            out, plan, target, tokenizer, train_stream, held_stream, command
        )
        run_wall = round(time.perf_counter() - wall, 1)
        card["draft3"]["wall_s"] = run_wall
        card["runs"] = [
            *previous.get("runs", [{"how": "full run", "wall_s": previous["total_wall_s"]}]),
            {"how": "--draft2-only", "wall_s": run_wall},
        ]
        card["total_wall_s"] = round(previous["total_wall_s"] - earlier + run_wall, 1)
        write_card(out, card)
        print(card_markdown(card))
        return

    draft, draft_log = train_drafter(
        drafters(plan)["draft"], target, tokenizer, train_stream, plan, out
    )
    if not args.draft_only:
        for leftover in (out / "tokenizer-tmp").iterdir():
            leftover.unlink()
        (out / "tokenizer-tmp").rmdir()

    card: dict[str, Any] = {
        "what": WHAT,
        "command": "python scripts/train_demo_pair.py" + quick,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "plan": asdict(plan),
        "data": {
            "source": "the interpreter's stdlib .py files (sysconfig stdlib path)",
            "skipped_dirs": sorted(SKIP_DIRS),
            "holdout_rule": f"sha256(relative path) % {HOLDOUT_MODULUS} == 0",
            "train_files": len(train_texts),
            "held_out_files_count": len(held_names),
            "train_bytes": sum(len(t.encode()) for t in train_texts),
            "train_tokens": train_stream.numel(),
            "held_out_tokens": held_stream.numel(),
        },
        "params": {
            "target": sum(p.numel() for p in target.parameters()),
            "draft": sum(p.numel() for p in draft.parameters()),
        },
        "training": {"target": target_log, "draft": draft_log},
        "storage": "float16 safetensors, loaded as float32 (config.json dtype)",
        "held_out_files": held_names,
    }
    card["measured"] = measure(out, plan, held_stream)
    if args.draft_only:
        if "draft3" in previous:  # distilled from the same, unchanged target: still valid
            card["draft3"] = previous["draft3"]
    else:
        start = time.perf_counter()
        card["draft3"] = draft3_entry(
            out, plan, target, tokenizer, train_stream, held_stream, card["command"]
        )
        card["draft3"]["wall_s"] = round(time.perf_counter() - start, 1)
    card["total_wall_s"] = round(time.perf_counter() - wall, 1)
    if args.draft_only:
        # What a full run costs: the earlier run's time less its draft, plus this draft.
        card["runs"] = [
            *previous.get("runs", [{"how": "full run", "wall_s": previous["total_wall_s"]}]),
            {"how": "--draft-only", "wall_s": card["total_wall_s"]},
        ]
        card["total_wall_s"] = round(
            previous["total_wall_s"]
            - previous["training"]["draft"]["wall_s"]
            + draft_log["wall_s"],
            1,
        )
    write_card(out, card)
    print(card_markdown(card))


if __name__ == "__main__":
    main()
