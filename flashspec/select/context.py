"""The lookup-context probe: whether prompt lookup has an n-gram match this round.

Which arm pays differs a lot between rounds where the output is copying its context and rounds
where it is not, and whether a prompt-lookup drafter has a match is known from committed tokens
alone, before the round: so selection may depend on it and stay exact.
"""

from __future__ import annotations

import torch

from ..models import Padding


class NgramIndex:
    """The probe's index, kept up to date round by round.

    Per row, the set of n-grams that start after the row's padding and have a committed token
    after them; a row's last n tokens match when they are in its set, exactly when
    ``PromptLookupDrafter(min_ngram=n)`` would draft (a longer match ends in an n-token one).
    Each round adds only the n-grams the new tokens complete, so the probe costs a few
    microseconds instead of the ~70 of a search over the whole row (about half a percent of a
    round of the demo pair), paid every round the model chooses.
    """

    def __init__(self, n: int, tokens: torch.Tensor, left: torch.Tensor) -> None:
        self.n = n
        self.rows: list[list[int]] = tokens.tolist()
        self.left: list[int] = left.tolist()
        self.seen: list[set[tuple[int, ...]]] = [set() for _ in self.rows]
        self.indexed = 0  # n-grams starting before this column are in ``seen``

    def follows(self, tokens: torch.Tensor) -> bool:
        """Whether ``tokens`` can be the rows indexed so far with columns appended. Within a
        generation the engine only appends columns and drops rows, so the shape tells; after a
        drop the index is built anew."""
        return tokens.shape[0] == len(self.rows) and tokens.shape[1] >= len(self.rows[0])

    def match(self, tokens: torch.Tensor) -> bool:
        """Whether any row of ``tokens`` (which ``follows`` this index) has a match."""
        n, known = self.n, len(self.rows[0])
        if tokens.shape[1] > known:
            for row, new in zip(self.rows, tokens[:, known:].tolist(), strict=True):
                row.extend(new)
        length = len(self.rows[0])
        windows = length - n  # n-gram j covers columns j .. j+n-1 and ends before the suffix
        found = False
        for row, seen, left in zip(self.rows, self.seen, self.left, strict=True):
            for j in range(max(self.indexed, left), windows):
                seen.add(tuple(row[j : j + n]))
            found = found or (length > n and tuple(row[-n:]) in seen)
        self.indexed = max(self.indexed, windows)
        return found


class LookupProbe:
    """The context of a round: 1 if some row's last ``n`` committed tokens occurred before in
    it (prompt lookup would draft), else 0."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.index: NgramIndex | None = None

    def reset(self) -> None:
        """Forget the previous generation's rows."""
        self.index = None

    def context(self, tokens: torch.Tensor, padding: Padding) -> int:
        """The context of the round about to run on ``tokens`` (committed tokens only)."""
        index = self.index
        if index is None or not index.follows(tokens):
            index = self.index = NgramIndex(self.n, tokens, padding.left)
        return int(index.match(tokens))
