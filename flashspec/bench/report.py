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
