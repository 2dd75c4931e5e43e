"""Write benchmark result files into README.md and docs/*.md between their markers.

    python benchmarks/render_readme.py

The figures in the README and the docs are never typed by hand: this script renders them
from the JSON that the benchmarks wrote (``flashspec bench
kernel|engine|profile|regret|adaptive|recurrent|batch|compiled``, ``benchmarks/load_server.py``,
``benchmarks/load_replicas.py``, ``benchmarks/adaptive_headroom.py``), with the machine,
versions and git sha recorded there.
Each section goes between ``<!-- TAG:START -->`` and ``<!-- TAG:END -->`` in the page that
``PAGES`` names. Sections whose JSON is missing are left as they are.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
# The page each generated section is rendered into (a page may hold several).
PAGES: dict[str, Path] = {
    "SUMMARY": README,
    "ENGINE-BENCH": DOCS / "benchmarks.md",
    "SERVE-LOAD": DOCS / "benchmarks.md",
    "REPLICAS-BENCH": DOCS / "benchmarks.md",
    "BATCH-BENCH": DOCS / "benchmarks.md",
    "COMPILED-BENCH": DOCS / "benchmarks.md",
    "KERNEL-BENCH": DOCS / "kernel.md",
    "ADAPTIVE-BENCH": DOCS / "adaptive.md",
    "DEMO-CARD": DOCS / "demo-pair.md",
    "RECURRENT-BENCH": DOCS / "models.md",
    "SMOLLM2": DOCS / "models.md",
    "SMOLLM2-DRAFT": DOCS / "models.md",
    "QUANT-KERNEL": DOCS / "quantized.md",
    "SMOLLM2-QUANT": DOCS / "quantized.md",
    "SMOLLM2-MEMORY": DOCS / "quantized.md",
    "SMOLLM2-Q4KM": DOCS / "quantized.md",
    "LENGTHS": DOCS / "adaptive.md",
    "API-FIELDS": DOCS / "engine.md",
    "TREES": DOCS / "trees.md",
}
RESULTS = ROOT / "benchmarks" / "results"
KERNEL_JSON = RESULTS / "kernel.json"
ENGINE_JSON = RESULTS / "engine.json"
PROFILE_JSON = RESULTS / "profile.json"
REGRET_JSON = RESULTS / "regret.json"
ADAPTIVE_JSON = RESULTS / "adaptive.json"
SERVE_JSON = RESULTS / "serve_load.json"
REPLICAS_JSON = RESULTS / "replicas.json"
RECURRENT_JSON = RESULTS / "recurrent.json"
SMOLLM2_JSON = RESULTS / "smollm2.json"
SMOLLM2_PROFILE_JSON = RESULTS / "profile-smollm2.json"
SMOLLM2_SWEEP_JSON = RESULTS / "smollm2-gamma-sweep.json"
SMOLLM2_DRAFT_JSON = RESULTS / "smollm2-draft.json"
SMOLLM2_TREE_JSON = RESULTS / "smollm2-draft-tree.json"
QUANT_JSON = RESULTS / "quant.json"
SMOLLM2_QUANT_JSON = RESULTS / "smollm2-quant.json"
SMOLLM2_Q4KM_JSON = RESULTS / "smollm2-q4_k_m-quant.json"
SMOLLM2_MEMORY_JSON = RESULTS / "smollm2-memory.json"
API_FIELDS_JSON = RESULTS / "api-fields.json"
LENGTHS_JSONS = [RESULTS / "engine-lengths.json", RESULTS / "smollm2-lengths.json"]
# flashspec bench batch: the demo pair, then other targets (batch-smollm2.json, ...).
BATCH_JSON = RESULTS / "batch.json"
# flashspec bench compiled: the demo pair, then other targets (compiled-smollm2.json, ...).
COMPILED_JSON = RESULTS / "compiled.json"
HEADROOM_JSONS = (
    RESULTS / "adaptive_headroom_sample.json",
    RESULTS / "adaptive_headroom_greedy.json",
)
# Written by scripts/train_demo_pair.py from the measurements in card.json.
DEMO_CARD = ROOT / "flashspec" / "demo" / "CARD.md"
SWEEP_HEADER = ["gamma", "speedup (median)", "ideal", "acceptance", "tokens/round", "identical"]
# The README's table: the engine table's HumanEval rows, cut to what a newcomer asks first.
SUMMARY_COLUMNS = ("method", "tokens/s", "speedup (median)", "greedy identity", "acceptance")


def _relative(page: Path, target: Path) -> str:
    """``target`` as a link from ``page``: a section reads the same wherever it is rendered."""
    return Path(os.path.relpath(target, page.parent)).as_posix()


def _plot(page: Path, name: str, alt: str) -> list[str]:
    """The image line of a results plot, if the benchmark wrote one."""
    path = RESULTS / name
    return ["", f"![{alt}]({_relative(page, path)})"] if path.exists() else []


def kernel_section(data: dict[str, Any], page: Path) -> str:
    rows = data["rows"]
    m = data["machine"]
    names = list(rows[0]["ns"].keys())
    head = "| implementation | " + " | ".join(f"V={r['V']:,}" for r in rows) + " |"
    sep = "|---|" + "---:|" * len(rows)
    lines = [
        f"Median µs per call, {m['cpu']}, {m['cores']} cores; Python {m['python']}, "
        f"NumPy {m['numpy']}, torch {m.get('torch')}, {m['gcc']}, {m['nasm']}; "
        f"git {m['git_sha'][:10]}, {m['date']}, {data['samples']} samples. "
        "C baselines are timed inside C (no call overhead); flashspec through its Python API.",
        "",
        head,
        sep,
    ]
    for n in names:
        cells = " | ".join(f"{r['ns'][n] / 1000:.2f}" for r in rows)
        lines.append(f"| {n} | {cells} |")
    lines += ["", "Against the kernel issue's targets (ratios from the same run):", ""]
    for k, v in data["summary"].items():
        lines.append(f"- {k}: {v}")
    lines += _plot(page, "kernel.png", "time per call against V")
    return "\n".join(lines)


def _markdown(rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(rows[0]) + " |", "|---|" + "---:|" * (len(rows[0]) - 1)]
    out += ["| " + " | ".join(row) + " |" for row in rows[1:]]
    return out


def engine_section(data: dict[str, Any], profile: dict[str, Any] | None, page: Path) -> str:
    from flashspec.bench.report import engine_table

    m, s, pair, costs = data["machine"], data["settings"], data["pair"], data["costs"]
    counts = s["prompts"]
    lines = [
        f"{m['cpu']}, {m['cores']} cores, {m.get('torch_threads')} torch threads; "
        f"torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}; "
        f"git {m['git_sha'][:10]}, {m['date']}; load average {m.get('loadavg_start')} at the "
        f"start, {m.get('loadavg_end')} at the end. Pair: `{Path(pair['target']).name}` "
        f"({pair['target_parameters'] / 1e6:.1f} M parameters) drafted by "
        f"`{Path(str(pair['draft'])).name}` ({(pair['draft_parameters'] or 0) / 1e6:.1f} M). "
        f"{counts['humaneval']} HumanEval prompts and {counts['stdlib']} held-out stdlib "
        f"prefixes (last {s['max_prompt_tokens']} prompt tokens), {s['max_new_tokens']} new "
        f"tokens each (EOS ignored by every method), gamma = {s['gamma']}; methods "
        "interleaved per prompt in one process after a warm-up. Speedup: median of per-prompt "
        "tokens/s ratios against plain HF `generate` (greedy; sampling against HF sampling). "
        "Greedy identity: prompts whose output equals HF greedy token for token, or differs "
        "first where the target's top-2 logits are within 1e-4 (a tie).",
        "",
        f"Decode cost at {costs['context_tokens']} tokens of context: target "
        f"{costs['target_ms']:.2f} ms per one-token step, draft {costs.get('draft_ms', 0):.2f} "
        f"ms (cost ratio c = {costs.get('c')}); a {costs['verify_tokens']}-token verification "
        f"forward costs {costs['verify_over_step']:.2f} steps. Ideal speedup = tokens per round "
        "/ (drafts per round x c + 1); efficiency = measured speedup / ideal. Raw efficiency = "
        "(rounds x (drafts per round x draft step + target step)) / measured time: how close "
        "a method gets to its bare forward costs, with no credit for HF `generate`'s own "
        "per-step overhead.",
    ]
    for split, title in (("humaneval", "HumanEval"), ("stdlib", "Held-out stdlib prefixes")):
        if split in data["summary"]:
            lines += ["", f"**{title}**", "", *_markdown(engine_table(data, split))]
    if data.get("targets"):
        lines += ["", "Against the benchmark issue's targets (HumanEval, flashspec greedy):", ""]
        lines += [f"- {k}: {v}" for k, v in data["targets"].items()]
    sweep = data.get("gamma_sweep")
    if sweep:
        lines += [
            "",
            f"**gamma sweep** (flashspec greedy, first {sweep[0]['prompts']} prompts):",
            "",
            *_markdown(
                [SWEEP_HEADER]
                + [
                    [
                        str(r["gamma"]),
                        f"{r['speedup_median']:.2f}x",
                        f"{r['ideal_speedup_median']:.2f}" if r["ideal_speedup_median"] else "—",
                        f"{r['acceptance_rate']:.1%}" if r["acceptance_rate"] is not None else "—",
                        f"{r['tokens_per_round']:.2f}",
                        "yes" if r["all_match"] else "NO",
                    ]
                    for r in sweep
                ]
            ),
        ]
    others = sorted(RESULTS.glob("engine-*.json"))
    if others:
        lines += ["", *other_runs([json.loads(path.read_text()) for path in others])]
    lines += _plot(page, "engine.png", "per-prompt speedups and gamma sweep")
    if profile is not None:
        lines += ["", *profile_section(profile)]
    return "\n".join(lines)


def summary_section(data: dict[str, Any], page: Path) -> str:
    """The README's one table: the HumanEval rows of the engine benchmark, fewer columns."""
    from flashspec.bench.report import engine_table

    m, s = data["machine"], data["settings"]
    rows = engine_table(data, "humaneval")
    keep = [rows[0].index(column) for column in SUMMARY_COLUMNS]
    details = _relative(page, PAGES["ENGINE-BENCH"])
    return "\n".join(
        [
            f"`flashspec bench engine` on the demo pair ({m['cpu']}, {m['cores']} cores, "
            f"torch {m['torch']}; git {m['git_sha'][:10]}): {s['prompts']['humaneval']} "
            f"HumanEval prompts, {s['max_new_tokens']} new tokens each, gamma = {s['gamma']}. "
            "Speedup: median of per-prompt tokens/s ratios against plain HF `generate` "
            "(greedy; sampling against HF sampling). Greedy identity: prompts whose output "
            "equals HF greedy token for token, or differs first at a floating-point tie.",
            "",
            *_markdown([[row[i] for i in keep] for row in rows]),
            "",
            f"The held-out stdlib prompts, the efficiency columns, the gamma sweep and where a "
            f"round's time goes are in [docs/benchmarks.md]({details}#engine-results).",
        ]
    )


