"""Chat: ``engine.chat``, ``flashspec generate --chat/--system``, and the greedy tie rule.

The reference for a chat is HF's own: ``tokenizer.apply_chat_template`` makes the prompt and
``model.generate`` decodes it greedily; flashspec must give the same tokens.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flashspec import (  # noqa: E402
    FlashSpecConfig,
    ModelDrafter,
    PromptLookupDrafter,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec._greedy import compare_greedy  # noqa: E402
from flashspec.cli import main  # noqa: E402
from flashspec.engine.chat import FALLBACK_CHAT_STOP, chat_ids, conversation, render  # noqa: E402
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy  # noqa: E402

# Only characters of the test tokenizer (lowercase, digits, a little punctuation).
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
MESSAGES = [{"role": "user", "content": "say abc abc abc abc"}]


def templated_tokenizer() -> Any:
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def engine_for(tokenizer: Any, *, model_drafter: bool = True) -> SpeculativeEngine:
    target = build_llama(seed=3)
    drafters: list[Any] = [PromptLookupDrafter()]
    if model_drafter:
        drafters.insert(0, ModelDrafter(perturbed_copy(target, 0.05, seed=4), name="draft"))
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3))
    return SpeculativeEngine(
        config, drafters, TargetModel("tiny", model=target, tokenizer=tokenizer)
    )


def hf_reference(engine: SpeculativeEngine, ids: list[int], new: int) -> list[int]:
    model = engine.target.model
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.int64),
            max_new_tokens=new,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(ids) :]]


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    """HF's own rendering of the conversation, tokenized as its chat template says."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    return [int(t) for t in ids]


@pytest.mark.parametrize("model_drafter", [True, False])
def test_chat_equals_hf_generate_on_the_template(model_drafter: bool) -> None:
    tokenizer = templated_tokenizer()
    engine = engine_for(tokenizer, model_drafter=model_drafter)
    result = engine.chat(MESSAGES, 24)
    ids = template_ids(tokenizer, MESSAGES)
    assert result.tokens[0] == hf_reference(engine, ids, 24)
    assert result.texts is not None and result.texts[0] == tokenizer.decode(
        result.tokens[0], skip_special_tokens=True
    )


def test_system_message_goes_first_and_changes_the_prompt() -> None:
    tokenizer = templated_tokenizer()
    with_system, _ = chat_ids(tokenizer, "hi", system="be brief")
    without, _ = chat_ids(tokenizer, "hi")
    text = tokenizer.decode(with_system)
    assert text.startswith("system: be brief\nuser: hi\n")
    assert text.endswith("assistant:")
    assert with_system[-len(without) :] == without
    engine = engine_for(tokenizer)
    reference = template_ids(
        tokenizer, [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    )
    assert reference == with_system
    assert engine.chat("hi", 12, system="be brief").tokens[0] == hf_reference(engine, reference, 12)


def test_without_a_template_the_transcript_stops_at_the_next_turn() -> None:
    tokenizer = build_char_tokenizer()  # no chat template
    chat = render(tokenizer, conversation("hi"))
    assert chat.text == "user: hi\nassistant:"
    assert chat.special and chat.stops == (FALLBACK_CHAT_STOP,)
    engine = engine_for(tokenizer)
    result = engine.chat("hi", 40)
    text = result.texts[0] if result.texts else ""
    if result.finish_reasons[0] == "stop":
        assert text.endswith(FALLBACK_CHAT_STOP)
    assert FALLBACK_CHAT_STOP not in text[: -len(FALLBACK_CHAT_STOP)]
    # The stop string is the only difference from plain generation of the same transcript.
    ids, _ = chat_ids(tokenizer, "hi")
    reference = hf_reference(engine, ids, 40)
    assert reference[: len(result.tokens[0])] == result.tokens[0]


def test_chat_stream_streams_the_reply() -> None:
    tokenizer = templated_tokenizer()
    engine = engine_for(tokenizer)
    pieces = list(engine.chat_stream(MESSAGES, 16).text())
    assert "".join(pieces) == engine.chat(MESSAGES, 16).texts[0]  # type: ignore[index]


@pytest.mark.parametrize(
    ("messages", "error", "match"),
    [
        ([], ValueError, "messages is empty"),
        (5, TypeError, "messages must be a string or a list"),
        (["hi"], TypeError, r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], ValueError, r"messages\[0\]\['role'\]"),
        ([{"role": "user", "content": 3}], ValueError, r"messages\[0\]\['content'\]"),
    ],
)
def test_bad_messages_name_the_message(messages: Any, error: type[Exception], match: str) -> None:
    engine = engine_for(templated_tokenizer(), model_drafter=False)
    with pytest.raises(error, match=match):
        engine.chat(messages, 4)


