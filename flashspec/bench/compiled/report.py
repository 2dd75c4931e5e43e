"""``flashspec bench compiled``'s tables and printed report, from its result JSON (the README
renders ``table``, ``compile_table`` and ``streaming_lines``)."""

from __future__ import annotations

from typing import Any

from .measure import STREAMING_FLOOR, graphs_after_warmup
from .methods import BASELINE, LABELS, REFERENCE


def _range(record: dict[str, Any], repeats: int, digits: int, suffix: str = "") -> str:
    text = f"{record['median']:.{digits}f}{suffix}"
    if repeats > 1:
        text += f" ({record['min']:.{digits}f}-{record['max']:.{digits}f})"
    return text


def identity_cell(record: dict[str, Any]) -> str:
    """``12/16 (+1 tie)``, ``..., 2 MISMATCH``, ``(reference)`` or ``-`` (sampled)."""
    identity = record.get("identity")
    if identity is None:
        return "-"
    same = f"{identity['identical']}/{identity['rows']}"
    if identity["tie"]:
        same += f" (+{identity['tie']} tie)"
    if identity["mismatch"]:
        same += f", {identity['mismatch']} MISMATCH"
    return same


def table(data: dict[str, Any]) -> str:
    """The results as a Markdown table: one line per dtype, mode and method."""
    lines = [
        "| dtype | mode | method | tokens/s | vs HF static compiled | vs HF eager "
        "| first call (s) | greedy rows identical to HF eager |",
        "|---|---|---|---:|---:|---:|---:|---:|",
    ]
    repeats = int(data["settings"]["repeats"])
    for run in data["runs"]:
        for mode, records in run["modes"].items():
            for method, record in records.items():
                vs_static = (
                    "1 (baseline)"
                    if method == BASELINE
                    else _range(record["vs_hf_static_compiled"], repeats, 2, "x")
                )
                vs_eager = (
                    "1" if method == REFERENCE else _range(record["vs_hf_eager"], repeats, 2, "x")
                )
                same = "(reference)" if method == REFERENCE and mode == "greedy" else ""
                same = same or identity_cell(record)
                lines.append(
                    f"| {run['dtype']} | {mode} | {LABELS.get(method, method)} "
                    f"| {_range(record['tokens_per_second'], repeats, 1)} | {vs_static} "
                    f"| {vs_eager} | {record['first_call_seconds']:.2f} | {same} |"
                )
    return "\n".join(lines)


def compile_table(data: dict[str, Any]) -> str:
    """The compiled methods' compile costs, per dtype, as a Markdown table."""
    lines = [
        "| dtype | method | first call (s) | compiling (s) | graphs | after the warm-up |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for run in data["runs"]:
        modes = run["modes"]
        mode = next(iter(modes))  # the first mode's first call compiles
        hf = run["compile"][BASELINE]
        lines.append(
            f"| {run['dtype']} | {LABELS[BASELINE]} "
            f"| {modes[mode][BASELINE]['first_call_seconds']:.2f} | (in the first call) "
            f"| {hf['graphs']} | {graphs_after_warmup(modes, BASELINE)} graph(s) compiled |"
        )
        fs = run["compile"]["flashspec_compiled"]
        failed = f"; failed: {'; '.join(fs['failed'])}" if fs["failed"] else ""
        lines.append(
            f"| {run['dtype']} | {LABELS['flashspec_compiled']} "
            f"| {modes[mode]['flashspec_compiled']['first_call_seconds']:.2f} "
            f"| {fs['compile_seconds']:.2f} | {fs['graphs']} "
            f"| {graphs_after_warmup(modes, 'flashspec_compiled')} graph(s) compiled, "
            f"{fs['recompiles_after_warmup']} recompile(s){failed} |"
        )
    return "\n".join(lines)


def streaming_lines(data: dict[str, Any]) -> list[str]:
    """Achieved target-weight bytes per second against the machine's streaming floor."""
    lines = []
    for run in data["runs"]:
        stream = run["weight_streaming"]
        cells = [
            f"{LABELS[row['method']]} ({row['mode']}) {row['weight_bytes_per_second'] / 1e9:.2f} "
            f"GB/s ({row['share_of_streaming_floor']:.1%} of the floor)"
            for row in stream["rows"]
        ]
        lines.append(
            f"- {run['dtype']}: target weights {stream['target_weight_bytes'] / 1e6:.1f} MB; "
            + ", ".join(cells)
        )
    return lines


def text(data: dict[str, Any]) -> str:
    """The tables, the weight streaming and the checks, for the terminal."""
    check = data["checks"]
    floor = STREAMING_FLOOR / 1e9
    return "\n".join(
        [
            table(data),
            "",
            compile_table(data),
            "",
            f"target weight bytes x target forwards/s, against the {floor:.0f} GB/s streaming "
            "floor (shared/design.md, not measured here):",
            *streaming_lines(data),
            "",
            "flashspec greedy rows identical to HF eager (or ties): "
            + ("yes" if check["flashspec_greedy_identical"] else f"NO: {check['mismatches']}"),
            f"flashspec compiled, recompiles after warm-up: {check['recompiles_after_warmup']}",
        ]
    )
