"""Write benchmark result files into README.md between their markers.

    python benchmarks/render_readme.py

The README's figures are never typed by hand: this script renders them from the JSON
that the benchmarks wrote, with the machine, versions and git sha recorded there.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
KERNEL_JSON = ROOT / "benchmarks" / "results" / "kernel.json"


def kernel_section(data: dict[str, Any]) -> str:
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
    return "\n".join(lines)


def replace_between(text: str, tag: str, body: str) -> str:
    start, end = f"<!-- {tag}:START -->", f"<!-- {tag}:END -->"
    a, b = text.index(start) + len(start), text.index(end)
    return text[:a] + "\n" + body + "\n" + text[b:]


def main() -> None:
    text = README.read_text()
    if KERNEL_JSON.exists():
        kernel = json.loads(KERNEL_JSON.read_text())
        text = replace_between(text, "KERNEL-BENCH", kernel_section(kernel))
    README.write_text(text)
    print(f"updated {README}")


if __name__ == "__main__":
    main()
