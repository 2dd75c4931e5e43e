"""Ragged batches: every row commits its own accepted drafts, rows join a running generation,
and each row's output stays exactly what it is alone.

References are independent of the engine: HF ``generate`` on each prompt alone (greedy), and the
exact first/second-token distributions of the target (sampling, chi-squared at alpha = 0.01).
The cache layout (``flashspec.kv.layout.RowLayout``) is checked against a plain-list model of it.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch

from flashspec import (
    BanditConfig,
    FlashSpecConfig,
    SamplingConfig,
    SpeculativeEngine,
    TargetModel,
)
from flashspec.drafters import ModelDrafter, PromptLookupDrafter
from flashspec.engine.loop import RoundView
from flashspec.kv.layout import COMPACT_COLUMNS, RowLayout
from flashspec.models import Padding
from tests.helpers.chi2 import chi_squared
from tests.helpers.distribution import exact
from tests.helpers.distribution import models as sampling_models
from tests.helpers.greedy import (
    PROMPTS,
    check_against,
    check_equal,
    check_rows_without_eos,
    make_engine,
    models,
    tokenizer,
)
from tests.helpers.models import build_llama, perturbed_copy

MAX_NEW = 32


def lockstep(engine: SpeculativeEngine) -> SpeculativeEngine:
    """The same models and settings, rows in lockstep."""
    config = FlashSpecConfig(
        sampling=engine.config.sampling, bandit=engine.config.bandit, batching="lockstep"
    )
    return SpeculativeEngine(config, engine.drafters, engine.target)


def test_the_default_follows_the_batch_and_stays_exact() -> None:
    """With a single fixed arm, rounds of 2+ rows are chosen by the throughput model (draft
    length up to gamma, or plain decoding); a batch of one keeps the arm. Outputs stay exact."""
    target, draft = models("plain")
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
        [ModelDrafter(draft, name="draft")],
        TargetModel("tiny", model=target, tokenizer=tokenizer()),
    )
    assert engine.batch_policy is not None and engine.batch_policy.model.max_gamma == 4
    prompts = PROMPTS[:6]
    for _ in range(2):
        result = engine.generate(prompts, max_new_tokens=MAX_NEW)
        for prompt, tokens in zip(prompts, result.tokens, strict=True):
            check_equal("plain", prompt, tokens)
    assert any(label.endswith("/batch") for label in result.stats.arm_rounds)
    single = engine.generate(PROMPTS[0], max_new_tokens=MAX_NEW).stats.arm_rounds
    assert set(single) == {"draft/gamma"}
    fixed = FlashSpecConfig(bandit=BanditConfig(batches="fixed"))
    assert SpeculativeEngine(fixed, engine.drafters, engine.target).batch_policy is None


@pytest.mark.parametrize(("kind", "drafter"), [("plain", "model"), ("loopy", "lookup")])
def test_ragged_rows_equal_target_generate_and_beat_lockstep(kind: str, drafter: str) -> None:
    engine = make_engine(kind, drafter, gamma=4)
    assert engine.shiftable
    prompts = PROMPTS[:8]  # different lengths: left padding, and rows that fall behind
    ragged = engine.generate(prompts, max_new_tokens=MAX_NEW)
    ties = sum(check_equal(kind, p, t) for p, t in zip(prompts, ragged.tokens, strict=True))
    assert ties <= 1
    locked = lockstep(engine).generate(prompts, max_new_tokens=MAX_NEW)
    assert locked.tokens == ragged.tokens
    # Each row advances by its own acceptance, not the batch's slowest.
    assert ragged.stats.mean_tokens_per_round > locked.stats.mean_tokens_per_round
    assert ragged.stats.rounds < locked.stats.rounds


def test_sampled_ragged_rows_differ_from_lockstep_only_in_speed() -> None:
    """Same seed, same target: the ragged rule emits more per round; each row's text is its
    own draw, so rows are checked for validity (no -1, in vocabulary) here and for their
    distribution in ``test_tokens_inside_mixed_batches_follow_target``."""
    engine = make_engine("plain", "model", gamma=4, temperature=0.8)
    result = engine.generate(PROMPTS[:6], max_new_tokens=MAX_NEW, seed=3, ignore_eos=True)
    assert all(len(t) == MAX_NEW for t in result.tokens)
    assert all(0 <= x < len(tokenizer()) for t in result.tokens for x in t)


def test_cache_stays_near_the_longest_row() -> None:
    """Dead slots are packed away: the target's cache never grows far past its longest row."""
    engine = make_engine("plain", "model", gamma=8)
    widths: list[tuple[int, int]] = []

    def watch(view: RoundView) -> None:
        rows = engine.target.rows
        if rows is not None and rows.lengths:
            widths.append((engine.target.cached, max(rows.lengths)))

    engine.before_round.append(watch)
    prompts = PROMPTS[:6]
    result = engine.generate(prompts, max_new_tokens=96, ignore_eos=True)
    check_rows_without_eos(models("plain")[0], prompts, result.tokens, 96)
    # Packed at COMPACT_COLUMNS dead columns beyond the longest row; a round adds at most 9.
    assert max(width - longest for width, longest in widths) < COMPACT_COLUMNS + 9
    assert any(width > longest for width, longest in widths), "no dead slot ever: test is moot"


