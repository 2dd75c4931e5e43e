"""The real-model benchmark (``flashspec bench engine --target smollm2``) on a tiny random model:
its requests, the run's schema, the summary, the tables and the dispatch."""

from __future__ import annotations

import argparse
import ast
import copy
import json
import re
from typing import Any

import pytest

from flashspec import bench
from flashspec.bench import chat_requests, common
from flashspec.bench.chat import command as C
from flashspec.bench.chat import measure as chat_measure
from flashspec.bench.chat import methods as chat_methods
from flashspec.bench.report import chat_sweep_table, chat_table, report_chat
from flashspec.config import BanditConfig, FlashSpecConfig, SamplingConfig
from flashspec.drafters import PromptLookupDrafter
from flashspec.engine import SpeculativeEngine
from flashspec.models import TargetModel
from tests.helpers.models import build_char_tokenizer, build_llama

TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def test_copy_prompts_cycle_the_kinds_and_strip_what_they_ask_for() -> None:
    requests = chat_requests.copy_prompts(8)
    assert [r.kind for r in requests] == list(chat_requests.COPY_KINDS) * 2
    assert len({r.id for r in requests}) == 8 and {r.workload for r in requests} == {"copy"}
    for r in requests:
        if r.kind in ("docstring", "type_hints"):
            code = r.user.split("```python\n", 1)[1].rsplit("```", 1)[0]
            tree = ast.parse(code)
            for node in ast.walk(tree):
                if isinstance(node, ast.FunctionDef):
                    if r.kind == "docstring":
                        assert ast.get_docstring(node) is None
                    else:
                        assert node.returns is None
                        assert all(a.annotation is None for a in node.args.args)
        if r.kind == "rename":
            old, new = re.findall(r"`(\w+)`", r.user)[:2]
            assert old != new and old in r.user.split("```python", 1)[1]
    assert chat_requests.humaneval_requests(2)[1].id == "HumanEval/1"


def test_spread_and_result_name() -> None:
    assert chat_measure.spread(list(range(8)), 2) == [0, 7]
    assert chat_measure.spread(list(range(8)), 3) == [0, 4, 7]
    assert chat_measure.spread([1, 2], 5) == [1, 2]
    assert chat_measure.spread([1, 2], 1) == [1]
    assert common.result_name("smollm2") == "smollm2"
    assert common.result_name("/x/SmolLM2-135M.Q4_1.gguf") == "SmolLM2-135M.Q4_1"


def test_parser_flags_and_defaults() -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "engine", "--target", "smollm2", "--copy", "3"])
    assert args.copy == 3 and args.no_llamacpp is False and args.humaneval is None
    settings = C.settings_from_args(args)
    assert settings.copy == 3 and settings.humaneval == chat_measure.DEFAULT_HUMANEVAL
    assert settings.draft is None  # the demo's default draft is dropped for a real model
    quick = C.settings_from_args(
        parser.parse_args(["bench", "engine", "--target", "smollm2", "--quick", "--no-llamacpp"])
    )
    assert quick.llamacpp is False and quick.max_new_tokens <= 64


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    model = build_llama(0, layers=2, max_positions=2048)
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE

    def build(gamma: int, dtype: str = "float32", drafter: str | None = None) -> Any:
        adaptive = drafter is None  # as EngineOptions: the default chooses lookup or plain
        config = FlashSpecConfig(
            sampling=SamplingConfig(gamma=gamma),
            bandit=BanditConfig(plain=adaptive, context="lookup" if adaptive else "none"),
            dtype=dtype,
        )
        target = TargetModel("tiny", model=copy.deepcopy(model), tokenizer=tokenizer, dtype=dtype)
        return SpeculativeEngine(config, [PromptLookupDrafter()], target)

    settings = chat_measure.ChatSettings(
        target="tiny",
        max_new_tokens=6,
        humaneval=1,
        copy=2,
        sweep_gammas=(2, 4),
        sweep_prompts=1,
        llamacpp=False,
        progress=False,
        probe_reps=2,
    )
    return chat_measure.run_chat(settings, build=build)


def test_run_schema(result: dict[str, Any]) -> None:
    json.dumps(result)
    names = result["settings"]["methods"]
    assert "llamacpp" not in names and names[0] == "hf_greedy"
    assert set(chat_methods.FP32_METHODS + chat_methods.BF16_METHODS) <= set(names)
    assert [p["workload"] for p in result["prompts"]] == ["humaneval", "copy", "copy"]
    for prompt in result["prompts"]:
        for method, record in prompt["methods"].items():
            assert 0 < record["new_tokens"] <= 6, method
            assert record["identity"]["status"] in ("identical", "tie"), method
            if method.startswith("fs_"):
                assert record["rounds"] and record["drafted"] is not None
    for workload in ("humaneval", "copy", "all"):
        assert result["summary"][workload]["fs_default"]["all_match"] is True
    assert {"float32", "bfloat16"} <= set(result["costs"])
    assert result["costs"]["float32"]["verify_tokens"] == 5
    assert [row["gamma"] for row in result["gamma_sweep"]["workloads"]["copy"]["rows"]] == [2, 4]
    assert result["gamma_sweep"]["best_gamma_overall"] in (2, 4)
    assert "met" in result["targets"]


def test_tables_and_report(result: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    rows = chat_table(result, "copy")
    assert rows[0][0] == "method" and len(rows) == 1 + len(result["settings"]["methods"])
    assert all(len(row) == len(rows[0]) for row in rows)
    assert len(chat_sweep_table(result, "copy")) == 3
    report_chat({"machine": {}, **result})
    assert "targets:" in capsys.readouterr().out
