"""The benchmark code paths on tiny random models: result schema, greedy identity, profile."""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from flashspec import SpeculativeEngine, bench
from flashspec.bench import engine as E
from flashspec.bench.pair import Pair, encode, make_pair
from flashspec.bench.profile import run_profile
from flashspec.bench.report import plot_engine
from flashspec.bench.runner import METHODS, SAMPLING
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

NEW = 8
PROMPTS = [
    bench.Prompt("tiny/0", "humaneval", "def add(a, b):\n    return"),
    bench.Prompt("tiny/1", "stdlib", "import os\nx = [1, 2, 3]\n"),
]


@pytest.fixture(scope="module")
def pair() -> Pair:
    target = build_llama(0, layers=2)
    draft = perturbed_copy(target, noise=0.05, seed=1)
    return make_pair(target, draft, build_char_tokenizer(), "tiny-target", "tiny-draft")


@pytest.fixture(scope="module")
def result(pair: Pair) -> dict[str, Any]:
    settings = E.EngineSettings(
        gamma=3,
        max_new_tokens=NEW,
        max_prompt_tokens=64,
        sweep_gammas=(1, 2),
        sweep_prompts=1,
        progress=False,
    )
    return E.run_engine(pair, PROMPTS, settings)


def test_engine_result_schema(result: dict[str, Any]) -> None:
    json.dumps(result)  # the file is JSON
    assert set(result["settings"]["methods"]) == set(METHODS)
    assert {"target_ms", "draft_ms", "c", "verify_over_step"} <= set(result["costs"])
    assert [p["id"] for p in result["prompts"]] == ["tiny/0", "tiny/1"]
    for prompt in result["prompts"]:
        for method, record in prompt["methods"].items():
            assert record["new_tokens"] == NEW, method  # EOS ignored: every method runs full
            assert record["tokens_per_second"] > 0
            assert record["speedup"] > 0
            if method.startswith("fs_") or method.startswith("hf_assisted"):
                assert record["rounds"] and record["drafted"] is not None
                assert 0 <= record["acceptance_rate"] <= 1
                assert record["ideal_speedup"] is not None and record["efficiency"] is not None
    for split in ("humaneval", "stdlib", "all"):
        for entry in result["summary"][split].values():
            assert {"tokens_per_second", "speedup_median", "acceptance_rate"} <= set(entry)
    assert set(result["targets"]) >= {
        "speedup_vs_hf_greedy (target >= 1.5)",
        "speedup_vs_best_hf_assisted (target >= 1.15)",
    }
    assert [row["gamma"] for row in result["gamma_sweep"]] == [1, 2]


def test_greedy_identity_is_computed(result: dict[str, Any]) -> None:
    for prompt in result["prompts"]:
        for method, record in prompt["methods"].items():
            if method in SAMPLING:
                assert record["identity"] is None
            else:
                # Lossless greedy methods (ours and HF's) must reproduce HF greedy.
                assert record["identity"]["status"] in ("identical", "tie"), (method, record)
    assert result["summary"]["all"]["fs_greedy"]["all_match"] is True
    assert result["gamma_sweep"][0]["all_match"] is True


def test_greedy_identity_flags_a_real_difference(pair: Pair) -> None:
    ids = encode(pair, PROMPTS[0].text, 64)
    with torch.inference_mode():
        out = pair.target.generate(
            torch.tensor([ids]), do_sample=False, max_new_tokens=4, pad_token_id=0
        )
    ref = out[0, len(ids) :].tolist()
    assert E.greedy_identity(pair, ids, ref, ref)["status"] == "identical"
    vocab = pair.target.config.vocab_size
    wrong = [*ref[:2], (ref[2] + 1) % vocab, *ref[3:]]
    verdict = E.greedy_identity(pair, ids, wrong, ref)
    assert verdict["status"] == "mismatch" and verdict["at"] == 2
    assert E.greedy_identity(pair, ids, ref[:3], ref)["status"] == "mismatch"


def test_profile_splits_the_round(pair: Pair) -> None:
    data = run_profile(
        pair,
        PROMPTS[:1],
        gamma=3,
        max_new_tokens=NEW,
        max_prompt_tokens=64,
        show_progress=False,
    )
    labels = [mode["label"] for mode in data["modes"]]
    assert labels == ["sampling, native residual", "sampling, torch residual", "greedy"]
    for mode in data["modes"]:
        assert sum(mode["share_of_round"].values()) == pytest.approx(1.0, abs=0.02)
        assert mode["ms_per_round"]["target forward"] > 0
        assert mode["ms_per_round"]["draft forwards"] > 0
    assert data["modes"][2]["residual_calls"] == 0  # greedy never draws a residual


def test_prompts_and_parser() -> None:
    he = bench.humaneval_prompts(3)
    assert [p.id for p in he] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    stdlib = bench.stdlib_prompts(2)
    assert len(stdlib) == 2 and all(p.text.endswith(":\n") for p in stdlib)
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "engine", "--quick", "--gamma", "5"])
    assert args.func is bench.main and args.bench == "engine" and args.gamma == 5


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="no matplotlib")
def test_plot(result: dict[str, Any], tmp_path: Path) -> None:
    data = {"machine": {"cpu": "test"}, **result}
    plot_engine(data, tmp_path / "engine.png", bench.pyplot())
    assert (tmp_path / "engine.png").stat().st_size > 1000


def test_long_generation_study(pair: Pair) -> None:
    """The default engine (draft + plain) against HF greedy at each length: the lengths run,
    cut to the context left after the prompt, the identity against HF, and the per-round
    times grouped by context."""
    from flashspec.bench.lengths import BIN, length_study, report_lengths

    settings = E.EngineSettings(gamma=3, max_new_tokens=NEW, max_prompt_tokens=64, progress=False)
    study = E.run_lengths(pair, PROMPTS, (6, 20), settings)
    assert study["engines"] == {"default": ["draft/gamma", "plain"], "fixed": ["draft/gamma"]}
    assert list(study["summary"]["default"]) == ["6", "20"]
    for record in study["records"]:
        assert record["new_tokens"] == record["length"]
        assert record["identity"] != "mismatch", record
        assert record["speedup"] > 0 and record["tokens_per_round"] >= 1
    for binned in study["round_ms_by_context"].values():
        assert binned and all(int(k) % BIN == 0 for k in binned)
    assert "20 new tokens" in report_lengths(study)
    ids = encode(pair, PROMPTS[0].text, 64)
    cut = length_study(
        SpeculativeEngine.from_pretrained(
            pair.target_name,
            models={pair.target_name: pair.target},
            tokenizer=pair.tokenizer,
            drafters=["prompt_lookup"],
        ),
        pair.target,
        [ids],
        (50,),
        pad_id=pair.pad_id,
        max_positions=len(ids) + 9,
        show_progress=False,
    )
    assert [r["new_tokens"] for r in cut["records"]] == [9]  # what the context holds