def test_rows_join_a_running_generation() -> None:
    engine = make_engine("plain", "model", gamma=4)
    first, later = PROMPTS[:2], PROMPTS[2:5]
    stream = engine.stream(first, max_new_tokens=MAX_NEW)
    assert stream.joinable
    outputs: dict[int, list[int]] = {}
    joined: dict[int, str] = {}
    rounds = 0
    for chunk in stream:
        outputs.setdefault(chunk.row, []).extend(chunk.token_ids)
        if chunk.row == 0:
            rounds += 1
            if rounds <= len(later):  # one joins after each of the first rounds
                prompt = later[rounds - 1]
                joined[stream.join(tokenizer()(prompt)["input_ids"], MAX_NEW)] = prompt
    assert stream.result is not None and not stream.joinable
    assert sorted(joined) == [2, 3, 4]
    for row, prompt in [*enumerate(first), *joined.items()]:
        check_equal("plain", prompt, outputs[row])
        assert stream.result.tokens[row] == outputs[row]


def test_a_short_prompt_joining_a_long_batch_reads_only_its_own_columns() -> None:
    """A join reads its prompt at the prompt's length, not the running batch's width (its
    cache is padded in front to that width), and the row is still its prompt's own output."""
    engine = make_engine("plain", "model", gamma=4)
    reads: list[int] = []
    target = engine.target
    feed = target.feed

    def spy(tokens: Any, padding: Any, *args: Any, **kwargs: Any) -> Any:
        reads.append(int(tokens.shape[1]))
        return feed(tokens, padding, *args, **kwargs)

    long_prompt, short = PROMPTS[0] * 3, "x = 1"
    stream = engine.stream([long_prompt], max_new_tokens=MAX_NEW)
    outputs: dict[int, list[int]] = {}
    row = None
    for chunk in stream:
        outputs.setdefault(chunk.row, []).extend(chunk.token_ids)
        if row is None:
            target.feed = spy  # type: ignore[method-assign]
            ids = tokenizer()(short)["input_ids"]
            row = stream.join(ids, MAX_NEW)
    del target.feed
    assert row is not None
    assert reads and reads[0] == len(ids) - 1, (reads, len(ids))
    check_equal("plain", short, outputs[row])
    check_equal("plain", long_prompt, outputs[0])


def test_joining_after_every_row_finished_and_cancelled_before_admission() -> None:
    engine = make_engine("plain", "model", gamma=3)
    stream = engine.stream(PROMPTS[0], max_new_tokens=2)
    finish: dict[int, str | None] = {}
    outputs: dict[int, list[int]] = {}
    for chunk in stream:
        outputs.setdefault(chunk.row, []).extend(chunk.token_ids)
        if chunk.finish_reason is not None:
            finish[chunk.row] = chunk.finish_reason
            if chunk.row == 0:
                # The only row is done; two join, one is cancelled before its first round.
                late = stream.join(PROMPTS[5], MAX_NEW)
                gone = stream.join("zz", MAX_NEW)
                stream.cancel(gone)
    assert finish[gone] == "cancelled" and outputs[gone] == []
    check_equal("plain", PROMPTS[5], outputs[late])


