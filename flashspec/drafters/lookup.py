"""PromptLookupDrafter: drafts what followed an earlier match of the row's suffix (n-gram
lookup in the prompt and generated text), as chains or merged into a trie of continuations."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .._validate import is_int
from ..trees.tree import ROOT, TokenTree, TreeBuilder, TreeShape
from .base import DraftContext, Drafter, Proposal, no_drafts, tree_depth


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram lookup in the prompt and generated text; no model.

    For each row the last n tokens (n from ``max_ngram`` down to ``min_ngram``) are searched for
    earlier in the row; the tokens that followed the most recent match with ``gamma`` tokens
    after it (else the earliest match) are proposed. Drafts are
    deterministic (point masses), which keeps rejection sampling lossless.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, name: str = "prompt_lookup") -> None:
        if not is_int(min_ngram, minimum=1):
            raise ValueError(
                f"PromptLookupDrafter min_ngram must be an integer >= 1, got {min_ngram!r}"
            )
        if not is_int(max_ngram, minimum=min_ngram):
            raise ValueError(
                f"PromptLookupDrafter max_ngram must be an integer >= min_ngram ({min_ngram}), "
                f"got {max_ngram!r}"
            )
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.name = name

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        """Up to ``gamma`` tokens that followed an earlier match of each row's suffix."""
        tokens = ctx.tokens
        batch, length = tokens.shape
        device = tokens.device
        left = ctx.padding.left
        start = torch.full((batch,), -1, dtype=torch.int64, device=device)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Window j covers columns j .. j+n-1; windows j <= length-n-1 end before the suffix.
            windows = tokens.unfold(1, n, 1)[:, : length - n]
            hit = (windows == tokens[:, length - n :].unsqueeze(1)).all(dim=-1)
            columns = torch.arange(length - n, device=device)
            hit &= columns.unsqueeze(0) >= left.unsqueeze(1)
            # The latest match that still has gamma tokens after it; failing that, the earliest
            # (the longest continuation). Taking the latest match alone drafts a single period
            # of repetitive text, however large gamma is.
            full = hit & (columns.unsqueeze(0) + n + gamma <= length)
            latest_full = torch.where(full, columns.unsqueeze(0), -1).max(dim=1).values
            earliest = torch.where(hit, columns.unsqueeze(0), length).min(dim=1).values
            chosen = torch.where(
                latest_full >= 0, latest_full, torch.where(earliest < length, earliest, -1)
            )
            start = torch.where((start < 0) & (chosen >= 0), chosen + n, start)
        available = torch.where(start >= 0, length - start, 0).clamp(max=gamma)
        count = int(available.max()) if batch else 0
        if count == 0:
            return no_drafts(tokens)
        offsets = torch.arange(count, device=device).unsqueeze(0)
        positions = (start.clamp_min(0).unsqueeze(1) + offsets).clamp(max=length - 1)
        # Rows with a shorter (or no) match are filled with their last token, which the
        # proposal's lengths mark as no draft: never accepted, and not read by a ragged batch.
        drafts = torch.where(
            offsets < available.unsqueeze(1), tokens.gather(1, positions), tokens[:, -1:]
        )
        return Proposal(drafts, lengths=available.tolist() if batch > 1 else None)

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        """Every distinct continuation of the row's suffix found earlier in the row, merged
        into a trie: the continuations of longer n-gram matches first (as ``propose`` tries
        them), then, for one n, more recent matches before older ones. Each continuation has
        up to ``shape.depth`` tokens; one that meets a node with ``shape.top_k`` children
        already (or the ``shape.nodes`` budget) is cut there. None for a batch of more rows, or
        when no match has a continuation.

        Cost: O(L·n) comparisons per n-gram length, then O(depth) per match on the host.
        """
        depth = tree_depth(ctx, shape)
        tokens = ctx.tokens
        length = int(tokens.shape[1])
        if depth < 1 or length < 2:
            return None
        left = ctx.padding.lefts[0]
        row = tokens[0]
        host: list[int] = row.tolist()
        builder = TreeBuilder()
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # Window j covers columns j .. j+n-1; windows j <= length-n-1 end before the suffix
            # and have at least one token after them.
            windows = row.unfold(0, n, 1)[: length - n]  # (length - n, n)
            hit = (windows == row[length - n :]).all(dim=-1)  # (length - n,)
            hit[: max(0, min(left, length - n))] = False  # padding is no text
            starts: list[int] = hit.nonzero().flatten().tolist()
            for j in reversed(starts):  # most recent first
                _add_continuation(builder, host[j + n : j + n + depth], shape)
                if builder.size >= shape.nodes:
                    return builder.build(tokens.device)
        return builder.build(tokens.device) if builder.size else None


def _add_continuation(builder: TreeBuilder, path: Sequence[int], shape: TreeShape) -> None:
    """Merge ``path`` into the trie from the root, cut where it would give a node more than
    ``shape.top_k`` children or the tree more than ``shape.nodes`` nodes."""
    parent, fits = ROOT, 0
    for token in path:
        child = builder.node(parent, token)
        if child is not None:
            parent, fits = child, fits + 1
            continue
        # Point-mass trials: one per child, so a parent's trial list counts its children.
        if len(builder.trials[parent + 1]) < shape.top_k:
            # Below the first new node every node is new and childless: only the budget binds.
            fits += min(shape.nodes - builder.size, len(path) - fits)
        break
    if fits:
        builder.add_path(path[:fits])
