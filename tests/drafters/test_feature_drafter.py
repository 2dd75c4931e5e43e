"""Drafts that read the target's hidden states (``flashspec.feature_drafter``): the states the
target keeps are its own, and the engine stays exact with them.

References: an independent full forward of the target over the committed tokens (its final
hidden states), HF ``generate`` (greedy identity, a padded batch too), and the exact first and
second-token distributions (``tests.helpers.distribution``) under the chi-squared test.
"""

from __future__ import annotations

from pathlib import Path
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
from flashspec.drafters import ModelDrafter
from flashspec.engine.loop import RoundView
from flashspec.feature_drafter import FeatureDrafter
from flashspec.models import UnsupportedModelError
from flashspec.shared_head import (
    build_shared_head_draft,
    draft_input,
    load_shared_head_draft,
    own_state,
    save_shared_head_draft,
)
from tests.helpers.chi2 import chi_squared
from tests.helpers.distribution import PROMPT, VOCAB, exact, models, sample_two
from tests.helpers.models import build_llama

SUBSET = [0, 2, 3, 5, 8, 11]


def feature_draft(target: torch.nn.Module, ids: list[int], seed: int = 3) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build_shared_head_draft(target, ids, layers=1, reads="features").eval()


def hf_greedy(target: Any, ids: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        out = target.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                              pad_token_id=0)  # fmt: skip
    tokens: list[int] = out[0, len(ids) :].tolist()
    eos = target.generation_config.eos_token_id
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def states_checker(engine: SpeculativeEngine, target: Any) -> tuple[Any, list[int]]:
    """A ``before_round`` hook asserting that the states the target keeps (every committed
    column but the newest) equal a fresh forward over each row's real tokens, and the count
    of rounds it checked."""
    checked = [0]

    def check(view: RoundView) -> None:
        counts = engine.target.feature_counts(view.padding)
        if counts is None:
            return
        known = view.tokens.shape[1] - 1
        index = torch.arange(known).expand(view.tokens.shape[0], -1)
        kept = engine.target.gather_features(index, view.padding)  # by each row's own index
        for row, left in enumerate(view.padding.lefts):
            assert counts[row] >= known - left
            if known - left < 1:
                continue  # a one-token prompt that joined: no state to read yet
            with torch.inference_mode():
                reference = target.model(input_ids=view.tokens[row : row + 1, left:known])
            want = reference.last_hidden_state[0]
            torch.testing.assert_close(kept[row, : known - left], want, atol=1e-4, rtol=1e-4)
        checked[0] += 1

    return check, checked


@pytest.mark.parametrize("batching", ["ragged", "lockstep"])
def test_the_states_the_target_keeps_are_its_own_at_every_round(batching: Any) -> None:
    """Each round, the states the drafter reads (every committed column but the newest) equal
    a fresh full forward of the target over each row's committed tokens."""
    target = build_llama(0, init_range=0.3)
    vocab = target.config.vocab_size
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), batching=batching),
        [FeatureDrafter(feature_draft(target, list(range(0, vocab, 2))))],
        TargetModel("tiny", model=target),
    )
    check, checked = states_checker(engine, target)
    engine.before_round.append(check)
    prompts = [[1, 5, 9, 13, 7, 22, 31], [4, 8, 15]]  # the second row is padded
    result = engine.generate(prompts, max_new_tokens=20, ignore_eos=True)
    assert checked[0] >= 10
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        assert tokens == hf_greedy(target, prompt, 20)[: len(tokens)]


def test_rows_sharing_a_prompt_keep_its_states_from_one_reading() -> None:
    """Rows with the same prompt read it once (``SpeculativeEngine._share_prompts``): each
    still holds that prompt's states, the ones a fresh forward gives, at every round."""
    target = build_llama(0, init_range=0.3)
    vocab = target.config.vocab_size
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)),
        [FeatureDrafter(feature_draft(target, list(range(0, vocab, 2))))],
        TargetModel("tiny", model=target),
    )
    check, checked = states_checker(engine, target)
    engine.before_round.append(check)
    prompts = [[1, 5, 9, 13, 7, 22, 31], [4, 8, 15], [1, 5, 9, 13, 7, 22, 31]]
    result = engine.generate(prompts, max_new_tokens=16, ignore_eos=True)
    assert checked[0] >= 8
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        assert tokens == hf_greedy(target, prompt, 16)[: len(tokens)]


