"""SpeculativeEngine: the round loop.

One round, each step in one place (``SpeculativeEngine._round``):

0. choose   with several arms: the drafter and draft length, or plain decoding
            (``throughput.ThroughputModel``, or a ``bandit`` selector), from past rounds only;
1. draft    ``drafter.propose(gamma)``: up to gamma tokens per row (incremental forwards on the
            drafter's own KV cache);
2. verify   ``target.verify``: one target forward over the uncached committed tokens (normally
            just the pending one) plus the drafts;
3. accept   ``sampling.accept_*``: accept/reject on the device, then ONE host read per round;
4. commit   append the emitted tokens and crop every cache to the valid prefix (bookkeeping,
            never recomputation);
5. stop     EOS, stop strings, max_new_tokens, context limit; stream the new text.

Batches run in lockstep. Each round every live row emits m + 1 tokens, where m is the smallest
number of drafts accepted by any live row: its first m drafts, then the token at position m
(its own accepted draft m if it accepted more than m, else the rule's replacement). This is
exact: whether a row emits position i this round depends only on accept events at positions
before i (of this and other rows, all independent of the token at i), and a token that reaches
position i is distributed as the target's conditional there, whether it is an accepted draft,
a residual draw or the bonus token. So every emitted token follows the target given the row's
past, whichever round produced it. Rows keep equal lengths, so caches stay rectangular and one
forward serves the whole batch. Rows that finish leave the batch (their cache rows are dropped).
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, cast

import torch

from .bandit import BanditKind, Selector, make_selector
from .config import BanditConfig, FlashSpecConfig, SamplingConfig
from .drafters import (
    DraftContext,
    Drafter,
    PromptLookupDrafter,
    Proposal,
    load_drafters,
    with_temperature,
)
from .models import (
    DEMO_DRAFT_NAME,
    DEMO_NAME,
    CausalLM,
    Padding,
    TargetModel,
    as_id_list,
    check_same_vocabulary,
)
from .sampling import Acceptance, Warper, accept_greedy, accept_rejection, accept_typical
from .throughput import DEFAULT_MEMORY, ThroughputModel, expected_counts

Prompt = str | Sequence[str] | torch.Tensor | Sequence[int] | Sequence[Sequence[int]]
Stop = str | Sequence[str] | Sequence[str | Sequence[str] | None] | None


# ---------------------------------------------------------------------------------------------
# Results


@dataclass
class GenerationStats:
    """Counters and timings of one generation.

    ``drafted``/``accepted`` count draft tokens over all rows; ``accepted`` counts drafts that
    were emitted. ``replays``/``replayed_tokens``/``time_replay``: a target with recurrent
    state restores its state and feeds the committed tokens again after a round that rejected
    a draft (``time_replay`` is part of ``time_other``). Times are wall-clock seconds spent
    inside rounds (on a GPU, without explicit synchronisation, asynchronous work is billed to
    the step that waits for it).
    """

    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    new_tokens: int = 0
    row_rounds: int = 0
    emitted: int = 0
    time_total: float = 0.0
    time_draft: float = 0.0
    time_verify: float = 0.0
    time_accept: float = 0.0
    replays: int = 0
    replayed_tokens: int = 0
    time_replay: float = 0.0
    arm_rounds: dict[str, int] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float:
        """accepted / drafted (0 when nothing was drafted)."""
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_tokens_per_round(self) -> float:
        """Tokens emitted per row per round (1 means no speculation gain)."""
        return self.emitted / self.row_rounds if self.row_rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        """New tokens (all rows, after stopping) per second of generation."""
        return self.new_tokens / self.time_total if self.time_total > 0 else 0.0

    @property
    def time_other(self) -> float:
        """Time in rounds outside draft, verify and accept: commit, stopping, decoding."""
        return max(0.0, self.time_total - self.time_draft - self.time_verify - self.time_accept)

    def as_dict(self) -> dict[str, float]:
        """All counters, derived rates and times as a flat dict."""
        data: dict[str, float] = {
            k: float(v) for k, v in asdict(self).items() if not isinstance(v, dict)
        }
        data.update(
            acceptance_rate=self.acceptance_rate,
            mean_tokens_per_round=self.mean_tokens_per_round,
            tokens_per_second=self.tokens_per_second,
            time_other=self.time_other,
        )
        return data

    def __str__(self) -> str:
        return (
            f"{self.new_tokens} tokens in {self.rounds} rounds "
            f"({self.mean_tokens_per_round:.2f}/round), "
            f"acceptance {self.acceptance_rate:.1%}, {self.tokens_per_second:.1f} tok/s; "
            f"time draft {self.time_draft:.3f}s verify {self.time_verify:.3f}s "
            f"accept {self.time_accept:.3f}s other {self.time_other:.3f}s"
        )


@dataclass
class GenerationResult:
    """Output of ``SpeculativeEngine.generate``.

    Attributes:
        output_ids: (B, T) int64 new tokens per row (prompt excluded), -1 after a row's end.
        tokens: the same as lists, without the -1 filler.
        texts: decoded new text per row (None without a tokenizer). A row stopped by a stop
            string ends right after it.
        finish_reasons: per row: "eos", "stop", "length" (max_new_tokens), "context_limit" or
            "cancelled" (``TokenStream.cancel``).
        stats: counters and timings.
    """

    output_ids: torch.Tensor
    tokens: list[list[int]]
    texts: list[str] | None
    finish_reasons: list[str]
    stats: GenerationStats

    @property
    def text(self) -> str:
        """The decoded new text of a single-row generation (use ``texts`` for batches)."""
        if self.texts is None:
            raise ValueError(
                "no text: the engine has no tokenizer; pass tokenizer= to TargetModel "
                "or read output_ids"
            )
        if len(self.texts) != 1:
            raise ValueError(
                f"this result has {len(self.texts)} rows; use .texts for batched generations"
            )
        return self.texts[0]


@dataclass
class StreamChunk:
    """New output of one row in one round.

    Attributes:
        row: index of the row in the batch.
        token_ids: tokens committed this round (after stopping).
        text: new text since the previous chunk of this row (empty without a tokenizer). Text
            ending in an incomplete character is held back until it completes.
        finish_reason: set on the row's last chunk.
    """

    row: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None


class TokenStream:
    """Iterator over ``StreamChunk`` as rounds commit; ``result`` is set once it is exhausted."""

    def __init__(
        self, rounds: Generator[list[StreamChunk], None, GenerationResult], generation: _Generation
    ) -> None:
        self._rounds = rounds
        self._generation = generation
        self.result: GenerationResult | None = None

    def _decode_at_end(self) -> None:
        # For generate(): nobody reads the text before the end unless a stop string needs it.
        self._generation.live_text = any(self._generation.stops)

    def cancel(self, row: int) -> None:
        """Stop generating for ``row`` (e.g. its client went away).

        May be called from another thread than the one iterating: the row leaves the batch
        before the next round, which frees its share of the work, and its last chunk has
        finish reason ``"cancelled"``. Cancelling a finished row does nothing.
        """
        if isinstance(row, bool) or not isinstance(row, int):
            raise TypeError(f"row must be an int, got {type(row).__name__}")
        self._generation.cancelled.add(row)

    def __iter__(self) -> Iterator[StreamChunk]:
        try:
            while True:
                yield from next(self._rounds)
        except StopIteration as done:
            self.result = done.value

    def text(self) -> Iterator[str]:
        """Only the text deltas (for single-row streaming)."""
        for chunk in self:
            if chunk.text:
                yield chunk.text


# ---------------------------------------------------------------------------------------------
# Per-generation state


@dataclass
class _Row:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    streamed: int = 0
    finish: str | None = None


@dataclass
class _Generation:
    tokens: torch.Tensor  # (live rows, L) committed tokens, left padded
    padding: Padding
    live: list[int]  # batch index of each live row
    rows: list[_Row]
    prompt_length: int
    max_new_tokens: list[int]  # per batch row
    limit: int | None
    eos: frozenset[int]
    stops: list[tuple[str, ...]]  # per batch row
    decode: Callable[[list[int]], str] | None
    live_text: bool  # decode every round (streaming, stop strings) rather than once at the end
    generator: torch.Generator | None
    sampling: SamplingConfig
    warper: Warper
    arm_gammas: list[int]  # current draft length of each arm (changes with dynamic_gamma)
    last_full: bool = False  # the last round with drafts had every draft accepted
    ngrams: _NgramIndex | None = None  # the lookup-context probe's index (see _context)
    drafted_by: set[int] = field(default_factory=set)  # drafters that have run this generation
    cancelled: set[int] = field(default_factory=set)  # batch rows; filled by TokenStream.cancel
    stats: GenerationStats = field(default_factory=GenerationStats)


@dataclass(frozen=True)
class Arm:
    """One choice the selector can make for a round.

    Attributes:
        drafter: index into ``SpeculativeEngine.drafters``; None for plain decoding.
        gamma: draft length; None for the generation's ``SamplingConfig.gamma``; 0 for plain.
        label: name in stats (``GenerationStats.arm_rounds``) and benchmarks.
    """

    drafter: int | None
    gamma: int | None
    label: str


# ---------------------------------------------------------------------------------------------
# The engine


class SpeculativeEngine:
    """Lossless speculative decoding over a HuggingFace causal LM.

    Args:
        config: engine settings (``FlashSpecConfig``).
        drafters: one or more drafters (``ModelDrafter``, ``PromptLookupDrafter``...).
        target: the model whose output is reproduced (``TargetModel``).
        selector: chooses the arm each round (see ``arms``); by default the one
            ``config.bandit`` describes, built when there is more than one arm.

    Attributes:
        arms: every drafter with every gamma of ``config.bandit.gammas``, then plain decoding
            if ``config.bandit.plain``. The selector's arm i is ``arms[i]``.
        selector: the bandit selector (None with a single arm or with ``model``).
        selectors: the bandit selectors in use: ``[selector]``, or with
            ``config.bandit.context == "lookup"`` one for rounds without a prompt-lookup match
            and one for rounds with one.
        throughput: the ``ThroughputModel`` choosing arms and draft lengths when
            ``config.bandit.selector == "model"`` (the default) and there is more than one arm
            and no ``selector`` was passed; else None. (``model`` is its earlier name.)

    Raises:
        ValueError: a model drafter with another vocabulary than the target's, or on another
            device.
    """

    def __init__(
        self,
        config: FlashSpecConfig,
        drafters: Sequence[Drafter] | Drafter,
        target: TargetModel,
        selector: Selector | None = None,
    ) -> None:
        if not isinstance(config, FlashSpecConfig):
            raise TypeError(f"config must be a FlashSpecConfig, got {type(config).__name__}")
        if not isinstance(target, CausalLM):
            raise TypeError(
                f"target must be a TargetModel, got {type(target).__name__}; "
                "wrap a model: TargetModel(model=m)"
            )
        drafter_list = [drafters] if isinstance(drafters, Drafter) else list(drafters)
        if not drafter_list:
            raise ValueError("drafters is empty; pass at least one, e.g. [PromptLookupDrafter()]")
        for drafter in drafter_list:
            if not isinstance(drafter, Drafter):
                raise TypeError(
                    "drafters must be Drafter objects (see load_drafters), "
                    f"got {type(drafter).__name__}"
                )
            if drafter.lm is not None:
                check_same_vocabulary(target, drafter.lm)
                if drafter.lm.device != target.device:
                    raise ValueError(
                        f"drafter {drafter.name!r} is on {drafter.lm.device} but the target "
                        f"is on {target.device}; "
                        "load both on the same device"
                    )
        bandit = config.bandit
        gammas: tuple[int | None, ...] = bandit.gammas or (None,)
        arms = [
            Arm(d, g, f"{drafter.name}/{'gamma' if g is None else g}")
            for d, drafter in enumerate(drafter_list)
            for g in gammas
        ]
        if bandit.plain:
            arms.append(Arm(None, 0, "plain"))
        model: ThroughputModel | None = None
        # A selector passed in beside the default "model" kind gets UCB1 twins (context).
        kind: BanditKind = "ucb1" if bandit.selector == "model" else bandit.selector
        if selector is None and len(arms) > 1 and bandit.selector == "model":
            model = ThroughputModel(
                [(arm.drafter, arm.gamma) for arm in arms],
                len(drafter_list),
                default_gamma=config.sampling.gamma,
                max_gamma=config.sampling.max_gamma,
                n_states=2 if bandit.context == "lookup" else 1,
                memory=bandit.window_size or DEFAULT_MEMORY,
                seed=bandit.seed,
            )
        elif selector is None and len(arms) > 1:
            selector = make_selector(
                kind,
                len(arms),
                window_size=bandit.window_size,
                exploration=bandit.exploration,
                seed=bandit.seed,
            )
        if bandit.n_arms is not None and bandit.n_arms != len(arms):
            raise ValueError(
                f"config.bandit.n_arms is {bandit.n_arms} but the engine has {len(arms)} arms: "
                f"{[arm.label for arm in arms]} (drafters x config.bandit.gammas, + plain); "
                "drop n_arms or match it"
            )
        _warn_ignored(config, model is not None, selector is not None or len(arms) > 1)
        if selector is not None and selector.n_arms != len(arms):
            raise ValueError(
                f"selector has {selector.n_arms} arms but the engine has {len(arms)}: "
                f"{[arm.label for arm in arms]} (drafters x config.bandit.gammas, + plain)"
            )
        # Kept across generations: what paid on the last prompts is the best prior for the
        # next (a window forgets it when the workload changes).
        selectors = [] if selector is None else [selector]
        self._probe_ngram: int | None = None
        if bandit.context == "lookup" and (selectors or model is not None):
            lookups = [d for d in drafter_list if isinstance(d, PromptLookupDrafter)]
            if not lookups:
                raise ValueError(
                    "config.bandit.context='lookup' needs a PromptLookupDrafter among the "
                    "drafters (e.g. drafters=[..., 'prompt_lookup']), or use context='none'"
                )
            # A one-token match exists almost always in code; two tokens say "copying now".
            self._probe_ngram = max(2, lookups[0].min_ngram)
            if selectors:
                # selectors[0]: rounds without an n-gram match; selectors[1]: rounds with one.
                selectors.append(
                    make_selector(
                        kind,
                        len(arms),
                        window_size=bandit.window_size,
                        exploration=bandit.exploration,
                        seed=None if bandit.seed is None else bandit.seed + 1,
                    )
                )
        self.config = config
        self.drafters = drafter_list
        self.target = target
        self.arms = arms
        self.selectors: list[Selector] = selectors
        self.selector = selector
        self.throughput = model
        sampling = config.sampling
        self.warper = Warper(sampling.temperature, sampling.top_k, sampling.top_p)
        self._owner: object | None = None

    @classmethod
    def from_pretrained(
        cls,
        target: str | torch.nn.Module | TargetModel | None = None,
        drafters: Sequence[str | torch.nn.Module | Drafter] | None = None,
        config: FlashSpecConfig | None = None,
        *,
        models: Mapping[str, torch.nn.Module] | None = None,
        tokenizer: Any = None,
        selector: Selector | None = None,
    ) -> SpeculativeEngine:
        """Build an engine from names.

        Args:
            target: local directory, hub id, loaded model or ``TargetModel``. ``None``/``"demo"``
                name the bundled demo target (see ``resolve_model_path``).
            drafters: names/paths/models/drafters (see ``load_drafters``); default: the demo
                drafter ``"demo-draft"`` for the demo target, prompt lookup otherwise.
            config: settings; ``config.device`` and ``config.dtype`` apply to every model.
            models: already-loaded models by name, so nothing is downloaded.
            tokenizer: the target's tokenizer when it cannot be loaded from ``target``.
        """
        config = config or FlashSpecConfig()
        models = models or {}
        if target is None and config.target_name is not None:
            target = config.target_name
        if drafters is None and config.drafter_name is not None:
            drafters = [config.drafter_name]
        if isinstance(target, TargetModel):
            target_model = target
        elif isinstance(target, torch.nn.Module):
            target_model = TargetModel(
                None, config.device, config.dtype, model=target, tokenizer=tokenizer
            )
        else:
            target_model = TargetModel(
                target,
                config.device,
                config.dtype,
                model=models.get(target or ""),
                tokenizer=tokenizer,
            )
        if drafters is None:
            demo = target is None or target == DEMO_NAME
            drafters = [DEMO_DRAFT_NAME] if demo else ["prompt_lookup"]
        drafter_list = load_drafters(
            drafters, device=config.device, dtype=config.dtype, models=models
        )
        return cls(config, drafter_list, target_model, selector)

    @property
    def model(self) -> ThroughputModel | None:
        """The earlier name of ``throughput`` (the ``ThroughputModel``, not a neural model)."""
        return self.throughput

    @property
    def tokenizer(self) -> Any:
        """The target's tokenizer (None if unknown)."""
        return self.target.tokenizer

    # -- public entry points ------------------------------------------------------------------

    def generate(
        self,
        prompt: Prompt | None = None,
        max_new_tokens: int | Sequence[int] | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        ignore_eos: bool = False,
        stop: Stop = None,
        seed: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> GenerationResult:
        """Generate a continuation of each prompt.

        Args:
            prompt: a string, a list of strings, token ids (list or (B, L) tensor; a tensor may be
                given as ``input_ids`` instead).
            max_new_tokens: new tokens per row at most (>= 0); one number for every row, or a
                list with one per row. Default: ``config.max_new_tokens``, else 128.
            attention_mask: (B, L) 1 for real tokens, 0 for padding (either side), for a tensor
                prompt.
            eos_token_id: id(s) that end a row; default: the target's. Ignored if ``ignore_eos``.
            stop: string(s) that end a row once they appear in its new text (needs a tokenizer);
                matches across round boundaries. Output keeps the stop string. A string or a
                list of strings applies to every row; a list of ``None``/string/list items, one
                per row, gives each row its own (e.g. ``[["\n\n"], None]``).
            seed: seed for this call (default ``config.sampling.seed``).
            sampling: settings for this call instead of ``config.sampling`` (temperature,
                top-k/top-p, method, gamma...), e.g. one per request in a server.

        Generation also ends at the target's context limit (``max_position_embeddings``):
        the row is truncated there with finish reason ``"context_limit"``.
        """
        stream = self.stream(
            prompt,
            max_new_tokens,
            input_ids=input_ids,
            attention_mask=attention_mask,
            eos_token_id=eos_token_id,
            ignore_eos=ignore_eos,
            stop=stop,
            seed=seed,
            sampling=sampling,
        )
        stream._decode_at_end()
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def stream(
        self,
        prompt: Prompt | None = None,
        max_new_tokens: int | Sequence[int] | None = None,
        *,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        ignore_eos: bool = False,
        stop: Stop = None,
        seed: int | None = None,
        sampling: SamplingConfig | None = None,
    ) -> TokenStream:
        """Like ``generate``, but returns an iterator of ``StreamChunk`` yielded as rounds commit.

        Arguments are checked here, before the first chunk. The final ``GenerationResult`` is
        available as ``stream.result`` after iteration.
        """
        generation = self._prepare(
            prompt,
            max_new_tokens,
            input_ids,
            attention_mask,
            eos_token_id,
            ignore_eos,
            stop,
            seed,
            sampling,
        )
        return TokenStream(self._run(generation), generation)

    # -- the loop -----------------------------------------------------------------------------

    def _run(self, gen: _Generation) -> Generator[list[StreamChunk], None, GenerationResult]:
        # Caches live in the models, so an engine runs one generation at a time.
        owner = object()
        self._owner = owner
        self.target.reset()
        for drafter in self.drafters:
            drafter.reset()
        while gen.live:
            if self._owner is not owner:
                raise RuntimeError(
                    "another generation started on this engine while this stream was being "
                    "read; an engine runs one generation at a time (use one engine per stream)"
                )
            if gen.cancelled:
                cancelled = self._cancel_rows(gen)
                if cancelled:
                    yield cancelled
                if not gen.live:
                    break
            # Inference mode per round, not around the yield: the consumer's code between
            # chunks must not run inside it.
            with torch.inference_mode():
                chunks = self._round(gen)
            if chunks:
                yield chunks
        return self._result(gen)

    def _round(self, gen: _Generation) -> list[StreamChunk]:
        start = time.perf_counter()
        stats = gen.stats
        length = gen.tokens.shape[1]
        generated = length - gen.prompt_length  # the same for every live row (lockstep)
        # Each row's own room: its max_new_tokens, and the context limit counted from its own
        # length (not the padded width, or a long prompt would cut the short rows beside it).
        room = max(
            self._row_room(gen, index, left, generated, length)
            for index, left in zip(gen.live, gen.padding.lefts, strict=True)
        )

        # 0. choose the arm: a drafter and its draft length, or plain decoding. Drafts beyond
        # room - 1 could never be emitted (the round adds one token of its own), and a round
        # that can emit one token is plain whatever is chosen, so it teaches the selector nothing.
        choosing = room > 1 and (self.throughput is not None or bool(self.selectors))
        context = self._context(gen) if choosing else 0
        model = self.throughput if choosing else None
        selector = self.selectors[context] if choosing and self.selectors else None
        full = gen.last_full
        if model is not None:
            index, gamma = model.choose(context, len(gen.live), room - 1, full=full)
        else:
            index = selector.select() if selector is not None else 0
            gamma = min(gen.arm_gammas[index], room - 1)
        arm = self.arms[index]
        # Choosing costs the same whichever arm wins, so the model counts it with the target
        # side of the round, not as drafting: spread over the drafts it made every draft look
        # dearer and drafts shorter than the best.
        chosen_at = time.perf_counter()
        # The first round also prefills the prompt, whichever arm runs it: it teaches the
        # selector nothing.
        learn = choosing and self.target.cached > 0

        # 1. draft
        setup = 0.0  # seconds of a drafter's first reading of the generation's tokens
        if arm.drafter is not None and gamma > 0:
            drafter = self.drafters[arm.drafter]
            ctx = self._draft_context(gen, drafter)
            if arm.drafter not in gen.drafted_by:
                # A drafter reads the prompt (and the tokens since) when it is first chosen in
                # a generation, not up front: one never chosen costs nothing (the 3-layer demo
                # draft's prefill was ~0.6% of a sampled generation it took no round of). The
                # selector does not learn that reading as the arm's cost, or a drafter first
                # chosen late would look dearer than it is.
                gen.drafted_by.add(arm.drafter)
                if learn:
                    drafter.prefill(ctx)
                    setup = time.perf_counter() - chosen_at
            proposal = drafter.propose(ctx, gamma)
        else:
            proposal = _empty(gen.tokens)
        drafted_at = time.perf_counter()

        # 2. verify
        logits = self.target.verify(
            gen.tokens[:, self.target.cached :], proposal.tokens, gen.padding
        )
        verified_at = time.perf_counter()

        # 3. accept / reject, and the round's single host read
        acceptance = self._accept(gen, logits, proposal)
        g = proposal.count
        host: list[list[int]] = torch.cat(
            [proposal.tokens, acceptance.token.unsqueeze(1), acceptance.accepted.unsqueeze(1)],
            dim=1,
        ).tolist()
        m = min(row[g + 1] for row in host)
        accepted_at = time.perf_counter()

        # 4. commit
        emitted = torch.cat([proposal.tokens[:, :m], acceptance.token.unsqueeze(1)], dim=1)
        gen.tokens = torch.cat([gen.tokens, emitted], dim=1)
        valid = gen.tokens.shape[1] - 1  # the newest token has no keys/values anywhere yet
        self.target.commit(gen.tokens, gen.padding)
        for each in self.drafters:
            each.commit(valid)

        live_rows = len(gen.live)
        stats.rounds += 1
        stats.row_rounds += live_rows
        stats.drafted += g * live_rows
        stats.accepted += sum(m + (row[g + 1] > m) for row in host)
        stats.emitted += (m + 1) * live_rows
        stats.arm_rounds[arm.label] = stats.arm_rounds.get(arm.label, 0) + 1
        stats.replays = self.target.replays
        stats.replayed_tokens = self.target.replayed_tokens
        stats.time_replay = self.target.replay_seconds
        if g:
            gen.last_full = m == g
        if (
            model is None
            and gen.sampling.dynamic_gamma
            and arm.drafter is not None
            and gamma == gen.arm_gammas[index]
        ):
            # +2 after a full acceptance, -1 otherwise; a round cut short by the room left
            # says nothing about the draft length.
            bound = max(gen.sampling.max_gamma, arm.gamma or gen.sampling.gamma)
            step = 2 if m == gamma else -1
            gen.arm_gammas[index] = min(bound, max(1, gamma + step))

        # 5. stop and stream
        chunks = self._finish_rows(gen, [[*row[:m], row[g]] for row in host])
        end = time.perf_counter()
        if learn and model is not None:
            counts = expected_counts(acceptance.probability, gamma)
            model.observe(
                context,
                arm.drafter,
                g,
                counts,
                drafted_at - chosen_at - setup,
                (chosen_at - start) + (end - drafted_at),
                full=full,
            )
        elif learn and selector is not None:
            # Tokens per second of this round's wall time: what the choice bought, including
            # the drafting it cost. Counted before stopping, which is not the arm's doing.
            selector.update(index, (m + 1) * live_rows / max(end - start - setup, 1e-9))
        stats.time_draft += drafted_at - start
        stats.time_verify += verified_at - drafted_at
        stats.time_accept += accepted_at - verified_at
        # The round's time includes the learning after it: it is the selector's own cost.
        stats.time_total += time.perf_counter() - start
        return chunks

    @staticmethod
    def _row_room(gen: _Generation, index: int, left: int, generated: int, length: int) -> int:
        """Tokens batch row ``index`` (left padding ``left``) may still emit."""
        room = gen.max_new_tokens[index] - generated
        if gen.limit is not None:
            room = min(room, gen.limit - (length - left))
        return room

    def _context(self, gen: _Generation) -> int:
        """Which selector decides this round: 1 if prompt lookup has a match (context
        'lookup'), else 0. Reads committed tokens only, so the choice stays exact."""
        if self._probe_ngram is None:
            return 0
        index = gen.ngrams
        if index is None or not index.follows(gen.tokens):
            index = gen.ngrams = _NgramIndex(self._probe_ngram, gen.tokens, gen.padding.left)
        return int(index.match(gen.tokens))

    def _draft_context(self, gen: _Generation, drafter: Drafter) -> DraftContext:
        warper = (
            gen.warper if gen.warper.greedy else with_temperature(gen.warper, drafter.temperature)
        )
        return DraftContext(
            tokens=gen.tokens,
            padding=gen.padding,
            warper=warper,
            generator=gen.generator,
            confidence_threshold=gen.sampling.confidence_threshold,
            residual=gen.sampling.residual,
        )

    @staticmethod
    def _accept(gen: _Generation, logits: torch.Tensor, proposal: Proposal) -> Acceptance:
        sampling = gen.sampling
        generator = gen.generator
        method = sampling.resolved_method
        if method == "greedy":
            return accept_greedy(logits, proposal.tokens)
        p = gen.warper.probs(logits)
        if method == "typical":
            return accept_typical(
                p, proposal.tokens, generator, sampling.typical_epsilon, sampling.typical_delta
            )
        return accept_rejection(p, proposal.probs, proposal.tokens, generator, sampling.residual)

    def _finish_rows(self, gen: _Generation, new_tokens: list[list[int]]) -> list[StreamChunk]:
        """Apply EOS, stop strings and limits to each live row's new tokens; drop finished rows."""
        before_round = gen.tokens.shape[1] - len(new_tokens[0]) if new_tokens else 0
        chunks: list[StreamChunk] = []
        keep: list[int] = []
        for position, (index, tokens) in enumerate(zip(gen.live, new_tokens, strict=True)):
            row = gen.rows[index]
            # Rows have their own limits; the round was sized for the one with most room.
            left = gen.padding.lefts[position]
            room = self._row_room(gen, index, left, len(row.tokens), before_round)
            tokens = tokens[:room]
            at_limit = gen.limit is not None and before_round - left + len(tokens) >= gen.limit
            for cut, token in enumerate(tokens):
                if token in gen.eos:
                    tokens = tokens[: cut + 1]
                    row.finish = "eos"
                    break
            before = len(row.tokens)
            row.tokens.extend(tokens)
            if gen.decode is not None and gen.live_text:
                self._update_text(gen.decode, gen.stops[index], row, before)
            if row.finish is None and len(row.tokens) >= gen.max_new_tokens[index]:
                row.finish = "length"
            if row.finish is None and at_limit:
                row.finish = "context_limit"
            gen.stats.new_tokens += len(row.tokens) - before
            text = self._text_delta(row)
            chunks.append(StreamChunk(index, row.tokens[before:], text, row.finish))
            if row.finish is None:
                keep.append(position)
        if len(keep) < len(gen.live):
            self._drop_rows(gen, keep)
        return chunks

    @staticmethod
    def _update_text(
        decode: Callable[[list[int]], str], stops: tuple[str, ...], row: _Row, before: int
    ) -> None:
        row.text = decode(row.tokens)
        if not stops:
            return
        # Search the whole new text, so a stop string split across rounds is found.
        hits = [(found + len(s), s) for s in stops if (found := row.text.find(s)) >= 0]
        if not hits:
            return
        end, _ = min(hits)
        # Keep tokens up to the one that completes the stop string; cut the text right after it.
        for count in range(before + 1, len(row.tokens) + 1):
            if len(decode(row.tokens[:count])) >= end:
                del row.tokens[count:]
                break
        row.text = row.text[:end]
        row.finish = "stop"

    @staticmethod
    def _text_delta(row: _Row) -> str:
        text = row.text
        if row.finish is None:
            # A trailing U+FFFD is usually half of a multi-byte character: wait for the rest.
            text = text.rstrip("\ufffd")
        delta = text[row.streamed :] if len(text) > row.streamed else ""
        row.streamed = max(row.streamed, len(text))
        return delta

    def _cancel_rows(self, gen: _Generation) -> list[StreamChunk]:
        """Finish the live rows ``TokenStream.cancel`` named; drop them from the batch."""
        chunks: list[StreamChunk] = []
        keep: list[int] = []
        for position, index in enumerate(gen.live):
            if index in gen.cancelled:
                row = gen.rows[index]
                row.finish = "cancelled"
                if gen.decode is not None and gen.live_text:
                    row.text = gen.decode(row.tokens)
                chunks.append(StreamChunk(index, [], self._text_delta(row), row.finish))
            else:
                keep.append(position)
        if chunks:
            self._drop_rows(gen, keep)
        return chunks

    def _drop_rows(self, gen: _Generation, keep: list[int]) -> None:
        gen.live = [gen.live[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.int64, device=gen.tokens.device)
        gen.tokens = gen.tokens.index_select(0, index)
        gen.padding = gen.padding.select(index)
        self.target.select_rows(index)
        for drafter in self.drafters:
            drafter.select_rows(index)

    def _result(self, gen: _Generation) -> GenerationResult:
        width = max((len(row.tokens) for row in gen.rows), default=0)
        output = torch.full((len(gen.rows), width), -1, dtype=torch.int64)
        for i, row in enumerate(gen.rows):
            if row.tokens:
                output[i, : len(row.tokens)] = torch.tensor(row.tokens, dtype=torch.int64)
        texts = None
        if gen.decode is not None:
            if not gen.live_text:
                for row in gen.rows:
                    row.text = gen.decode(row.tokens)
            texts = [row.text for row in gen.rows]
        return GenerationResult(
            output_ids=output,
            tokens=[list(row.tokens) for row in gen.rows],
            texts=texts,
            finish_reasons=[row.finish or "length" for row in gen.rows],
            stats=gen.stats,
        )

    # -- input preparation --------------------------------------------------------------------

    def _prepare(
        self,
        prompt: Prompt | None,
        max_new_tokens: int | Sequence[int] | None,
        input_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        eos_token_id: int | Sequence[int] | None,
        ignore_eos: bool,
        stop: Stop,
        seed: int | None,
        sampling: SamplingConfig | None,
    ) -> _Generation:
        if sampling is not None and not isinstance(sampling, SamplingConfig):
            raise TypeError(
                f"sampling must be a SamplingConfig or None, got {type(sampling).__name__}"
            )
        if prompt is not None and input_ids is not None:
            raise ValueError("pass the prompt either positionally or as input_ids=, not both")
        rows = self._tokenize(input_ids if input_ids is not None else prompt, attention_mask)
        if max_new_tokens is None:
            max_new_tokens = self.config.max_new_tokens
        max_new = _per_row_limits(128 if max_new_tokens is None else max_new_tokens, len(rows))
        stops = _per_row_stops(stop, len(rows))
        decode = self._decoder()
        if any(stops) and decode is None:
            raise ValueError(
                "stop strings need a tokenizer; pass tokenizer= to TargetModel or use eos_token_id"
            )
        limit = self.target.max_context
        longest = max(len(r) for r in rows)
        if limit is not None and longest >= limit and max(max_new) > 0:
            raise ValueError(
                f"a prompt has {longest} tokens but the target's context limit is {limit}, "
                "leaving no room to generate; shorten the prompt"
            )
        eos = (
            frozenset()
            if ignore_eos
            else frozenset(as_id_list(eos_token_id) or self.target.eos_token_ids)
        )
        pad = self._pad_id()
        device = self.target.device
        # Rows with nothing to generate never enter the batch.
        live = [i for i, n in enumerate(max_new) if n > 0]
        longest = max((len(rows[i]) for i in live), default=longest)
        tokens = torch.tensor(
            [[pad] * (longest - len(rows[i])) + rows[i] for i in live],
            dtype=torch.int64,
            device=device,
        ).reshape(len(live), longest)
        left = torch.tensor(
            [longest - len(rows[i]) for i in live], dtype=torch.int64, device=device
        )
        sampling = sampling or self.config.sampling
        warper = (
            self.warper
            if sampling is self.config.sampling
            else Warper(sampling.temperature, sampling.top_k, sampling.top_p)
        )
        seed = seed if seed is not None else sampling.seed
        generator: torch.Generator | None = None
        if not warper.greedy:
            generator = torch.Generator(device=device)
            if seed is not None:
                generator.manual_seed(seed)
            else:
                generator.seed()
        return _Generation(
            tokens=tokens,
            padding=Padding(left),
            live=live,
            rows=[_Row() for _ in rows],
            prompt_length=longest,
            max_new_tokens=max_new,
            limit=limit,
            eos=eos,
            stops=stops,
            decode=decode,
            live_text=True,
            generator=generator,
            sampling=sampling,
            warper=warper,
            arm_gammas=[sampling.gamma if arm.gamma is None else arm.gamma for arm in self.arms],
        )

    def _tokenize(
        self, prompt: Prompt | None, attention_mask: torch.Tensor | None
    ) -> list[list[int]]:
        """Prompt in any accepted form -> one list of token ids per row (padding removed)."""
        if prompt is None:
            raise ValueError(
                "no prompt: pass a string, a list of strings, or token ids (input_ids=)"
            )
        if attention_mask is not None and not isinstance(prompt, torch.Tensor):
            raise ValueError(
                "attention_mask applies to tensor prompts only; other prompts are unpadded"
            )
        if isinstance(prompt, str) or (
            isinstance(prompt, Sequence)
            and len(prompt) > 0
            and all(isinstance(p, str) for p in prompt)
        ):
            texts = [prompt] if isinstance(prompt, str) else list(prompt)
            if self.tokenizer is None:
                raise ValueError(
                    "text prompts need a tokenizer; pass tokenizer= to TargetModel "
                    "or give input_ids"
                )
            encode = self.tokenizer
            rows = [list(encode(text, add_special_tokens=True)["input_ids"]) for text in texts]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt.unsqueeze(0) if prompt.dim() == 1 else prompt
            if ids.dim() != 2 or ids.dtype.is_floating_point:
                raise ValueError(
                    "input_ids must be an integer tensor of shape (B, L) or (L,), "
                    f"got {prompt.dtype} {tuple(prompt.shape)}"
                )
            ids = ids.cpu()
            if attention_mask is not None:
                mask = (
                    attention_mask.unsqueeze(0) if attention_mask.dim() == 1 else attention_mask
                ).cpu()
                if mask.shape != ids.shape:
                    raise ValueError(
                        f"attention_mask shape {tuple(mask.shape)} differs from "
                        f"input_ids {tuple(ids.shape)}"
                    )
                rows = [r[m.bool()].tolist() for r, m in zip(ids, mask, strict=True)]
            else:
                rows = ids.tolist()
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            rows = [[int(t) for t in cast(Sequence[int], prompt)]]  # [] is one empty row
        elif isinstance(prompt, Sequence) and all(isinstance(r, Sequence) for r in prompt):
            rows = [[int(t) for t in cast(Sequence[int], r)] for r in prompt]
        else:
            raise ValueError(
                f"cannot read a prompt from {type(prompt).__name__}; pass a string, a list of "
                "strings, a list of token ids, or a (B, L) tensor"
            )
        vocab = self.target.vocab_size
        for i, row in enumerate(rows):
            if any(not 0 <= t < vocab for t in row):
                raise ValueError(
                    f"prompt row {i} has token ids outside [0, {vocab}) of the target's vocabulary"
                )
        bos = self._bos_id()
        for i, row in enumerate(rows):
            if not row:
                if bos is None:
                    raise ValueError(
                        f"prompt row {i} is empty and the target defines no bos_token_id "
                        "to start from; "
                        "give at least one token"
                    )
                row.append(bos)
        return rows

    def _decoder(self) -> Callable[[list[int]], str] | None:
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None

        def decode(ids: list[int]) -> str:
            return str(tokenizer.decode(ids, skip_special_tokens=True))

        return decode

    def _bos_id(self) -> int | None:
        for source in (
            getattr(self.target.model, "generation_config", None),
            self.target.config,
            self.tokenizer,
        ):
            value = getattr(source, "bos_token_id", None)
            if isinstance(value, int):
                return value
        return None

    def _pad_id(self) -> int:
        # Any valid id works: padded columns are masked out.
        for source in (self.tokenizer, self.target.config):
            value = getattr(source, "pad_token_id", None)
            if isinstance(value, int) and 0 <= value < self.target.vocab_size:
                return value
        return 0


class _NgramIndex:
    """The lookup-context probe, kept up to date round by round.

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


def _warn_ignored(config: FlashSpecConfig, throughput: bool, bandit: bool) -> None:
    """Warn about settings the engine's mode ignores (each warning shows once per place)."""
    if throughput and config.sampling.dynamic_gamma:
        warnings.warn(
            "SamplingConfig.dynamic_gamma is ignored: BanditConfig.selector='model' chooses "
            "every round's draft length itself; use selector='ucb1' or 'thompson' for "
            "dynamic_gamma, or drop it",
            UserWarning,
            stacklevel=3,
        )
    kind = config.bandit.selector
    default = BanditConfig.__dataclass_fields__["exploration"].default
    if config.bandit.exploration != default and not (bandit and kind == "ucb1"):
        warnings.warn(
            f"BanditConfig.exploration is ignored: it is UCB1's constant, and this engine "
            f"{'uses selector=' + repr(kind) if bandit else 'has a single arm'}; "
            "use selector='ucb1' with several arms, or drop it",
            UserWarning,
            stacklevel=3,
        )


def _empty(tokens: torch.Tensor) -> Proposal:
    return Proposal(tokens.new_empty((tokens.shape[0], 0)))


def _per_row_limits(max_new_tokens: int | Sequence[int], rows: int) -> list[int]:
    """``max_new_tokens`` (one number, or one per row) as one limit per row."""

    def valid(n: object) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and n >= 0

    if valid(max_new_tokens):
        return [cast(int, max_new_tokens)] * rows
    if isinstance(max_new_tokens, Sequence) and not isinstance(max_new_tokens, (str, bytes)):
        limits = list(max_new_tokens)
        if len(limits) != rows or not all(valid(n) for n in limits):
            raise ValueError(
                f"max_new_tokens as a list needs one integer >= 0 per prompt row ({rows}), "
                f"got {max_new_tokens!r}"
            )
        return [int(n) for n in limits]
    raise ValueError(
        f"max_new_tokens must be an integer >= 0 (or one per row), got {max_new_tokens!r}"
    )


def _per_row_stops(stop: Stop, rows: int) -> list[tuple[str, ...]]:
    """``stop`` (shared, or one entry per row) as one tuple of stop strings per row."""

    def strings(item: object) -> tuple[str, ...]:
        if item is None:
            return ()
        items = (item,) if isinstance(item, str) else item
        if not isinstance(items, Sequence) or any(not isinstance(s, str) or not s for s in items):
            raise ValueError(
                "stop must be a non-empty string, a list of them, or one such entry (or None) "
                f"per row, got {stop!r}"
            )
        return tuple(cast(Sequence[str], items))

    if stop is None or isinstance(stop, str):
        return [strings(stop)] * rows
    entries = list(stop) if isinstance(stop, Sequence) else None
    if entries is None:
        return [strings(stop)] * rows  # raises: not a sequence
    if all(isinstance(entry, str) for entry in entries):
        return [strings(entries)] * rows
    if len(entries) != rows:
        raise ValueError(
            f"stop given per row needs {rows} entries (None, a string or a list of strings), "
            f"got {len(entries)}"
        )
    return [strings(entry) for entry in entries]