def test_join_refuses_bad_rows_and_unshiftable_models() -> None:
    engine = make_engine("plain", "model", gamma=3)
    stream = engine.stream(PROMPTS[0], max_new_tokens=4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        stream.join("abc", 0)
    with pytest.raises(TypeError, match="one prompt"):
        stream.join([["a"]], 4)  # type: ignore[list-item]
    for _ in stream:
        pass
    with pytest.raises(RuntimeError, match="ended"):
        stream.join("abc", 4)

    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=len(tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
    )  # fmt: skip
    mistral: Any = MistralForCausalLM(config).eval()
    windowed = SpeculativeEngine(
        FlashSpecConfig(),
        [PromptLookupDrafter()],
        TargetModel("mistral", model=mistral, tokenizer=tokenizer()),
    )
    assert not windowed.shiftable  # sliding-window layers count dead columns: lockstep
    stream = windowed.stream(["ab", "abcd"], max_new_tokens=4)
    assert not stream.joinable
    with pytest.raises(RuntimeError, match="sliding-window or recurrent"):
        stream.join("abc", 4)


def test_gpt2_ragged_rows_equal_generate() -> None:
    """Learned absolute positions: a row's k-th token gets position k whatever its column."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(8)
    config = GPT2Config(
        vocab_size=len(tokenizer()), n_embd=64, n_layer=2, n_head=4, n_positions=256
    )
    target: Any = GPT2LMHeadModel(config).eval()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4), bandit=BanditConfig(batches="fixed")),
        [ModelDrafter(perturbed_copy(target, 0.05, seed=9), name="draft")],
        TargetModel("gpt2", model=target, tokenizer=tokenizer()),
    )
    prompts = PROMPTS[:5]
    result = engine.generate(prompts, max_new_tokens=24, ignore_eos=True)
    check_rows_without_eos(target, prompts, result.tokens, 24)


# -- sampling inside batches of different prompt lengths ----------------------------------------

PROMPT = [1, 5, 7, 3, 9, 5, 7]  # test_engine_distribution's prompt, whose exact law is known
NEIGHBOURS = [[2, 4], [3, 3, 8, 1, 6, 2, 2, 9, 10, 4, 5], [7], [6, 1, 1, 8, 2, 3, 4, 9, 11]]


@pytest.mark.parametrize("gamma", [2, 4])
def test_tokens_inside_mixed_batches_follow_target(gamma: int) -> None:
    """The measured row sits among rows of other lengths, each accepting its own count, so its
    second token often comes from a round after a ragged commit (dead slots, moved rows)."""
    target, draft = sampling_models()
    engine = SpeculativeEngine(
        FlashSpecConfig(
            sampling=SamplingConfig(gamma=gamma, temperature=1.0),
            bandit=BanditConfig(batches="fixed"),
        ),
        [ModelDrafter(draft)],
        TargetModel(model=target),
    )
    first: Counter[int] = Counter()
    second: Counter[int] = Counter()
    late = 0
    for call in range(300):
        prompts = [*NEIGHBOURS[: call % 4], PROMPT, *NEIGHBOURS[call % 4 :]]
        row = call % 4
        stream = engine.stream(prompts, max_new_tokens=gamma + 3, ignore_eos=True, seed=call)
        tokens: list[int] = []
        chunks = 0
        for chunk in stream:
            if chunk.row == row:
                chunks += 1
                tokens.extend(chunk.token_ids)
                if len(tokens) >= 2:
                    break
        late += chunks > 1
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    p_first, p_second = exact(1.0, 1.0)
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name}: chi2 {stat:.1f} >= {critical} ({sorted(counts.items())})"
    assert late > 50, "the second token rarely came from a later round: the test is moot"


# -- the layout itself ----------------------------------------------------------------------------


def test_row_layout_against_a_list_model() -> None:
    """Random feeds, keeps and selections: ``RowLayout`` agrees with per-row lists of which
    columns hold which token, and packing keeps every row's tokens in order."""
    rng = torch.Generator().manual_seed(0)
    layout = RowLayout()
    layout.start(4, torch.device("cpu"))
    # model: per row, the column of each of its tokens; width
    cols: list[list[int]] = [[] for _ in range(4)]
    width = 0
    for _ in range(300):
        action = int(torch.randint(0, 3, (1,), generator=rng))
        rows = len(cols)
        if action == 0 or width == 0:
            count = int(torch.randint(1, 6, (1,), generator=rng))
            dead = [int(torch.randint(0, count + 1, (1,), generator=rng)) for _ in range(rows)]
            positions, new, _ = layout.plan(dead, count, torch.device("cpu"))
            for b in range(rows):
                expected = list(range(len(cols[b]), len(cols[b]) + count - dead[b]))
                assert positions[b, dead[b] :].tolist() == expected
                cols[b] += [width + j for j in range(dead[b], count)]
            layout.append(new, [count - d for d in dead])
            width += count
        elif action == 1:
            counts = [int(torch.randint(0, len(c) + 1, (1,), generator=rng)) for c in cols]
            crop = layout.keep(counts)
            cols = [c[:n] for c, n in zip(cols, counts, strict=True)]
            end = max((c[-1] + 1 for c in cols if c), default=0)
            assert crop == width - end
            layout.crop(crop)
            width -= crop
        elif rows > 1:
            keep = sorted(set(torch.randint(0, rows, (rows - 1,), generator=rng).tolist()))
            crop = layout.select(torch.tensor(keep), keep)
            cols = [cols[i] for i in keep]
            end = max((c[-1] + 1 for c in cols if c), default=0)
            assert crop == width - end
            layout.crop(crop)
            width -= crop
        plan = layout.compaction()
        longest = max((len(c) for c in cols), default=0)
        assert (plan is not None) == (width - longest >= COMPACT_COLUMNS)
        if plan is not None:
            source, width = plan
            for b, c in enumerate(cols):
                assert source[b, width - len(c) :].tolist() == c  # in order, at the right end
            cols = [list(range(width - len(c), width)) for c in cols]
        assert layout.width == width and layout.lengths == [len(c) for c in cols]
        assert layout.alive is not None
        for b, c in enumerate(cols):
            assert torch.nonzero(layout.alive[b]).view(-1).tolist() == c


def test_llama_draft_of_other_depth_in_ragged_batches() -> None:
    """A drafter whose cache lags the target's (it is not chosen every round) stays exact."""
    target = build_llama(0, init_range=0.3)
    drafters = [ModelDrafter(perturbed_copy(target, 0.02, seed=1), name="d"), PromptLookupDrafter()]
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(batches="fixed")),
        drafters,
        TargetModel("tiny", model=target, tokenizer=tokenizer()),
    )
    prompts = PROMPTS[8:14]
    result = engine.generate(prompts, max_new_tokens=MAX_NEW)
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        ids = torch.tensor([tokenizer()(prompt)["input_ids"]])
        with torch.inference_mode():
            out = target.generate(ids, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0)
        ref = out[0, ids.shape[1] :].tolist()
        eos = target.generation_config.eos_token_id
        check_against(target, prompt, tokens, ref[: ref.index(eos) + 1] if eos in ref else ref)
    assert len(result.stats.arm_rounds) == 2, "both drafters should have run"


