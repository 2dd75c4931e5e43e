"""Choosing each round's arm and draft length from a model of what a round costs and yields.

The bandit selectors (``flashspec.select.bandit``) learn each arm's tokens per second from the
rounds' rewards alone. Under sampling those rewards are noisy (one round emits one token, the
next five), so telling apart two drafters 10% apart takes hundreds of rounds, and every draft
length is an arm of its own. ``ThroughputModel`` predicts a round instead, from parts that are
each easy to measure:

* A round of drafter d with draft length g over B ragged rows (each commits its own accepted
  drafts) emits, in expectation, ``B * (1 + sum_{k=1..g} prod_{i<=k} a_i)`` tokens, where a_i is
  the probability that draft i is accepted once drafts 1..i-1 were; in lockstep
  (``ragged=False``) each a_i is raised to the power B (the batch advances by its slowest row).
  Acceptance comes in runs (a copied span, boilerplate), so a_i grows with i; a single rate
  for every position would undervalue long drafts.
* It costs ``d(g) + v(g + 1)`` seconds: ``d(g) = e_d + c_d * g`` is the drafter's measured
  drafting time, a fixed part per round and a part per draft, and ``v(n)`` the target side of a
  round that verifies n tokens over all rows (forward, acceptance, commit), a line fitted to
  every round: a batch's verification grows with B * (g + 1), so the best draft length falls as
  the batch grows, down to plain decoding, g = 0: ``B / v(B)`` tokens per second.

Each a_i is a Beta posterior per drafter, state and position. Its counts are expected: the
probability with which the verifier accepted each draft (``min(1, p/q)`` under sampling, 0 or 1
under greedy), weighted by the probability that the run reached it, rather than the coin flip
itself, which removes most of the noise of sampled rounds. A position's prior is centred on the
estimate of the position before it, so positions never drafted yet inherit what is known and
the model dares longer drafts. The state is the selection context (whether prompt lookup has a
match); within it the estimates after a round whose drafts were all accepted and after any
other are kept apart (runs of acceptance span rounds too). Position 1 of each borrows its prior
from the other, at most as strongly as the other's own evidence: a drafter that had a few
unlucky rounds in one of the two is judged there by what the other knows, not by those few
alone, which once locked the best drafter out of a state for hundreds of rounds.

A round of a drafter other than the previous round's also pays its catch-up: it first reads
the tokens committed since it last drafted, measured as what its rounds after a switch take
beyond its rounds in a row.

Each round draws every a_i from its posterior (Thompson sampling). Each drafter's draft length
is the best under the posterior means, and the arm taken is the one with the largest predicted
tokens per second at that length under the draws. Drawing explores drafters; the draft length
needs no exploration of its own (a position not drafted yet inherits the estimate of the one
before), and rating a drafter at one length rather than at the best of many noisy drawn ones
keeps a drafter known from few rounds from looking better than it is. The choice depends on past
rounds and on the model's own random source only, never on the generation's, so the output
stays exact.

The model's own time is part of every round it chooses (a round of the demo pair is ~15 ms), so
what the draws are taken from (the posteriors, each drafter's length under their means, the
costs) is remade every ``PLAN_ROUNDS`` rounds rather than every round, and the draws for the
next rounds are taken in one call: a round's choice is then a lookup and a few divisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from .._validate import is_int
from .costs import _COST_MEMORY, _CostLine, _DraftTime, _settling_mean

DEFAULT_MEMORY = 256
"""Rounds of memory of the acceptance posteriors: each round of a drafter multiplies its counts
in the round's state by 1 - 1/memory, so its estimates follow a workload that changes."""

RETRY_FACTOR = 4
"""Every round in a state also multiplies the counts of the drafters it did not play by
1 - 1/(RETRY_FACTOR * memory): the posterior of a drafter left unplayed widens again, so a
drafter judged on a bad stretch is tried again later instead of never, but slowly: each retry
of a drafter that is worse costs a round at its lower rate (docs/adaptive.md, "Why the model is
built this way")."""