def other_runs(runs: list[dict[str, Any]]) -> list[str]:
    """One line per extra engine run (``engine-*.json``: other gamma, other pairs)."""
    rows = [
        [
            "run",
            "gamma",
            "prompts",
            "flashspec greedy",
            "best HF assisted",
            "HF prompt lookup",
            "flashspec lookup",
            "all greedy identical",
            "flashspec efficiency",
        ]
    ]
    for data in runs:
        he = data["summary"].get("humaneval") or data["summary"]["all"]
        assisted = [v["speedup_median"] for k, v in he.items() if k.startswith("hf_assisted")]
        counts = data["settings"]["prompts"]
        greedy = [v for k, v in he.items() if k not in ("hf_sample", "fs_sample")]
        ours = he.get("fs_greedy") or he.get("fs_lookup") or {}

        def speed(method: str, he: dict[str, Any] = he) -> str:
            return f"{he[method]['speedup_median']:.2f}x" if method in he else "—"

        rows.append(
            [
                str(data["settings"].get("name") or Path(data["pair"]["target"]).name),
                str(data["settings"]["gamma"]),
                f"{counts['humaneval']} HumanEval",
                speed("fs_greedy"),
                f"{max(assisted):.2f}x" if assisted else "—",
                speed("hf_lookup"),
                speed("fs_lookup"),
                "yes" if all(v.get("all_match", True) for v in greedy) else "NO",
                f"{ours['efficiency_median']:.2f}" if ours.get("efficiency_median") else "—",
            ]
        )
    return [
        "Other runs (`benchmarks/results/engine-*.json`; HumanEval medians against plain HF "
        "greedy):",
        "",
        *_markdown(rows),
    ]


def profile_section(data: dict[str, Any]) -> list[str]:
    modes = data["modes"]
    s = data["settings"]
    categories = list(modes[0]["ms_per_round"])
    lines = [
        f"**Where a round's time goes** (`flashspec bench profile`: {len(s['prompts'])} "
        f"HumanEval prompts, {s['max_new_tokens']} new tokens, gamma = {s['gamma']}, "
        f"vocabulary {data['pair']['vocab_size']:,}; ms per round, share of the round):",
        "",
        "| part of the round | " + " | ".join(mode["label"] for mode in modes) + " |",
        "|---|" + "---:|" * len(modes),
    ]
    for key in categories:
        cells = " | ".join(
            f"{mode['ms_per_round'][key]:.3f} ({mode['share_of_round'][key]:.1%})" for mode in modes
        )
        lines.append(f"| {key} | {cells} |")
    lines.append(
        "| **round** | " + " | ".join(f"**{mode['round_ms']:.3f}**" for mode in modes) + " |"
    )
    lines.append("")
    for mode in modes:
        if mode["residual_calls"]:
            lines.append(
                f"- {mode['label']}: the residual draw takes {mode['residual_us_per_call']} µs "
                f"a call, {mode['residual_share_of_verification']:.2%} of verification "
                "(target forward + softmax/warping + accept test + residual) and "
                f"{mode['share_of_round']['residual (rejection)']:.2%} of the round."
            )
    return lines


def _versions(m: dict[str, Any]) -> str:
    return (
        f"{m['cpu']}, {m['cores']} cores; Python {m['python']}, torch {m.get('torch')}; "
        f"git {m['git_sha'][:10]}, {m['date']}"
    )


def regret_section(data: dict[str, Any], page: Path) -> list[str]:
    setup, bound, sel = data["setup"], data["bound"], data["selectors"]
    earlier = data["reference"]["earlier_library"]
    lines = [
        f"**Synthetic regret** ({_versions(data['machine'])}): K = {setup['K']} Bernoulli arms "
        f"with means {tuple(setup['means'])}, T = {setup['horizon']:,}, {setup['runs']} runs "
        "(both selectors see the same reward draws). The setup of the earlier library's "
        f"figures (UCB1 {earlier['regret']['ucb1']}, Thompson {earlier['regret']['thompson']}, "
        f"bound about {earlier['ucb1_bound']:.0f}) is unknown; these means give the nearest "
        "textbook bound.",
        "",
        "| selector | cumulative regret at T (mean ± sd) | median | 5-95% |",
        "|---|---:|---:|---:|",
    ]
    for name, label in (("ucb1", "UCB1 (c = 1)"), ("thompson", "Thompson, Beta(1, 1)")):
        r = sel[name]["final_regret"]
        lines.append(
            f"| {label} | {r['mean']:.1f} ± {r['std']:.1f} | {r['median']:.1f} | "
            f"{r['p5']:.1f}-{r['p95']:.1f} |"
        )
    lines.append(f"| UCB1 bound (Auer et al. 2002) | {bound['at_horizon']:.1f} | | |")
    lines += _plot(page, "regret.png", "cumulative regret against t")
    return lines


