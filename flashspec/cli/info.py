"""``flashspec info``: versions, the kernel backend, CPU features, the demo pair, named models."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

from ..flags.options import first_line


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``info`` to ``subparsers`` (the parent's ``add_subparsers()`` object)."""
    info: argparse.ArgumentParser = subparsers.add_parser(
        "info", help="versions, kernel backend, CPU features, demo pair, named models"
    )
    info.add_argument("--json", action="store_true", help="print as JSON")
    info.set_defaults(func=cmd_info)
    return info


def _version_of(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def _cpu_name() -> str:
    # platform.processor() is empty on most Linux systems; /proc/cpuinfo names the model.
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def report() -> dict[str, Any]:
    """What ``flashspec info`` reports, as a dict."""
    import numpy
    import torch
    import transformers

    from .. import __version__
    from ..models import DEMO_DIR

    report: dict[str, Any] = {
        "flashspec": __version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": f"{platform.system()} {platform.machine()}",
        "torch": f"{torch.__version__} (threads: {torch.get_num_threads()}, "
        f"cuda: {torch.cuda.is_available()})",
        "transformers": transformers.__version__,
        "tokenizers": _version_of("tokenizers"),
        "numpy": numpy.__version__,
        "cpu": f"{_cpu_name()} ({os.cpu_count()} logical cores)",
    }
    try:
        from .. import _residual

        features = _residual.cpu_features()
        report["kernel"] = {
            "backend": _residual.backend(),
            "available": _residual.available_backends(),
            "abi_version": _residual.abi_version(),
            "cpu_features": dict(features),
        }
    except ImportError as exc:
        report["kernel"] = f"not available ({first_line(exc)}); the engine falls back to torch"
    card_path = DEMO_DIR / "card.json"
    demo: dict[str, Any] = {
        "path": str(DEMO_DIR),
        "target": str(DEMO_DIR / "target"),
        "draft": str(DEMO_DIR / "draft"),
        "draft3": str(DEMO_DIR / "draft3"),
        "present": all(
            (DEMO_DIR / part / "config.json").is_file() for part in ("target", "draft", "draft3")
        ),
    }
    if card_path.is_file():
        card = json.loads(card_path.read_text())
        measured = card.get("measured", {})
        demo["card"] = {
            "held_out_loss": measured.get("held_out_loss"),
            "draft_target_cost_ratio": measured.get("draft_target_cost_ratio"),
            "greedy_acceptance": measured.get("greedy_acceptance", {}).get("acceptance_rate"),
            "size_mb": card.get("size_mb"),
        }
    report["demo_pair"] = demo
    from ..loading import NAMED_MODELS, cache_dir

    named: dict[str, Any] = {}
    for name, model in NAMED_MODELS.items():
        path = model.locate()
        named[name] = str(path) if path is not None else f"not installed ({model.install})"
    report["named_models"] = named
    from ..loading.drafts import bundled_draft

    shipped: dict[str, Any] = {}
    for name in NAMED_MODELS:
        folder = bundled_draft(name)
        if folder is not None:
            shipped[name] = str(folder)
    report["shipped_drafts"] = shipped
    report["gguf"] = {
        "support": all(_version_of(p) != "not installed" for p in ("gguf", "accelerate")),
        "cache": str(cache_dir() / "gguf"),
    }
    return report


def cmd_info(args: argparse.Namespace) -> int:
    """``flashspec info``."""
    found = report()
    if args.json:
        print(json.dumps(found, indent=2))
        return 0
    for key, value in found.items():
        if isinstance(value, dict):
            print(f"{key}:")
            for sub, item in value.items():
                if isinstance(item, dict):
                    item = ", ".join(f"{k}={v}" for k, v in item.items())
                print(f"  {sub}: {item}")
        else:
            print(f"{key}: {value}")
    return 0
