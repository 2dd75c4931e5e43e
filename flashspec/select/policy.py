"""Policies: which arm (drafter and draft length, or plain decoding) each round runs, and what
the round teaches. One interface, ``choose`` before a round and ``observe`` after it, in front of
a fixed arm (with or without the dynamic draft length), the UCB1/Thompson bandits and the
throughput model. A choice depends only on past rounds, so the output stays exact.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..config import BanditConfig, FlashSpecConfig, SamplingConfig, SelectorKind
from ..drafters import Drafter, PromptLookupDrafter
from ..models import Padding
from .bandit import BanditKind, Selector, make_selector
from .context import LookupProbe
from .throughput import DEFAULT_MEMORY, ThroughputModel, expected_counts


@dataclass(frozen=True)
class Arm:
    """One choice a policy can make for a round.

    Attributes:
        drafter: index into ``SpeculativeEngine.drafters``; None for plain decoding.
        gamma: draft length; None for the generation's ``SamplingConfig.gamma``; 0 for plain.
        label: name in stats (``GenerationStats.arm_rounds``) and benchmarks.
    """

    drafter: int | None
    gamma: int | None
    label: str


@dataclass(frozen=True)
class Choice:
    """A policy's decision for one round.

    Attributes:
        index: the arm's index in ``Policy.arms``.
        arm: the arm.
        gamma: drafts to propose (never more than the round can emit).
        context: the lookup context the choice was made in (0 without a probe).
        full: whether the round before, the last with drafts, accepted all of them.
        learn: whether the round teaches the policy (it chose, and it is not the prompt's
            first forward, whose prefill says nothing about the arm).
    """

    index: int
    arm: Arm
    gamma: int
    context: int
    full: bool
    learn: bool


@dataclass(frozen=True)
class Outcome:
    """What one round did, for ``Policy.observe``.

    Attributes:
        drafted: drafts per row (g).
        accepted: drafts every live row accepted (the fewest any row accepted).
        probability: (rows, g) probability with which each draft was accepted.
        rows: live rows in the round.
        draft_seconds: drafting, less a drafter's first reading of the generation's tokens.
        other_seconds: the rest of the round (choosing, verifying, accepting, committing,
            stopping): the target side of the throughput model.
        seconds: the round's wall time, less that first reading.
        emitted: tokens the round committed over all rows, before stopping.
        verified: tokens the verification computed over all rows (None: rows x (drafted +
            1)); fewer when rows proposed fewer drafts and the target skips their dead
            columns (``Proposal.lengths``).
    """

    drafted: int
    accepted: int
    probability: torch.Tensor
    rows: int
    draft_seconds: float
    other_seconds: float
    seconds: float
    emitted: int
    verified: int | None = None


def arms_of(drafters: Sequence[Drafter], bandit: BanditConfig) -> list[Arm]:
    """Every drafter with every gamma of ``bandit.gammas``, then plain decoding if asked."""
    gammas: tuple[int | None, ...] = bandit.gammas or (None,)
    arms = [
        Arm(d, g, f"{drafter.name}/{'gamma' if g is None else g}")
        for d, drafter in enumerate(drafters)
        for g in gammas
    ]
    if bandit.plain:
        arms.append(Arm(None, 0, "plain"))
    return arms


class Policy:
    """A fixed arm: always the first, at the generation's draft length.

    With ``SamplingConfig.dynamic_gamma`` the arm's draft length moves after every round that
    drafted it: +2 after a full acceptance, -1 otherwise (HF's "heuristic" schedule), within
    [1, max(max_gamma, the arm's own gamma)].
    """

    def __init__(self, arms: list[Arm], probe: LookupProbe | None = None) -> None:
        self.arms = arms
        self.probe = probe
        self.sampling = SamplingConfig()
        self.gammas: list[int] = []  # each arm's current draft length, this generation
        self.last_full = False  # the last round with drafts accepted every draft

    @property
    def chooses(self) -> bool:
        """Whether this policy picks among arms (rounds then teach it)."""
        return False

    def start(self, sampling: SamplingConfig, *, ragged: bool = False) -> None:
        """A new generation with these settings; ``ragged``: its rows commit their own accepted
        drafts (else the batch moves in lockstep)."""
        self.sampling = sampling
        self.gammas = [sampling.gamma if arm.gamma is None else arm.gamma for arm in self.arms]
        self.last_full = False
        if self.probe is not None:
            self.probe.reset()

    def choose(
        self,
        tokens: torch.Tensor,
        padding: Padding,
        rows: int,
        room: int,
        prefilled: bool,
        *,
        fixed: bool = False,
    ) -> Choice:
        """The arm for a round that may emit up to ``room`` tokens per row; drafts beyond
        room - 1 could never be emitted (the round adds one token of its own). ``fixed``: the
        first arm at its configured length, whatever the policy would choose (and the round
        teaches nothing)."""
        choosing = room > 1 and self.chooses and not fixed
        context = self._context(tokens, padding) if choosing else 0
        index, gamma = self._pick(context, rows, room, choosing)
        # The first round also prefills the prompt, whichever arm runs it: it teaches nothing.
        return Choice(
            index, self.arms[index], gamma, context, self.last_full, choosing and prefilled
        )

    def observe(self, choice: Choice, outcome: Outcome) -> None:
        """Learn from a round run with ``choice``."""
        if outcome.drafted:
            self.last_full = outcome.accepted == outcome.drafted
        self._schedule(choice, outcome)
        if choice.learn:
            self._learn(choice, outcome)

    def _context(self, tokens: torch.Tensor, padding: Padding) -> int:
        return 0 if self.probe is None else self.probe.context(tokens, padding)

    def _pick(self, context: int, rows: int, room: int, choosing: bool) -> tuple[int, int]:
        return 0, min(self.gammas[0], room - 1)

    def _schedule(self, choice: Choice, outcome: Outcome) -> None:
        index, gamma, arm = choice.index, choice.gamma, choice.arm
        # A round cut short by the room left says nothing about the draft length.
        if not self.sampling.dynamic_gamma or arm.drafter is None or gamma != self.gammas[index]:
            return
        bound = max(self.sampling.max_gamma, arm.gamma or self.sampling.gamma)
        step = 2 if outcome.accepted == gamma else -1
        self.gammas[index] = min(bound, max(1, gamma + step))

    def _learn(self, choice: Choice, outcome: Outcome) -> None:
        pass


class BanditPolicy(Policy):
    """UCB1 or Thompson sampling over the arms, rewarded with each round's tokens per second of
    wall time; with a lookup probe, one selector for rounds without a match and one for rounds
    with one. Draft lengths as in ``Policy`` (fixed, or the dynamic schedule)."""

    def __init__(
        self, arms: list[Arm], selectors: list[Selector], probe: LookupProbe | None
    ) -> None:
        super().__init__(arms, probe)
        self.selectors = selectors

    @property
    def chooses(self) -> bool:
        return True

    def _pick(self, context: int, rows: int, room: int, choosing: bool) -> tuple[int, int]:
        index = self.selectors[context].select() if choosing else 0
        return index, min(self.gammas[index], room - 1)

    def _learn(self, choice: Choice, outcome: Outcome) -> None:
        # What the choice bought, its drafting included; counted before stopping, which is not
        # the arm's doing.
        reward = outcome.emitted / max(outcome.seconds, 1e-9)
        self.selectors[choice.context].update(choice.index, reward)


class ThroughputPolicy(Policy):
    """The throughput model (``ThroughputModel``): the arm and draft length with the most
    predicted tokens per second, from acceptance posteriors and measured costs."""

    def __init__(self, arms: list[Arm], model: ThroughputModel, probe: LookupProbe | None) -> None:
        super().__init__(arms, probe)
        self.model = model

    @property
    def chooses(self) -> bool:
        return True

    def start(self, sampling: SamplingConfig, *, ragged: bool = False) -> None:
        super().start(sampling, ragged=ragged)
        self.model.ragged = ragged

    def _pick(self, context: int, rows: int, room: int, choosing: bool) -> tuple[int, int]:
        if not choosing:
            return super()._pick(context, rows, room, choosing)
        return self.model.choose(context, rows, room - 1, full=self.last_full)

    def _schedule(self, choice: Choice, outcome: Outcome) -> None:
        pass  # the model chooses every round's draft length itself

    def _learn(self, choice: Choice, outcome: Outcome) -> None:
        counts = expected_counts(outcome.probability, choice.gamma)
        self.model.observe(
            choice.context,
            choice.arm.drafter,
            outcome.drafted,
            counts,
            outcome.draft_seconds,
            outcome.other_seconds,
            full=choice.full,
            rows=outcome.rows,
            verified=outcome.verified,
        )


def default_bandit(drafters: Sequence[Drafter], selector: SelectorKind = "model") -> BanditConfig:
    """The selection an engine gets when its user configured none (``from_pretrained`` without
    a config, ``flashspec generate``/``serve`` without ``--draft``/``--drafter``): the
    drafters and plain decoding, chosen by the throughput model (or ``selector``) every round,
    so drafting stops where it does not pay, as on a long generation whose acceptance falls;
    with prompt lookup among the drafters, separate statistics for rounds with and without an
    n-gram match."""
    lookup = any(isinstance(d, PromptLookupDrafter) for d in drafters)
    return BanditConfig(selector=selector, plain=True, context="lookup" if lookup else "none")


def make_policy(
    config: FlashSpecConfig, drafters: Sequence[Drafter], selector: Selector | None
) -> Policy:
    """The policy ``config.bandit`` describes for these drafters (``selector``: one passed in
    instead of the configured kind).

    Raises:
        ValueError: ``n_arms`` or the selector's arm count does not match the arms, or
            ``context="lookup"`` without a ``PromptLookupDrafter``.
    """
    bandit = config.bandit
    arms = arms_of(drafters, bandit)
    if bandit.n_arms is not None and bandit.n_arms != len(arms):
        raise ValueError(
            f"config.bandit.n_arms is {bandit.n_arms} but the engine has {len(arms)} arms: "
            f"{[arm.label for arm in arms]} (drafters x config.bandit.gammas, + plain); "
            "drop n_arms or match it"
        )
    model: ThroughputModel | None = None
    # A selector passed in beside the default "model" kind gets UCB1 twins (context).
    kind: BanditKind = "ucb1" if bandit.selector == "model" else bandit.selector
    if selector is None and len(arms) > 1 and bandit.selector == "model":
        model = ThroughputModel(
            [(arm.drafter, arm.gamma) for arm in arms],
            len(drafters),
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
    _warn_ignored(config, model is not None, selector is not None or model is not None)
    if selector is not None and selector.n_arms != len(arms):
        raise ValueError(
            f"selector has {selector.n_arms} arms but the engine has {len(arms)}: "
            f"{[arm.label for arm in arms]} (drafters x config.bandit.gammas, + plain)"
        )
    selectors = [] if selector is None else [selector]
    probe: LookupProbe | None = None
    if bandit.context == "lookup" and (selectors or model is not None):
        lookups = [d for d in drafters if isinstance(d, PromptLookupDrafter)]
        if not lookups:
            raise ValueError(
                "config.bandit.context='lookup' needs a PromptLookupDrafter among the "
                "drafters (e.g. drafters=[..., 'prompt_lookup']), or use context='none'"
            )
        # A one-token match exists almost always in code; two tokens say "copying now".
        probe = LookupProbe(max(2, lookups[0].min_ngram))
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
    if model is not None:
        return ThroughputPolicy(arms, model, probe)
    if selectors:
        return BanditPolicy(arms, selectors, probe)
    return Policy(arms)


def make_batch_policy(
    config: FlashSpecConfig, drafters: Sequence[Drafter], policy: Policy
) -> Policy | None:
    """The policy of rounds with two or more rows when ``policy`` is a single fixed arm and
    ``config.bandit.batches == "follow"``: the throughput model over that drafter at a length
    it chooses and plain decoding (see ``BanditConfig.batches``); else None."""
    bandit = config.bandit
    if bandit.batches != "follow" or type(policy) is not Policy or len(policy.arms) != 1:
        return None
    arm = policy.arms[0]
    if arm.drafter is None or config.sampling.dynamic_gamma:
        return None
    arms = [Arm(arm.drafter, None, f"{drafters[arm.drafter].name}/batch"), Arm(None, 0, "plain")]
    model = ThroughputModel(
        [(a.drafter, a.gamma) for a in arms],
        len(drafters),
        default_gamma=config.sampling.gamma,
        # Up to the configured length, not beyond: batches only shorten drafts (vLLM's rule,
        # k per batch-size range), and longer drafts chosen freely were measured slower here.
        max_gamma=config.sampling.gamma,
        memory=bandit.window_size or DEFAULT_MEMORY,
        seed=bandit.seed,
    )
    return ThroughputPolicy(arms, model, None)


def _warn_ignored(config: FlashSpecConfig, throughput: bool, bandit: bool) -> None:
    """Warn about settings the engine's policy ignores (each warning shows once per place)."""
    if throughput and config.sampling.dynamic_gamma:
        warnings.warn(
            "SamplingConfig.dynamic_gamma is ignored: BanditConfig.selector='model' chooses "
            "every round's draft length itself; use selector='ucb1' or 'thompson' for "
            "dynamic_gamma, or drop it",
            UserWarning,
            stacklevel=4,
        )
    kind = config.bandit.selector
    default = BanditConfig.__dataclass_fields__["exploration"].default
    if config.bandit.exploration != default and not (bandit and kind == "ucb1"):
        warnings.warn(
            f"BanditConfig.exploration is ignored: it is UCB1's constant, and this engine "
            f"{'uses selector=' + repr(kind) if bandit else 'has a single arm'}; "
            "use selector='ucb1' with several arms, or drop it",
            UserWarning,
            stacklevel=4,
        )
