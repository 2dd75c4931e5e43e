"""The drafter contract (``flashspec.drafters.base``): one ``keep`` after every round, ragged
or lockstep, and ``shiftable`` declared by each drafter, not guessed from what it overrides."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from flashspec import FlashSpecConfig, SamplingConfig, SpeculativeEngine, TargetModel
from flashspec.drafters import DraftContext, Drafter, ModelDrafter, PromptLookupDrafter, Proposal
from flashspec.models import Padding
from flashspec.sampling import Warper
from tests.helpers.greedy import MAX_NEW, PROMPTS, check_equal, models, tokenizer
from tests.helpers.models import build_llama


def mistral() -> Any:
    """A sliding-window model: its cache is column-aligned (not shiftable)."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(4)
    config = MistralConfig(
        vocab_size=len(tokenizer()), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
    )  # fmt: skip
    return MistralForCausalLM(config).eval()


@pytest.mark.parametrize("kind", ["shiftable", "column-aligned"])
def test_keep_with_equal_counts_is_the_lockstep_commit(kind: str) -> None:
    """Rows that advance by the same count each round, kept by ``keep(lengths, padding)``,
    leave the draft model's cache as the earlier lockstep commit did (``rollback`` to the
    still-valid columns): the same rows, columns and next drafts, round after round."""
    model = build_llama(5) if kind == "shiftable" else mistral()
    kept, committed = ModelDrafter(model), ModelDrafter(model)
    assert kept.lm.shiftable == (kind == "shiftable") == kept.shiftable
    kept.reset()
    committed.reset()
    lefts = [0, 3]
    tokens = torch.tensor([[5, 9, 13, 7, 22, 8, 11], [0, 0, 0, 6, 17, 4, 12]])
    padding = Padding(torch.tensor(lefts))
    warper = Warper(0.0)
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for _ in range(5):
            ctx = DraftContext(tokens, padding, warper, None)
            mine, theirs = kept.propose(ctx, 3), committed.propose(ctx, 3)
            assert mine.tokens.tolist() == theirs.tokens.tolist()
            accepted = int(torch.randint(0, mine.count + 1, (1,), generator=generator))
            extra = torch.randint(3, 40, (2, 1), generator=generator)
            tokens = torch.cat([tokens, mine.tokens[:, :accepted], extra], dim=1)
            width = tokens.shape[1]
            kept.keep([width - 1 - left for left in lefts], padding)
            committed.lm.rollback(width - 1)  # the earlier Drafter.commit(width - 1)
            assert kept.lm.cached == committed.lm.cached
            if kept.lm.rows is not None and committed.lm.rows is not None:
                assert kept.lm.rows.lengths == committed.lm.rows.lengths
                # At most the kept tokens (one short after a full acceptance).
                lengths = [width - 1 - left for left in lefts]
                assert all(n <= m for n, m in zip(kept.lm.rows.lengths, lengths, strict=True))


class ColumnLookup(PromptLookupDrafter):
    """Prompt lookup that declares it cannot serve ragged rows, and records every ``keep``."""

    def __init__(self) -> None:
        super().__init__(name="column_lookup")
        self.kept: list[list[int]] = []

    @property
    def shiftable(self) -> bool:
        return False

    def keep(self, lengths: Any, padding: Padding) -> None:
        self.kept.append(list(lengths))


def test_a_drafter_that_declares_no_ragged_rows_keeps_batches_in_lockstep() -> None:
    target, _ = models("loopy")
    drafter = ColumnLookup()
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), batching="ragged"),
        [drafter],
        TargetModel("tiny", model=target, tokenizer=tokenizer()),
    )
    assert engine.target.shiftable and not engine.shiftable
    prompts = PROMPTS[:3]
    result = engine.generate(prompts, max_new_tokens=MAX_NEW)
    for prompt, row in zip(prompts, result.tokens, strict=True):
        check_equal("loopy", prompt, row)
    # Lockstep: each round every row kept the same number of new tokens.
    steps = {
        tuple(b - a for a, b in zip(before, after, strict=True))
        for before, after in zip(drafter.kept, drafter.kept[1:], strict=False)
        if len(before) == len(after)
    }
    assert steps and all(len(set(step)) == 1 for step in steps), steps
    stream = engine.stream(PROMPTS[0], max_new_tokens=4)
    assert not stream.joinable
    with pytest.raises(RuntimeError, match="cannot join"):
        stream.join("abc", 4)


class Stateless(Drafter):
    name = "stateless"

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        return Proposal(ctx.tokens[:, -1:].repeat(1, gamma))


def test_a_drafter_that_keeps_no_state_serves_ragged_rows() -> None:
    target, _ = models("plain")
    engine = SpeculativeEngine(
        FlashSpecConfig(), [Stateless()], TargetModel("tiny", model=target, tokenizer=tokenizer())
    )
    assert Stateless().shiftable and engine.shiftable


class EarlierLookup(PromptLookupDrafter):
    """A drafter written against the verbs of before #39: ``prefill`` and ``commit(valid)``."""

    def __init__(self) -> None:
        super().__init__(name="earlier_lookup")
        self.valid: list[int] = []

    def commit(self, valid: int) -> None:
        self.valid.append(valid)


def test_a_drafter_written_against_the_earlier_verbs_runs_unchanged() -> None:
    """As before #39: a drafter that overrides ``commit`` keeps batches in lockstep, and its
    ``commit`` hears the columns every row keeps after each round (``flashspec.legacy``)."""
    target, _ = models("loopy")
    drafter = EarlierLookup()
    assert not drafter.shiftable
    engine = SpeculativeEngine(
        FlashSpecConfig(sampling=SamplingConfig(gamma=3), batching="ragged"),
        [drafter],
        TargetModel("tiny", model=target, tokenizer=tokenizer()),
    )
    assert not engine.shiftable
    prompts = PROMPTS[:3]
    result = engine.generate(prompts, max_new_tokens=MAX_NEW)
    for prompt, row in zip(prompts, result.tokens, strict=True):
        check_equal("loopy", prompt, row)
    assert len(drafter.valid) >= 2 and drafter.valid == sorted(drafter.valid), drafter.valid
    width = max(len(tokenizer()(p)["input_ids"]) for p in prompts)
    assert drafter.valid[0] >= width - 1
