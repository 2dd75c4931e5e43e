"""``flashspec bench compiled``: its pure helpers (spread, ratios, warm-up order, names, the
tables and checks), the parser, and one end-to-end run on a tiny random pair (1 layer, hidden
32) that compiles HF's static cache and flashspec's path: the result schema, identity statuses
and compile counters. Nothing here asserts a speed."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path
from typing import Any

import pytest

from flashspec import bench
from flashspec.bench.batch import command as B
from flashspec.bench.batch import methods as batch_methods
from flashspec.bench.compiled import command as C
from flashspec.bench.compiled import measure as compiled_measure
from flashspec.bench.compiled import methods as compiled_methods
from flashspec.bench.compiled import report as compiled_report
from flashspec.bench.pair import Pair, make_pair
from tests.helpers.bench import MACHINE, check_missing_model_skipped, load_renderer, needs_renderer
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

NEW = 4
PROMPTS = [
    bench.Prompt("tiny/0", "humaneval", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"),
    bench.Prompt("tiny/1", "humaneval", "x = [1, 2, 3]\n"),
]


@pytest.fixture(scope="module")
def pair() -> Pair:
    target = build_llama(0, layers=1, hidden=32)
    draft = perturbed_copy(target, noise=0.05, seed=1)
    return make_pair(target, draft, build_char_tokenizer(), "tiny-target", "tiny-draft")


@pytest.fixture(scope="module")
def result(pair: Pair) -> dict[str, Any]:
    # The one run that compiles (HF's decode step, flashspec's verify and draft steps).
    settings = compiled_measure.CompiledSettings(max_new_tokens=NEW, repeats=1, progress=False)
    loaded: list[str] = []

    def load(dtype: str) -> Pair:
        loaded.append(dtype)
        return pair

    data = compiled_measure.run_compiled(load, PROMPTS, settings)
    assert loaded == ["float32"]
    return data


def test_end_to_end_schema_identity_and_compiles(result: dict[str, Any]) -> None:
    json.dumps(result)  # the file is JSON
    assert result["kind"] == "compiled"
    settings = result["settings"]
    assert settings["methods"] == list(compiled_methods.METHODS) and settings["modes"] == [
        "greedy",
        "sampled",
    ]
    assert settings["hf_compile_config"]["_compile_all_devices"] is True
    assert isinstance(settings["inductor_cache"]["warm_at_start"], bool)
    assert settings["configs"]["flashspec_compiled"]["compile"] is True
    assert settings["configs"]["flashspec_eager"]["compile"] is False
    assert result["pair"]["drafter"] == "tiny-draft"
    (run,) = result["runs"]
    assert run["dtype"] == "float32" and run["target_weight_bytes"] > 0
    for mode, records in run["modes"].items():
        assert set(records) == set(compiled_methods.METHODS)
        for method, record in records.items():
            assert record["new_tokens"] == NEW * len(PROMPTS), (mode, method)  # EOS ignored
            assert record["tokens_per_second"]["median"] > 0
            assert record["first_call_seconds"] > 0
            assert record["warmup"]["calls"] >= 1
            assert record["weight_bytes_per_second"] > 0
            if mode == "greedy" and method != compiled_methods.REFERENCE:
                assert record["identity"]["rows"] == len(PROMPTS)
                assert record["identity"]["mismatch"] == 0, record["differences"]
                assert record["all_match"] is True
            else:
                assert "identity" not in record
        assert records[compiled_methods.BASELINE]["vs_hf_static_compiled"]["median"] == 1.0
        assert records[compiled_methods.REFERENCE]["vs_hf_eager"]["median"] == 1.0
    compiled = run["compile"]["flashspec_compiled"]
    assert compiled["on"] is True and compiled["failed"] == []
    assert compiled["graphs"] >= 2  # the target's verification and the drafter's step
    assert compiled["recompiles_after_warmup"] == 0
    assert all(m["compiled_calls"] > 0 for m in compiled["models"])
    assert run["compile"]["flashspec_eager"]["on"] is False
    hf = run["compile"][compiled_methods.BASELINE]
    assert hf["graphs"] >= 1  # HF really compiled on a CPU (_compile_all_devices)
    assert hf["graphs_after_warmup"] == 0  # the longest prompt first: one cache length
    assert hf["max_cache_len"] == max(result["settings"]["prompt_tokens"]) + NEW - 1
    assert [row["method"] for row in run["weight_streaming"]["rows"]] == [
        "flashspec_compiled",
        compiled_methods.REFERENCE,
    ]
    assert result["checks"]["flashspec_greedy_identical"] is True
    assert result["checks"]["no_recompiles"] is True


def test_tables_and_report(result: dict[str, Any]) -> None:
    text = compiled_report.text(result)
    assert "| float32 | greedy | flashspec compiled |" in text
    assert "1 (baseline)" in text and "(reference)" in text
    assert "| float32 | flashspec compiled |" in compiled_report.compile_table(result)
    assert "of the floor" in text and "yes" in text
    broken = copy.deepcopy(result)
    record = broken["runs"][0]["modes"]["greedy"]["flashspec_compiled"]
    record["identity"] = {"identical": 1, "tie": 0, "mismatch": 1, "rows": 2}
    record["all_match"] = False
    broken["checks"] = compiled_measure.checks(broken)
    assert broken["checks"]["mismatches"] == ["float32 greedy flashspec_compiled"]
    assert "1 MISMATCH" in compiled_report.table(broken) and "NO:" in compiled_report.text(broken)


def test_identity_cell() -> None:
    assert compiled_report.identity_cell({}) == "-"
    cell = compiled_report.identity_cell(
        {"identity": {"identical": 3, "tie": 1, "mismatch": 0, "rows": 4}}
    )
    assert cell == "3/4 (+1 tie)"


def test_spread_and_ratios() -> None:
    assert compiled_measure.spread([3.0, 1.0, 2.0], 2) == {
        "median": 2.0,
        "min": 1.0,
        "max": 3.0,
        "runs": [3.0, 1.0, 2.0],
    }
    assert compiled_measure.ratios([2.0, 3.0], [1.0, 0.0]) == [2.0, 0.0]
    with pytest.raises(ValueError):
        compiled_measure.spread([], 2)
    with pytest.raises(ValueError):
        compiled_measure.ratios([1.0], [1.0, 2.0])


def test_warmup_order_runs_the_longest_first() -> None:
    rows = [[0] * 10, [0] * 40, [0] * 20]
    assert compiled_measure.warmup_order(rows, max_new_tokens=8, gamma=4) == [1, 2, 0]
    # A prompt past the first static-cache bucket (256 columns) starts a bucket of its own.
    rows = [[0] * 300, [0] * 10, [0] * 20]
    assert compiled_measure.warmup_order(rows, max_new_tokens=8, gamma=4) == [0, 2, 1]


def test_engine_configs_and_hf_compile_config() -> None:
    assert compiled_methods.engine_config("flashspec_compiled", 4, lookup=False).compile is True
    eager = compiled_methods.engine_config("flashspec_eager", 3, lookup=True)
    assert eager.compile is False and eager.sampling.gamma == 3
    assert eager.bandit.plain and eager.bandit.context == "lookup"
    with pytest.raises(ValueError):
        compiled_methods.engine_config("hf_eager", 4, lookup=False)
    config = compiled_methods.hf_compile_config()
    assert config._compile_all_devices is True
    assert (config.fullgraph, config.dynamic, config.mode) == (True, False, "default")
    assert compiled_methods.mode_sampling("sampled", 4).temperature > 0
    assert compiled_methods.mode_sampling("greedy", 4).temperature == 0


def test_parser_names_and_quick() -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "compiled", "--dtype", "float32", "bfloat16"])
    assert args.func is bench.main and args.bench == "compiled"
    settings = C.settings_from_args(args)
    assert settings.dtypes == ("float32", "bfloat16") and settings.modes == compiled_methods.MODES
    assert (settings.prompts, settings.max_new_tokens, settings.repeats) == (16, 64, 2)
    quick = C.settings_from_args(parser.parse_args(["bench", "compiled", "--quick"]))
    assert (quick.prompts, quick.max_new_tokens, quick.repeats) == (4, 16, 1)
    assert quick.dtypes == ("float32",)
    assert C.result_name("demo") == "compiled"
    assert C.result_name("smollm2") == "compiled-smollm2"


def test_batch_takes_compile() -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "batch", "--batches", "1", "--compile", "on"])
    assert B.settings_from_args(args).compile is True
    assert batch_methods.engine_config("ragged", 4, False, compile=True).compile is True
    default = B.settings_from_args(parser.parse_args(["bench", "batch", "--batches", "1"]))
    assert default.compile == "auto"


def test_a_missing_model_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    check_missing_model_skipped(C, "compiled", monkeypatch, tmp_path, capsys)


@needs_renderer
def test_docs_section_renders(result: dict[str, Any]) -> None:
    render = load_renderer()
    body = render.compiled_section([{"machine": MACHINE, **result}])
    assert "| float32 | sampled | flashspec compiled |" in body
    assert "_compile_all_devices" in body and "GB/s" in body
    assert render.PAGES["COMPILED-BENCH"].name == "benchmarks.md"
