"""Engine API: the user-facing forms, stopping, streaming, edge cases and error messages."""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import torch

import flashspec
from flashspec import (
    TRITON_AVAILABLE,
    BanditConfig,
    FlashSpecConfig,
    ModelDrafter,
    PromptLookupDrafter,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
    UCB1Selector,
    load_drafters,
)
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy

PROMPT = "def quicksort(arr):"


@cache
def tokenizer() -> Any:
    return build_char_tokenizer()


@cache
def pair() -> tuple[Any, Any]:
    target = build_llama(0, init_range=0.3)
    return target, perturbed_copy(target, 0.02, seed=1)


def engine(gamma: int = 3, max_positions: int | None = None, **sampling: Any) -> SpeculativeEngine:
    target, draft = pair()
    if max_positions is not None:
        target = build_llama(0, init_range=0.3, max_positions=max_positions)
        draft = perturbed_copy(target, 0.02, seed=1)
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=gamma, **sampling))
    target_model = TargetModel("tiny", model=target, tokenizer=tokenizer())
    return SpeculativeEngine(config, [ModelDrafter(draft, name="draft")], target_model)


def greedy_reference(prompt_ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = pair()[0].generate(
            torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=n, pad_token_id=0
        )
    tokens: list[int] = out[0, len(prompt_ids) :].tolist()
    return tokens


def test_issue_example_form() -> None:
    target, draft = pair()
    eng = SpeculativeEngine.from_pretrained(
        target="tiny-target",
        drafters=["tiny-draft"],
        config=FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
        models={"tiny-target": target, "tiny-draft": draft},
        tokenizer=tokenizer(),
    )
    result = eng.generate(PROMPT, max_new_tokens=16)
    assert isinstance(result.text, str) and len(result.tokens[0]) <= 16
    assert result.text == tokenizer().decode(result.tokens[0], skip_special_tokens=True)
    stats = result.stats
    assert stats.rounds > 0 and stats.new_tokens == len(result.tokens[0])
    assert 0.0 <= stats.acceptance_rate <= 1.0 and stats.mean_tokens_per_round >= 1.0
    assert stats.tokens_per_second > 0 and stats.time_total >= stats.time_draft + stats.time_verify
    assert set(stats.as_dict()) >= {
        "rounds",
        "drafted",
        "accepted",
        "time_other",
        "tokens_per_second",
    }
    assert "tok/s" in str(stats)


def test_explicit_form_of_the_earlier_library() -> None:
    target, draft = pair()
    config = FlashSpecConfig(
        sampling=SamplingConfig(gamma=4, temperature=0.0), bandit=BanditConfig(window_size=50)
    )
    target_model = TargetModel("tiny-target", "cpu", torch.float32, model=target)
    drafters = load_drafters(
        ["tiny-draft", "prompt_lookup"],
        device="cpu",
        dtype=torch.float32,
        temperature=0.0,
        models={"tiny-draft": draft},
    )
    selector = UCB1Selector(n_arms=len(drafters), window_size=50)
    eng = SpeculativeEngine(config, drafters, target_model, selector)
    ids = torch.tensor([tokenizer()(PROMPT)["input_ids"]])
    result = eng.generate(ids, max_new_tokens=12)
    assert result.output_ids.shape == (1, 12)
    assert result.output_ids[0].tolist() == greedy_reference(ids[0].tolist(), 12)
    assert result.texts is None  # no tokenizer was given
    assert isinstance(TRITON_AVAILABLE, bool)


def test_output_ids_pad_with_minus_one_after_a_row_ends() -> None:
    ids = tokenizer()(PROMPT)["input_ids"]
    first = greedy_reference(ids, 1)[0]
    eng = engine()
    # Row 0 ends at once (its first token is EOS); row 1 (a different prompt) continues.
    result = eng.generate([PROMPT, "x = 1"], max_new_tokens=8, eos_token_id=first)
    assert result.tokens[0] == [first] and result.finish_reasons[0] == "eos"
    assert result.output_ids[0].tolist() == [first] + [-1] * (result.output_ids.shape[1] - 1)
    assert len(result.tokens[1]) > 1


def test_eos_list_and_ignore_eos() -> None:
    ids = tokenizer()(PROMPT)["input_ids"]
    ref = greedy_reference(ids, 10)
    eng = engine()
    stopped = eng.generate(PROMPT, max_new_tokens=10, eos_token_id=[999_999, ref[3]])
    assert stopped.tokens[0] == ref[: ref.index(ref[3]) + 1]
    assert stopped.finish_reasons == ["eos"]
    full = eng.generate(PROMPT, max_new_tokens=10, eos_token_id=ref[3], ignore_eos=True)
    assert full.tokens[0] == ref and full.finish_reasons == ["length"]


def test_max_new_tokens_zero() -> None:
    result = engine().generate([PROMPT, "ab"], max_new_tokens=0)
    assert result.output_ids.shape == (2, 0)
    assert result.tokens == [[], []] and result.texts == ["", ""]
    assert result.stats.rounds == 0 and result.stats.tokens_per_second == 0.0


def test_empty_prompt_starts_from_bos() -> None:
    result = engine().generate("", max_new_tokens=6)
    assert result.tokens[0] == greedy_reference([1], 6)  # LlamaConfig bos_token_id = 1
    assert engine().generate([], max_new_tokens=6).tokens[0] == result.tokens[0]


def test_empty_prompt_without_bos_is_a_clear_error() -> None:
    eng = engine()
    model: Any = eng.target.model
    model.generation_config.bos_token_id = None
    model.config.bos_token_id = None
    no_bos = build_char_tokenizer()
    no_bos.bos_token = None
    eng.target.tokenizer = no_bos
    with pytest.raises(ValueError, match="empty and the target defines no bos_token_id"):
        eng.generate("", max_new_tokens=4)


def test_stop_string_split_across_rounds() -> None:
    eng = engine(gamma=3)
    chunks = list(eng.stream(PROMPT, max_new_tokens=40, ignore_eos=True))
    text = "".join(c.text for c in chunks)
    # Pick a round boundary b such that text[b-2 : b+2] first occurs there.
    boundary = None
    offset = 0
    for chunk in chunks[:-1]:
        offset += len(chunk.text)
        window = text[offset - 2 : offset + 2]
        if offset >= 2 and len(window) == 4 and text.find(window) == offset - 2:
            boundary = offset
            break
    assert boundary is not None, "no usable round boundary"
    stop = text[boundary - 2 : boundary + 2]
    result = eng.generate(PROMPT, max_new_tokens=40, ignore_eos=True, stop=[stop, "@@never@@"])
    assert result.finish_reasons == ["stop"]
    assert result.text == text[: boundary + 2] and result.text.endswith(stop)
    assert len(result.tokens[0]) == boundary + 2  # character tokenizer: one token per character


def test_stream_yields_text_as_rounds_commit() -> None:
    eng = engine(gamma=2)
    stream = eng.stream(PROMPT, max_new_tokens=20, ignore_eos=True)
    chunks = list(stream)
    assert stream.result is not None and len(chunks) == stream.result.stats.rounds
    assert "".join(c.text for c in chunks) == stream.result.text
    assert [t for c in chunks for t in c.token_ids] == stream.result.tokens[0]
    assert chunks[-1].finish_reason == "length"
    assert (
        "".join(eng.stream(PROMPT, max_new_tokens=20, ignore_eos=True).text()) == stream.result.text
    )


def test_interleaved_streams_are_refused() -> None:
    eng = engine()
    first = iter(eng.stream(PROMPT, max_new_tokens=20, ignore_eos=True))
    next(first)
    eng.generate("abc", max_new_tokens=3)
    with pytest.raises(RuntimeError, match="one generation at a time"):
        list(first)


def test_context_limit_truncates_and_long_prompt_is_refused() -> None:
    eng = engine(max_positions=30)
    ids = tokenizer()(PROMPT)["input_ids"]  # 19 tokens
    result = eng.generate(PROMPT, max_new_tokens=50, ignore_eos=True)
    assert len(ids) + len(result.tokens[0]) == 30
    assert result.finish_reasons == ["context_limit"]
    with pytest.raises(ValueError, match="context limit is 30"):
        eng.generate("x" * 30, max_new_tokens=5)


def test_right_padded_tensor_prompt_with_attention_mask() -> None:
    tok = tokenizer()
    a, b = tok(PROMPT)["input_ids"], tok("x = 1")["input_ids"]
    ids = torch.tensor([a, b + [0] * (len(a) - len(b))])
    mask = torch.tensor([[1] * len(a), [1] * len(b) + [0] * (len(a) - len(b))])
    result = engine().generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=8, ignore_eos=True
    )
    assert result.tokens[1] == greedy_reference(b, 8)


