"""The engine benchmark's tables and plot: the per-method table (also the README's), the
printed report and ``engine.png``."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .runner import baseline_of

LABELS = {
    "hf_greedy": "HF generate (greedy)",
    "hf_assisted_default": "HF assisted, defaults (20 tok, conf 0.4)",
    "hf_assisted_gamma": "HF assisted, gamma matched",
    "hf_lookup": "HF prompt lookup",
    "fs_greedy": "flashspec greedy (draft model)",
    "fs_lookup": "flashspec greedy (prompt lookup)",
    "hf_sample": "HF generate (T 0.8, top-p 0.95)",
    "fs_sample": "flashspec (T 0.8, top-p 0.95)",
}


def engine_table(data: dict[str, Any], split: str) -> list[list[str]]:
    """Rows (header first) of the per-method table for one split."""
    summary = data["summary"].get(split, {})
    rows = [
        [
            "method",
            "tokens/s",
            "speedup (median)",
            "greedy identity",
            "acceptance",
            "tokens/round",
            "ideal",
            "efficiency",
            "raw efficiency",
        ]
    ]

    def fmt(x: Any, spec: str) -> str:
        return "—" if x is None else format(x, spec)

    for method, s in summary.items():
        ident = s.get("identity")
        ident_text = (
            "n/a (sampling)"
            if ident is None
            else f"{ident['identical'] + ident['tie']}/{s['prompts']}"
            + (f" ({ident['tie']} ties)" if ident["tie"] else "")
            + ("" if s.get("all_match") else " MISMATCH")
        )
        base = baseline_of(method)
        speedup = "1 (baseline)" if method == base else f"{s['speedup_median']:.2f}x vs {base}"
        rows.append(
            [
                LABELS.get(method, method),
                f"{s['tokens_per_second']:.1f}",
                speedup,
                ident_text,
                fmt(s["acceptance_rate"], ".1%"),
                fmt(s["tokens_per_round"], ".2f"),
                fmt(s["ideal_speedup_median"], ".2f"),
                fmt(s["efficiency_median"], ".2f"),
                fmt(s.get("efficiency_raw_median"), ".2f"),
            ]
        )
    return rows


def _print_rows(rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)))


def plot_engine(data: dict[str, Any], path: Path, plt: Any) -> None:
    """Per-prompt speedups per method (left); the gamma sweep (right)."""
    sweep = data.get("gamma_sweep")
    fig, axes = plt.subplots(1, 2 if sweep else 1, figsize=(13 if sweep else 8, 5), squeeze=False)
    ax = axes[0][0]
    methods = [m for m in data["settings"]["methods"] if m != baseline_of(m)]
    colors = {"humaneval": "tab:blue", "stdlib": "tab:orange"}
    for i, method in enumerate(methods):
        for source, color in colors.items():
            ys = [r["methods"][method]["speedup"] for r in data["prompts"] if r["source"] == source]
            xs = [i + (-0.12 if source == "humaneval" else 0.12)] * len(ys)
            ax.scatter(xs, ys, s=14, alpha=0.7, color=color, label=source if i == 0 else None)
        med = statistics.median(r["methods"][method]["speedup"] for r in data["prompts"])
        ax.hlines(med, i - 0.3, i + 0.3, color="black")
    ax.axhline(1.0, color="grey", linestyle="--", linewidth=1)
    ax.set_xticks(range(len(methods)))
    ax.set_xticklabels([LABELS.get(m, m) for m in methods], rotation=25, ha="right", fontsize=7)
    ax.set_ylabel("speedup over plain HF generate (per prompt)")
    pair = data["pair"]
    ax.set_title(
        f"{Path(pair['target']).name} / {Path(str(pair['draft'])).name}, "
        f"gamma={data['settings']['gamma']}, {data['settings']['max_new_tokens']} new tokens\n"
        f"{data['machine']['cpu']}",
        fontsize=8,
    )
    ax.legend(fontsize=7)
    if sweep:
        ax2 = axes[0][1]
        gs = [row["gamma"] for row in sweep]
        for row in sweep:
            ax2.scatter(
                [row["gamma"]] * len(row["speedups"]),
                row["speedups"],
                s=10,
                alpha=0.4,
                color="tab:blue",
            )
        ax2.plot(gs, [row["speedup_median"] for row in sweep], "-o", label="measured (median)")
        ideal = [row["ideal_speedup_median"] for row in sweep]
        if all(v is not None for v in ideal):
            ax2.plot(gs, ideal, "--", label="ideal (acceptance, cost ratio)")
        ax2.axhline(1.0, color="grey", linestyle="--", linewidth=1)
        ax2.set_xlabel("gamma (drafts per round)")
        ax2.set_ylabel("flashspec greedy speedup over HF generate")
        ax2.set_title("gamma sweep", fontsize=9)
        ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_engine(data: dict[str, Any]) -> None:
    """Print the tables, the cost model, the sweep and the targets."""
    costs = data["costs"]
    print(
        f"\ndecode cost at {costs['context_tokens']} tokens of context: target "
        f"{costs['target_ms']:.2f} ms/token, draft {costs.get('draft_ms', float('nan')):.2f} "
        f"ms/token (c = {costs.get('c')}), {costs['verify_tokens']}-token verification "
        f"{costs['target_verify_ms']:.2f} ms ({costs['verify_over_step']:.2f}x a step)"
    )
    for split in ("humaneval", "stdlib", "all"):
        if split in data["summary"]:
            print(f"\n[{split}]")
            _print_rows(engine_table(data, split))
    for row in data.get("gamma_sweep", []):
        print(
            f"gamma={row['gamma']}: speedup {row['speedup_median']:.2f}x "
            f"(ideal {row['ideal_speedup_median']}), acceptance {row['acceptance_rate']}, "
            f"{row['tokens_per_round']:.2f} tokens/round, identical {row['all_match']}"
        )
    print("\ntargets (HumanEval):")
    for key, value in data["targets"].items():
        print(f"  {key}: {value}")


# ------------------------------------------------------------------- real model (bench chat)

CHAT_LABELS = {
    "hf_greedy": "HF generate (greedy, fp32)",
    "hf_greedy_bf16": "HF generate (greedy, bf16)",
    "hf_lookup": "HF prompt lookup (10 tokens, fp32)",
    "fs_default": "flashspec default (lookup or plain per round, fp32)",
    "fs_default_bf16": "flashspec default, --dtype bfloat16",
    "fs_lookup": "flashspec prompt lookup every round (gamma 4, fp32)",
    "llamacpp": "llama.cpp (Q4_1 GGUF, greedy)",
    "llamacpp_lookup": "llama.cpp + prompt lookup (10 tokens)",
}


def chat_label(method: str) -> str:
    """The table label of a real-model benchmark method."""
    if method.startswith("fs_lookup_gamma"):
        return f"flashspec prompt lookup, gamma {method.removeprefix('fs_lookup_gamma')}"
    return CHAT_LABELS.get(method, method)


def chat_table(data: dict[str, Any], workload: str) -> list[list[str]]:
    """Rows (header first) of the real-model table for one workload (``smollm2.json``)."""
    summary = data["summary"].get(workload, {})
    rows = [
        [
            "method",
            "tokens/s (median)",
            "speedup vs HF greedy fp32",
            "vs HF lookup",
            "greedy identity",
            "acceptance",
            "tokens/round",
        ]
    ]

    def fmt(x: Any, spec: str) -> str:
        return "—" if x is None else format(x, spec)

    for method, s in summary.items():
        ident = s["identity"]
        same = ident["identical"] + ident["tie"]
        if method.startswith("llamacpp"):
            first = s.get("first_difference_median")
            ident_text = f"{ident['identical']}/{s['prompts']} equal" + (
                f" (median first difference at token {first:g})" if first is not None else ""
            )
        else:
            ident_text = (
                f"{same}/{s['prompts']}"
                + (f" ({ident['tie']} ties)" if ident["tie"] else "")
                + ("" if s["all_match"] else f" ({ident['mismatch']} MISMATCH)")
                + (" vs bf16 HF" if s["baseline"] != "hf_greedy" else "")
            )
        speed = (
            "1 (baseline)"
            if method == "hf_greedy"
            else f"{s['speedup_vs_hf_greedy_median']:.2f}x"
            + (
                f" ({s['speedup_median']:.2f}x vs bf16 HF)"
                if s["baseline"] != "hf_greedy" and method != s["baseline"]
                else ""
            )
        )
        lookup = s.get("speedup_vs_hf_lookup_median")
        vs_lookup = (
            "1 (reference)"
            if method == "hf_lookup"
            else "—"
            if lookup is None
            else f"{lookup:.2f}x"
        )
        rows.append(
            [
                chat_label(method),
                f"{s['tokens_per_second_median']:.1f}",
                speed,
                vs_lookup,
                ident_text,
                fmt(s["acceptance_rate"], ".1%"),
                fmt(s["tokens_per_round"], ".2f"),
            ]
        )
    return rows


def chat_sweep_table(data: dict[str, Any], workload: str) -> list[list[str]]:
    """Rows (header first) of the gamma sweep for one workload."""
    sweep = data.get("gamma_sweep", {}).get("workloads", {}).get(workload)
    rows = [
        ["gamma", "speedup vs HF greedy", "vs HF lookup", "acceptance", "tokens/round", "identical"]
    ]
    if not sweep:
        return rows
    for r in sweep["rows"]:
        rows.append(
            [
                str(r["gamma"]),
                f"{r['speedup_median']:.2f}x",
                "—"
                if r["speedup_vs_hf_lookup_median"] is None
                else f"{r['speedup_vs_hf_lookup_median']:.2f}x",
                "—" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.1%}",
                "—" if r["tokens_per_round"] is None else f"{r['tokens_per_round']:.2f}",
                "yes" if r["all_match"] else "NO",
            ]
        )
    return rows


def report_chat(data: dict[str, Any]) -> None:
    """Print the real-model benchmark: costs, per-workload tables, sweep, targets."""
    model, costs = data["model"], data["costs"]
    print(
        f"\n{model['target']}: {model['model_type']}, {model['layers']} layers x "
        f"{model['hidden_size']}, vocabulary {model['vocab_size']:,}, "
        f"{model['parameters'] / 1e6:.1f} M parameters"
    )
    for dtype in ("float32", "bfloat16"):
        c = costs[dtype]
        print(
            f"cost at {c['context_tokens']} tokens of context ({dtype}): 1-token forward "
            f"{c['step_ms']:.2f} ms, {c['verify_tokens']}-token forward {c['verify_ms']:.2f} ms "
            f"({c['verify_over_step']:.2f}x)"
        )
    for note, text in data["settings"].get("notes", {}).items():
        print(f"{note}: {text}")
    for workload in ("humaneval", "copy", "all"):
        if workload in data["summary"]:
            print(f"\n[{workload}]")
            _print_rows(chat_table(data, workload))
    if data.get("speedup_by_kind"):
        print("\ncopy workload, median speedup vs each method's baseline by kind:")
        for kind, per in data["speedup_by_kind"].items():
            cells = ", ".join(f"{m} {v:.2f}x" for m, v in per.items() if m != "hf_greedy")
            print(f"  {kind}: {cells}")
    sweep = data.get("gamma_sweep")
    if sweep:
        for workload in sweep["workloads"]:
            best = sweep["workloads"][workload]["best_gamma"]
            print(f"\ngamma sweep [{workload}] (best gamma {best})")
            _print_rows(chat_sweep_table(data, workload))
        if "best_gamma_overall" in sweep:
            print(f"best gamma over both workloads: {sweep['best_gamma_overall']}")
    print("\ntargets:")
    for key, value in data["targets"].items():
        print(f"  {key}: {value}")
