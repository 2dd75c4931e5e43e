"""``flashspec bench recurrent``: speculative decoding on small random recurrent/hybrid pairs
against HF ``generate``, and what the state replay costs (``recurrent.json``)."""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from ..flags import argtypes
from .common import machine_info, progress, write_json

# Small random pairs of each supported stateful family (tiny configs, nothing downloaded): an
# 8-layer target whose layers after the first contribute little (their output projections are
# scaled down), and a 1-layer draft that is the target's first layer with its embeddings and
# head (Qwen3-Next and Lfm2: two layers, the first attention layer included), so the draft
# agrees with the target often, as a trained pair would. Measured, interleaved per
# prompt: plain HF ``generate`` (greedy), flashspec with the state kept after full accepts, and
# flashspec always replaying (``FLASHSPEC_RECURRENT=replay``); plus how often the replay runs and
# what it costs per round.

FAMILIES = ("mamba2", "qwen3_next", "lfm2", "falcon_h1", "mamba", "falcon_mamba", "jamba")
VOCAB = 256
# The share of each deep layer's output kept in the target: small, so a 1-layer draft agrees
# with the 8-layer target on most tokens.
DEEP_SCALE = 0.05


def tiny_config(family: str, layers: int, hidden: int = 32, vocab: int = VOCAB) -> Any:
    """A small random config of ``family`` (a model_type), ids 0/1/2 = pad/bos/eos."""
    # Any: the configs' typed keyword arguments vary by release; the values are checked at run
    # time by transformers itself.
    tf: Any = importlib.import_module("transformers")
    ids: dict[str, Any] = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    heads: dict[str, Any] = {"num_attention_heads": 4, "num_key_value_heads": 2}
    if family == "mamba2":
        return tf.Mamba2Config(
            vocab_size=vocab, hidden_size=hidden, state_size=8, num_hidden_layers=layers,
            expand=2, conv_kernel=4, num_heads=4, head_dim=hidden * 2 // 4, n_groups=1,
            chunk_size=16, **ids,
        )  # fmt: skip
    if family == "qwen3_next":
        return tf.Qwen3NextConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, head_dim=8, linear_num_value_heads=4,
            linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
            linear_conv_kernel_dim=4, num_experts=2, num_experts_per_tok=1,
            moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
            full_attention_interval=2, max_position_embeddings=512, **heads, **ids,
        )  # fmt: skip
    if family == "lfm2":
        return tf.Lfm2Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, full_attn_idxs=list(range(1, layers, 2)), conv_L_cache=3,
            max_position_embeddings=512, **heads, **ids,
        )  # fmt: skip
    if family == "falcon_h1":
        return tf.FalconH1Config(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, head_dim=8, mamba_d_ssm=hidden, mamba_n_heads=4,
            mamba_d_head=hidden // 4, mamba_d_state=8, mamba_d_conv=4, mamba_n_groups=1,
            mamba_chunk_size=16, max_position_embeddings=512, **heads, **ids,
        )  # fmt: skip
    if family in ("mamba", "falcon_mamba"):
        cls = tf.MambaConfig if family == "mamba" else tf.FalconMambaConfig
        return cls(
            vocab_size=vocab, hidden_size=hidden, state_size=8, num_hidden_layers=layers,
            expand=2, conv_kernel=4, **ids,
        )  # fmt: skip
    if family == "jamba":
        return tf.JambaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=layers, attn_layer_period=2, attn_layer_offset=1,
            expert_layer_period=2, expert_layer_offset=1, num_experts=2, num_experts_per_tok=1,
            mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
            max_position_embeddings=512, **heads, **ids,
        )  # fmt: skip
    if family == "recurrent_gemma":
        return tf.RecurrentGemmaConfig(
            vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=1, lru_width=hidden,
            attention_window_size=16, conv1d_width=4,
            block_types=["recurrent", "attention", "recurrent"], **ids,
        )  # fmt: skip
    raise ValueError(f"no tiny config for family {family!r}; known: {FAMILIES}")


def build(family: str, layers: int, seed: int, hidden: int = 32, vocab: int = VOCAB) -> Any:
    """A seeded random model of ``family`` in eval mode (float32, CPU)."""
    auto: Any = importlib.import_module("transformers").AutoModelForCausalLM
    torch.manual_seed(seed)
    model: Any = auto.from_config(tiny_config(family, layers, hidden, vocab))
    return model.eval()


def _decoder_layers(model: Any) -> torch.nn.ModuleList:
    for name in ("layers", "h", "blocks"):
        for owner in (getattr(model, "model", None), getattr(model, "backbone", None)):
            found = getattr(owner, name, None)
            if isinstance(found, torch.nn.ModuleList):
                return found
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


def pair(family: str, layers: int = 8, seed: int = 0) -> tuple[Any, Any]:
    """(target, draft): the draft is the target cut to its first layer (two for the hybrids
    whose first layer is not attention)."""
    target = build(family, layers, seed)
    with torch.no_grad():
        for layer in list(_decoder_layers(target))[1:]:
            for name, param in layer.named_parameters():
                # Scale what each deep layer writes back into the residual stream.
                if name.endswith(
                    ("out_proj.weight", "o_proj.weight", "down_proj.weight", "w2.weight")
                ):
                    param.mul_(DEEP_SCALE)
    # transformers cannot run these hybrids without attention layers: their drafts keep the
    # first attention layer too.
    draft = build(family, 2 if family in ("qwen3_next", "lfm2", "jamba") else 1, seed)
    # The target's first layer(s), embeddings, final norm and head; deeper layers' keys are extra.
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    if missing:
        raise ValueError(f"the 1-layer {family} draft lacks target weights for {missing}")
    return target, draft