PRIOR_STRENGTH = 8.0
"""Pseudo-positions of the prior each posterior borrows from its neighbour (see the module
docstring): enough to carry an estimate to a position not drafted yet, soon outweighed."""

PLAN_ROUNDS = 8
"""Rounds a state's plan (posteriors, each drafter's best draft length under them, costs) is
reused by ``choose`` before it is remade. The Thompson draws stay fresh every round: keeping a
whole choice for 8 rounds instead made every lucky draw of a slower drafter cost 8 rounds."""

_SETTLED = 32.0
"""Expected first-position drafts a drafter needs in a state before a round of it there leaves
the state's plan in place: its first rounds move its estimates (and its first measured rounds
its cost) far more than 1/memory, and a plan that lagged them would keep drawing from a
posterior already refuted."""

_RESCALE_BELOW = 1e-100  # a cell's scale below which its stored counts are rescaled (no overflow)

_FILL_DECAY = 0.95  # memory of a drafter's share of drafts its rows really proposed (~20 rounds)


def expected_counts(probability: torch.Tensor, requested: int) -> tuple[list[float], list[float]]:
    """Expected tried and accepted drafts per position of one round, summed over rows.

    Args:
        probability: (B, g) the probability with which the verifier accepted each draft given
            the drafts before it.
        requested: the draft length asked of the drafter; a drafter that proposed fewer
            (prompt lookup without a long enough match, the confidence stop) is charged a
            rejection at the first position it left empty, so a drafter that has nothing to
            propose in some state is learned to be worthless there.

    Returns:
        ``(tried, accepted)``, one entry per position: position i is tried when the drafts
        before it were all accepted.
    """
    rows, g = probability.shape
    if g == 0:
        return ([float(rows)], [0.0]) if requested > 0 else ([], [])
    # One host read, then plain floats: as torch ops on a (rows, g) tensor this took ~30 us a
    # round in the engine, where the models' forwards leave the caches cold.
    accepted = [0.0] * g  # P(drafts 1..k accepted), summed over rows
    for row in probability.tolist():
        reach = 1.0
        for k, p in enumerate(row):
            reach *= p
            accepted[k] += reach
    tried = [float(rows), *accepted[:-1]]
    if g < requested:
        tried.append(accepted[-1])
        accepted.append(0.0)
    return tried, accepted


