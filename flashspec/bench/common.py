"""What every benchmark shares: its prompts (HumanEval, held-out stdlib code), the machine
record and JSON output of a result file, progress bars, plotting and quiet timing."""

from __future__ import annotations

import gc
import gzip
import hashlib
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# This file sits in flashspec/bench/; the bundled data sits in flashspec/data/.
PACKAGE_DIR = Path(__file__).resolve().parents[1]
DATA_DIR = PACKAGE_DIR / "data"
HUMANEVAL = DATA_DIR / "humaneval" / "HumanEval.jsonl.gz"
DEFAULT_OUT = Path("benchmarks") / "results"
"""Where result files go unless ``--out-dir`` says otherwise (relative to the working directory)."""

# The demo pair's train/held-out split (scripts/train_demo_pair.py): a stdlib file is held
# out iff sha256 of its path relative to the stdlib root is 0 mod 20; test suites and
# site-packages never entered the corpus at all.
HOLDOUT_MODULUS = 20
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "__pycache__"})


# ---------------------------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    """One benchmark prompt: ``source`` is ``"humaneval"`` or ``"stdlib"``."""

    id: str
    source: str
    text: str


def humaneval_prompts(limit: int | None = None) -> list[Prompt]:
    """HumanEval task prompts in task order (bundled data, MIT licensed; see its LICENSE)."""
    prompts: list[Prompt] = []
    with gzip.open(HUMANEVAL, "rt", encoding="utf-8") as fh:
        for line in fh:
            if not line.strip():
                continue
            task = json.loads(line)
            prompts.append(Prompt(task["task_id"], "humaneval", task["prompt"]))
            if limit is not None and len(prompts) >= limit:
                break
    return prompts


def _held_out(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HOLDOUT_MODULUS == 0


def held_out_stdlib_files(card: Path | None = None) -> list[Path]:
    """Stdlib files the demo pair never trained on: the card's list if it has one, else the
    split rule applied to this interpreter's stdlib."""
    root = Path(sysconfig.get_paths()["stdlib"])
    names: list[str] | None = None
    if card is not None and card.is_file():
        listed = json.loads(card.read_text()).get("held_out_files")
        if isinstance(listed, list) and listed:
            names = [str(n) for n in listed]
    if names is None:
        names = []
        for path in sorted(root.rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if not SKIP_DIRS.intersection(rel.split("/")[:-1]) and _held_out(rel):
                names.append(rel)
    return [root / n for n in sorted(names) if (root / n).is_file()]


def stdlib_prompts(limit: int, card: Path | None = None, chars: int = 1200) -> list[Prompt]:
    """Code prefixes from held-out stdlib files, each ending just after a ``def`` line.

    The cut falls on the first function definition past the module docstring and imports, so
    the model continues a function body, as with HumanEval; ``chars`` bounds the prefix.
    """
    prompts: list[Prompt] = []
    for path in held_out_stdlib_files(card):
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) < 3000:
            continue
        cut = _def_end(text, start=len(text) // 5)
        if cut is None:
            continue
        begin = text.rfind("\n", 0, max(0, cut - chars)) + 1
        rel = path.relative_to(Path(sysconfig.get_paths()["stdlib"])).as_posix()
        prompts.append(Prompt(f"stdlib/{rel}", "stdlib", text[begin:cut]))
        if len(prompts) >= limit:
            break
    return prompts


def _def_end(text: str, start: int) -> int | None:
    """End (after the newline) of the first single-line ``def ...:`` at or after ``start``."""
    at = start
    while True:
        found = text.find("def ", at)
        if found < 0:
            return None
        line_end = text.find("\n", found)
        if line_end < 0:
            return None
        line = text[found:line_end].rstrip()
        if line.endswith(":") and (found == 0 or text[found - 1] in " \n"):
            return line_end + 1
        at = line_end


# ---------------------------------------------------------------------------------- results


def machine_info() -> dict[str, Any]:
    """CPU, versions, git sha, load: what a result file needs to be read later."""
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "git_sha": _git_sha(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "gcc": _first_line(["gcc", "--version"]),
        "nasm": _first_line(["nasm", "-v"]),
    }
    for module in ("flashspec", "numpy", "torch", "transformers"):
        try:
            info[module] = str(importlib.import_module(module).__version__)
        except ImportError:
            info[module] = None
    try:
        from .. import _residual as R

        info["kernel_backend"] = R.backend()
        info["backends"] = list(R.available_backends())
        info["cpu_features"] = R.cpu_features()
    except ImportError:
        info["kernel_backend"] = None
    if info["torch"] is not None:
        import torch

        info["torch_threads"] = torch.get_num_threads()
    return info


def _first_line(cmd: list[str]) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout
        return out.splitlines()[0] if out else "unavailable"
    except (OSError, subprocess.SubprocessError):
        return "unavailable"


def _git_sha() -> str:
    # The source checkout this module runs from, if any (an installed package has none).
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            cwd=PACKAGE_DIR,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    sha = out.stdout.strip()
    if out.returncode != 0 or not sha:
        return "unknown"
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        cwd=PACKAGE_DIR,
        timeout=10,
    ).stdout.strip()
    return sha + ("+dirty" if dirty else "")


def result_name(target: str) -> str:
    """The result file stem for a target: its short name, or its file or folder name."""
    stem = Path(target).name
    if stem.lower().endswith(".gguf"):
        stem = stem[: -len(".gguf")]
    return re.sub(r"[^A-Za-z0-9._-]+", "-", stem) or "chat"


def write_json(data: dict[str, Any], path: Path) -> None:
    """Write ``data`` (with the load average at the end of the run) as indented JSON."""
    machine = data.get("machine")
    if isinstance(machine, dict):
        machine["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {path}", file=sys.stderr)


def progress(iterable: Any, **kwargs: Any) -> Any:
    """``tqdm(iterable, **kwargs)`` (on stderr); imported by name, as tqdm ships no types."""
    tqdm = importlib.import_module("tqdm").tqdm
    return tqdm(iterable, **kwargs)


def pyplot() -> Any:
    """matplotlib.pyplot on the file-only backend, or None when matplotlib is missing."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        print(
            "matplotlib is not installed: no plot (pip install 'flashspec[bench]')",
            file=sys.stderr,
        )
        return None
    matplotlib.use("Agg")
    return importlib.import_module("matplotlib.pyplot")


@contextmanager
def quiet_timing() -> Iterator[None]:
    """No garbage collection inside the block, after a full one before it."""
    # A collection inside one timed call but not another would be charged to whichever ran.
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
