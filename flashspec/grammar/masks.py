"""Per-row grammar matchers and the masks of one round.

Position i of a round's target logits is the distribution after the committed tokens and the
drafts before it, so its mask is the grammar's state after those drafts: each row's matcher
consumes its drafts one by one, reading the allowed tokens before each, then rolls back. A
draft the grammar refuses ends that row's walk: the target gives it probability 0, so it is
rejected (and no later position of the row is ever used). After the round the matcher consumes
the tokens the row emitted, which the masks made valid.
"""

from __future__ import annotations

from typing import Any

import torch

from .spec import Grammar
from .tokens import ll_tokenizer

_BITS = torch.arange(32, dtype=torch.int32)


class GrammarState:
    """The matchers of one generation, one per batch row, all of one grammar."""

    def __init__(self, grammar: Grammar, tokenizer: Any, eos: list[int], vocab: int) -> None:
        """
        Args:
            vocab: width of the logits (ids past the tokenizer's are never allowed).

        Raises:
            GrammarError: the grammar does not compile (llguidance's message).
            ImportError: llguidance is missing.
        """
        from llguidance import LLMatcher

        from .spec import GrammarError

        if tokenizer is None:
            raise GrammarError("structured output needs the target's tokenizer")
        self.tokenizer = ll_tokenizer(tokenizer, eos)
        self.source = grammar.llguidance_source()
        self.vocab = vocab
        self.eos = [e for e in eos if 0 <= e < vocab]
        probe = LLMatcher(self.tokenizer, self.source, log_level=0)
        if probe.is_error():
            raise GrammarError(f"the {grammar.kind} does not compile: {probe.get_error()}")
        self._words = (self.tokenizer.vocab_size + 31) // 32
        self.matchers: dict[int, Any] = {}
        self._probe = probe

    def add_rows(self, rows: list[int]) -> None:
        """A fresh matcher for each of these batch rows."""
        for row in rows:
            self.matchers[row] = self._probe.deep_copy()

    def allowed(self, matcher: Any) -> torch.Tensor:
        """(vocab,) bool: the tokens the matcher's current state allows (EOS if none)."""
        words = torch.empty(self._words, dtype=torch.int32)
        matcher.unsafe_compute_mask_ptr(words.data_ptr(), self._words * 4)
        bits = ((words.unsqueeze(1) >> _BITS) & 1).reshape(-1).bool()
        allowed = torch.zeros(self.vocab, dtype=torch.bool)
        n = min(self.vocab, bits.numel())
        allowed[:n] = bits[:n]
        if not bool(allowed.any()):
            allowed[self.eos] = True  # a finished or broken state: only ending is possible
        return allowed

    def commit(self, live: list[int], new_tokens: list[list[int]]) -> None:
        """Each live row's matcher consumes the tokens the row emitted this round."""
        for row, tokens in zip(live, new_tokens, strict=True):
            matcher = self.matchers[row]
            # All valid by the masks, up to the end of the grammar (tokens after an EOS are
            # cut by stopping; the matcher's finished state then allows only EOS).
            matcher.consume_tokens(tokens[: matcher.validate_tokens(tokens)])

    def round(self, live: list[int]) -> GrammarRound:
        """The masks of a round over these batch rows (in the order of the round's rows)."""
        return GrammarRound(self, [self.matchers[row] for row in live])


class GrammarRound:
    """One round's masks: draft steps (``draft``) and every verified position (``target``)."""

    def __init__(self, state: GrammarState, matchers: list[Any]) -> None:
        self.state = state
        self.matchers = matchers
        self.consumed = [0] * len(matchers)  # drafts each matcher took while drafting
        self.read = [0] * len(matchers)  # drafts looked at (a finished matcher takes none)
        self.broken = [False] * len(matchers)  # a draft the grammar refused

    def draft(self, logits: torch.Tensor, drafts: list[torch.Tensor]) -> torch.Tensor:
        """(rows, V) logits of draft step len(drafts) -> masked by each row's state after the
        round's drafts so far."""
        if logits.shape[-1] != self.state.vocab:
            return logits
        step = len(drafts)
        masks = torch.ones(logits.shape, dtype=torch.bool)
        for b, matcher in enumerate(self.matchers):
            while not self.broken[b] and self.read[b] < step:
                token = int(drafts[self.read[b]][b])
                self.read[b] += 1
                # A finished matcher (after an EOS) allows only EOS and takes nothing more;
                # consume_token on a refused token would break the matcher for good, and
                # try_consume_tokens does not take an EOS, so: validate, then consume.
                if matcher.is_stopped():
                    continue
                if matcher.validate_tokens([token]) != 1:
                    self.broken[b] = True
                else:
                    matcher.consume_token(token)
                    self.consumed[b] += 1
            if not self.broken[b]:
                masks[b] = self.state.allowed(matcher)
        return logits.float().masked_fill(~masks.to(logits.device), float("-inf"))

    def target(self, logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
        """(rows, g + 1, V) target logits -> masked: position i by the state after
        drafts[:, :i] (drafts: (rows, g))."""
        for b, matcher in enumerate(self.matchers):  # undo what drafting consumed
            if self.consumed[b]:
                matcher.rollback(self.consumed[b])
                self.consumed[b] = 0
        positions = logits.shape[1]
        masks = torch.ones(logits.shape, dtype=torch.bool)
        host = drafts.tolist()
        for b, matcher in enumerate(self.matchers):
            taken = 0
            for i in range(positions):
                allowed = self.state.allowed(matcher)
                masks[b, i] = allowed
                if i == positions - 1:
                    break
                token = host[b][i]
                # A refused draft is rejected (probability 0 here); later positions unused.
                if not (0 <= token < allowed.numel() and bool(allowed[token])):
                    break
                if not matcher.is_stopped():  # (finished: every later mask is this one)
                    matcher.consume_token(token)  # allowed, so taken (an EOS too)
                    taken += 1
            if taken:
                matcher.rollback(taken)
        return logits.float().masked_fill(~masks.to(logits.device), float("-inf"))