def test_typical_acceptance_runs() -> None:
    # Lossy by design: only check it produces a full, valid generation.
    eng = engine(gamma=4, temperature=0.8, method="typical", seed=0)
    result = eng.generate([PROMPT, "ab"], max_new_tokens=12, ignore_eos=True)
    assert [len(t) for t in result.tokens] == [12, 12]
    assert all(0 <= t < 58 for row in result.tokens for t in row)


def test_sampling_is_reproducible_with_a_seed() -> None:
    eng = engine(gamma=3, temperature=1.0, top_k=20, top_p=0.9)
    a = eng.generate(PROMPT, max_new_tokens=12, seed=123, ignore_eos=True)
    b = eng.generate(PROMPT, max_new_tokens=12, seed=123, ignore_eos=True)
    assert a.tokens == b.tokens


def test_vocabulary_mismatch_is_refused() -> None:
    target, _ = pair()
    small = build_llama(5, vocab_size=30)
    with pytest.raises(ValueError, match="vocabulary of 30 tokens but target 'tiny' has 58"):
        SpeculativeEngine(
            FlashSpecConfig(), [ModelDrafter(small)], TargetModel("tiny", model=target)
        )
    # Same size, different token table: caught through the tokenizers.
    other = build_char_tokenizer()
    other.add_tokens(["@"])  # a different table (size checked separately above)
    swapped = TargetModel("tiny", model=target, tokenizer=tokenizer())
    draft = ModelDrafter(pair()[1], name="draft", tokenizer=other)
    with pytest.raises(ValueError, match="different tokens"):
        SpeculativeEngine(FlashSpecConfig(), [draft], swapped)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gamma": 0}, r"SamplingConfig.gamma must be an integer >= 1, got 0; try gamma=4"),
        ({"gamma": 2.5}, r"SamplingConfig.gamma must be an integer >= 1"),
        ({"temperature": -0.1}, r"SamplingConfig.temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, r"SamplingConfig.temperature must be a finite number"),
        ({"top_p": 0.0}, r"SamplingConfig.top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"SamplingConfig.top_p must be in \(0, 1\].*try top_p=0.9"),
        ({"top_k": -1}, r"SamplingConfig.top_k must be an integer >= 0"),
        ({"method": "nucleus"}, r"SamplingConfig.method must be one of"),
        ({"residual": "asm"}, r"SamplingConfig.residual must be one of"),
        ({"method": "rejection"}, r"needs temperature > 0"),
        ({"method": "greedy", "temperature": 0.5}, r"method='greedy' but temperature=0.5"),
        (
            {"confidence_threshold": 2.0},
            r"confidence_threshold must be None \(off\) or in \[0, 1\]",
        ),
    ],
)
def test_bad_sampling_config_values(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingConfig(**kwargs)


def test_other_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"BanditConfig\.window_size"):
        BanditConfig(window_size=0)
    with pytest.raises(ValueError, match=r"FlashSpecConfig\.dtype"):
        FlashSpecConfig(dtype="int8")
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 0"):
        engine().generate(PROMPT, max_new_tokens=-1)
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        SpeculativeEngine(
            FlashSpecConfig(), [PromptLookupDrafter()], TargetModel(model=pair()[0])
        ).generate([1, 2], stop="x")
    with pytest.raises(ValueError, match="outside"):
        engine().generate([[1, 2, 500]], max_new_tokens=2)
    with pytest.raises(ValueError, match="n_arms"):
        UCB1Selector(n_arms=0)
    with pytest.raises(TypeError, match="list of names"):
        load_drafters("prompt_lookup")