def test_a_template_that_refuses_is_a_value_error() -> None:
    tokenizer = templated_tokenizer()
    tokenizer.chat_template = "{{ raise_exception('no system messages') }}"
    engine = engine_for(tokenizer, model_drafter=False)
    with pytest.raises(ValueError, match="chat template refused"):
        engine.chat("hi", 4)


def test_chat_needs_a_tokenizer() -> None:
    engine = engine_for(None, model_drafter=False)
    with pytest.raises(ValueError, match="tokenizer"):
        engine.chat("hi", 4)


# ------------------------------------------------------------------------------------ the CLI


def test_cli_chat_prints_the_reply_and_compares(capsys: pytest.CaptureFixture[str]) -> None:
    status = main(["generate", "--chat", "def add(a, b):", "--max-new-tokens", "12", "--compare"])
    out, err = capsys.readouterr()
    assert status == 0, err
    assert not out.startswith("user:")  # the reply only, not the transcript
    assert "greedy outputs identical" in err


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["generate", "hello", "--chat", "hi"], "--chat is the prompt"),
        (["generate", "hello", "--system", "be brief"], "--system goes with --chat"),
    ],
)
def test_cli_chat_flag_errors(
    argv: list[str], match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and match in err[0]


# ----------------------------------------------------------------------------- the tie rule


def test_tie_rule_accepts_the_targets_own_argmax_and_nothing_else() -> None:
    model = build_llama(seed=5)
    prompt = [4, 5, 6, 7, 8]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1]
    order = logits.argsort(descending=True).tolist()
    best, second = order[0], order[1]
    # The "reference" chose the runner-up; a token equal to the whole-prefix argmax is a tie.
    assert compare_greedy(model, prompt, [best], [second]).status == "tie"
    # A token that is neither the argmax nor within TIE of it is a mismatch.
    gap = float(logits[order[0]] - logits[order[5]])
    assert gap > 1e-4
    assert compare_greedy(model, prompt, [order[5]], [best]).status == "mismatch"
    assert compare_greedy(model, prompt, [best, 9], [best, 9]).status == "identical"


def test_tie_rule_is_not_fooled_by_a_shifted_copy() -> None:
    """An engine that emits the right tokens one position late is a mismatch."""
    model = copy.deepcopy(build_llama(seed=6))
    prompt = [4, 5, 6, 7]
    reference = [10, 11, 12]
    got = [reference[0], reference[0], reference[1]]
    result = compare_greedy(model, prompt, got, reference)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([[*prompt, reference[0]]])).logits[0, -1]
    if int(logits.argmax()) != reference[0]:
        assert result.status == "mismatch"


def test_tie_threshold_follows_the_dtype() -> None:
    from flashspec._greedy import TIE, tie_threshold

    # float32: the fixed 1e-4; bfloat16: 8 steps of bfloat16 at the top logit (0.125 at 20).
    assert tie_threshold(torch.float32, 22.9) == TIE
    assert tie_threshold(torch.bfloat16, 22.9) == 1.0
    assert tie_threshold(torch.bfloat16, 3.0) == 8 * 2.0**-7 * 2
    assert tie_threshold(torch.float16, 22.9) == 8 * 2.0**-10 * 16


def test_bfloat16_gap_within_its_rounding_is_a_tie() -> None:
    model = build_llama(seed=5).to(torch.bfloat16)
    prompt = [4, 5, 6, 7, 8]
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    order = logits.argsort(descending=True).tolist()
    gap = float(logits[order[0]] - logits[order[1]])
    status = compare_greedy(model, prompt, [order[1]], [order[0]]).status
    from flashspec._greedy import tie_threshold

    assert status == (
        "tie" if gap <= tie_threshold(torch.bfloat16, float(logits.max())) else "mismatch"
    )
    far = next(t for t in order if float(logits[order[0]] - logits[t]) > 2.0)
    assert compare_greedy(model, prompt, [far], [order[0]]).status == "mismatch"