def test_greedy_with_a_feature_draft_equals_hf_generate(char_tokenizer: Any) -> None:
    target = build_llama(0, init_range=0.3)
    vocab = target.config.vocab_size
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=4)),
        [FeatureDrafter(feature_draft(target, list(range(vocab))))],
        TargetModel("tiny", model=target, tokenizer=char_tokenizer),
    )
    for prompt in ("def f(x):", "import os", "class A:"):
        ids = char_tokenizer(prompt)["input_ids"]
        assert engine.generate([ids], max_new_tokens=24).tokens[0] == hf_greedy(target, ids, 24)
    stats = engine.generate("def f(x):", max_new_tokens=24).stats
    assert stats.drafted > 0


def feature_engine(gamma: int, temperature: float, top_p: float) -> SpeculativeEngine:
    target, _ = models()
    sampling_config = SamplingConfig(gamma=gamma, temperature=temperature, top_p=top_p)
    return SpeculativeEngine(
        FlashSpecConfig(sampling=sampling_config),
        [FeatureDrafter(feature_draft(target, SUBSET))],
        TargetModel(model=target),
    )


@pytest.mark.parametrize("gamma", [1, 4])
@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_with_a_feature_draft_follows_the_target(
    gamma: int, temperature: float, top_p: float
) -> None:
    engine = feature_engine(gamma, temperature, top_p)
    # Prompts of one row each: the first round is the target's alone (no states yet), so a
    # batch of 20 copies makes the drafter draft from the second token on.
    first, second = sample_two(engine, 300, 1, seed=900 + 10 * gamma)
    p_first, p_second = exact(temperature, top_p)
    for name, counts, p in (("first", first, p_first), ("second", second, p_second)):
        stat, critical = chi_squared(counts, p)
        assert stat < critical, f"{name}: chi2 {stat:.1f} >= {critical} ({sorted(counts.items())})"
    stats = engine.generate([PROMPT] * 20, max_new_tokens=gamma + 2, ignore_eos=True, seed=7).stats
    assert 0 < stats.accepted < stats.drafted


def test_save_and_load_keep_the_fuse_and_what_the_draft_reads(tmp_path: Path) -> None:
    target, _ = models()
    draft = feature_draft(target, SUBSET)
    assert any(name.startswith("fuse.") for name in own_state(draft))
    folder = save_shared_head_draft(draft, tmp_path / "draft")
    loaded = load_shared_head_draft(folder, target)
    assert draft_input(loaded) == "features"
    features = torch.randn(1, 4, 32)
    tokens = torch.tensor([[1, 2, 3, 4]])
    from flashspec.shared_head import feature_hidden

    with torch.inference_mode():
        want = feature_hidden(draft, features, tokens)
        got = feature_hidden(loaded, features, tokens)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)  # saved in float16


def test_refusals_name_the_problem() -> None:
    target, other = models()
    with pytest.raises(ValueError, match="ModelDrafter"):
        FeatureDrafter(build_shared_head_draft(target, SUBSET))  # reads tokens
    with pytest.raises(ValueError, match="temperature"):
        FeatureDrafter(feature_draft(target, SUBSET), temperature=-1.0)
    wider = build_llama(1, vocab_size=VOCAB, layers=1, hidden=64)
    with pytest.raises(ValueError, match="width 32"):
        SpeculativeEngine(FlashSpecConfig(), [FeatureDrafter(feature_draft(target, SUBSET))],
                          TargetModel(model=wider))  # fmt: skip
    with pytest.raises(ValueError, match="hidden states"):
        SpeculativeEngine(
            FlashSpecConfig(compile=True),
            [FeatureDrafter(feature_draft(target, SUBSET)), ModelDrafter(other)],
            TargetModel(model=target),
        )
    unbound = FeatureDrafter(feature_draft(target, SUBSET))
    from flashspec.drafters import DraftContext
    from flashspec.models import Padding
    from flashspec.sampling import Warper

    ctx = DraftContext(torch.tensor([PROMPT]), Padding(torch.zeros(1, dtype=torch.long)),
                       Warper(0.0, None, None), None)  # fmt: skip
    with pytest.raises(RuntimeError, match="not bound"):
        unbound.propose(ctx, 2)