def test_package_exports_load_the_engine_lazily() -> None:
    assert set(flashspec.__all__) == {*flashspec._EXPORTS, "__version__"}
    code = (
        "import sys, flashspec\n"
        "assert 'torch' not in sys.modules\n"
        "assert flashspec.SpeculativeEngine.__name__ == 'SpeculativeEngine'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("name", [None, "demo"])
def test_missing_demo_pair_is_a_clear_error(
    name: str | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashspec.loading.pretrained

    assert flashspec.resolve_model_path("/some/dir") == "/some/dir"
    # An installation whose package data lost the pair (e.g. a trimmed sdist build).
    monkeypatch.setattr(flashspec.loading.pretrained, "DEMO_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match=r"demo .*target="):
        SpeculativeEngine.from_pretrained(target=name)


def test_prompt_lookup_drafts_gamma_tokens_of_repetitive_text() -> None:
    """The latest match of a periodic suffix is one period back: drafting from it alone would
    propose one period whatever gamma is."""
    from flashspec.drafters import DraftContext
    from flashspec.models import Padding
    from flashspec.sampling import Warper

    tokens = torch.tensor([[9, 8, 7] + [5, 6] * 10])
    ctx = DraftContext(tokens, Padding(torch.zeros(1, dtype=torch.int64)), Warper(0.0), None)
    drafts = PromptLookupDrafter().propose(ctx, 10).tokens
    assert drafts.tolist() == [[5, 6] * 5]
    # Without a match that long, the earliest match gives the longest continuation.
    short = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 9, 1, 2]])
    ctx = DraftContext(short, Padding(torch.zeros(1, dtype=torch.int64)), Warper(0.0), None)
    assert PromptLookupDrafter().propose(ctx, 10).tokens.tolist() == [[3, 4, 1, 2, 3, 9, 1, 2]]


