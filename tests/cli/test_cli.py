"""The ``flashspec`` command: end to end in a subprocess, and every user error as one line.

Error cases run in-process through ``main(argv)`` (no interpreter start-up per case); the
end-to-end runs and the offline hub case use a fresh interpreter with ``HF_HUB_OFFLINE=1``,
which huggingface_hub reads when it is imported.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from flashspec.cli import main
from flashspec.models import DEMO_DIR

# One thread, as conftest sets in-process: on a shared 2-core machine two processes with
# two spinning OpenMP threads each slow each other down by 10x and more.
OFFLINE = {
    **os.environ,
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
}
PROMPT = "def quicksort(arr):"


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "flashspec.cli", *args],
        env=OFFLINE,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "Traceback" not in err
    assert lines[0].startswith("flashspec: error: ")
    return lines[0]


# ------------------------------------------------------------------------------ end to end


def test_generate_compare_end_to_end() -> None:
    done = run_cli("generate", PROMPT, "--max-new-tokens", "24", "--compare")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(PROMPT)
    assert len(done.stdout) > len(PROMPT) + 10
    assert "Traceback" not in done.stderr
    assert "tokens/s" in done.stderr and "acceptance" in done.stderr
    assert "tokens/round" in done.stderr
    assert "speedup" in done.stderr
    assert "greedy outputs identical" in done.stderr


def test_info_end_to_end() -> None:
    done = run_cli("info")
    assert done.returncode == 0, done.stderr[-2000:]
    for word in ("flashspec", "torch", "transformers", "backend", "demo_pair", str(DEMO_DIR)):
        assert word in done.stdout


def test_hub_id_while_offline_is_one_line() -> None:
    done = run_cli("generate", PROMPT, "--target", "nobody-here/no-such-model")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "offline" in lines[0] and "nobody-here/no-such-model" in lines[0]


# ------------------------------------------------------------------------------ in-process


def test_sampling_batch_file_and_prompt_lookup(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    batch = tmp_path / "prompts.txt"
    batch.write_text("def add(a, b):\n\nimport sys\\nimport os\n")
    args = ["generate", "--batch-file", str(batch), "--max-new-tokens", "8"]
    assert (
        main([*args, "--temperature", "0.8", "--top-p", "0.9", "--top-k", "50", "--seed", "1"]) == 0
    )
    out = capsys.readouterr()
    assert "--- [0] ---\ndef add(a, b):" in out.out
    assert "--- [1] ---\nimport sys\nimport os" in out.out
    assert "acceptance" in out.err

    assert main(["generate", PROMPT, "--drafter", "prompt-lookup", "--max-new-tokens", "8"]) == 0
    out = capsys.readouterr()
    assert out.out.startswith(PROMPT) and "tokens/s" in out.err


def test_adaptive_chooses_among_both_demo_drafters_lookup_and_plain(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["generate", PROMPT, "--adaptive", "--max-new-tokens", "48", "--compare"]
    assert main([*argv, "--selector", "thompson"]) == 0
    err = capsys.readouterr().err
    assert "greedy outputs identical" in err
    arms = err.split("rounds per arm: ", 1)[1].splitlines()[0]
    labels = {part.rsplit(" ", 1)[0] for part in arms.split(", ")}
    # Thompson sampling starts from flat priors, so 15+ rounds try several arms.
    assert len(labels) >= 2 and labels <= {
        "demo-draft/gamma", "demo-draft3/gamma", "prompt_lookup/gamma", "plain",
    }, arms  # fmt: skip


def test_missing_model_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no-model-here"
    assert main(["generate", PROMPT, "--target", str(missing)]) == 2
    line = one_line_error(capsys)
    assert str(missing) in line and "save_pretrained" in line


def test_directory_without_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", PROMPT, "--draft", str(tmp_path)]) == 2
    assert "config.json" in one_line_error(capsys)


def test_vocabulary_mismatch(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path / "other")
    assert main(["generate", PROMPT, "--draft", str(tmp_path / "other")]) == 2
    line = one_line_error(capsys)
    assert "vocabulary" in line and "prompt-lookup" in line.replace(
        "prompt lookup", "prompt-lookup"
    )


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["--gamma", "0"], "--gamma"),
        (["--gamma", "four"], "--gamma"),
        (["--top-p", "1.5"], "--top-p"),
        (["--temperature", "-1"], "--temperature"),
        (["--temperature", "nan"], "--temperature"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--top-k", "-3"], "--top-k"),
        (["--variant", "fast"], "--variant"),
        (["--drafter", "bogus"], "--drafter"),
    ],
)
def test_bad_flag_values(
    flags: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", PROMPT, *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0] and "--help" in lines[0], err


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["generate"], "no prompt"),
        (["generate", PROMPT, "--variant", "rejection"], "--temperature"),
        (["generate", PROMPT, "--drafter", "prompt-lookup", "--draft", "x"], "--drafter"),
        (["generate", PROMPT, "--batch-file", "/nonexistent/prompts.txt"], "--batch-file"),
        (["generate", PROMPT, "--dtype", "int8"], "dtype"),
    ],
)
def test_bad_combinations(
    argv: list[str], expected: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert expected in one_line_error(capsys)


def test_structured_output_and_penalty_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--regex and --json-schema constrain the output; penalties reach the engine; bad values
    are one-line errors naming the flag."""
    import json
    import re

    pytest.importorskip("llguidance")
    argv = ["generate", "x = ", "--max-new-tokens", "12", "--repetition-penalty", "1.2"]
    assert main([*argv, "--regex", "[0-9]{1,3};"]) == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"x = [0-9]{1,3};?\n", out), out
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"enum": [1, 2]}},
                                  "required": ["n"], "additionalProperties": False}))  # fmt: skip
    assert main(["generate", "x = ", "--max-new-tokens", "60", "--json-schema", str(schema)]) == 0
    assert json.loads(capsys.readouterr().out[len("x = ") :])["n"] in (1, 2)
    assert main(["generate", "x", "--presence-penalty", "3"]) == 2
    assert "--presence-penalty must be in [-2, 2]" in one_line_error(capsys)
    assert main(["generate", "x", "--regex", "["]) == 2
    assert "regex does not compile" in one_line_error(capsys)
    schema.write_text("{not json")
    assert main(["generate", "x", "--json-schema", str(schema)]) == 2
    assert f"--json-schema {schema}: the JSON schema is not valid JSON" in one_line_error(capsys)
    assert main(["generate", "x", "--regex", "a", "--compare"]) == 2
    assert "--compare runs HF generate" in one_line_error(capsys)