def test_an_engine_refused_or_dropped_leaves_no_hook_on_the_model() -> None:
    """The hidden-state hook a features drafter puts on the target's final norm goes with the
    engine: a refused engine (the compiled path with a features draft) takes it off at once, a
    dropped one when it is collected. A hook left behind kept recording for later engines on
    the same model and made their compiled graphs recompile."""
    import gc

    from flashspec.models.features import final_norm

    target, other = models()
    gc.collect()  # engines of earlier tests on the same model, collected now, not mid-test
    hooks = final_norm(target)._forward_hooks
    before = len(hooks)
    with pytest.raises(ValueError, match="hidden states"):
        SpeculativeEngine(
            FlashSpecConfig(compile=True),
            [FeatureDrafter(feature_draft(target, SUBSET)), ModelDrafter(other)],
            TargetModel(model=target),
        )
    assert len(hooks) == before
    engine = SpeculativeEngine(FlashSpecConfig(), [FeatureDrafter(feature_draft(target, SUBSET))],
                               TargetModel(model=target))  # fmt: skip
    assert len(hooks) == before + 1
    engine.generate(input_ids=torch.tensor([PROMPT]), max_new_tokens=4)
    del engine
    gc.collect()
    assert len(hooks) == before


def test_a_recurrent_target_is_refused() -> None:
    from transformers import MambaConfig, MambaForCausalLM

    torch.manual_seed(0)
    config = MambaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=1, state_size=4)
    recurrent = TargetModel(model=MambaForCausalLM(config).eval())
    llama, _ = models()
    drafter = FeatureDrafter(feature_draft(llama, SUBSET))
    with pytest.raises(UnsupportedModelError, match="recurrent state"):
        drafter.bind(recurrent)


def test_each_round_drafts_what_the_draft_computes_on_the_whole_sequence() -> None:
    """The drafter's cached, incremental reading (catch-up after accepted drafts, its own
    states dropped) gives, every round, the first draft's logits a fresh teacher-forced pass
    of the draft over the target's states gives at the newest column; later drafts read the
    draft's own states, as the same pass unrolled does."""
    target = build_llama(0, init_range=0.3)
    vocab = target.config.vocab_size
    drafter = FeatureDrafter(feature_draft(target, list(range(vocab))))
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)),
        [drafter],
        TargetModel("tiny", model=target),
    )
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    real = drafter.draft.lm_head.forward

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = real(hidden)
        seen.append((hidden.clone(), logits.clone()))
        return logits

    drafter.draft.lm_head.forward = spy
    checked = 0

    def check(view: RoundView) -> None:
        nonlocal checked
        if engine.target.feature_counts(view.padding) is None:
            return
        seen.clear()
        proposal = drafter.propose(engine._draft_context(view._gen, drafter), 3)
        drafter.keep([view.tokens.shape[1] - 1 - left for left in view.padding.lefts], view.padding)
        tokens = view.tokens
        from flashspec.shared_head import feature_hidden

        with torch.inference_mode():
            states = target.model(input_ids=tokens).last_hidden_state
            first = feature_hidden(drafter.draft, states[:, :-1], tokens[:, 1:])[:, -1:]
        torch.testing.assert_close(seen[0][0], first, atol=1e-4, rtol=1e-4)
        assert int(seen[0][1][0, -1].argmax()) == int(proposal.tokens[0, 0])
        # The second step, read incrementally after the first, against a fresh pass over
        # the target's states and the draft's own first state.
        with torch.inference_mode():
            both = feature_hidden(
                drafter.draft,
                torch.cat([states[:, :-1], first], dim=1),
                torch.cat([tokens[:, 1:], proposal.tokens[:, :1]], dim=1),
            )[:, -1:]
        torch.testing.assert_close(seen[1][0], both, atol=1e-4, rtol=1e-4)
        checked += 1

    engine.before_round.append(check)
    engine.generate([[1, 5, 9, 13, 7, 22, 31]], max_new_tokens=24, ignore_eos=True)
    assert checked >= 5