def adaptive_section(data: dict[str, Any]) -> list[str]:
    s = data["settings"]
    m = data["machine"]
    lines = [
        f"**Real workloads** ({_versions(m)}; load average {m.get('loadavg_start')} at the "
        f"start, {m.get('loadavg_end')} at the end): the demo target with drafters "
        f"{', '.join(s['drafters'])}; "
        f"{s['prompts_per_workload']['humaneval']} HumanEval prompts, "
        f"{s['prompts_per_workload']['copy']} copy prompts (a held-out stdlib function, then its "
        "own `def` line under a new name), and both shuffled into one mixed stream; "
        f"{s['max_new_tokens']} new tokens each (EOS ignored). Every configuration runs on "
        f"every prompt, interleaved per prompt{_order_and_seeds(s)}. Fixed: each drafter at gamma "
        f"{'/'.join(map(str, s['fixed_gammas']))}, with dynamic gamma, a draft model with the "
        "confidence stop, and plain decoding. Adaptive: "
        f"{s['adaptive_arms']}; each adaptive engine carries what it learned through the "
        "workload's prompts. "
        "Tokens/s over the whole workload. In brackets, where the file has it: the 95% "
        "bootstrap interval of the ratio to the best fixed arm, resampling prompts with each "
        "prompt's pair of runs kept together (how far apart two configurations land by the "
        "noise of sampling and of the machine alone; the best fixed arm, the largest of 15 "
        "noisy measurements, is itself biased upwards)."
        f"{_held_out_note(data)}",
        "",
    ]
    titles = {"model": "model", "ucb1": "UCB1", "thompson": "Thompson"}
    # Older files predate the selectors field: they hold UCB1 and Thompson.
    selectors = s.get("selectors", ["ucb1", "thompson"])
    for regime, workloads in data["regimes"].items():
        settings = s["regimes"][regime]
        header = " | ".join(f"adaptive {titles.get(k, k)}" for k in selectors)
        lines += [
            f"*{regime}* (temperature {settings['temperature']}, top-p {settings['top_p']}):",
            "",
            f"| workload | plain | best fixed arm | {header} |",
            "|---|---:|---|" + "---:|" * len(selectors),
        ]
        for workload, entry in workloads.items():
            best = entry["best_fixed"]
            cells = []
            for kind in selectors:
                run = entry["adaptive"][f"adaptive-{kind}"]
                # Older files have no interval.
                low, high = run.get("vs_best_fixed_ci95", (None, None))
                interval = f" [{low:.2f}-{high:.2f}]" if low is not None else ""
                held = run.get("vs_held_out_best_fixed")
                held_text = f", {held:.2f}x held-out best" if held is not None else ""
                cells.append(
                    f"{run['tokens_per_second']:.1f} ({run['vs_best_fixed']:.2f}x best"
                    f"{interval}{held_text}, {run['vs_plain']:.2f}x plain)"
                )
            held_best = entry.get("held_out_best_fixed", {}).get("tokens_per_second")
            held_best_text = f"; held out {held_best:.1f}" if held_best else ""
            lines.append(
                f"| {workload} | {entry['plain_tokens_per_second']:.1f} | "
                f"{best['tokens_per_second']:.1f} `{best['name']}`{held_best_text} | "
                f"{' | '.join(cells)} |"
            )
        lines.append("")
    lines += ["Against the issue's targets (ratios from the same run):", ""]
    for key, checks in data["targets"].items():
        verdict = ", ".join(f"{name} {'✓' if ok else '✗'}" for name, ok in checks.items())
        lines.append(f"- {key}: {verdict}")
    return lines


def headroom_section(runs: list[dict[str, Any]]) -> list[str]:
    """The oracle bounds of ``benchmarks/adaptive_headroom.py``: one column per regime and
    scope, one row per state the oracle conditions on."""
    columns = [
        (run["settings"]["regime"], scope, entry)
        for run in runs
        for scope, entry in run["scopes"].items()
    ]
    states = list(columns[0][2]["by_state"])
    lines = [
        "**Headroom** (`benchmarks/adaptive_headroom.py`; "
        + "; ".join(
            f"{run['settings']['regime']}: {_versions(run['machine'])}, "
            f"{run['settings']['prompts_per_workload']} prompts per workload x "
            f"{run['settings']['seeds']} seeds, lengths up to {run['settings']['max_gamma']}"
            for run in runs
        )
        + "): the tokens/s of an oracle that knows every arm's true mean in each state and "
        "plays the best one there, over the best single arm's, both priced by the measured "
        "cost lines. What the adaptive engine could gain over the best fixed arm by "
        "conditioning on that state, before paying to learn it.",
        "",
        "| the oracle knows | " + " | ".join(f"{r} {s}" for r, s, _ in columns) + " |",
        "|---|" + "---:|" * len(columns),
        "| (best single arm) | "
        + " | ".join(f"`{e['best_single_arm']}`" for *_, e in columns)
        + " |",
    ]
    for name in columns[0][2].get("best_per_drafter", {}):
        cells = [
            f"{e['best_per_drafter'][name]['vs_best_single']:.4f} "
            f"`{e['best_per_drafter'][name]['arm']}`"
            for *_, e in columns
        ]
        lines.append(f"| no state; {name} only, at its best length | " + " | ".join(cells) + " |")
    for state in states:
        cells = [f"{e['by_state'][state]['vs_best_single']:.4f}" for *_, e in columns]
        lines.append(f"| {state} | " + " | ".join(cells) + " |")
    drafters = sorted({d for *_, e in columns for d in e["confidence_stop"]})
    for drafter in drafters:
        cells = []
        for *_, e in columns:
            rule = e["confidence_stop"].get(drafter)
            cells.append(
                f"{rule['vs_best_single']:.4f} (< {rule['threshold']}, <= {rule['max_gamma']})"
                if rule
                else "n/a"
            )
        lines.append(
            f"| confidence stop, {drafter} (best threshold, length) | " + " | ".join(cells) + " |"
        )
    return lines


def _held_out_note(data: dict[str, Any]) -> str:
    # Older files predate the held-out choice.
    first = next(iter(data["regimes"].values()))
    if not any("held_out_best_fixed" in entry for entry in first.values()):
        return ""
    return (
        " Held out: the best fixed arm chosen on one half of the prompts (alternating by place "
        "in the stream) and measured on the other, both ways, which is free of that bias for "
        "the arm chosen and, since it can choose a worse one, biased the other way: the "
        "best arm's true speed lies between the two."
    )


def _order_and_seeds(settings: dict[str, Any]) -> str:
    # Older files predate both: a fixed order and one seed per prompt.
    seeds = settings.get("sampled_seeds")
    if seeds is None:
        return ""
    passes = "one pass" if seeds == 1 else f"{seeds} passes over the stream with fresh seeds"
    return f" in a random order per prompt; greedy makes one pass, sampled {passes}"


_SERVE_MODES = {"unbatched": 0, "static": 1, "batched": 1, "continuous": 2}


def _serve_budget(value: int | list[int]) -> str:
    """``--max-tokens``: one budget, or several cycled through by request (mixed lengths)."""
    if isinstance(value, int) or len(value) == 1:
        return str(value if isinstance(value, int) else value[0])
    return f"{', '.join(map(str, value))} (cycled per request)"