def test_a_cache_emptied_then_resized_takes_the_new_batch() -> None:
    """A cache whose rows all lost their tokens keeps empty layer tensors of the old batch size;
    after rows leave or join, the next forward must not meet them."""
    target, _ = models("plain")
    lm = TargetModel("tiny", model=target, tokenizer=tokenizer())
    lm.reset()
    tokens = torch.tensor([[3, 4, 5], [6, 7, 8]])
    padding = Padding(torch.tensor([0, 0]))
    lm.feed(tokens, padding)
    lm.keep_rows([0, 0])  # every row loses its tokens: no column left
    assert lm.cached == 0
    lm.select_rows(torch.tensor([1]))
    one = lm.feed(tokens[1:], Padding(torch.tensor([0])))
    with torch.inference_mode():
        want = target(tokens[1:]).logits[:, -1:]
    assert torch.allclose(one, want, atol=1e-5)
    lm.keep_rows([0])
    lm.add_rows(tokens, Padding(torch.tensor([0, 0])))  # two rows join an empty cache
    assert lm.feed(torch.cat([tokens[1:], tokens]), Padding(torch.tensor([0, 0, 0]))).shape[0] == 3


@pytest.mark.parametrize("drafter", ["model", "lookup"])
def test_rows_with_one_prompt_read_it_once_and_generate_as_alone(drafter: str) -> None:
    """n choices of a prompt (rows 0, 2 and 3 below) share its prefill: the target's first
    forward reads each distinct prompt once (but its last token), and every row's output is
    still its prompt's own greedy continuation; sampled with a seed, the output equals the
    same call with the sharing off."""
    engine = make_engine("loopy", drafter, 4)
    target = engine.target
    shapes: list[tuple[int, ...]] = []
    forward = target.model.forward

    def spy(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        shapes.append(tuple(ids.shape))
        return forward(*args, **kwargs)

    target.model.forward = spy
    try:
        prompts = [PROMPTS[0], PROMPTS[3], PROMPTS[0], PROMPTS[0]]
        result = engine.generate(prompts, max_new_tokens=MAX_NEW, ignore_eos=True)
    finally:
        del target.model.forward
    width = max(len(tokenizer()(p)["input_ids"]) for p in prompts)
    assert shapes[0] == (2, width - 1)  # two distinct prompts, all but their last token
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        check_equal("loopy", prompt, tokens)
    sampled = make_engine("loopy", drafter, 4, temperature=0.8)
    shared = sampled.generate(prompts, max_new_tokens=12, ignore_eos=True, seed=3).tokens
    sampled._share_prompts = lambda gen: None  # type: ignore[method-assign]
    alone = sampled.generate(prompts, max_new_tokens=12, ignore_eos=True, seed=3).tokens
    assert shared == alone
