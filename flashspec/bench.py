"""Benchmarks: ``flashspec bench engine | kernel | profile | regret | adaptive``.

- ``engine``: flashspec against plain HF ``generate``, HF assisted generation (same draft) and
  HF prompt lookup, per prompt, methods interleaved in one process; tokens/s, speedups, greedy
  token identity, acceptance, and the ideal speedup the measured acceptance and cost ratio allow.
  Then a gamma sweep. Writes ``engine.json`` and ``engine.png``.
- ``kernel``: the residual kernel against NumPy, torch and C (``kernel.json``, ``kernel.png``).
- ``profile``: where one speculative round's time goes, with the native residual kernel and
  with the PyTorch one (``profile.json``).
- ``regret``: the drafter selectors' synthetic regret on Bernoulli arms (``regret.json``,
  ``regret.png``; ``flashspec._bench_regret``).
- ``adaptive``: online (drafter, gamma) selection against every fixed arm on HumanEval, a
  prompt-copying workload and a mix of both (``adaptive.json``; ``flashspec._bench_adaptive``).

Results go to ``--out-dir`` (default ``benchmarks/results``); ``benchmarks/render_readme.py``
turns them into the README tables. Wiring into a parent parser::

    from . import bench
    bench.add_parser(commands)  # commands: the parent's add_subparsers() object

after which ``args.func(args)`` runs the chosen benchmark. ``python -m flashspec.bench ...``
works on its own.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _argtypes

DATA_DIR = Path(__file__).resolve().parent / "data"
HUMANEVAL = DATA_DIR / "humaneval" / "HumanEval.jsonl.gz"
DEFAULT_OUT = Path("benchmarks") / "results"

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
        from . import _residual as R

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
            cwd=Path(__file__).resolve().parent,
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
        cwd=Path(__file__).resolve().parent,
        timeout=10,
    ).stdout.strip()
    return sha + ("+dirty" if dirty else "")


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


# ------------------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` with its ``engine``/``kernel``/``profile`` commands to ``subparsers``.

    Each command sets ``func=main``; ``main(args)`` returns the exit status.
    """
    bench: argparse.ArgumentParser = subparsers.add_parser(
        "bench",
        help="benchmarks: engine vs HF generate/assisted generation, kernel, round profile",
        description=(
            "engine: flashspec against plain HF generate, HF assisted generation with the same "
            "draft and HF prompt lookup, on HumanEval and held-out stdlib code, then a gamma "
            "sweep (engine.json, engine.png). kernel: the residual kernel against NumPy, torch "
            "and C (kernel.json, kernel.png). profile: where a speculative round's time goes "
            "(profile.json). regret: UCB1 and Thompson sampling on Bernoulli arms "
            "(regret.json, regret.png). recurrent: recurrent/hybrid pairs (recurrent.json)."
        ),
    )
    which = bench.add_subparsers(dest="bench", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--quick", action="store_true", help="a short run (under two minutes)")
        p.add_argument(
            "--out-dir",
            type=Path,
            default=DEFAULT_OUT,
            help=f"where result files go (default {DEFAULT_OUT})",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bars")
        p.set_defaults(func=main)

    def models(p: argparse.ArgumentParser) -> None:
        p.add_argument("--target", default="demo", help="target: local path (default: demo)")
        p.add_argument(
            "--draft", default="demo-draft", help="draft: local path, or none (no draft model)"
        )
        p.add_argument(
            "--gamma", type=_argtypes.positive_int, default=4, help="drafts per round (default 4)"
        )
        p.add_argument(
            "--threads",
            type=_argtypes.positive_int,
            default=None,
            help="torch threads (default: torch's own)",
        )
        p.add_argument(
            "--max-prompt-tokens",
            type=_argtypes.positive_int,
            default=128,
            help="keep the last N prompt tokens (default 128: the demo pair trained on "
            "256-token windows, and 128 new tokens follow)",
        )

    def engine_options(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--humaneval",
            type=_argtypes.nonnegative_int,
            default=20,
            help="HumanEval prompts (first N)",
        )
        p.add_argument(
            "--stdlib", type=_argtypes.nonnegative_int, default=10, help="held-out stdlib prefixes"
        )
        p.add_argument("--max-new-tokens", type=_argtypes.positive_int, default=128)
        p.add_argument(
            "--sweep-prompts",
            type=_argtypes.nonnegative_int,
            default=8,
            help="prompts in the gamma sweep",
        )
        p.add_argument("--sweep-gammas", default="1,2,3,4,5,6,7,8", help="gamma values to sweep")
        p.add_argument("--no-sweep", action="store_true", help="skip the gamma sweep")
        p.add_argument(
            "--methods", default=None, help="comma-separated subset of methods (default: all)"
        )

    engine = which.add_parser(
        "engine", help="flashspec vs HF generate / assisted generation / prompt lookup"
    )
    common(engine)
    models(engine)
    engine_options(engine)
    engine.add_argument("--name", default="engine", help="result file stem (default engine)")

    kernel = which.add_parser("kernel", help="residual kernel vs NumPy, torch and C")
    common(kernel)
    kernel.add_argument("--name", default="kernel", help="result file stem (default kernel)")

    profile = which.add_parser("profile", help="where one round's time goes")
    common(profile)
    models(profile)
    profile.add_argument(
        "--prompts", type=_argtypes.positive_int, default=6, help="HumanEval prompts profiled"
    )
    profile.add_argument("--max-new-tokens", type=_argtypes.positive_int, default=128)
    profile.add_argument("--name", default="profile", help="result file stem (default profile)")

    from ._bench_regret import add_arguments as regret_arguments

    regret = which.add_parser("regret", help="selectors' synthetic regret on Bernoulli arms")
    common(regret)
    regret_arguments(regret)

    from ._bench_adaptive import add_arguments as adaptive_arguments

    adaptive = which.add_parser(
        "adaptive", help="online drafter/gamma selection vs every fixed arm, on real workloads"
    )
    common(adaptive)
    adaptive_arguments(adaptive)

    from ._bench_recurrent import add_arguments as recurrent_arguments

    recurrent = which.add_parser(
        "recurrent", help="recurrent/hybrid pairs: speedup over HF generate, replay cost"
    )
    common(recurrent)
    recurrent_arguments(recurrent)

    every = which.add_parser(
        "all", help="kernel, engine and profile in turn (kernel.json, engine.json, profile.json)"
    )
    common(every)
    models(every)
    engine_options(every)
    every.add_argument(
        "--profile-prompts",
        dest="prompts",
        type=_argtypes.positive_int,
        default=6,
        help="prompts profiled",
    )
    return bench


def main(args: argparse.Namespace) -> int:
    """Run the benchmark ``args.bench`` names; write its JSON (and PNG) to ``args.out_dir``."""
    if args.bench == "kernel":
        return _main_kernel(args)
    if args.bench == "regret":
        from . import _bench_regret

        return _bench_regret.main(args)
    if args.bench == "adaptive":
        from . import _bench_adaptive

        return _bench_adaptive.main(args)
    if args.bench == "recurrent":
        from . import _bench_recurrent

        return _bench_recurrent.main(args)
    from . import _bench_engine

    if args.bench == "engine":
        return _bench_engine.main_engine(args)
    if args.bench == "profile":
        return _bench_engine.main_profile(args)
    if args.bench == "all":
        status = 0
        for name, run in (
            ("kernel", _main_kernel),
            ("engine", _bench_engine.main_engine),
            ("profile", _bench_engine.main_profile),
        ):
            print(f"\n=== flashspec bench {name} ===", file=sys.stderr, flush=True)
            status = max(status, run(argparse.Namespace(**{**vars(args), "name": name})))
        return status
    raise SystemExit(f"unknown benchmark {args.bench!r}")


def _main_kernel(args: argparse.Namespace) -> int:
    from . import _bench_kernel

    data = {"machine": machine_info(), **_bench_kernel.run(args.quick, not args.no_progress)}
    out = Path(args.out_dir)
    print(_bench_kernel.table(data))
    print("\nAgainst the kernel issue's targets (ratios in this run):")
    for key, value in data["summary"].items():
        print(f"  {key}: {value}")
    write_json(data, out / f"{args.name}.json")
    plt = pyplot()
    if plt is not None:
        _bench_kernel.plot(data, out / f"{args.name}.png", plt)
        print(f"wrote {out / f'{args.name}.png'}", file=sys.stderr)
    return 0


def cli(argv: Sequence[str] | None = None) -> int:
    """``python -m flashspec.bench engine|kernel|profile [...]``."""
    parser = argparse.ArgumentParser(prog="flashspec")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *(sys.argv[1:] if argv is None else argv)])
    status: int = args.func(args)
    return status


if __name__ == "__main__":
    sys.exit(cli())