HELP = "recurrent/hybrid pairs: speedup over HF generate, replay cost"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashspec bench recurrent``."""
    parser.add_argument(
        "--families", default=",".join(FAMILIES), help=f"model types (default {','.join(FAMILIES)})"
    )
    parser.add_argument("--prompts", type=argtypes.positive_int, default=8)
    parser.add_argument("--max-new-tokens", type=argtypes.positive_int, default=96)
    parser.add_argument("--gamma", type=argtypes.positive_int, default=4)
    parser.add_argument("--layers", type=argtypes.positive_int, default=8)
    parser.add_argument("--name", default="recurrent", help="result file stem")


def _measure(family: str, args: argparse.Namespace, show: bool) -> dict[str, Any]:
    from ..config import FlashSpecConfig, SamplingConfig
    from ..drafters import ModelDrafter
    from ..engine import SpeculativeEngine
    from ..models import TargetModel

    target, draft = pair(family, args.layers)
    target.generation_config.eos_token_id = None  # both sides generate max_new_tokens
    engines = {}
    for mode in ("keep", "replay"):
        tm = TargetModel(model=target)
        tm.state_mode = mode
        engines[mode] = SpeculativeEngine(
            FlashSpecConfig(sampling=SamplingConfig(gamma=args.gamma)), [ModelDrafter(draft)], tm
        )
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, VOCAB, (1, 24), generator=generator) for _ in range(args.prompts)]
    rates: dict[str, list[float]] = {"hf": [], "keep": [], "replay": []}
    identical = 0
    rounds = replays = 0
    replay_time = round_time = 0.0
    accepted = drafted = 0
    n = args.max_new_tokens
    with torch.inference_mode():
        target.generate(prompts[0], max_new_tokens=4, do_sample=False, pad_token_id=0)  # warm-up
        for ids in progress(prompts, desc=family, disable=not show):
            start = time.perf_counter()
            out = target.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0)
            rates["hf"].append(n / (time.perf_counter() - start))
            reference = out[0, ids.shape[1] :].tolist()
            for mode, engine in engines.items():
                result = engine.generate(input_ids=ids, max_new_tokens=n, ignore_eos=True)
                rates[mode].append(result.stats.tokens_per_second)
                if mode == "keep":
                    identical += result.tokens[0] == reference
                    stats = result.stats
                    rounds += stats.rounds
                    replays += stats.replays
                    replay_time += stats.time_replay
                    round_time += stats.time_total
                    accepted += stats.accepted
                    drafted += stats.drafted
    ratio = {
        mode: statistics.median(r / h for r, h in zip(rates[mode], rates["hf"], strict=True))
        for mode in ("keep", "replay")
    }
    return {
        "family": family,
        "target_class": type(target).__name__,
        "target_layers": args.layers,
        "tokens_per_second": {k: statistics.median(v) for k, v in rates.items()},
        "speedup_vs_hf": ratio["keep"],
        "speedup_always_replay_vs_hf": ratio["replay"],
        "greedy_identical": f"{identical}/{len(prompts)}",
        "acceptance": accepted / drafted if drafted else 0.0,
        "replay_share_of_rounds": replays / rounds if rounds else 0.0,
        "replay_ms_per_replay": 1e3 * replay_time / replays if replays else 0.0,
        "replay_share_of_time": replay_time / round_time if round_time else 0.0,
    }


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; print a table; write ``recurrent.json``."""
    torch.set_num_threads(1)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; choose from {','.join(FAMILIES)}")
    if args.quick:
        args.prompts, args.max_new_tokens = min(args.prompts, 2), min(args.max_new_tokens, 32)
    rows = [_measure(family, args, not args.no_progress) for family in families]
    data = {
        "machine": machine_info(),
        "settings": {
            "prompts": args.prompts,
            "max_new_tokens": args.max_new_tokens,
            "gamma": args.gamma,
            "layers": args.layers,
            "deep_scale": DEEP_SCALE,
            "threads": 1,
        },
        "results": rows,
    }
    print(table(data))
    write_json(data, Path(args.out_dir) / f"{args.name}.json")  # says where it wrote
    return 0


def table(data: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = [
        "| family | HF generate tok/s | flashspec tok/s | speedup | always replay | identical "
        "| acceptance | rounds with a replay | ms per replay | replay share of time |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["results"]:
        rate = row["tokens_per_second"]
        lines.append(
            f"| {row['family']} | {rate['hf']:.1f} | {rate['keep']:.1f} "
            f"| {row['speedup_vs_hf']:.2f}x | {row['speedup_always_replay_vs_hf']:.2f}x "
            f"| {row['greedy_identical']} | {row['acceptance']:.1%} "
            f"| {row['replay_share_of_rounds']:.1%} | {row['replay_ms_per_replay']:.2f} "
            f"| {row['replay_share_of_time']:.1%} |"
        )
    return "\n".join(lines)