def test_rounds_of_other_arms_keep_the_states_it_reads() -> None:
    """Beside prompt lookup and plain decoding (the throughput model choosing), the states the
    target keeps stay its own whichever arm ran the last round, and greedy stays HF's."""
    from flashspec.config import BanditConfig
    from flashspec.drafters import PromptLookupDrafter

    target = build_llama(0, init_range=0.3)
    vocab = target.config.vocab_size
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(plain=True)),
        [FeatureDrafter(feature_draft(target, list(range(vocab)))), PromptLookupDrafter()],
        TargetModel("tiny", model=target),
    )
    check, checked = states_checker(engine, target)
    engine.before_round.append(check)
    prompt = [1, 5, 9, 13, 1, 5, 9, 13, 1, 5]  # repetitive: lookup has matches to draft
    result = engine.generate([prompt], max_new_tokens=40, ignore_eos=True)
    assert result.tokens[0] == hf_greedy(target, prompt, 40)[: len(result.tokens[0])]
    assert len(result.tokens[0]) == 40 and checked[0] > 5
    assert len(result.stats.arm_rounds) >= 2, result.stats.arm_rounds


def mimic_draft(target: Any) -> torch.nn.Module:
    """A features draft of a one-layer ``target`` that is nearly that target reading the
    tokens (its layer and norm; the fuse passes the embedding through, plus a little of the
    feature): it drafts mostly what the target would. Often right, not always, so rows commit
    different counts, and the states it reads and its attention over its own cache decide its
    drafts."""
    draft: Any = feature_draft(target, list(range(target.config.vocab_size)))
    width = target.config.hidden_size
    with torch.no_grad():
        draft.fuse.proj.weight[:, :width] *= 0.1
        draft.fuse.proj.weight[:, width:] = torch.eye(width)
        draft.fuse.proj.bias.zero_()
        draft.fuse.proj.bias.zero_()
        draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
        draft.model.norm.load_state_dict(target.model.norm.state_dict())
    module: torch.nn.Module = draft
    return module


def test_ragged_rows_and_rows_that_join_keep_their_own_states() -> None:
    """Ragged batches (rows commit their own counts, rows join a running generation): every
    round the states each row reads are the target's own over that row's tokens, each row's
    first draft is what the draft computes over that row alone, and every row's tokens equal
    HF greedy decoding of its prompt alone."""
    from flashspec.shared_head import feature_hidden

    target = build_llama(0, layers=1, init_range=0.3)
    drafter = FeatureDrafter(mimic_draft(target))
    config = FlashSpecConfig(sampling=SamplingConfig(gamma=3), bandit=BanditConfig(batches="fixed"))
    engine = SpeculativeEngine(config, [drafter], TargetModel("tiny", model=target))
    check, checked = states_checker(engine, target)
    engine.before_round.append(check)
    seen: list[torch.Tensor] = []
    real = drafter.draft.lm_head.forward

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(hidden.clone())
        logits: torch.Tensor = real(hidden)
        return logits

    drafter.draft.lm_head.forward = spy
    uneven, drafted = [0], [0]
    before: list[int] = []

    def watch(view: RoundView) -> None:
        nonlocal before
        width, lefts = view.tokens.shape[1], view.padding.lefts
        lengths = [width - left for left in lefts]
        if len(lengths) == len(before):
            # Rows that gained different counts in the last round: a ragged commit.
            uneven[0] += len({a - b for a, b in zip(lengths, before, strict=True)}) > 1
        before = lengths
        seen.clear()
        drafter.propose(engine._draft_context(view._gen, drafter), 2)
        drafter.keep([width - 1 - left for left in lefts], view.padding)
        if not seen:
            return  # a row without states yet: no drafts this round
        drafted[0] += 1
        for row, left in enumerate(lefts):
            tokens = view.tokens[row : row + 1, left:]
            with torch.inference_mode():
                states = target.model(input_ids=tokens).last_hidden_state
                alone = feature_hidden(drafter.draft, states[:, :-1], tokens[:, 1:])[:, -1]
            torch.testing.assert_close(seen[0][row, -1:], alone, atol=1e-4, rtol=1e-4)

    engine.before_round.append(watch)
    first = [[1, 5, 9, 13, 7, 22, 31], [4, 8, 15]]
    later = [[3, 3, 7, 12, 30, 2, 9, 9, 40, 11], [6], [17, 2, 5]]
    stream = engine.stream(first, max_new_tokens=18, ignore_eos=True)
    assert stream.joinable
    outputs: dict[int, list[int]] = {}
    prompts = dict(enumerate(first))
    rounds = 0
    for chunk in stream:
        outputs.setdefault(chunk.row, []).extend(chunk.token_ids)
        if chunk.row == 0:
            rounds += 1
            if rounds <= len(later):
                prompts[stream.join(later[rounds - 1], 18)] = later[rounds - 1]
    assert stream.result is not None and len(outputs) == 5
    assert checked[0] >= 8 and drafted[0] >= 5 and uneven[0] >= 2, (checked, drafted, uneven)
    assert stream.result.stats.accepted > 0
    for row, prompt in prompts.items():
        reference = hf_greedy(target, prompt, 18)  # (which stops at EOS)
        assert len(outputs[row]) == 18 and outputs[row][: len(reference)] == reference, row