def serve_section(data: dict[str, Any]) -> str:
    s = data["settings"]
    modes = s.get("modes", ["batched", "unbatched"])
    target = s.get("target")
    model = "the demo pair" if target in (None, "demo") else f"`{target}` (its default engine)"
    compile_settings = s.get("compile")
    command = "python benchmarks/load_server.py" + (
        "" if target in (None, "demo") else f" --target {target}"
    )
    if compile_settings:
        command += " --compile " + " ".join(compile_settings)
        path = (
            "each mode on a compiled engine and an eager one (`/compiled`, `/eager`)"
            if len(compile_settings) > 1
            else f"the engine built as `flashspec serve --compile {compile_settings[0]}` builds it"
        )
    else:  # files from before the flag: SpeculativeEngine.from_pretrained, eager on a CPU
        path = "an eager engine"
    # Files before "prompt_order" cycled 32 prompts, several clients sending the same one.
    order = " (distinct among the requests in flight)" if s.get("prompt_order") else ""
    lines = [
        f"`{command}` ({_versions(data['machine'])}): {model}, "
        f"{s['requests']} requests per client of {_serve_budget(s['max_tokens'])} new tokens, "
        "HumanEval "
        f"prompts{order}, clients in the server's process; continuous = `--batching continuous "
        f"--max-batch {s['max_batch']}` (requests join the running batch between rounds), "
        f"static = `--batching static --max-batch {s['max_batch']}` (they wait for the next "
        "batch), unbatched = `--max-batch 1`; the modes "
        f"({', '.join(modes)}) alternate at each level; {path}. Ratios: tokens/s over the "
        "same level's static and unbatched runs (with the same compile setting).",
        "",
        "| clients | mode | tokens/s | vs static | vs unbatched | requests/s "
        "| latency p50 / p90 / p99 (s) | TTFT p50 / p99 (s) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]

    def label(r: dict[str, Any]) -> str:
        return str(r.get("label", r["mode"]))

    runs = sorted(
        data["runs"],
        key=lambda r: (r["clients"], not r.get("compiled"), _SERVE_MODES.get(r["mode"], 3)),
    )
    by_level = {(r["clients"], label(r)): r["tokens_per_s"] for r in runs}

    def ratio(r: dict[str, Any], other: str) -> str:
        suffix = label(r).partition("/")[2]
        named = "/".join(filter(None, (other, suffix)))
        base = by_level.get((r["clients"], named)) or by_level.get((r["clients"], "batched"))
        if not base or r["mode"] == other:
            return ""
        return f"{r['tokens_per_s'] / base:.2f}x"

    for r in runs:
        lat, ttft = r["latency_s"], r["ttft_s"]
        lines.append(
            f"| {r['clients']} | {label(r)} | {r['tokens_per_s']:.1f} | {ratio(r, 'static')} | "
            f"{ratio(r, 'unbatched')} | {r['requests_per_s']:.2f} | {lat['p50']:.2f} / "
            f"{lat['p90']:.2f} / {lat['p99']:.2f} | {ttft['p50']:.2f} / {ttft['p99']:.2f} |"
        )
    over = data.get("compiled_over_eager_tokens_per_s") or {}
    if over:
        parts = [
            f"{mode} " + ", ".join(f"{x:.2f}x at {n}" for n, x in by_clients.items())
            for mode, by_clients in over.items()
        ]
        lines += ["", "Compiled over eager, tokens/s, same mode and clients: " + "; ".join(parts)]
    return "\n".join(lines)


def replicas_section(data: dict[str, Any]) -> str:
    """``benchmarks/load_replicas.py``: the single-process server against replicas on Ray
    Serve, one row per mode (medians over the rounds)."""
    s, m = data["settings"], data["machine"]
    rounds = s["repeats"]
    order = (
        f"each mode once, in the order {', '.join(s['modes'])}"
        if rounds == 1
        else f"{rounds} rounds of every mode, the order rotating from round to round; medians "
        "over the rounds"
    )
    requests = f"{s['requests']} streaming greedy request{'' if s['requests'] == 1 else 's'}"
    lines = [
        f"`{s['command']}` ({m['cpu']}, {m['cores']} cores; Python {m['python']}, torch "
        f"{m.get('torch')}, Ray {m.get('ray')}; git {m['git_sha'][:10]}, {m['date']}; load "
        f"average {m.get('loadavg_start')} at the start, {m.get('loadavg_end')} at the end): "
        f"the `{s['target']}` engine (`--compile {s['compile']}`), {s['clients']} concurrent "
        f"clients, each sending {requests} of "
        f"{_serve_budget(s['max_tokens'])} new tokens (HumanEval prompts) one after another; "
        f"continuous batching, `--max-batch {s['max_batch']}` in every engine. process = one "
        f"`flashspec serve` process, torch on {s['process_threads']} threads; replicas-N = "
        f"`flashspec serve --replicas N --replica-cpus {s['replica_cpus']:g}` on a local Ray "
        "head started for the mode (one torch thread per CPU). The clients are threads of the "
        "benchmark's process (in the process mode, the server's own); in the replicas modes "
        "they share the cores with Ray's proxy, ingress and replicas. Each mode's server is "
        "started, warmed up with a few short requests, loaded, and stopped before the next "
        f"starts; {order}. Startup: seconds from nothing to ready (for the replicas, Ray's "
        "start included). Replicas answering: distinct `x-flashspec-replica` values in the "
        "answers of a round (the fewest over the rounds). Ratios: tokens/s over the process "
        "mode's and replicas-1's.",
        "",
        "| mode | replicas answering | startup (s) | tokens/s | vs process | vs replicas-1 "
        "| requests/s | latency p50 / p90 / p99 (s) | TTFT p50 / p99 (s) | errors |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def ratio(value: float | None) -> str:
        return f"{value:.2f}x" if value is not None else ""

    def seconds(summary: dict[str, float], *names: str) -> str:
        # A mode whose every request failed has no percentiles.
        return " / ".join(f"{summary[n]:.2f}" if n in summary else "—" for n in names)

    def answering(mode: dict[str, Any]) -> str:
        if not mode["replicas"]:
            return "(one process)"
        # Every round starts new replicas with new ids: count them round by round.
        rounds = [run for run in data.get("runs", []) if run["mode"] == mode["mode"]]
        counts = [len(run["replicas_seen"]) for run in rounds] or [len(mode["replicas_seen"])]
        return str(min(counts))

    for r in data["modes"]:
        lines.append(
            f"| {r['mode']} | {answering(r)} | {r['startup_s']:.1f} | {r['tokens_per_s']:.1f} | "
            f"{'' if r['mode'] == 'process' else ratio(r.get('vs_process'))} | "
            f"{'' if r['mode'] == 'replicas-1' else ratio(r.get('vs_replicas_1'))} | "
            f"{r['requests_per_s']:.2f} | {seconds(r['latency_s'], 'p50', 'p90', 'p99')} | "
            f"{seconds(r['ttft_s'], 'p50', 'p99')} | {r['error_count']} |"
        )
    return "\n".join(lines)


def run_lead(data: dict[str, Any], drafted: str) -> str:
    """The opening of a model benchmark's paragraph: the pair, the machine and versions, the
    run's load and length, and the HumanEval prompts it read (ends mid-sentence)."""
    m, s, pair = data["machine"], data["settings"], data["pair"]
    lengths = s["prompt_tokens"]
    return (
        f"**`{Path(pair['target']).name}`** drafted by {drafted} ({m['cpu']}, "
        f"{m['cores']} cores, {m.get('torch_threads')} torch threads; torch {m['torch']}, "
        f"transformers {m['transformers']}, Python {m['python']}; git {m['git_sha'][:10]}, "
        f"{m['date']}; load average {m.get('loadavg_start')} at the start, "
        f"{m.get('loadavg_end')} at the end; {data.get('wall_seconds')} s in all). The "
        f"first {s['prompts']} HumanEval prompts (their last {s['max_prompt_tokens']} "
        f"tokens at most: {min(lengths)} to {max(lengths)}), "
    )


def batch_section(runs: list[dict[str, Any]]) -> str:
    """``flashspec bench batch`` runs (``batch.json``, ``batch-*.json``): one table each."""
    from flashspec.bench.batch.report import table, target_lines

    lines: list[str] = []
    for data in runs:
        s, pair = data["settings"], data["pair"]
        drafter = pair["drafter"]
        drafted = "prompt lookup" if drafter == "prompt_lookup" else f"`{Path(drafter).name}`"
        passes = s["repeats"]
        lines += [
            *([""] if lines else []),
            run_lead(data, drafted) + "cut into batches of B consecutive "
            f"prompts, left padded; {s['max_new_tokens']} new tokens per row, greedy, EOS "
            f"ignored; gamma = {s['gamma']}. At each B: fresh engines and a warm-up, then "
            f"{passes} pass{'' if passes == 1 else 'es'} over the prompts, the methods "
            "alternating batch by batch. "
            "Medians over the passes; the speedup is the median of each pass's tokens/s ratio "
            "to HF batched `generate` at the same B (range in brackets). Tokens/round: tokens "
            "per row per round (`GenerationStats.mean_tokens_per_round`; HF: per step). Rows "
            "identical: rows whose tokens equal HF's at the same B in every pass (a tie: they "
            "differ first where the target's top-2 logits are within the tie rule).",
            "",
            table(data),
            *_compile_lines(data),
            "",
            "Against the issue's targets (from the same run):",
            "",
            *target_lines(data),
        ]
    return "\n".join(lines)


def _compile_lines(data: dict[str, Any]) -> list[str]:
    """What the compiled methods compiled at each B: graphs held and the warm-up's seconds
    (fresh engines at every B; a timed run that compiled again is named)."""
    parts = []
    for entry in data["results"]:
        for method, record in entry["methods"].items():
            if "graphs" not in record:
                continue
            again = record.get("compile_seconds_timed") or 0
            parts.append(
                f"B = {entry['batch_size']}, {method}: {record['graphs']} graphs, "
                f"{record['compile_seconds_warmup']:.0f} s compiling in the warm-up"
                + (f", {again:.0f} s in the timed runs" if again else "")
            )
    if not parts:
        return []
    return ["", "Compiled methods (graphs per slot bucket of a batch's rows, "
            "`flashspec.kv.slots`): " + "; ".join(parts) + "."]  # fmt: skip


def compiled_section(runs: list[dict[str, Any]]) -> str:
    """``flashspec bench compiled`` runs (``compiled.json``, ``compiled-*.json``): the
    throughput table, the compile costs and the weight streaming of each."""
    from flashspec.bench.compiled.report import compile_table, streaming_lines, table

    lines: list[str] = []
    for data in runs:
        s, pair = data["settings"], data["pair"]
        drafter = pair["drafter"]
        drafted = "prompt lookup" if drafter == "prompt_lookup" else f"`{Path(drafter).name}`"
        passes = s["repeats"]
        sampled = s["sampled"]
        modes = " and ".join(
            f"sampled (temperature {sampled['temperature']}, top-p {sampled['top_p']})"
            if mode == "sampled"
            else mode
            for mode in s["modes"]
        )
        hf = s["hf_compile_config"]
        floor = data["runs"][0]["weight_streaming"]["floor_bytes_per_second"] / 1e9
        cache = s.get("inductor_cache") or {}
        cached = (
            "held compiled code of earlier runs, which shortens the first calls"
            if cache.get("warm_at_start")
            else "was empty: the first calls compiled cold"
        )
        lines += [
            *([""] if lines else []),
            run_lead(data, drafted) + "one at a time, "
            f"{s['max_new_tokens']} new tokens each, EOS ignored; {modes}; gamma = "
            f"{s['gamma']}; weights in {', '.join(s['dtypes'])}. HF `generate` with its dynamic "
            "cache, eager, is the reference of the greedy check; HF `generate` with "
            f'`cache_implementation="static"` and `CompileConfig(fullgraph={hf["fullgraph"]}, '
            f'dynamic={hf["dynamic"]}, mode="{hf["mode"]}")` (with `_compile_all_devices` set, '
            "without which HF compiles on CUDA only) is the baseline of the ratios; flashspec "
            "ran `FlashSpecConfig(compile=False)` and `compile=True`. For each dtype and mode, "
            "one warm-up call of each method on the longest prompt (first call: for the "
            f"compiled methods it includes the compile; inductor's on-disk cache {cached}), "
            f"then {passes} "
            f"pass{'' if passes == 1 else 'es'} over the prompts, every prompt running every "
            "method, the order rotating from prompt to prompt. Medians over the passes; a ratio "
            "is the median of each pass's tokens/s ratio (range in brackets). Greedy rows "
            "identical: prompts whose tokens equal HF eager's in every pass (a tie: they differ "
            "first where the target's top-2 logits are within the tie rule).",
            "",
            table(data),
            "",
            "What compiling cost (graphs: shapes compiled in the warm-up; after it: what "
            "compiled again in the timed passes):",
            "",
            compile_table(data),
            "",
            "Target weight bytes times target forwards per second (HF: one forward a token; "
            f"flashspec: one a round), against the {floor:.0f} GB/s weight-streaming floor "
            "quoted from the design notes (a torch sum on the project's earlier 2-core AVX-512 "
            "machine; not measured in this run, nor on this machine), for the faster mode of "
            "each:",
            "",
            *streaming_lines(data),
        ]
    return "\n".join(lines)


def replace_between(text: str, tag: str, body: str) -> str:
    start, end = f"<!-- {tag}:START -->", f"<!-- {tag}:END -->"
    if start not in text or end not in text:
        raise ValueError(f"no {start} ... {end} markers to render {tag} between")
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + "\n" + text[b:]


def recurrent_section(data: dict[str, Any]) -> str:
    from flashspec.bench.recurrent import table

    s = data["settings"]
    return (
        f"{_versions(data['machine'])}. {s['prompts']} random prompts of 24 tokens, "
        f"{s['max_new_tokens']} new tokens, gamma = {s['gamma']}, {s['layers']}-layer targets, "
        f"{s['threads']} torch thread; medians of per-prompt ratios.\n\n{table(data)}"
    )


def _chat_sweep(data: dict[str, Any], title: str) -> list[str]:
    """The gamma sweep tables of a real-model run, one per workload."""
    from flashspec.bench.report import chat_sweep_table

    sweep = data.get("gamma_sweep")
    if not sweep:
        return []
    lines: list[str] = []
    for workload, result in sweep["workloads"].items():
        lines += [
            "",
            f"**{title}, {workload}** (`--drafter prompt-lookup --gamma N`, "
            f"{len(result['prompts'])} prompts; HF prompt "
            f"lookup {result['hf_lookup_speedup_median']:.2f}x; best gamma "
            f"{result['best_gamma']}):",
            "",
            *_markdown(chat_sweep_table(data, workload)),
        ]
    if "best_gamma_overall" in sweep:
        lines += [
            "",
            "Best gamma over both workloads (geometric mean of the medians): "
            f"{sweep['best_gamma_overall']}.",
        ]
    return lines


def smollm2_section(
    data: dict[str, Any], profile: dict[str, Any] | None, sweep: dict[str, Any] | None = None
) -> str:
    """``flashspec bench engine --target smollm2`` (``smollm2.json``), its profile and a
    larger gamma sweep (``smollm2-gamma-sweep.json``), where they exist."""
    from flashspec.bench.report import chat_table

    m, s, model, costs = data["machine"], data["settings"], data["model"], data["costs"]
    counts, kinds = s["prompts"], s.get("copy_kinds", {})
    kind_text = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in kinds.items() if n)
    lines = [
        f"{m['cpu']}, {m['cores']} cores, {m.get('torch_threads')} torch threads; torch "
        f"{m['torch']}, transformers {m['transformers']}, Python {m['python']}; git "
        f"{m['git_sha'][:10]}, {m['date']}; load average {m.get('loadavg_start')} at the start, "
        f"{m.get('loadavg_end')} at the end; {data.get('wall_seconds')} s in all. Model: "
        f"`{model['target']}` ({model['model_type']}, {model['layers']} layers x "
        f"{model['hidden_size']}, vocabulary {model['vocab_size']:,}, "
        f"{model['parameters'] / 1e6:.1f} M parameters). {counts.get('humaneval', 0)} HumanEval "
        f"chat requests and {counts.get('copy', 0)} copy-heavy ones ({kind_text}), through the "
        f"chat template; greedy, every method stops at EOS, at most {s['max_new_tokens']} new "
        "tokens; methods interleaved per prompt (rotating order) in one process after a "
        "warm-up. Speedup: median over prompts of the tokens/s ratio (the whole call, prefill "
        "included) against HF `generate` in float32; the bfloat16 rows also against HF in "
        "bfloat16, their identity reference. flashspec default = the engine `flashspec "
        f"generate --target {model['target']}` builds: prompt lookup or plain decoding, "
        "chosen each round by the throughput model, which also picks the draft length; "
        f"prompt lookup every round = `--drafter prompt-lookup --gamma {s['gamma']}`. "
        "llama.cpp runs the Q4_1 GGUF itself (quantized kernels), so its tokens differ from the "
        "dequantized model's; its identity column counts equal outputs.",
        "",
    ]
    for dtype in ("float32", "bfloat16"):
        c = costs[dtype]
        lines.append(
            f"- Cost at {c['context_tokens']} tokens of context, {dtype}: a 1-token forward "
            f"with a KV cache {c['step_ms']:.1f} ms, a {c['verify_tokens']}-token one "
            f"{c['verify_ms']:.1f} ms ({c['verify_over_step']:.2f} steps)."
        )
    for note, text in s.get("notes", {}).items():
        lines.append(f"- {note}: {text}.")
    for workload, title in (("humaneval", "HumanEval"), ("copy", "Copy-heavy requests")):
        if workload in data["summary"]:
            lines += ["", f"**{title}**", "", *_markdown(chat_table(data, workload))]
    by_kind = data.get("speedup_by_kind") or {}
    if by_kind:
        lines += ["", "Copy-heavy requests by kind (median speedup against HF greedy):", ""]
        for kind, per in by_kind.items():
            cells = ", ".join(
                f"{m} {v:.2f}x"
                for m, v in per.items()
                if m in ("hf_lookup", "fs_default", "fs_lookup")
            )
            lines.append(f"- {kind.replace('_', ' ')}: {cells}")
    lines += _chat_sweep(data, "gamma sweep")
    if sweep is not None:
        sm = sweep["machine"]
        # The command as typed (argv[0] is the module's path under python -m).
        command = "flashspec " + sweep["settings"].get("command", "").split(" ", 1)[-1]
        lines += [
            "",
            f"A larger sweep, in a run of its own (`{command}`; git "
            f"{sm['git_sha'][:10]}, {sm['date']}, load average {sm.get('loadavg_start')} at the "
            f"start, {sm.get('loadavg_end')} at the end):",
            *_chat_sweep(sweep, "gamma sweep"),
        ]
    if data.get("targets"):
        lines += ["", "Against the issue's targets:", ""]
        lines += [f"- {k}: {v}" for k, v in data["targets"].items()]
    if profile is not None:
        lines += [
            "",
            *profile_section(profile),
            "",
            "(Drafter: prompt lookup; prompts: HumanEval chat requests; EOS ignored so that "
            "every prompt runs the same number of rounds.)",
        ]
    return "\n".join(lines)


DRAFT_METHODS = (
    "hf_greedy", "hf_greedy_bf16", "hf_sample", "hf_sample_bf16",
    "fs_draft", "fs_draft_tree", "fs_merged_tree", "fs_default", "fs_tree", "fs_lookup",
    "fs_sample", "fs_tree_sample",
    "fs_draft_bf16", "fs_draft_tree_bf16", "fs_merged_tree_bf16", "fs_default_bf16",
    "fs_tree_bf16", "fs_lookup_bf16", "fs_sample_bf16", "fs_tree_sample_bf16",
    "fs_draft_q", "fs_draft_tree_q", "fs_merged_tree_q", "fs_default_q", "fs_tree_q",
    "fs_lookup_q", "fs_sample_q", "fs_tree_sample_q",
    "llamacpp",
)  # fmt: skip


def _draft_method_rank(name: str) -> int:
    """A method's row in every workload's table (a run records them in its rotated order)."""
    return DRAFT_METHODS.index(name) if name in DRAFT_METHODS else len(DRAFT_METHODS)


def smollm2_draft_section(data: dict[str, Any], with_card: bool = True) -> str:
    """``benchmarks/smollm2_draft.py``: the shipped SmolLM2 draft against HF and llama.cpp,
    one table per workload, and what its card says of its training (``with_card``)."""
    m, s = data["machine"], data["settings"]
    card = (data.get("draft_card") or {}) if with_card else {}
    lines = [
        f"`python benchmarks/smollm2_draft.py` ({m['cpu']}, {m['cores']} cores, "
        f"{m.get('torch_threads')} torch threads; torch {m['torch']}, transformers "
        f"{m['transformers']}, Python {m['python']}; git {m['git_sha'][:10]}, {m['date']}; load "
        f"average {m.get('loadavg_start')} at the start, {m.get('loadavg_end')} at the end; "
        f"{data.get('wall_seconds')} s in all): held-out chat requests, up to "
        f"{s['max_new_tokens']} new tokens, every method stopping at the end of turn, run one "
        "after another per prompt in a rotating order. Speedup: the median over prompts of the "
        "tokens/s ratio to HF `generate` of the same dtype and decoding (sampled rows: "
        f"temperature {s['sampling']['temperature']}, top-p {s['sampling']['top_p']}; their "
        "answers differ from HF's, their distribution is the target's). Identity: greedy "
        "tokens against HF greedy of the same dtype (a tie within the dtype's rounding counts "
        "as equal). " + " ".join(f"{k}: {v}." for k, v in s.get("notes", {}).items()),
    ]
    tree = s.get("tree")
    if tree:
        lines[0] += (
            f" Rows with `tree` verify a token tree a round (up to {tree['depth']} levels, "
            f"{tree['nodes']} nodes, {tree['top_k']} children a node, "
            f"{tree.get('expand') or tree['top_k']} expanded a level; flashspec.trees); their "
            "acceptance is accepted tokens over tree nodes verified."
        )
    if any(name.endswith("_q") for rows in data["summary"].values() for name in rows):
        lines[0] += (
            " Rows ending `_q` run the default load (`flashspec generate --target smollm2`: the "
            "GGUF file's blocks through flashspec's quantized kernels, whose weights take "
            "exactly their dequantized float32 values); they are measured against HF in "
            "float32, and their identity is against HF float32 greedy. The other flashspec rows "
            "dequantize the file (`--dtype float32` / `--dtype bfloat16`)."
        )
    for workload, rows in data["summary"].items():
        lines += [
            "",
            f"**{workload}** ({next(iter(rows.values()))['prompts']} prompts)",
            "",
            "| method | tokens/s (median) | speedup (median) | vs | acceptance | tokens/round "
            "| identity |",
            "|---|---:|---:|---|---:|---:|---|",
        ]
        for name, row in sorted(rows.items(), key=lambda item: _draft_method_rank(item[0])):
            ident = row.get("identity")
            identity = ", ".join(f"{v} {k}" for k, v in ident.items() if v) if ident else ""
            accept = row.get("acceptance_rate")
            per_round = row.get("tokens_per_round")
            lines.append(
                f"| {name} | {row['tokens_per_second_median']:.1f} | "
                f"{row['speedup_median']:.2f}x | {row['baseline']} | "
                f"{'' if accept is None else f'{accept:.2f}'} | "
                f"{'' if per_round is None else f'{per_round:.2f}'} | {identity} |"
            )
        ratios = _tree_ratios(rows)
        if ratios:
            lines += ["", "Tokens per round, the tree over the chain with the same draft: "
                      + "; ".join(ratios) + "."]  # fmt: skip
    if card:
        held, chat, costs = card["held_out"], card.get("held_out_chat") or {}, card["costs"]

        def steps(result: dict[str, Any]) -> str:
            later = sorted(k for k in result if k.startswith("greedy_agreement_step"))
            keys = ["greedy_agreement", *later]
            return " / ".join(f"{result[k]:.3f}" for k in keys if k in result)

        earlier = card.get("init") or {}
        steps_all = card["steps"] + earlier.get("steps", 0)
        wall_all = card["wall_s"] + earlier.get("wall_s", 0.0)
        seen_all = card["data"]["tokens_seen"] + earlier.get("tokens_seen", 0)
        went_on = (
            f" (this run went on from an earlier draft's {earlier['steps']} steps and "
            f"{earlier['wall_s'] / 60:.0f} min: {card['steps']} steps, "
            f"{card['wall_s'] / 60:.0f} min here)"
            if earlier
            else ""
        )
        kinds = card["data"].get("chat_prompts") or {}
        prompts = (
            "; chat prompts: " + ", ".join(f"{n} {k.replace('_', '-')}" for k, n in kinds.items())
            if kinds
            else ""
        )
        lines += [
            "",
            f"The draft's card (`flashspec/drafts/smollm2/card.json`): {card['layers']} layer, "
            f"reads {card['reads']}, {card['subset_tokens']} tokens; {steps_all} steps in "
            f"{wall_all / 60:.0f} min of training in all{went_on} ({card['dtype']}), "
            f"{seen_all:,} tokens seen{prompts}. Held-out greedy agreement with the "
            f"target, teacher-forced, drafts 1 / 2 / 3: code {steps(held)}"
            + (f", chat {steps(chat)}" if chat else "")
            + f". One draft step costs {costs['draft_over_target']:.3f} of a target step "
            f"({costs['draft_step_ms']:.1f} ms against {costs['target_step_ms']:.1f} ms).",
        ]
    measured = data.get("costs") or {}
    if measured:
        lines += ["", _costs_line(measured, s["gamma"], data["summary"])]
    return "\n".join(lines)


def _tree_ratios(rows: dict[str, Any]) -> list[str]:
    """``fs_draft_tree*`` over ``fs_draft*`` (the draft every round, tree against chain) and
    ``fs_tree*`` over ``fs_default*``, in tokens per round, for each load the run has."""
    out = []
    for suffix in ("", "_bf16", "_q"):
        pairs = (("fs_draft_tree", "fs_draft"), ("fs_merged_tree", "fs_draft"),
                 ("fs_tree", "fs_default"), ("fs_tree_sample", "fs_sample"))  # fmt: skip
        for tree, chain in pairs:
            a = rows.get(tree + suffix, {}).get("tokens_per_round")
            b = rows.get(chain + suffix, {}).get("tokens_per_round")
            if a and b:
                out.append(f"{tree}{suffix} / {chain}{suffix} {a / b:.2f}x")
    return out


def _untuned(cost: dict[str, Any]) -> str:
    untuned = cost.get("verify_untuned_over_target")
    if untuned is None or abs(untuned - cost["verify_over_target"]) < 0.005:
        return ""
    return f"; {untuned:.2f} with torch's own linear layers"


def _costs_line(costs: dict[str, Any], gamma: int, summary: dict[str, Any]) -> str:
    """The run's step costs per dtype and, where it measured the verify, the acceptance each
    speedup goal needs beside what the draft reached."""
    parts = []
    for dtype, c in costs.items():
        text = (
            f"{dtype}: the draft {c['draft_step_ms']:.2f} ms, the target "
            f"{c['target_step_ms']:.2f} ms ({c['draft_over_target']:.3f} of a target step)"
        )
        if "verify_ms" in c:
            suffix = "" if dtype == "float32" else "_bf16"
            reached = ", ".join(
                f"{workload} {rows['fs_draft' + suffix]['per_draft_acceptance']:.2f}"
                for workload, rows in summary.items()
                if rows.get("fs_draft" + suffix, {}).get("per_draft_acceptance") is not None
            )
            needs = ", ".join(
                f"{goal}x needs {'more than 1' if a is None else f'{a:.2f}'}"
                for goal, a in c["needed_acceptance"].items()
            )
            text += (
                f", a verify of {gamma + 1} tokens {c['verify_ms']:.2f} ms "
                f"({c['verify_over_target']:.2f} steps{_untuned(c)}): a round of {gamma} drafts "
                f"costs {c['round_over_target']:.2f} target steps, so per-draft acceptance "
                f"{needs}" + (f"; the draft alone reached {reached}" if reached else "")
            )
        parts.append(text)
    return (
        "Step costs in this run (timed alternately, medians; a round yields 1 + a + ... + "
        f"a^{gamma} tokens at per-draft acceptance a, and its bookkeeping is left out, so what "
        "a goal needs is a floor): " + "; ".join(parts) + "."
    )


def quant_kernel_section(data: dict[str, Any]) -> str:
    """``flashspec bench quant``: each shape, format and backend at 1, 5 and 16 rows."""
    read = float(data["read_gb_per_s"])
    lines = [
        f"`flashspec bench quant` ({_versions(data['machine'])}; {data['settings']['threads']} "
        f"kernel threads). Read bandwidth measured in the same run (a torch sum over 512 MiB): "
        f"{read:.1f} GB/s. Times are medians of repeated calls on random weights quantized by "
        "gguf-py; GB/s counts the weight bytes a call reads; torch's columns multiply the same "
        "weights dequantized (float32, bfloat16) by the same rows.",
    ]
    peak = data.get("fma_peak_gmacs")
    if peak is not None:
        lines.append(
            f"Float32 multiply-add peak measured in the same run (`_quant.fma_probe`: "
            f"independent FMAs on every kernel thread): {peak:.1f} G/s. *5-row floor*: the "
            "least time 5 rows' multiply-adds take at that peak, over this kernel's one row "
            "and over one row streaming its weights at the read bandwidth: every row needs "
            "its own multiply-add per weight, so no exact kernel's 5 rows beat it."
        )
    lines.append("")
    floors = peak is not None
    rows = [["shape", "format", "backend", "1 row ms (GB/s, of read)", "5 rows ms (x 1 row)",
             "16 rows ms (x 1 row)", "torch fp32 / bf16, 1 row ms"]]  # fmt: skip
    if floors:
        rows[0].append("5-row floor (x 1 row, x read)")
    keyed: dict[tuple[str, str, str], dict[int, dict[str, Any]]] = {}
    for row in data["rows"]:
        keyed.setdefault((row["shape"], row["format"], row["backend"]), {})[row["rows"]] = row
    for (shape, fmt, backend), by_m in keyed.items():
        one = by_m.get(1)
        if one is None:
            continue
        rate = one["weight_gb_per_s"]
        cells = [shape, fmt, backend, f"{one['ms']:.3f} ({rate:.1f}, {rate / read:.0%})"]
        for m in (5, 16):
            other = by_m.get(m)
            cells.append(f"{other['ms']:.3f} ({other['ms'] / one['ms']:.2f}x)" if other else "-")
        cells.append(f"{one['torch_fp32_ms']:.3f} / {one['torch_bf16_ms']:.3f}")
        five = by_m.get(5)
        if floors:
            if five is not None and "fma_floor_ms" in five:
                floor = five["fma_floor_ms"]
                read_ms = one["weight_bytes"] / read / 1e6
                cells.append(f"{floor:.3f} ({floor / one['ms']:.2f}x, {floor / read_ms:.2f}x)")
            else:
                cells.append("-")
        rows.append(cells)
    return "\n".join(lines + _markdown(rows))


def smollm2_quant_section(data: dict[str, Any]) -> str:
    """``benchmarks/smollm2_quant.py``: SmolLM2 on the quantized path against HF and llama.cpp."""
    m = data["machine"]
    settings = data["settings"]
    target = settings.get("target", "smollm2")
    command = "python benchmarks/smollm2_quant.py" + (
        f" --target {settings.get('file', target)}" if target != "smollm2" else ""
    )
    lines = [
        f"`{command}` ({_versions(m)}; quantized kernels "
        f"{m.get('quant_backend')}; {settings['threads']} threads for every method; "
        f"{settings['max_new_tokens']} new tokens, greedy; {data['wall_seconds']:.0f} s in all). "
        "Each request runs every method in a rotating order. tokens/s: the median over requests "
        "of new tokens over the whole call's seconds (prefill included); the ratios are medians "
        "of per-request ratios. Identity: against HF float32 on transformers' dequantized "
        "model, under the tie rule.",
    ]
    for workload, methods in data["summary"].items():
        rows = [["method", "tokens/s", "x llama.cpp", "x HF fp32", "tokens/round", "identity"]]
        for name, row in methods.items():
            ident = row.get("identity")
            rows.append([
                name, f"{row['tokens_per_second_median']:.1f}",
                f"{row['over_llamacpp_median']:.2f}" if "over_llamacpp_median" in row else "-",
                f"{row['over_hf_fp32_median']:.2f}" if "over_hf_fp32_median" in row else "-",
                f"{row['tokens_per_round']:.2f}" if "tokens_per_round" in row else "-",
                ", ".join(f"{v} {k}" for k, v in ident.items() if v) if ident else "reference",
            ])  # fmt: skip
        lines += ["", f"**{workload}** ({next(iter(methods.values()))['prompts']} requests):", ""]
        lines += _markdown(rows)
    lines += _memory_lines(data)
    notes = settings.get("notes") or {}
    if notes:
        lines += ["", "Notes: " + "; ".join(f"{k}: {v}" for k, v in notes.items()) + "."]
    steps = data.get("step_costs")
    if steps:
        fused, plain = steps["ms"]["fused"], steps["ms"]["per_operation"]
        contexts = steps.get("contexts", [steps["context"]])
        rows = [["forward", "fused C step ms (x 1 row)", "per-operation ms", "fused speedup"]]
        for context in contexts:
            keys = [k for k in fused if k.startswith(f"{context}:")] or [
                k for k in fused if k != "prefill" and ":" not in k
            ]
            one = keys[0]
            for key in keys:
                rows_count = key.split(":")[-1]
                rows.append([
                    f"{rows_count} rows after {context}", f"{fused[key]:.2f} "
                    f"({fused[key] / fused[one]:.2f}x)", f"{plain[key]:.2f}",
                    f"{plain[key] / fused[key]:.2f}x",
                ])  # fmt: skip
        prefill = fused["prefill"], plain["prefill"]
        rows.append([f"prefill of {steps['context']}", f"{prefill[0]:.2f}",
                     f"{prefill[1]:.2f}", f"{prefill[1] / prefill[0]:.2f}x"])  # fmt: skip
        lines += ["", "One target forward after a prompt of the given length (median of "
                  f"{steps['repeats']}, the two forwards interleaved; the prefill from an empty "
                  "cache):", ""]  # fmt: skip
        lines += _markdown(rows)
    return "\n".join(lines)


def _memory_lines(data: dict[str, Any]) -> list[str]:
    """The resident-memory readings of a ``smollm2_quant.py`` run (none: no lines)."""
    loaded = data.get("resident_mb_after_load") or {}
    if not loaded:
        return []
    generated = data.get("resident_mb_after_generate") or {}
    n = data["settings"]["max_new_tokens"]

    def mb(value: Any) -> str:
        return f"{value:.0f}" if isinstance(value, (int, float)) else "failed"

    if not generated:  # runs before the after-generation reading
        parts = [f"{k} {mb(v)} MB" for k, v in loaded.items()]
        lines = ["", "Resident memory after loading, each in a fresh process: "
                 + ", ".join(parts) + "."]  # fmt: skip
    else:
        rows = [["process", "MB after load", f"MB after {n} tokens"]]
        rows += [[k, mb(v), mb(generated[k]) if k in generated else "-"]
                 for k, v in loaded.items()]  # fmt: skip
        lines = ["", "Resident memory (VmRSS), each in a fresh process, after loading and after "
                 f"generating the reply to one chat request ({n} tokens at most):", ""]  # fmt: skip
        lines += _markdown(rows)
    if "imports" in loaded:
        lines += ["", "`imports` is a process that only imports torch and transformers' "
                  "Llama model code: what any engine on transformers' models holds before "
                  "a weight loads; `file` is the GGUF's size, the weights every token reads; "
                  "`llamacpp_alone` is llama.cpp in a process without torch."]  # fmt: skip
    return lines


def smollm2_memory_section(data: dict[str, Any]) -> str:
    """``benchmarks/smollm2_quant.py --memory``: resident memory of each way to run SmolLM2."""
    m, settings = data["machine"], data["settings"]
    lines = [f"`python benchmarks/smollm2_quant.py --memory` ({_versions(m)}; "
             f"{data['wall_seconds']:.0f} s in all; each process run once before the measured "
             "one, so caches a first load writes are not counted)."]  # fmt: skip
    lines += _memory_lines(data)
    notes = settings.get("notes") or {}
    if notes:
        lines += ["", "Notes: " + "; ".join(f"{k}: {v}" for k, v in notes.items()) + "."]
    return "\n".join(lines)


def api_fields_section(data: dict[str, Any]) -> str:
    """``benchmarks/api_fields.py``: the default engine with each API field against HF
    ``generate`` with the same processors."""
    s = data["settings"]
    lines = [
        f"`python benchmarks/api_fields.py` ({_versions(data['machine'])}; the demo pair's "
        f"default engine, {s['prompts']} HumanEval prompts, {s['max_new_tokens']} new tokens, "
        "greedy; each mode on every prompt, engine and HF interleaved). Speedup: median of "
        "per-prompt tokens/s ratios against HF `generate` with the same processors. Draft "
        "agreement: the median share of HF's tokens that the draft model's own greedy choice, "
        "with the same processor, gives at each position (teacher-forced): what bounds the "
        "tokens a round can emit.",
        "",
    ]
    bounded = any("bound_of_plain_speedup_median" in row for row in data["summary"].values())
    head = ["mode", "setting", "speedup", "of the plain speedup", "identical", "draft agreement"]
    if bounded:
        lines[0] += (
            " Tokens and milliseconds per round: the engine's medians. Bound: the most of the "
            "plain speedup a mode can keep when its rounds cost what plain rounds cost, prompt "
            "by prompt (median): at agreement a a round of g drafts emits (1 - a^(g+1)) / (1 - a) "
            "tokens on average, the plain run does at least as well at its own g as at the "
            "mode's, and the ratio of the two is largest at g = 1: (1 + a) / (1 + a plain)."
        )
        head += ["tokens/round", "ms/round", "bound"]
    rows = [head]
    for mode, row in data["summary"].items():
        agreement = row.get("draft_agreement_median")
        cells = [
            mode, s["modes"].get(mode, "none"), f"{row['speedup_median']:.2f}x",
            f"{row['over_plain_speedup']:.2f}", f"{row['identical']}/{row['prompts']}",
            "n/a" if agreement is None else f"{agreement:.2f}",
        ]  # fmt: skip
        if bounded:
            bound = row.get("bound_of_plain_speedup_median")
            cells += [
                f"{row['fs_tokens_per_round_median']:.2f}",
                f"{row['fs_ms_per_round_median']:.1f}",
                "n/a" if bound is None else f"{bound:.2f}",
            ]
        rows.append(cells)
    return "\n".join([*lines, *_markdown(rows)])


def lengths_section(runs: list[dict[str, Any]]) -> str:
    """``flashspec bench engine --lengths``: engines against HF greedy as generations grow."""
    lines: list[str] = []
    for data in runs:
        study = data["lengths"]
        m = data["machine"]
        target = data.get("pair", {}).get("target") or data.get("model", {}).get("target")
        prompts = len({r["prompt"] for r in study["records"]})
        lines += [
            f"`{data['settings'].get('command', 'flashspec bench engine')}` ({_versions(m)}; "
            f"target {Path(str(target)).name}; {prompts} "
            "prompts; EOS ignored; every engine and HF greedy interleaved per prompt). Speedup: "
            "total new tokens over total seconds against HF greedy's, and the median of "
            "per-prompt ratios. Engines: "
            + "; ".join(f"{k}: {', '.join(v)}" for k, v in study.get("engines", {}).items())
            + ".",
            "",
        ]
        rows = [["engine", "new tokens", "speedup", "median", "tokens/round", "identical"]]
        for name, per_length in study["summary"].items():
            for n, s in per_length.items():
                rows.append([
                    name, f"{n} (ran {s['new_tokens_median']:.0f})", f"{s['speedup_total']:.2f}x",
                    f"{s['speedup_median']:.2f}x", f"{s['tokens_per_round_median']:.2f}",
                    f"{s['identical']}/{s['prompts']}"
                    + (f" ({s['ties']} at a float tie)" if s.get("ties") else ""),
                ])  # fmt: skip
        lines += _markdown(rows)
        growth = ", ".join(f"{k} {v}x" for k, v in study["round_growth"].items())
        lines += [
            "",
            f"Time of a round from the first {study['bin_tokens']}-token context bin to the last "
            f"(longest runs): {growth}; HF's time per token over the same span: "
            f"{study['hf_token_growth']}x.",
            "",
        ]
    return "\n".join(lines).strip()


def _load(path: Path) -> Any:
    return json.loads(path.read_text())


def sections() -> dict[str, str]:
    """The body of every section whose result files exist, by tag."""
    bodies: dict[str, str] = {}
    if ENGINE_JSON.exists():
        engine = _load(ENGINE_JSON)
        profile = _load(PROFILE_JSON) if PROFILE_JSON.exists() else None
        bodies["SUMMARY"] = summary_section(engine, PAGES["SUMMARY"])
        bodies["ENGINE-BENCH"] = engine_section(engine, profile, PAGES["ENGINE-BENCH"])
    if SERVE_JSON.exists():
        serve = [serve_section(_load(SERVE_JSON))]
        mixed = RESULTS / "serve_load_mixed.json"
        if mixed.exists():
            serve += ["", "Mixed request lengths:", "", serve_section(_load(mixed))]
        smollm2 = RESULTS / "serve_load_smollm2.json"
        if smollm2.exists():
            serve += ["", "SmolLM2 from its GGUF file (quantized layers):", ""]
            serve.append(serve_section(_load(smollm2)))
        bodies["SERVE-LOAD"] = "\n".join(serve)
    if REPLICAS_JSON.exists():
        bodies["REPLICAS-BENCH"] = replicas_section(_load(REPLICAS_JSON))
    batch_runs = [BATCH_JSON] if BATCH_JSON.exists() else []
    batch_runs += sorted(RESULTS.glob("batch-*.json"))
    if batch_runs:
        bodies["BATCH-BENCH"] = batch_section([_load(path) for path in batch_runs])
    compiled_runs = [COMPILED_JSON] if COMPILED_JSON.exists() else []
    compiled_runs += sorted(RESULTS.glob("compiled-*.json"))
    if compiled_runs:
        bodies["COMPILED-BENCH"] = compiled_section([_load(path) for path in compiled_runs])
    if KERNEL_JSON.exists():
        bodies["KERNEL-BENCH"] = kernel_section(_load(KERNEL_JSON), PAGES["KERNEL-BENCH"])
    adaptive_lines: list[str] = []
    if REGRET_JSON.exists():
        adaptive_lines += regret_section(_load(REGRET_JSON), PAGES["ADAPTIVE-BENCH"])
    if ADAPTIVE_JSON.exists():
        adaptive_lines += ["", *adaptive_section(_load(ADAPTIVE_JSON))]
    headroom = [_load(path) for path in HEADROOM_JSONS if path.exists()]
    if headroom:
        adaptive_lines += ["", *headroom_section(headroom)]
    if adaptive_lines:
        bodies["ADAPTIVE-BENCH"] = "\n".join(adaptive_lines).strip()
    if DEMO_CARD.exists():
        bodies["DEMO-CARD"] = DEMO_CARD.read_text().strip().replace("\n## ", "\n#### ")
    if RECURRENT_JSON.exists():
        bodies["RECURRENT-BENCH"] = recurrent_section(_load(RECURRENT_JSON))
    if SMOLLM2_JSON.exists():
        profile = _load(SMOLLM2_PROFILE_JSON) if SMOLLM2_PROFILE_JSON.exists() else None
        sweep = _load(SMOLLM2_SWEEP_JSON) if SMOLLM2_SWEEP_JSON.exists() else None
        bodies["SMOLLM2"] = smollm2_section(_load(SMOLLM2_JSON), profile, sweep)
    if SMOLLM2_DRAFT_JSON.exists():
        bodies["SMOLLM2-DRAFT"] = smollm2_draft_section(_load(SMOLLM2_DRAFT_JSON))
    if SMOLLM2_TREE_JSON.exists():
        bodies["TREES"] = smollm2_draft_section(_load(SMOLLM2_TREE_JSON), with_card=False)
    if QUANT_JSON.exists():
        bodies["QUANT-KERNEL"] = quant_kernel_section(_load(QUANT_JSON))
    if SMOLLM2_QUANT_JSON.exists():
        bodies["SMOLLM2-QUANT"] = smollm2_quant_section(_load(SMOLLM2_QUANT_JSON))
    if SMOLLM2_Q4KM_JSON.exists():
        bodies["SMOLLM2-Q4KM"] = smollm2_quant_section(_load(SMOLLM2_Q4KM_JSON))
    if SMOLLM2_MEMORY_JSON.exists():
        bodies["SMOLLM2-MEMORY"] = smollm2_memory_section(_load(SMOLLM2_MEMORY_JSON))
    if API_FIELDS_JSON.exists():
        bodies["API-FIELDS"] = api_fields_section(_load(API_FIELDS_JSON))
    lengths = [_load(path) for path in LENGTHS_JSONS if path.exists()]
    if lengths:
        bodies["LENGTHS"] = lengths_section(lengths)
    return bodies


def main() -> None:
    pages: dict[Path, str] = {}
    for tag, body in sections().items():
        page = PAGES[tag]
        text = pages[page] if page in pages else page.read_text()
        try:
            pages[page] = replace_between(text, tag, body)
        except ValueError as error:
            raise SystemExit(f"{page.relative_to(ROOT)}: {error}") from None
    for page, text in pages.items():
        page.write_text(text)
        print(f"updated {page.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