# -- per-row limits and stops, cancellation, per-call sampling (what a server needs) ------------


def test_max_new_tokens_per_row() -> None:
    prompts = [PROMPT, "x = 1", "abc"]
    eng = engine(gamma=4)
    result = eng.generate(prompts, max_new_tokens=[3, 11, 0], ignore_eos=True)
    assert [len(t) for t in result.tokens] == [3, 11, 0]
    assert result.finish_reasons == ["length", "length", "length"]
    for prompt, tokens in zip(prompts[:2], result.tokens, strict=False):
        assert tokens == greedy_reference(tokenizer()(prompt)["input_ids"], len(tokens))
    with pytest.raises(ValueError, match="one integer >= 0 per prompt row"):
        eng.generate(prompts, max_new_tokens=[3, 4])
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate(prompts, max_new_tokens=[3, -1, 2])


def test_stop_strings_per_row() -> None:
    eng = engine(gamma=3)
    full = eng.generate([PROMPT, PROMPT], max_new_tokens=24, ignore_eos=True).texts
    assert full is not None and len(full[0]) > 6
    stop = full[0][4:6]
    result = eng.generate([PROMPT, PROMPT], max_new_tokens=24, ignore_eos=True, stop=[[stop], None])
    assert result.texts is not None
    assert result.finish_reasons == ["stop", "length"]
    assert result.texts[0] == full[0][: full[0].index(stop) + len(stop)]
    assert result.texts[1] == full[1]
    with pytest.raises(ValueError, match="per row needs 2 entries"):
        eng.generate([PROMPT, PROMPT], stop=[["a"], None, ["b"]])
    with pytest.raises(ValueError, match="non-empty string"):
        eng.generate([PROMPT, PROMPT], stop=[[""], None])


def test_cancel_drops_a_row_and_the_others_continue() -> None:
    prompts = [PROMPT, "x = 1", "abc"]
    eng = engine(gamma=2)
    stream = eng.stream(prompts, max_new_tokens=20, ignore_eos=True)
    finished: dict[int, str] = {}
    rounds = 0
    for chunk in stream:
        if chunk.finish_reason is not None:
            finished[chunk.row] = chunk.finish_reason
        if chunk.row == 2 and rounds == 0:
            stream.cancel(1)
            stream.cancel(1)  # twice is harmless
            rounds += 1
    assert stream.result is not None
    assert finished == {0: "length", 1: "cancelled", 2: "length"}
    assert stream.result.finish_reasons == ["length", "cancelled", "length"]
    lengths = [len(t) for t in stream.result.tokens]
    assert lengths[0] == lengths[2] == 20 and 0 < lengths[1] < 20
    for prompt, tokens in zip(prompts, stream.result.tokens, strict=True):
        assert tokens == greedy_reference(tokenizer()(prompt)["input_ids"], 20)[: len(tokens)]
    with pytest.raises(TypeError, match="row must be an int"):
        stream.cancel("1")  # type: ignore[arg-type]


def test_cancel_every_row_ends_the_stream() -> None:
    stream = engine().stream([PROMPT, "abc"], max_new_tokens=50, ignore_eos=True)
    reasons = []
    for chunk in stream:
        stream.cancel(0)
        stream.cancel(1)
        if chunk.finish_reason:
            reasons.append(chunk.finish_reason)
    assert reasons == ["cancelled", "cancelled"]
    assert stream.result is not None and all(len(t) < 50 for t in stream.result.tokens)