class ThroughputModel:
    """Picks the arm and draft length with the largest predicted tokens per second.

    Args:
        arms: ``(drafter, gamma)`` per arm, as ``SpeculativeEngine.arms``: drafter None is
            plain decoding; gamma None lets the model choose the draft length in
            ``[1, max_gamma]``.
        n_drafters: number of drafters (arms index them).
        default_gamma: draft length of a drafter's rounds until its cost has been measured.
        max_gamma: longest draft length the model chooses.
        n_states: number of states (``state`` of ``choose``/``observe``) with separate
            acceptance estimates, each kept twice: after a fully accepted round (``full``)
            and after any other.
        memory: rounds of memory of the acceptance posteriors (see ``DEFAULT_MEMORY``).
        seed: seed of the model's own random source (Thompson draws).
    """

    def __init__(
        self,
        arms: Sequence[tuple[int | None, int | None]],
        n_drafters: int,
        *,
        default_gamma: int = 4,
        max_gamma: int = 16,
        n_states: int = 1,
        memory: int = DEFAULT_MEMORY,
        seed: int | None = None,
    ) -> None:
        if not arms:
            raise ValueError("arms is empty; pass at least one (drafter, gamma) pair")
        for drafter, gamma in arms:
            if drafter is not None and not 0 <= drafter < n_drafters:
                raise ValueError(f"arm drafter {drafter} is not in [0, {n_drafters})")
            if gamma is not None and gamma < 0:
                raise ValueError(f"arm gamma must be None or >= 0, got {gamma}")
        for name, value in (
            ("default_gamma", default_gamma),
            ("max_gamma", max_gamma),
            ("n_states", n_states),
            ("memory", memory),
        ):
            if not is_int(value, minimum=1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.arms = list(arms)
        self.n_drafters = n_drafters
        self.default_gamma = default_gamma
        self.max_gamma = max_gamma
        self.n_states = n_states
        self.memory = memory
        self._decay = 1.0 - 1.0 / memory
        self._decay_unplayed = 1.0 - 1.0 / (RETRY_FACTOR * memory)
        # Positions tracked: as long as the longest draft any arm can ask for.
        self.positions = max([max_gamma, default_gamma, *(g or 0 for _, g in self.arms)])
        self._seed = seed
        self.ragged = False
        """Whether the batches chosen for are ragged (see the module docstring); the engine sets
        it per generation."""
        self.reset()

    def reset(self) -> None:
        """Forget everything learned (costs, acceptance) and reseed."""
        self._rng = np.random.default_rng(self._seed)
        # Expected counts per state, previous round fully accepted or not, drafter: one list
        # entry a position, stored divided by the cell's scale (the product of the decays so
        # far), so that a round's decay of every drafter is one multiplication each.
        cells = [
            (s, f, d)
            for s in range(self.n_states)
            for f in range(2)
            for d in range(self.n_drafters)
        ]
        self._raw_tried = {cell: [0.0] * self.positions for cell in cells}
        self._raw_accepted = {cell: [0.0] * self.positions for cell in cells}
        self._scale = dict.fromkeys(cells, 1.0)
        # A drafter's drafting time measured in its rounds in a row, and in its rounds right
        # after another's, which stand in until it has one in a row (see observe).
        self._in_a_row = [_DraftTime() for _ in range(self.n_drafters)]
        self._stand_in = [_DraftTime() for _ in range(self.n_drafters)]
        self._last_drafter: int | None = None
        # Mean extra drafting time (a share of the target side's) of a drafter's round right
        # after another's, over a round in a row: the tokens committed meanwhile (see choose).
        self._catch_up = [0.0] * self.n_drafters
        self._catch_up_rounds = [0] * self.n_drafters
        self._line = _CostLine()
        # Per drafter, the share of the drafts asked that its rows really proposed, in rounds
        # whose target skipped the rest (``observe``'s verified): such a round of length g
        # verifies rows * (1 + fill * g) tokens, not the rectangle.
        self._fill = [1.0] * self.n_drafters
        self._plans: dict[tuple[int, bool, int, bool], _Plan] = {}
        self.rounds = 0

    # ------------------------------------------------------------------------------ queries

    def _posteriors(
        self, state: int, full: bool, drafters: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Beta parameters ``(alpha, beta)``, each (len(drafters), positions).

        Position 1's prior is the estimate of the sibling state (the same state after the other
        kind of round), position i's the estimate of position i - 1.
        """
        f = int(full)
        tried, accepted = zip(*(self._counts(state, f, d) for d in drafters), strict=True)
        sibling = [self._counts(state, 1 - f, d) for d in drafters]
        sibling_tried = [n[0] for n, _ in sibling]
        sibling_accepted = [a[0] for _, a in sibling]
        alphas: list[list[float]] = []
        betas: list[list[float]] = []
        # Plain floats: a few dozen scalar steps cost less than as many tiny numpy calls.
        for n_row, a_row, n_sib, a_sib in zip(
            tried, accepted, sibling_tried, sibling_accepted, strict=True
        ):
            # Position 1 borrows from the sibling (uniform when it knows nothing) with at most
            # the strength of the sibling's own evidence. Not from other states: that would drag
            # a state where a drafter shines (prompt lookup on copied text) towards one where it
            # has nothing to say.
            centre = (1.0 + a_sib) / (2.0 + n_sib)
            strength = min(PRIOR_STRENGTH, 2.0 + n_sib)
            alpha_row, beta_row = [], []
            for n, a in zip(n_row, a_row, strict=True):
                alpha = strength * centre + a
                beta = strength * (1.0 - centre) + n - a
                alpha_row.append(alpha)
                beta_row.append(beta)
                strength, centre = PRIOR_STRENGTH, alpha / (alpha + beta)
            alphas.append(alpha_row)
            betas.append(beta_row)
        return np.maximum(alphas, 1e-3), np.maximum(betas, 1e-3)

    def _counts(self, state: int, f: int, drafter: int) -> tuple[list[float], list[float]]:
        """Expected ``(tried, accepted)`` per position of a drafter in a cell."""
        cell = (state, f, drafter)
        scale = self._scale[cell]
        return (
            [n * scale for n in self._raw_tried[cell]],
            [a * scale for a in self._raw_accepted[cell]],
        )

    def acceptance(self, state: int, drafter: int, position: int = 1, full: bool = False) -> float:
        """Posterior mean of the probability that draft ``position`` (1-based) is accepted
        once the drafts before it were, in ``state`` after a fully accepted round (``full``)
        or after any other."""
        alpha, beta = self._posteriors(state, full, [drafter])
        return float(alpha[0, position - 1] / (alpha[0, position - 1] + beta[0, position - 1]))

    def draft_seconds(self, drafter: int, gamma: int) -> float | None:
        """Predicted seconds of drafting ``gamma`` tokens (None before the drafter's first
        measured round).

        Kept as a share of the target side's mean round time and read at the target side's
        current time: the machine's speed drifts (the plain rate of one benchmark run moved
        between 65 and 85 tokens/s), and a drafter left unplayed would otherwise keep the cost
        of a slower or faster stretch against drafters measured now.
        """
        parts = self._draft_parts(drafter)
        return None if parts is None else parts[0] + parts[1] * gamma

    def draft_cost(self, drafter: int) -> float | None:
        """Seconds per draft: what one more draft adds to a round (None before the drafter's
        first measured round). See ``draft_seconds``."""
        parts = self._draft_parts(drafter)
        return None if parts is None else parts[1]

    def verify_seconds(self, tokens: int) -> float | None:
        """The measured cost of a round's target side (verification and the rest) that reads
        ``tokens`` tokens, from the fitted line; None before any round or while the line has
        no slope yet (one length seen)."""
        if not self._line.known or self._line.slope() is None:
            return None
        return self._line(tokens)

    def verify_share(self, rows: int) -> float | None:
        """Seconds one more verified token adds to a round of ``rows`` rows, as a share of a
        plain round's seconds per row (the target side's measured line); None before the line
        has a slope (``flashspec.select.rows`` weighs each row's drafts with it)."""
        slope = self._line.slope() if self._line.known else None
        if slope is None:
            return None
        return max(slope, 0.0) * rows / self._line(rows)

    def _draft_parts(self, drafter: int) -> tuple[float, float] | None:
        """``(fixed seconds per round, seconds per draft)`` of a drafter, or None."""
        measured = self._in_a_row[drafter]
        if measured.rounds == 0:
            measured = self._stand_in[drafter]
            if measured.rounds == 0:
                return None
        fixed, per_draft = measured.fit()
        seconds = self._line.mean_seconds()
        return fixed * seconds, per_draft * seconds

    def predict(
        self, drafter: int | None, gamma: int, acceptance: float | Sequence[float], rows: int = 1
    ) -> float:
        """Predicted tokens per second of a round (after at least one observed round).

        Args:
            drafter: the drafter (None: plain decoding).
            gamma: draft length.
            acceptance: per-position acceptance probabilities (at least ``gamma``), or one for
                every position.
            rows: live rows of the batch.
        """
        if not self._line.known:
            raise RuntimeError("predict needs at least one observed round")
        if drafter is None or gamma == 0:
            return rows / self._line(rows)
        rates = [acceptance] * gamma if isinstance(acceptance, (int, float)) else acceptance
        table = np.array([list(rates[:gamma])], dtype=np.float64)
        tokens = float(expected_tokens(table, self._together(rows))[0, gamma])
        drafting = self.draft_seconds(drafter, gamma) or 0.0
        return rows * tokens / (drafting + self._line(rows * (gamma + 1)))

    def _together(self, rows: int) -> int:
        """Rows that must all accept a draft for it to count: 1 when rows are ragged."""
        return 1 if self.ragged else rows

    def choose(
        self, state: int, rows: int = 1, max_gamma: int | None = None, *, full: bool = False
    ) -> tuple[int, int]:
        """The next round's ``(arm index, draft length)``.

        Args:
            state: which acceptance estimates apply (``0 <= state < n_states``).
            rows: live rows of the batch.
            max_gamma: longest useful draft this round (the room left), at most ``max_gamma``.
            full: whether the previous round's drafts were all accepted.
        """
        limit = self.max_gamma if max_gamma is None else min(max_gamma, self.max_gamma)
        if not self._line.known:
            # Nothing measured yet: the first arm at its own or the default length.
            drafter, gamma = self.arms[0]
            return 0, self._length(drafter, gamma, limit)
        plan = self._plan(state, full, rows)
        if plan.next == len(plan.tokens):
            self._draw(plan, rows)
        # One Thompson draw of a_1..a_g per drafter (see _draw): the draws explore drafters,
        # never lengths.
        tokens = plan.tokens[plan.next]
        plan.next += 1
        best_rate, best = -1.0, (0, 0)
        last = self._last_drafter
        for index, (drafter, _) in enumerate(self.arms):
            if drafter is None or limit < 1:
                rate, g = rows / plan.verify[1], 0
            else:
                g = min(plan.lengths[index], limit)
                verify = plan.verify_of[drafter][g + 1]
                seconds = plan.fixed[index] + plan.per_draft[index] * g + verify
                if drafter != last:
                    # A switch pays the drafter's catch-up now, whatever the draw says: free,
                    # a slower drafter's lucky draws would each cost a round at its rate plus
                    # its catch-up, mostly in single rounds.
                    seconds += plan.catch_up[drafter]
                rate = rows * tokens[drafter][g] / seconds
            if rate > best_rate:
                best_rate, best = rate, (index, g)
        return best

    def _plan(self, state: int, full: bool, rows: int) -> _Plan:
        """What ``choose`` needs of the estimates in a state, kept for a few rounds.

        Recomputing it every round was most of the model's own time (~0.1 ms a round in the
        engine, where the models' forwards leave the caches cold), while the estimates it reads
        move by about 1/memory a round once settled. See ``PLAN_ROUNDS`` for when a plan is
        remade.
        """
        key = (state, full, rows, self.ragged)
        plan = self._plans.get(key)
        if plan is not None and self.rounds - plan.made < PLAN_ROUNDS:
            return plan
        verify = self._line.many(self.positions + 2, step=rows)
        verify_mean = self._line.mean_seconds()
        # Per drafter, the target side's seconds by tokens per row (1 + draft length), its
        # fill applied to the drafts.
        verify_of = {
            d: [self._line(rows * (1.0 + fill * max(k - 1, 0))) for k in range(len(verify))]
            for d, fill in enumerate(self._fill)
        }
        drafters = sorted({d for d, _ in self.arms if d is not None})
        alpha, beta = (
            self._posteriors(state, full, drafters) if drafters else (np.zeros((0, 0)),) * 2
        )
        together = self._together(rows)
        mean_tokens = expected_tokens(alpha / (alpha + beta), together) if drafters else alpha
        row_of = {d: row for row, d in enumerate(drafters)}
        lengths: list[int] = []
        fixed: list[float] = []
        per_draft: list[float] = []
        every = np.arange(1, self.max_gamma + 1)
        for drafter, gamma in self.arms:
            parts = None if drafter is None else self._draft_parts(drafter)
            if drafter is None:
                g = 0
            elif gamma is not None or parts is None:
                # A drafter not yet measured runs at its default length: optimistic (cost 0)
                # so that it is tried soon, without an overlong first draft.
                g = self._length(drafter, gamma, self.max_gamma)
            else:
                # The best length under the posterior means. Tokens are concave in the length
                # and seconds convex, so their ratio rises to this length and falls after it:
                # where less room is left, the room itself is the best length (choose clips).
                targets = np.array(verify_of[drafter][2 : self.max_gamma + 2])
                seconds = parts[0] + parts[1] * every + targets
                rates = mean_tokens[row_of[drafter], 1 : self.max_gamma + 1] / seconds
                g = int(rates.argmax()) + 1
            lengths.append(g)
            fixed.append(parts[0] if parts else 0.0)
            per_draft.append(parts[1] if parts else 0.0)
        longest = dict.fromkeys(drafters, 0)
        for (drafter, _), g in zip(self.arms, lengths, strict=True):
            if drafter is not None:
                longest[drafter] = max(longest[drafter], g)
        plan = _Plan(
            made=self.rounds,
            lengths=lengths,
            catch_up=[max(c, 0.0) * verify_mean for c in self._catch_up],
            fixed=fixed,
            per_draft=per_draft,
            verify=verify.tolist(),
            verify_of=verify_of,
            alpha={d: alpha[row_of[d], :g] for d, g in longest.items()},
            beta={d: beta[row_of[d], :g] for d, g in longest.items()},
        )
        self._plans[key] = plan
        return plan

    def _draw(self, plan: _Plan, rows: int) -> None:
        """Thompson draws for the next ``PLAN_ROUNDS`` choices from the plan's posteriors, in
        one call per drafter: a choice only looks one up, which costs a few microseconds where
        a draw of its own cost ~70 in the engine. The draws of different choices are as
        independent as if each had drawn its own; each holds, per drafter, the expected tokens
        of a round of every length up to the drafter's longest."""
        tokens: list[dict[int, list[float]]] = [{} for _ in range(PLAN_ROUNDS)]
        for d, alpha in plan.alpha.items():
            drawn = self._rng.beta(alpha, plan.beta[d], size=(PLAN_ROUNDS, len(alpha)))
            by_length = expected_tokens(drawn, self._together(rows)).tolist()
            for each, row in zip(tokens, by_length, strict=True):
                each[d] = row
        plan.tokens, plan.next = tokens, 0

    def _length(self, drafter: int | None, gamma: int | None, limit: int) -> int:
        if drafter is None:
            return 0
        return max(0, min(self.default_gamma if gamma is None else gamma, limit))

    # ------------------------------------------------------------------------------ learning

    def observe(
        self,
        state: int,
        drafter: int | None,
        drafted: int,
        counts: tuple[Sequence[float], Sequence[float]],
        draft_seconds: float,
        other_seconds: float,
        *,
        full: bool = False,
        rows: int = 1,
        verified: int | None = None,
    ) -> None:
        """Learn from one round.

        Args:
            state: the state the round was chosen in.
            drafter: the round's drafter (None: plain decoding).
            drafted: drafts proposed per row (g).
            counts: ``expected_counts`` of the round: tried and accepted per position.
            draft_seconds: wall time of drafting.
            other_seconds: the rest of the round (verification, acceptance, commit).
            full: whether the round before it had all its drafts accepted (as passed to
                ``choose``).
            rows: live rows of the round (its verification read ``rows * (drafted + 1)``
                tokens).
            verified: tokens the verification computed, when fewer than that (rows that
                proposed fewer drafts, whose dead columns the target skips).
        """
        self.rounds += 1
        self._line.add(rows * (drafted + 1) if verified is None else verified, other_seconds)
        if verified is not None and drafter is not None and drafted > 0:
            live = min(max((verified - rows) / (rows * drafted), 0.0), 1.0)
            self._fill[drafter] = _FILL_DECAY * self._fill[drafter] + (1.0 - _FILL_DECAY) * live
        switched, self._last_drafter = drafter != self._last_drafter, drafter
        f = int(full)
        for d in range(self.n_drafters):
            cell = (state, f, d)
            scale = self._scale[cell] * (self._decay if d == drafter else self._decay_unplayed)
            if scale < _RESCALE_BELOW:
                self._raw_tried[cell] = [n * scale for n in self._raw_tried[cell]]
                self._raw_accepted[cell] = [a * scale for a in self._raw_accepted[cell]]
                scale = 1.0
            self._scale[cell] = scale
        if drafter is None:
            return
        # A drafter's first round after another's (or plain decoding's) also feeds it the tokens
        # committed meanwhile: ~20% more per draft on the demo pair. Counted into its cost, that
        # made a drafter explored early in a stream look dearer than it is for its first 50
        # rounds, and the model settled on a worse one. Such rounds only stand in (their mean)
        # until the drafter's first round in a row replaces them; after that, what they take
        # beyond a round in a row is the drafter's catch-up, which choose charges a switch.
        measured = None
        if drafted > 0 and not switched:
            measured = self._in_a_row[drafter]
        elif drafted > 0 and self._in_a_row[drafter].rounds == 0:
            measured = self._stand_in[drafter]
        if measured is not None:
            measured.add(drafted, draft_seconds / self._line.mean_seconds())
        elif drafted > 0:
            fixed, per_draft = self._in_a_row[drafter].fit()
            excess = draft_seconds / self._line.mean_seconds() - fixed - per_draft * drafted
            self._catch_up_rounds[drafter] += 1
            count = self._catch_up_rounds[drafter]
            self._catch_up[drafter] = _settling_mean(self._catch_up[drafter], excess, count)
        cell = (state, f, drafter)
        raw_tried, raw_accepted = self._raw_tried[cell], self._raw_accepted[cell]
        inverse = 1.0 / self._scale[cell]
        new_cost = measured is not None and measured.rounds < _COST_MEMORY
        if new_cost or raw_tried[0] * self._scale[cell] < _SETTLED:
            self._plans.clear()
        tried, accepted = counts
        for i in range(min(len(tried), self.positions)):
            raw_tried[i] += tried[i] * inverse
            raw_accepted[i] += min(accepted[i], tried[i]) * inverse


@dataclass
class _Plan:
    """``ThroughputModel._plan``: per arm its draft length at full room and drafting seconds
    (fixed per round and per draft), per drafter its catch-up seconds after a switch, the target
    side's seconds by verified tokens, per drafter the Beta parameters of its acceptance at
    positions 1..its longest length, and Thompson draws not used yet (``tokens[next:]``, see
    ``ThroughputModel._draw``). ``made`` is the model's round count when it was made."""

    made: int
    lengths: list[int]
    catch_up: list[float]
    fixed: list[float]
    per_draft: list[float]
    verify: list[float]
    verify_of: dict[int, list[float]]
    alpha: dict[int, np.ndarray]
    beta: dict[int, np.ndarray]
    tokens: list[dict[int, list[float]]] = field(default_factory=list)
    next: int = 0


def expected_tokens(rates: np.ndarray, rows: int) -> np.ndarray:
    """Expected tokens per row of a round for every draft length 0..P, per row of ``rates``
    (shape (D, P): acceptance per position), when ``rows`` rows must all accept a draft for it
    to count (lockstep; 1 for ragged rows)."""
    runs = np.cumprod(rates**rows, axis=1)
    return np.concatenate([np.ones((rates.shape[0], 1)), 1.0 + np.cumsum(runs, axis=1)], axis=1)