def test_a_column_aligned_target_keeps_its_states_by_column() -> None:
    """A sliding-window target keeps its cache column-aligned (no per-row layout): its states
    are kept by column of the token matrix, and the drafter reads the same ones."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(4)
    config = MistralConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, initializer_range=0.3,
    )  # fmt: skip
    target: Any = MistralForCausalLM(config).eval()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3)),
        [FeatureDrafter(feature_draft(target, list(range(0, 64, 2))))],
        TargetModel("mistral-tiny", model=target),
    )
    check, checked = states_checker(engine, target)
    engine.before_round.append(check)
    prompts = [[1, 5, 9, 13, 7, 22, 31, 40, 2, 17, 3], [4, 8, 15]]
    result = engine.generate(prompts, max_new_tokens=20, ignore_eos=True)
    assert engine.target.rows is None and checked[0] >= 10
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        reference = hf_greedy(target, prompt, 20)
        assert tokens[: len(reference)] == reference


def test_the_confidence_stop_ends_each_rows_drafting_on_its_own() -> None:
    """In a ragged batch a row whose draft turns unsure stops while the others draft on
    (``RowStops``): rounds propose lengths that differ across rows, and every row equals HF
    greedy decoding of its prompt alone."""
    target = build_llama(0, layers=1, init_range=0.3)
    drafter = FeatureDrafter(mimic_draft(target))
    sampling = SamplingConfig(gamma=4, confidence_threshold=0.3)
    config = FlashSpecConfig(sampling=sampling, bandit=BanditConfig(batches="fixed"))
    engine = SpeculativeEngine(config, [drafter], TargetModel("tiny", model=target))
    lengths: list[list[int] | None] = []
    propose = drafter.propose

    def spy(ctx: Any, gamma: int) -> Any:
        proposal = propose(ctx, gamma)
        if proposal.count and (ctx.caps is None or min(ctx.caps) == gamma):
            lengths.append(proposal.lengths)  # where no row was capped: the stop's own lengths
        return proposal

    drafter.propose = spy  # type: ignore[method-assign]
    prompts = [[1, 5, 9, 13, 7, 22, 31], [4, 8, 15], [3, 3, 7, 12, 30, 2, 9, 9, 40, 11]]
    result = engine.generate(prompts, max_new_tokens=20, ignore_eos=True)
    for prompt, tokens in zip(prompts, result.tokens, strict=True):
        reference = hf_greedy(target, prompt, 20)
        assert tokens[: len(reference)] == reference
    assert any(n is not None and len(set(n)) > 1 for n in lengths), lengths
    assert result.stats.accepted > 0
