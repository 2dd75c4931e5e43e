"""``flashspec bench batch``'s table and printed report, from its result JSON (the README
renders ``table`` and ``target_lines``)."""

from __future__ import annotations

from typing import Any

from .methods import BASELINE, LABELS


def table(data: dict[str, Any]) -> str:
    """The results as a Markdown table: one line per batch size and method."""
    lines = [
        "| B | method | tokens/s | tokens/round | vs HF batched | rows identical to HF |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    repeats = int(data["settings"]["repeats"])
    for entry in data["results"]:
        for method, record in entry["methods"].items():
            speed = record["speedup"]
            if method == BASELINE:
                vs = "1 (baseline)"
            elif repeats > 1:
                vs = f"{speed['median']:.2f}x ({speed['min']:.2f}-{speed['max']:.2f})"
            else:
                vs = f"{speed['median']:.2f}x"
            identity = record.get("identity")
            if identity is None:
                same = "(reference)"
            else:
                same = f"{identity['identical']}/{identity['rows']}"
                if identity["tie"]:
                    same += f" (+{identity['tie']} tie)"
                if identity["mismatch"]:
                    same += f", {identity['mismatch']} MISMATCH"
            lines.append(
                f"| {entry['batch_size']} | {LABELS.get(method, method)} "
                f"| {record['tokens_per_second']['median']:.1f} "
                f"| {record['tokens_per_round']['median']:.2f} | {vs} | {same} |"
            )
    return "\n".join(lines)


def target_lines(data: dict[str, Any]) -> list[str]:
    """One line per target: the threshold and each flashspec method's measured value."""
    lines = []
    for check in data["targets"]:
        values = []
        for method, value in check["measured"].items():
            met = check["met"][method]
            mark = "" if met is None else (" ✓" if met else " ✗")
            shown = "not measured" if value is None else f"{value:.2f}"
            values.append(f"{method} {shown}{mark}")
        lines.append(f"- {check['target']} (target >= {check['threshold']}): {', '.join(values)}")
    return lines


def text(data: dict[str, Any]) -> str:
    """The table and the targets, for the terminal."""
    return "\n".join(
        [table(data), "", "targets (not claims; measured in this run):", *target_lines(data)]
    )