def test_sampling_override_per_call() -> None:
    eng = engine(gamma=3)  # greedy config
    hot = SamplingConfig(gamma=2, temperature=1.0)
    a = eng.generate(PROMPT, max_new_tokens=16, sampling=hot, seed=3, ignore_eos=True)
    b = eng.generate(PROMPT, max_new_tokens=16, sampling=hot, seed=3, ignore_eos=True)
    greedy = eng.generate(PROMPT, max_new_tokens=16, ignore_eos=True)
    ref = greedy_reference(tokenizer()(PROMPT)["input_ids"], 16)
    assert a.tokens == b.tokens  # seeded sampling: reproducible
    assert greedy.tokens[0] == ref  # the engine's own config is untouched
    assert a.tokens[0] != ref  # sampled at temperature 1 from a random model: not the argmax
    assert a.stats.drafted <= 2 * a.stats.rounds  # the call's gamma, not the engine's
    with pytest.raises(TypeError, match="sampling must be a SamplingConfig"):
        eng.generate(PROMPT, sampling={"temperature": 1.0})  # type: ignore[arg-type]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_each_row_has_its_own_context_limit(arch: str) -> None:
    """A short row batched with one near the context limit is not cut at (limit - the longest
    prompt): each row stops at its own limit. GPT-2's learned positions also check that the
    long row's columns past its limit index no missing position embedding."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if arch == "llama":
        model = build_llama(4, max_positions=48)
    else:
        torch.manual_seed(4)
        config = GPT2Config(vocab_size=58, n_positions=48, n_embd=32, n_layer=2, n_head=2)
        model = GPT2LMHeadModel(config).eval()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
        [ModelDrafter(perturbed_copy(model, 0.02, seed=1))],
        TargetModel(model=model),
    )
    long_row, short_row = [7] * 46, [5, 9, 11, 13]
    single_short = engine.generate([short_row], max_new_tokens=16, ignore_eos=True)
    single_long = engine.generate([long_row], max_new_tokens=16, ignore_eos=True)
    batch = engine.generate([long_row, short_row], max_new_tokens=16, ignore_eos=True)
    assert batch.finish_reasons == ["context_limit", "length"]
    assert batch.tokens[1] == single_short.tokens[0] and len(batch.tokens[1]) == 16
    assert batch.tokens[0] == single_long.tokens[0] and len(batch.tokens[0]) == 48 - 46


def test_before_round_probes_leave_the_generation_unchanged() -> None:
    """A hook that probes every round with the target drafting for itself: each probe accepts
    every draft (greedy), and the output equals the same generation without the hook."""
    from flashspec.engine import RoundView

    target, draft = pair()
    eng = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)),
        [ModelDrafter(draft)],
        TargetModel(model=target, tokenizer=tokenizer()),
    )
    plain = eng.generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens[0]
    probe = ModelDrafter(target)
    seen: list[list[float]] = []

    def hook(view: RoundView) -> None:
        if view.prefilled and view.room > 3:
            _, acceptance = view.probe(probe, 3)
            seen.append(acceptance.probability[0].tolist())

    eng.before_round.append(hook)
    probe.reset()  # not one of the engine's drafters: its cache is the hook's to start
    probed = eng.generate(PROMPT, max_new_tokens=24, ignore_eos=True).tokens[0]
    assert probed == plain
    assert seen and all(p == [1.0, 1.0, 1.0] for p in seen)


def test_profiling_records_spans_only_while_active() -> None:
    from flashspec.profiling import Spans, profiling

    eng = engine()
    spans = Spans()
    eng.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    assert not spans.calls  # nothing recorded outside the block
    with profiling(spans):
        result = eng.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    rounds = result.stats.rounds
    assert spans.calls[("draft",)] == rounds - 1 or spans.calls[("draft",)] == rounds
    assert spans.calls[("accept",)] == rounds
    assert spans.calls[("target_forward",)] >= rounds
    assert spans.calls[("draft", "forward")] >= spans.calls[("draft",)]
    assert all(seconds >= 0 for seconds in spans.exclusive.values())
    with profiling(spans), pytest.raises(RuntimeError, match="already active"), profiling(Spans()):
        pass
