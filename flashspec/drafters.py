"""Drafters: cheap proposers of the next few tokens.

A drafter sees the committed token matrix (B, L) and proposes up to ``gamma`` tokens per row,
together with the distributions it sampled them from (``Proposal.probs``) — or None when each
draft was chosen deterministically, which verification treats as a point mass (q(d) = 1).
Proposing fewer than ``gamma`` (even zero) drafts is always allowed.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._validate import is_int
from .config import AUTO_DTYPE, ResidualBackend
from .models import CausalLM, Padding, TargetModel, load_pretrained, place_model
from .row_random import RowRandom
from .sampling import Warper, draft_sample
from .trees.tree import ROOT, TokenTree, TreeBuilder, TreeShape

PROMPT_LOOKUP_NAMES = ("prompt_lookup", "prompt-lookup", "ngram")


@dataclass
class DraftContext:
    """What a drafter may look at in one round.

    Attributes:
        tokens: (B, L) committed tokens, left padded.
        padding: where each row's real tokens start.
        warper: the sampling warp (the engine's, or the drafter's own temperature).
        generator: random source for sampled drafts (``RowRandom``: each row's own).
        confidence_threshold: stop drafting once a row's top probability falls below this.
        residual: sampling backend (``SamplingConfig.residual``), also used for drafting.
        adjust: the generation's penalties for a draft step's (B, V) logits, given the round's
            drafts so far (``pick_draft`` applies it); None without penalties.
        ragged: rows commit their own counts (``Generation.ragged``), so a row may stop
            drafting alone; in lockstep the batch advances by its shortest row, and the
            confidence stop ends the round for every row.
        caps: the most drafts each row may propose this round (None: ``gamma``); a model
            drafter stops once every row is capped or unsure (``RowStops``).
    """

    tokens: torch.Tensor
    padding: Padding
    warper: Warper
    generator: torch.Generator | RowRandom | None
    confidence_threshold: float | None = None
    residual: ResidualBackend = "auto"
    adjust: Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor] | None = None
    ragged: bool = False
    caps: list[int] | None = None


@dataclass
class Proposal:
    """Drafted tokens (B, g) and the (B, g, V) distributions they came from (None: point masses).

    ``lengths``: how many of its g drafts each row really proposes (None: all of them). A row's
    tokens after its length are filler that is never accepted; in a ragged batch the target
    does not even read them (their columns are dead, ``flashspec._layout``), so a row with
    nothing to propose decodes plainly inside the batch's verification.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    lengths: list[int] | None = None

    @property
    def count(self) -> int:
        """Drafts per row (g)."""
        return int(self.tokens.shape[1])

    @property
    def short(self) -> bool:
        """Whether some row proposes fewer than ``count`` drafts."""
        return self.lengths is not None and any(n < self.count for n in self.lengths)

    def capped(self, caps: Sequence[int] | None) -> Proposal:
        """This proposal with row b proposing at most ``caps[b]`` drafts (None: unchanged)."""
        if caps is None or self.count == 0:
            return self
        lengths = [min(n, c) for n, c in zip(self.lengths or [self.count] * len(caps), caps,
                                             strict=True)]  # fmt: skip
        short = any(n < self.count for n in lengths)
        return dataclasses.replace(self, lengths=lengths if short else None)


def _no_drafts(tokens: torch.Tensor) -> Proposal:
    return Proposal(tokens.new_empty((tokens.shape[0], 0)))


def tree_depth(ctx: DraftContext, shape: TreeShape) -> int:
    """The most levels a tree may have this round: ``shape.depth``, or the row's cap (a
    row near its token limit has no use for deeper drafts); 0 unless the batch has one row."""
    if ctx.tokens.shape[0] != 1:
        return 0
    return shape.depth if ctx.caps is None else min(shape.depth, ctx.caps[0])


class Drafter(ABC):
    """Interface between the engine and a drafter.

    The engine calls ``reset`` once per generation, ``propose`` each round it picks this drafter,
    ``commit`` after every round (picked or not) and ``select_rows`` when rows finish.
    """

    name: str = "drafter"
    temperature: float | None = None
    """If set, drafts are sampled at this temperature instead of the engine's (still lossless,
    because verification uses the distribution the drafts were actually drawn from)."""

    @property
    def lm(self) -> CausalLM | None:
        """The drafter's model, if it has one (used to check the vocabulary)."""
        return None

    def reset(self) -> None:  # noqa: B027 - optional hook, stateless drafters keep the default
        """Forget the previous generation."""

    def bind(self, target: TargetModel) -> None:  # noqa: B027 - optional hook
        """The engine's target, given once when the engine is built (a drafter that reads the
        target's hidden states asks it to keep them here)."""

    @abstractmethod
    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        """Propose up to ``gamma`` tokens per row after ``ctx.tokens``."""

    def propose_tree(self, ctx: DraftContext, shape: TreeShape) -> TokenTree | None:
        """A tree of continuations for a batch of ONE row (``ctx.tokens`` is (1, L)), or None:
        this drafter proposes chains only (the default), the batch has more rows, or it has
        nothing to propose.

        Trials are point masses (``q`` None), each parent's children in the drafter's order of
        preference (most likely first); the tree has at most ``shape.depth`` levels (and at
        most ``ctx.caps[0]``, when capped), ``shape.nodes`` nodes and ``shape.top_k`` children
        per node. The engine calls ``commit`` / ``keep_rows`` after the round as after a chain.
        """
        return None

    def prefill(self, ctx: DraftContext) -> None:  # noqa: B027 - stateless drafters: nothing to do
        """Bring any cached state up to all but the newest committed token, ahead of time.

        The engine calls it in the first round of a generation when it chooses among arms, so
        that no drafter's prompt prefill lands in (and skews) the reward of a later round.
        """

    def commit(self, valid: int) -> None:  # noqa: B027
        """Only the first ``valid`` committed columns are still correct in any cached state."""

    def select_rows(self, index: torch.Tensor) -> None:  # noqa: B027
        """Keep only the batch rows in ``index``."""

    # Ragged batches (``flashspec._layout``): rows commit their own counts, and rows join a
    # running batch. The engine then calls ``keep_rows`` instead of ``commit``, and ``add_rows``.

    @property
    def shiftable(self) -> bool:
        """Whether this drafter can serve ragged batches: by default, a drafter that keeps no
        state between rounds (it does not override ``commit``). Otherwise the engine keeps
        batches in lockstep."""
        return type(self).commit is Drafter.commit

    def keep_rows(self, lengths: Sequence[int]) -> None:  # noqa: B027
        """Row b's first ``lengths[b]`` committed tokens are still correct in any cached state
        (the ragged ``commit``)."""

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:  # noqa: B027
        """Rows joined the batch: ``tokens`` (n, L) right-aligned, laid out by ``padding``."""


class ModelDrafter(Drafter):
    """A small causal LM with the target's vocabulary, drafting incrementally on its own KV cache.

    Args:
        model: the draft model (HuggingFace causal LM).
        name: label for stats and errors.
        tokenizer: its tokenizer, used to check the vocabulary against the target's.
        temperature: optional sampling temperature of its own (see ``Drafter.temperature``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        name: str | None = None,
        tokenizer: Any = None,
        temperature: float | None = None,
    ) -> None:
        if temperature is not None and (isinstance(temperature, bool) or not temperature >= 0):
            raise ValueError(f"ModelDrafter temperature must be None or >= 0, got {temperature!r}")
        self._lm = CausalLM(model, name=name, tokenizer=tokenizer, role="drafter")
        self.name = self._lm.name
        self.temperature = temperature

    @property
    def lm(self) -> CausalLM:
        """The draft model with its cache."""
        return self._lm

    def reset(self) -> None:
        """Empty the KV cache."""
        self._lm.reset()

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        """Draft autoregressively; the first forward also feeds committed tokens the cache lacks."""
        lm = self._lm
        length = ctx.tokens.shape[1]
        if lm.max_context is not None:
            # Draft i is produced by feeding column length + i - 2, a valid position for the
            # shortest row (longer rows' positions are clamped; their drafts past their limit
            # are never emitted).
            gamma = min(gamma, lm.max_context - (length - ctx.padding.max_left) + 1)
        if gamma <= 0:
            return _no_drafts(ctx.tokens)
        last: torch.Tensor | None = None  # the previous draft, fed after the committed tokens
        drafts: list[torch.Tensor] = []
        dists: list[torch.Tensor] = []
        stops = RowStops(ctx, gamma)
        for i in range(gamma):
            if i:
                # A stateful drafter keeps a copy of its state at each committed-or-drafted
                # column, so commit() returns to the accepted one without feeding anything again.
                lm.mark()
            logits = lm.feed(ctx.tokens, ctx.padding, last, keep=1)[:, -1]
            token, unsure = pick_draft(logits, ctx, drafts, dists)
            if not stops.more(unsure):
                break
            last = token.unsqueeze(1)
        return stops.proposal(drafts, dists)

    def prefill(self, ctx: DraftContext) -> None:
        """Feed the prompt (all but its last token, which ``propose`` feeds) into the cache."""
        lm = self._lm
        end = ctx.tokens.shape[1] - 1
        if lm.max_context is not None and end > lm.max_context:
            return
        if lm.rows is not None:
            held = lm.rows.lengths or [0] * len(ctx.padding.lefts)
            if any(end - left > n for left, n in zip(ctx.padding.lefts, held, strict=True)):
                lm.feed(ctx.tokens[:, :end], ctx.padding, keep=1)
        elif end > lm.cached:
            lm.forward(ctx.tokens[:, lm.cached : end], ctx.padding, keep=1)

    def commit(self, valid: int) -> None:
        """Crop the cache to the still-valid prefix; after a full acceptance the cache is one
        column short and the next ``propose`` catches up in its first forward."""
        self._lm.rollback(valid)

    def select_rows(self, index: torch.Tensor) -> None:
        """Drop finished rows from the cache."""
        self._lm.select_rows(index)

    @property
    def shiftable(self) -> bool:
        """Whether the draft model's cache serves ragged batches (``CausalLM.shiftable``)."""
        return self._lm.shiftable

    def keep_rows(self, lengths: Sequence[int]) -> None:
        """Trim each row of the cache to its committed tokens."""
        self._lm.keep_rows(lengths)

    def add_rows(self, tokens: torch.Tensor, padding: Padding) -> None:
        """Read the joining rows into the cache (see ``CausalLM.add_rows``)."""
        self._lm.add_rows(tokens, padding)


def pick_draft(
    logits: torch.Tensor,
    ctx: DraftContext,
    drafts: list[torch.Tensor],
    dists: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A model drafter's next draft per row from its (B, V) ``logits``: the argmax when
    greedy, else a sample of the warped distribution (appended to ``dists``, for
    verification). The draft is appended to ``drafts``. Also returns the (B,) bool rows the
    confidence stop (``ctx.confidence_threshold``) asks to draft no further, still on the
    device (None without the stop; ``RowStops.more`` reads it)."""
    threshold = ctx.confidence_threshold
    if ctx.adjust is not None:
        logits = ctx.adjust(logits, drafts)
    if ctx.warper.greedy:
        token = logits.max(dim=-1).indices
        probs = logits.float().softmax(dim=-1) if threshold is not None else None
    else:
        probs = ctx.warper.probs(logits)
        token = draft_sample(probs, ctx.generator, ctx.residual)
        dists.append(probs)
    drafts.append(token)
    if threshold is None or probs is None:
        return token, None
    return token, probs.max(dim=-1).values < threshold


class RowStops:
    """When a model drafter's round stops, and how many drafts each row proposed.

    A row stops at its cap (``DraftContext.caps``) or once the confidence stop finds it unsure
    (keeping the unsure draft, which verification may still accept). In a ragged batch of two
    or more rows the others draft on while any row still goes and ``gamma`` allows: a row
    whose draft model is lost no longer ends the round of rows it drafts well. Otherwise (one
    row, lockstep) any unsure row ends the round for all, as the batch advances by its
    shortest row anyway.

    Host reads: none without the confidence stop; with it, one per draft step (the unsure
    flags), as the whole-batch stop always took.
    """

    def __init__(self, ctx: DraftContext, gamma: int) -> None:
        self.gamma = gamma
        self.step = 0  # drafts made so far, in every row
        self.per_row = ctx.ragged and ctx.tokens.shape[0] > 1
        self.lengths: list[int] | None = None if ctx.caps is None else list(ctx.caps)

    def more(self, unsure: torch.Tensor | None) -> bool:
        """After a draft step with the (B,) ``unsure`` rows (None: no confidence stop):
        whether to draft another."""
        self.step += 1
        step = self.step
        if step >= self.gamma:
            return False
        if unsure is not None and not self.per_row:
            return not bool(unsure.any())
        if unsure is not None:
            flags: list[bool] = unsure.tolist()
            lengths = self.lengths or [self.gamma] * len(flags)
            self.lengths = [min(n, step) if u else n for n, u in zip(lengths, flags, strict=True)]
        return self.lengths is None or any(n > step for n in self.lengths)

    def proposal(self, drafts: list[torch.Tensor], dists: list[torch.Tensor]) -> Proposal:
        """The round's (B, g) drafts and (B, g, V) distributions, each row's length set when
        some row proposes fewer than g."""
        tokens = torch.stack(drafts, dim=1)
        proposal = Proposal(tokens, torch.stack(dists, dim=1) if dists else None)
        return proposal.capped(self.lengths)


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
            return _no_drafts(tokens)
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


def load_drafters(
    names: Sequence[str | torch.nn.Module | Drafter],
    device: str | torch.device | None = None,
    dtype: str | torch.dtype | None = None,
    temperature: float | None = None,
    models: Mapping[str, torch.nn.Module] | None = None,
    tokenizers: Mapping[str, Any] | None = None,
) -> list[Drafter]:
    """Build drafters from names.

    Args:
        names: for each drafter, a local path / hub id, ``"prompt_lookup"``, a key of ``models``,
            a loaded model, or a ready ``Drafter``.
        device, dtype: where and how to load models given by name (models in ``models`` are moved
            or cast only when these are given).
        temperature: optional drafting temperature of model drafters (default: the engine's).
        models: already-loaded models by name, so nothing is downloaded.
        tokenizers: tokenizers by name, used for the vocabulary check.

    Raises:
        TypeError / ValueError: for entries that are none of the above.
    """
    if isinstance(names, (str, bytes)):
        raise TypeError(
            f"load_drafters expects a list of names, got the string {names!r}; use [{names!r}]"
        )
    models = models or {}
    tokenizers = tokenizers or {}
    drafters: list[Drafter] = []
    for entry in names:
        if isinstance(entry, Drafter):
            drafters.append(entry)
        elif isinstance(entry, torch.nn.Module):
            drafters.append(
                ModelDrafter(place_model(entry, device, dtype), temperature=temperature)
            )
        elif isinstance(entry, str) and entry in PROMPT_LOOKUP_NAMES:
            drafters.append(PromptLookupDrafter())
        elif isinstance(entry, str) and entry in models:
            model = place_model(models[entry], device, dtype)
            drafters.append(
                ModelDrafter(
                    model, name=entry, tokenizer=tokenizers.get(entry), temperature=temperature
                )
            )
        elif isinstance(entry, str):
            model, tokenizer = load_pretrained(
                entry, device or "cpu", dtype if dtype is not None else AUTO_DTYPE
            )
            drafters.append(
                ModelDrafter(model, name=entry, tokenizer=tokenizer, temperature=temperature)
            )
        else:
            raise TypeError(
                f"load_drafters: cannot make a drafter from {type(entry).__name__}; pass a path "
                f"or hub id, one of {PROMPT_LOOKUP_NAMES}, a key of models=, a model or a Drafter"
            )
    return drafters


def with_temperature(warper: Warper, temperature: float | None) -> Warper:
    """``warper`` with the drafter's own temperature, if it has one."""
    return warper if temperature is None else dataclasses.replace(warper, temperature=temperature)
