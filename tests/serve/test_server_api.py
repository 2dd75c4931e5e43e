"""The OpenAI API's sampling and output fields through the official client, under speculation:
logprobs (completions and chat, whole and streamed) equal to HF's own, penalties and
``logit_bias`` equal to HF ``generate`` with the same processors, ``n`` choices, and
``response_format`` JSON that always parses and validates.

A tiny engine (2-layer Llama over a character tokenizer with braces, a draft that agrees) keeps
the server fast.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

pytest.importorskip("openai")
pytest.importorskip("llguidance")

import openai

from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import ModelDrafter
from flashspec.serve import ServerThread, create_app

VOCAB = 60
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "ok"],
    "additionalProperties": False,
}


def target() -> Any:
    return build_llama(41, vocab_size=VOCAB, init_range=0.3, max_positions=256)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    model = target()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
        [ModelDrafter(perturbed_copy(model, 0.02, seed=2), name="draft")],
        TargetModel("tiny", model=model, tokenizer=build_char_tokenizer(extra="{}")),
    )
    with ServerThread(create_app(engine, model_name="tiny", max_batch=8, timeout_s=60)) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> Any:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def hf(prompt: str, n: int, **kwargs: Any) -> Any:
    """HF greedy ``generate`` on the same weights (prompt with its BOS), EOS ignored."""
    tokenizer = build_char_tokenizer(extra="{}")
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    return target().generate(
        torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
        eos_token_id=None, pad_token_id=0, output_logits=True, return_dict_in_generate=True,
        **kwargs,
    ), len(ids)  # fmt: skip


def test_completion_logprobs_equal_hf(client: Any) -> None:
    out, start = hf("def f(x):", 12)
    tokenizer = build_char_tokenizer(extra="{}")
    answer = client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=12, temperature=0, logprobs=3
    )
    lp = answer.choices[0].logprobs
    # (the server stops at EOS, HF here runs on: the server's tokens are a prefix of HF's)
    expected = out.sequences[0, start:].tolist()[: len(lp.tokens)]
    assert len(lp.tokens) >= 4
    assert lp.tokens == [tokenizer.decode([t]) for t in expected]
    assert tokenizer.decode(expected, skip_special_tokens=True) == answer.choices[0].text
    for step, (value, top) in enumerate(zip(lp.token_logprobs, lp.top_logprobs, strict=True)):
        logp = out.logits[step][0].double().log_softmax(-1)
        assert abs(value - float(logp[expected[step]])) < 1e-4
        want = {tokenizer.decode([int(t)]): float(v) for v, t in zip(*logp.topk(3), strict=True)}
        assert top.keys() == want.keys() and all(abs(top[k] - want[k]) < 1e-4 for k in want)
    assert lp.text_offset[0] == 0
    streamed: list[float] = []
    for chunk in client.completions.create(
        model="tiny", prompt="def f(x):", max_tokens=12, temperature=0, logprobs=0, stream=True
    ):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.token_logprobs
    assert streamed == pytest.approx(lp.token_logprobs, abs=1e-6)


def test_chat_logprobs_streamed_and_whole(client: Any) -> None:
    messages = [{"role": "user", "content": "hello"}]
    whole = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=2,
    )  # fmt: skip
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)
    streamed: list[Any] = []
    for chunk in client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True,
        top_logprobs=2, stream=True,
    ):  # fmt: skip
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [c.token for c in streamed] == [c.token for c in content]


class OpenAIPenalties:
    """Reference processor: presence/frequency over the generated tokens, float64."""

    def __init__(self, start: int, presence: float, frequency: float) -> None:
        self.start, self.presence, self.frequency = start, presence, frequency

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.bincount(input_ids[0, self.start :], minlength=scores.shape[-1]).double()
        x = scores.double() - self.presence * (counts > 0) - self.frequency * counts
        return x.float()


def test_penalties_and_bias_equal_hf(client: Any) -> None:
    from transformers import LogitsProcessorList

    tokenizer = build_char_tokenizer(extra="{}")
    answer = client.completions.create(
        model="tiny", prompt="aaaa", max_tokens=20, temperature=0,
        extra_body={"repetition_penalty": 1.4},
    )  # fmt: skip
    out, start = hf("aaaa", 20, repetition_penalty=1.4)
    expected = tokenizer.decode(out.sequences[0, start:], skip_special_tokens=True)
    assert expected.startswith(answer.choices[0].text), (answer.choices[0].text, expected)
    presence, frequency = 1.5, 0.5
    answer = client.completions.create(
        model="tiny", prompt="aaaa", max_tokens=20, temperature=0,
        presence_penalty=presence, frequency_penalty=frequency,
    )  # fmt: skip
    processors = LogitsProcessorList([OpenAIPenalties(start, presence, frequency)])
    out, start = hf("aaaa", 20, logits_processor=processors)
    assert tokenizer.decode(out.sequences[0, start:], skip_special_tokens=True).startswith(
        answer.choices[0].text
    )
    z = tokenizer.convert_tokens_to_ids("z")
    biased = client.completions.create(
        model="tiny", prompt="aaaa", max_tokens=6, temperature=0, logit_bias={str(z): 100}
    )
    assert biased.choices[0].text == "z" * 6


def test_n_choices_and_seeds(client: Any) -> None:
    answer = client.completions.create(
        model="tiny", prompt=["ab", "cd"], max_tokens=8, temperature=1.0, n=3, seed=5
    )
    assert [c.index for c in answer.choices] == list(range(6))
    again = client.completions.create(
        model="tiny", prompt=["ab", "cd"], max_tokens=8, temperature=1.0, n=3, seed=5
    )
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]
    assert answer.usage.prompt_tokens == 4  # each prompt counts once, whatever n is
    assert len({c.text for c in answer.choices[:3]}) > 1  # the choices draw apart


def test_best_of_returns_the_candidates_of_the_highest_mean_logprob(client: Any) -> None:
    """best_of=4, n=2: the two candidates (of the four that n=4 draws with the same seed) of
    the highest mean token logprob, in their order; usage counts all four; logprobs shown
    only when asked."""
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": "ab", "max_tokens": 8, "seed": 9}
    every = client.completions.create(**kwargs, temperature=1.0, n=4, logprobs=0)
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in every.choices]
    best = sorted(sorted(range(4), key=lambda i: (-means[i], i))[:2])
    assert best != [0, 1]  # the first n would not do
    answer = client.completions.create(**kwargs, temperature=1.0, n=2, best_of=4)
    assert [c.text for c in answer.choices] == [every.choices[i].text for i in best]
    assert [c.index for c in answer.choices] == [0, 1]
    assert all(c.logprobs is None for c in answer.choices)
    assert answer.usage.completion_tokens == every.usage.completion_tokens
    shown = client.completions.create(**kwargs, temperature=1.0, n=2, best_of=4, logprobs=1)
    assert [c.text for c in shown.choices] == [c.text for c in answer.choices]
    assert all(len(c.logprobs.top_logprobs[0]) == 1 for c in shown.choices)


def test_echo_puts_the_prompt_and_its_logprobs_first(client: Any) -> None:
    """echo: each choice's text starts with its prompt; with logprobs the prompt's tokens come
    first, the first without a logprob, the rest equal to HF's log-softmax of the target over
    the prompt (within 1e-4, top alternatives too), then the generated tokens as without
    echo. Streamed, the prompt is the first chunk."""
    tokenizer = build_char_tokenizer(extra="{}")
    prompt = "def f(x):"
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    kwargs: dict[str, Any] = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    plain = client.completions.create(**kwargs, logprobs=2)
    echoed = client.completions.create(**kwargs, logprobs=2, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    lp = echoed.choices[0].logprobs
    head = len(ids)
    assert lp.tokens[:head] == [tokenizer.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.inference_mode():
        logp = target()(torch.tensor([ids])).logits[0].double().log_softmax(-1)
    for i in range(1, head):
        assert abs(lp.token_logprobs[i] - float(logp[i - 1, ids[i]])) < 1e-4
        want = {
            tokenizer.decode([int(t)]): float(v) for v, t in zip(*logp[i - 1].topk(2), strict=True)
        }
        got = lp.top_logprobs[i]
        assert got.keys() == want.keys() and all(abs(got[k] - want[k]) < 1e-4 for k in want)
    assert lp.token_logprobs[head:] == pytest.approx(plain.choices[0].logprobs.token_logprobs)
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = [
        c.choices[0].text
        for c in client.completions.create(**kwargs, echo=True, stream=True)
        if c.choices
    ]
    assert chunks[0] == prompt and "".join(chunks) == echoed.choices[0].text


def test_json_schema_outputs_always_parse(client: Any) -> None:
    texts: list[str] = []
    for seed in range(4):
        answer = client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "give json"}], max_tokens=80,
            temperature=1.0, n=5, seed=seed,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}},
        )  # fmt: skip
        texts += [c.message.content for c in answer.choices]
    assert len(texts) == 20
    for text in texts:
        value = json.loads(text)
        assert (
            set(value) == {"id", "ok"} and 0 <= value["id"] <= 99 and isinstance(value["ok"], bool)
        )
    chunks = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "x"}], max_tokens=80,
        temperature=0, response_format={"type": "json_object"}, stream=True,
    )  # fmt: skip
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(streamed), dict)
    regex = client.completions.create(
        model="tiny",
        prompt="n = ",
        max_tokens=10,
        temperature=0,
        extra_body={"regex": "[0-9]{2,4}"},
    )
    assert regex.choices[0].text.isdigit() and 2 <= len(regex.choices[0].text) <= 4
