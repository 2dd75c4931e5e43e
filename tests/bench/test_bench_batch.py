"""``flashspec bench batch`` on tiny random models: the result schema, identity counting (a
corrupted row must count as a mismatch), the targets, the parser and the docs section."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from flashspec import bench
from flashspec.bench import identity
from flashspec.bench.batch import command as B
from flashspec.bench.batch import measure as batch_measure
from flashspec.bench.batch import methods as batch_methods
from flashspec.bench.batch import report as batch_report
from flashspec.bench.pair import Pair, encode, make_pair
from tests.helpers.bench import MACHINE, check_missing_model_skipped, load_renderer, needs_renderer
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

NEW = 6
# Different lengths, so a batch of two is left padded.
PROMPTS = [
    bench.Prompt("tiny/0", "humaneval", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"),
    bench.Prompt("tiny/1", "humaneval", "x = [1, 2, 3]\n"),
    bench.Prompt("tiny/2", "humaneval", "import os\nprint(os.path.join('a', 'b'))\n"),
    bench.Prompt("tiny/3", "humaneval", "for i in range(3):\n"),
]
SETTINGS = batch_measure.BatchSettings(
    batches=(1, 2), max_new_tokens=NEW, repeats=1, progress=False
)


@pytest.fixture(scope="module")
def pair() -> Pair:
    target = build_llama(0, layers=2)
    draft = perturbed_copy(target, noise=0.05, seed=1)
    return make_pair(target, draft, build_char_tokenizer(), "tiny-target", "tiny-draft")


@pytest.fixture(scope="module")
def result(pair: Pair) -> dict[str, Any]:
    return batch_measure.run_batch(pair, PROMPTS, SETTINGS)


def test_result_schema(result: dict[str, Any]) -> None:
    json.dumps(result)  # the file is JSON
    assert result["kind"] == "batch"
    assert result["settings"]["methods"] == list(batch_methods.METHODS)
    assert result["pair"]["drafter"] == "tiny-draft"
    assert [entry["batch_size"] for entry in result["results"]] == [1, 2]
    assert [entry["calls"] for entry in result["results"]] == [4, 2]
    assert result["results"][1]["padding_share"] > 0  # mixed lengths, left padded
    for entry in result["results"]:
        assert set(entry["methods"]) == set(batch_methods.METHODS)
        for method, record in entry["methods"].items():
            assert record["new_tokens"] == NEW * len(PROMPTS), method  # EOS ignored
            assert record["tokens_per_second"]["median"] > 0
            assert record["tokens_per_round"]["median"] >= 1.0
            if method == batch_methods.BASELINE:
                assert record["speedup"]["median"] == 1.0
                assert record["tokens_per_round"]["median"] == 1.0  # one token per HF step
                assert "identity" not in record
            else:
                # Greedy and lossless: every row equals HF's, up to floating-point ties.
                assert record["identity"]["rows"] == len(PROMPTS)
                assert record["identity"]["mismatch"] == 0, record["differences"]
                assert record["all_match"] is True
    lockstep = result["settings"]["configs"]["lockstep"]
    assert lockstep["batching"] == "lockstep" and not lockstep["plain_arm"]
    assert result["settings"]["configs"]["ragged_adaptive"]["plain_arm"] is True


def test_targets_need_their_batch_sizes(result: dict[str, Any]) -> None:
    checks = {c["target"]: c for c in result["targets"]}
    assert len(checks) == 4
    at8 = checks["speedup vs HF batched at B=8"]
    assert at8["threshold"] == 1.6 and at8["measured"]["ragged"] is None
    assert at8["met"]["ragged"] is None
    lowest = checks["speedup vs HF batched at every B (lowest)"]
    speedups = [e["methods"]["ragged"]["speedup"]["median"] for e in result["results"]]
    assert lowest["measured"]["ragged"] == min(speedups)
    assert lowest["met"]["ragged"] == (min(speedups) >= 0.95)
    text = batch_report.text(result)
    assert "flashspec lockstep" in text and "not measured" in text


def test_a_corrupted_row_counts_as_a_mismatch(pair: Pair, monkeypatch: Any) -> None:
    real_run = batch_methods.BatchRunner.run
    vocab = int(pair.target.config.vocab_size)

    def corrupt(
        self: batch_methods.BatchRunner, method: str, rows: Any, max_new_tokens: Any = None
    ) -> Any:
        run = real_run(self, method, rows, max_new_tokens)
        if method == "lockstep" and max_new_tokens is None:  # timed runs, not the warm-up
            first = run.tokens[0]
            first[1] = (first[1] + 1) % vocab
        return run

    monkeypatch.setattr(batch_methods.BatchRunner, "run", corrupt)
    settings = batch_measure.BatchSettings(
        batches=(2,), max_new_tokens=4, repeats=1, methods=("lockstep",), progress=False
    )
    data = batch_measure.run_batch(pair, PROMPTS, settings)
    record = data["results"][0]["methods"]["lockstep"]
    # The first row of each batch of two: prompts 0 and 2.
    assert record["identity"] == {"identical": 2, "tie": 0, "mismatch": 2, "rows": 4}
    assert record["all_match"] is False
    assert [(d["prompt"], d["at"]) for d in record["differences"]] == [("tiny/0", 1), ("tiny/2", 1)]
    assert "2 MISMATCH" in batch_report.table(data)


def test_row_statuses_and_counts(pair: Pair) -> None:
    runner = batch_methods.BatchRunner(pair, gamma=3, max_new_tokens=4)
    rows = [encode(pair, p.text, 64) for p in PROMPTS[:2]]
    reference = runner.run(batch_methods.BASELINE, rows).tokens
    assert [v["status"] for v in identity.row_statuses(pair, rows, reference, reference)] == [
        "identical",
        "identical",
    ]
    wrong = [
        list(reference[0]),
        [*reference[1][:-1], (reference[1][-1] + 1) % pair.target.config.vocab_size],
    ]
    verdicts = identity.row_statuses(pair, rows, wrong, reference)
    assert verdicts[0] == {"status": "identical"}
    assert verdicts[1]["status"] == "mismatch" and verdicts[1]["at"] == 3
    assert identity.worst(["identical", "tie", "identical"]) == "tie"
    assert identity.count_statuses(["identical", "mismatch", "identical"]) == {
        "identical": 2,
        "tie": 0,
        "mismatch": 1,
    }


def test_parser_and_names() -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        ["bench", "batch", "--batches", "1", "2", "--max-new-tokens", "8", "--repeats", "1"]
    )
    assert args.func is bench.main and args.bench == "batch"
    assert args.batches == [1, 2] and args.methods == list(batch_methods.METHODS)
    settings = B.settings_from_args(args)
    assert settings.batches == (1, 2) and settings.max_new_tokens == 8 and settings.prompts == 32
    assert B.result_name("demo") == "batch"
    assert B.result_name("smollm2") == "batch-smollm2"
    too_big = parser.parse_args(["bench", "batch", "--batches", "8", "--prompts", "4"])
    with pytest.raises(SystemExit, match="exceed"):
        B.settings_from_args(too_big)


def test_a_missing_model_is_skipped(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: Any
) -> None:
    check_missing_model_skipped(B, "batch", monkeypatch, tmp_path, capsys)


@needs_renderer
def test_docs_section_renders(result: dict[str, Any]) -> None:
    render = load_renderer()
    body = render.batch_section([{"machine": MACHINE, **result}])
    assert "| 2 | flashspec ragged |" in body and "target >= 1.6" in body
    assert render.PAGES["BATCH-BENCH"].name == "benchmarks.md"
