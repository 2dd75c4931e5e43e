"""How much could any online selector gain over the best fixed arm? An oracle bound, demo pair.

    python benchmarks/adaptive_headroom.py [--regime sample] [--prompts 20] [--seeds 2]
        [--max-gamma 8] [--out benchmarks/results/adaptive_headroom_sample.json]

``flashspec bench adaptive`` asks the adaptive engine to beat every fixed arm on the mixed
stream. That is only possible where different arms are best in different states a selector can
see. This measures how much such states are worth, with the selector's learning taken out:

1. A reference engine (fixed demo-draft at gamma 4) generates the HumanEval and copy prompts.
   Before each of its rounds, every drafter (demo-draft, demo-draft3, prompt lookup) also drafts
   ``--max-gamma`` tokens against the same committed text and the target verifies them, after
   which every cache is rolled back: for every drafter, the probability with which each draft
   position would have been accepted (``min(1, p/q)``, its expectation rather than the coin).
   From those, the expected tokens of every arm (drafter, g <= max-gamma) in that round follow.
2. Fixed engines of every drafter at g = 1, 2, 4, 8, 16 (up to --max-gamma) and plain
   decoding run the first prompts interleaved: each drafter's drafting milliseconds per round
   as a line in g, and the target side's as one line in g, fitted by least squares. They price
   every arm in every round.
3. An oracle that knows the true mean tokens and seconds of every arm in every state picks the
   best arm per state (maximising total tokens / total seconds, by Dinkelbach's iteration). Its
   rate over the best single arm's is the most that conditioning on that state can earn; a real
   selector must also pay to learn. States: the workload, the lookup context the engine uses,
   which drafters would have had their first 4 drafts accepted in the round before (an upper
   bound on what a selector's own last round tells it), all three together, the prompt (an oracle
   that knows each prompt's best arm in advance) and the round (knowing every round's
   acceptances in advance: an unreachable ceiling). The confidence stop (a model drafter stops
   after a draft whose top probability is under a threshold) is evaluated on the same rounds
   at every threshold and maximum length.

Every recorded round starts where one of the reference's rounds starts, so an arm is priced at
the reference's starting points rather than its own; sampled, every arm that matters emits 2 to
4 tokens a round, as the reference does. The rates are those of the cost lines, measured with a
few engines interleaved, not the bench's crowd of them, so only the ratios carry over.

The sampled regime's trajectories do not depend on the reference arm (speculative decoding keeps
the target's distribution), and greedy ones are the target's own, so the rounds are the ones
any engine would see. Rounds with less than ``max-gamma + 1`` tokens of room are left out, so
that every arm is available in every recorded round; the first round (the prompt's prefill) too.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from flashspec import bench
from flashspec.bench import (
    REGIMES,
    SEED_STRIDE,
    FixedArm,
    copy_prompts,
    encode,
    load_drafters_for,
    load_pair,
)
from flashspec.config import BanditConfig, FlashSpecConfig, SamplingConfig
from flashspec.drafters import Drafter
from flashspec.engine import RoundView, SpeculativeEngine
from flashspec.models import TargetModel
from flashspec.select.context import NgramIndex
from flashspec.select.throughput import expected_tokens

DRAFTERS = "demo-draft,demo-draft3,prompt_lookup"
COST_GAMMAS = (1, 2, 4, 8, 16)  # those up to --max-gamma are run
CONFIDENCE_THRESHOLDS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
LOOKUP_NGRAM = 2  # the engine's lookup context: a 2-gram match
FULL_AT = 4  # "previous round full": its first 4 drafts accepted (probability >= 1/2 together)


@dataclass
class Round:
    """One recorded round: its state and, per drafter, each position's acceptance probability."""

    workload: str
    prompt: int
    lookup: bool
    previous_full: tuple[bool, ...]  # per drafter, in the round before
    accept: list[list[float]]  # per drafter, per drafted position
    top: list[list[float]]  # per drafter, the top draft probability per position (models only)
    tokens: list[list[float]]  # per drafter, tokens_by_length of its acceptances


class Prober:
    """Before each of the reference engine's rounds (a ``before_round`` hook), every probe
    drafter drafts and the target verifies (``RoundView.probe``, which rolls every cache
    back); records what each would have had accepted."""

    def __init__(self, probes: Sequence[Drafter], max_gamma: int) -> None:
        self.probes = probes
        self.max_gamma = max_gamma
        self.workload = ""
        self.prompt = 0
        self.rounds: list[Round] = []
        self.last_full: tuple[bool, ...] = ()  # per drafter, its latest probe; () at a new prompt

    def __call__(self, view: RoundView) -> None:
        if not view.prefilled or view.room - 1 < self.max_gamma:
            return
        accept: list[list[float]] = []
        top: list[list[float]] = []
        for drafter in self.probes:
            proposal, acceptance = view.probe(drafter, self.max_gamma)
            accept.append(acceptance.probability[0].tolist())
            top.append(
                proposal.probs[0].max(dim=-1).values.tolist() if proposal.probs is not None else []
            )
        index = NgramIndex(LOOKUP_NGRAM, view.tokens, view.padding.left)
        previous = self.last_full or (False,) * len(accept)
        self.rounds.append(
            Round(
                self.workload,
                self.prompt,
                index.match(view.tokens),
                previous,
                accept,
                top,
                [tokens_by_length(row) for row in accept],
            )
        )
        self.last_full = tuple(
            len(row) >= FULL_AT and float(np.prod(row[:FULL_AT])) >= 0.5 for row in accept
        )


# ------------------------------------------------------------------------------- the oracle


@dataclass(frozen=True)
class CostModel:
    """Milliseconds of a round: ``draft[d] = (fixed, per draft)`` and the target side's line."""

    draft: dict[str, tuple[float, float]]
    target: tuple[float, float]

    def seconds(self, drafter: str | None, drafts: int) -> float:
        fixed, per = self.target
        ms = fixed + per * drafts
        if drafter is not None:
            d_fixed, d_per = self.draft[drafter]
            ms += d_fixed + d_per * drafts
        return ms / 1000.0


def tokens_by_length(accept: Sequence[float]) -> list[float]:
    """Tokens a round of 0, 1, ..., len(accept) drafts emits in expectation (the throughput
    model's formula for one row): the bonus token plus each drafted position times the
    probability that it and all before it are accepted."""
    rates = np.asarray([list(accept)], dtype=np.float64).reshape(1, len(accept))
    by_length: list[float] = expected_tokens(rates, 1)[0].tolist()
    return by_length


def arm_table(
    rounds: list[Round], names: list[str], costs: CostModel, max_gamma: int
) -> tuple[list[str], np.ndarray, np.ndarray]:
    """Arm labels and (rounds, arms) arrays of expected tokens and seconds."""
    labels = ["plain"] + [f"{name}/{g}" for name in names for g in range(1, max_gamma + 1)]
    tokens = np.zeros((len(rounds), len(labels)))
    seconds = np.zeros_like(tokens)
    for r, rnd in enumerate(rounds):
        tokens[r, 0], seconds[r, 0] = 1.0, costs.seconds(None, 0)
        column = 1
        for name, by_length in zip(names, rnd.tokens, strict=True):
            for g in range(1, max_gamma + 1):
                drafts = min(g, len(by_length) - 1)  # prompt lookup may propose fewer
                tokens[r, column] = by_length[drafts]
                seconds[r, column] = costs.seconds(name, drafts)
                column += 1
    return labels, tokens, seconds


def oracle(
    tokens: np.ndarray, seconds: np.ndarray, groups: Sequence[object]
) -> tuple[float, dict[object, int]]:
    """The best arm per group for the total rate sum(tokens) / sum(seconds), by Dinkelbach's
    iteration: at rate lam, each group's best arm maximises sum(tokens - lam * seconds)."""
    members: dict[object, list[int]] = defaultdict(list)
    for r, group in enumerate(groups):
        members[group].append(r)
    sums = {g: (tokens[rows].sum(axis=0), seconds[rows].sum(axis=0)) for g, rows in members.items()}
    total_t = sum(t for t, _ in sums.values())
    total_s = sum(s for _, s in sums.values())
    rate = float((total_t / total_s).max())
    choice: dict[object, int] = {}
    for _ in range(100):
        choice = {g: int(np.argmax(t - rate * s)) for g, (t, s) in sums.items()}
        new = sum(sums[g][0][a] for g, a in choice.items()) / sum(
            sums[g][1][a] for g, a in choice.items()
        )
        if new <= rate * (1 + 1e-12):
            break
        rate = float(new)
    return rate, choice


def confidence_rule(
    rounds: list[Round], drafter: int, name: str, costs: CostModel, max_gamma: int
) -> dict[str, Any]:
    """The best confidence stop for one model drafter: stop after a draft whose top probability
    is under the threshold, at most ``g`` drafts."""
    best: dict[str, Any] = {"rate": 0.0}
    for threshold in CONFIDENCE_THRESHOLDS:
        for g in range(1, max_gamma + 1):
            total_t = total_s = 0.0
            for rnd in rounds:
                top = rnd.top[drafter]
                drafts = next((i + 1 for i in range(g) if top[i] < threshold), g)
                total_t += rnd.tokens[drafter][drafts]
                total_s += costs.seconds(name, drafts)
            if total_t / total_s > best["rate"]:
                best = {"rate": total_t / total_s, "threshold": threshold, "max_gamma": g}
    return best


def _confidence_signal(rounds: list[Round], drafter: int) -> dict[str, float]:
    """How much a draft's top probability says about its acceptance: the median top
    probability, and the mean acceptance probability of drafts under and over it."""
    top = np.array([t for rnd in rounds for t in rnd.top[drafter]])
    accept = np.array([a for rnd in rounds for a in rnd.accept[drafter][: len(rnd.top[drafter])]])
    median = float(np.median(top))
    return {
        "top_probability_median": round(median, 4),
        "acceptance_under_median": round(float(accept[top < median].mean()), 4),
        "acceptance_over_median": round(float(accept[top >= median].mean()), 4),
    }


# ------------------------------------------------------------------------------ measurement


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    slope, intercept = np.polyfit(np.asarray(xs), np.asarray(ys), 1)
    return float(intercept), float(slope)


def measure_costs(
    target: TargetModel,
    drafters: list[Drafter],
    sampling: SamplingConfig,
    ids: list[list[int]],
    max_new: int,
    max_gamma: int,
) -> tuple[CostModel, dict[str, Any]]:
    """Fixed engines at every (drafter, g in COST_GAMMAS up to ``max_gamma``) and plain,
    interleaved per prompt."""
    with_plain = FlashSpecConfig(sampling=sampling, bandit=BanditConfig(gammas=(1,), plain=True))
    arms = SpeculativeEngine(with_plain, drafters[0], target).arms
    plain = next(i for i, arm in enumerate(arms) if arm.drafter is None)
    engines: dict[tuple[str, int], SpeculativeEngine] = {
        ("plain", 0): SpeculativeEngine(with_plain, drafters[0], target, FixedArm(len(arms), plain))
    }
    gammas = [g for g in COST_GAMMAS if g <= max_gamma]
    for drafter in drafters:
        for g in gammas:
            config = FlashSpecConfig(sampling=replace(sampling, gamma=g))
            engines[(drafter.name, g)] = SpeculativeEngine(config, drafter, target)
    for engine in engines.values():
        engine.generate(ids[0], max_new_tokens=8, ignore_eos=True, seed=0)
    totals: dict[tuple[str, int], list[float]] = {key: [0.0] * 4 for key in engines}
    for position, prompt in enumerate(ids):
        order = list(engines.items())
        random.Random(position).shuffle(order)
        for key, engine in order:
            stats = engine.generate(
                prompt, max_new_tokens=max_new, ignore_eos=True, seed=1000 + position
            ).stats
            total = totals[key]
            total[0] += stats.rounds
            total[1] += stats.drafted
            total[2] += stats.time_draft
            total[3] += stats.time_total - stats.time_draft
    per_round = {
        key: {
            "drafts": rounds_drafted / rounds,
            "draft_ms": 1000 * draft / rounds,
            "target_ms": 1000 * other / rounds,
        }
        for key, (rounds, rounds_drafted, draft, other) in totals.items()
    }
    draft_lines = {
        drafter.name: fit_line(
            [per_round[(drafter.name, g)]["drafts"] for g in gammas],
            [per_round[(drafter.name, g)]["draft_ms"] for g in gammas],
        )
        for drafter in drafters
    }
    target_line = fit_line(
        [row["drafts"] for row in per_round.values()],
        [row["target_ms"] for row in per_round.values()],
    )
    measured = {f"{name}/{g}": row for (name, g), row in per_round.items()}
    return CostModel(draft_lines, target_line), measured


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regime", choices=sorted(REGIMES), default="sample")
    parser.add_argument("--prompts", type=int, default=20, help="prompts per workload")
    parser.add_argument("--seeds", type=int, default=2, help="passes with fresh seeds (sampled)")
    parser.add_argument("--cost-prompts", type=int, default=8, help="per workload, for the costs")
    parser.add_argument("--max-gamma", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--max-prompt-tokens", type=int, default=192)
    parser.add_argument("--out", default=None, help="default: adaptive_headroom_<regime>.json")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    if min(args.prompts, args.seeds, args.cost_prompts, args.max_gamma) < 1:
        parser.error("--prompts, --seeds, --cost-prompts and --max-gamma must be >= 1")
    out = Path(args.out or f"benchmarks/results/adaptive_headroom_{args.regime}.json")

    machine = bench.machine_info()
    started = time.perf_counter()
    pair = load_pair("demo", None)
    target = TargetModel(model=pair.target, tokenizer=pair.tokenizer)
    drafters = load_drafters_for(argparse.Namespace(drafters=DRAFTERS))
    names = [drafter.name for drafter in drafters]
    workloads = {
        "humaneval": bench.humaneval_prompts(args.prompts),
        "copy": copy_prompts(args.prompts),
    }
    ids = {
        w: [encode(pair, p.text, args.max_prompt_tokens) for p in ps] for w, ps in workloads.items()
    }
    sampling = REGIMES[args.regime]

    cost_ids = [x for w in ids.values() for x in w[: args.cost_prompts]]
    costs, measured = measure_costs(
        target, drafters, sampling, cost_ids, args.max_new_tokens, args.max_gamma
    )

    reference_drafter = load_drafters_for(argparse.Namespace(drafters="demo-draft"))[0]
    engine = SpeculativeEngine(FlashSpecConfig(sampling=sampling), reference_drafter, target)
    prober = Prober(drafters, args.max_gamma)
    engine.before_round.append(prober)
    seeds = 1 if sampling.temperature == 0 else args.seeds
    passes = [(s, w, i) for s in range(seeds) for w in ids for i in range(len(ids[w]))]
    for seed, workload, position in bench.progress(passes, desc="probe", disable=args.no_progress):
        for drafter in drafters:
            drafter.reset()
        prober.workload, prober.prompt, prober.last_full = workload, position, ()
        engine.generate(
            ids[workload][position],
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,
            seed=1000 + position + SEED_STRIDE * seed,
        )
    rounds = prober.rounds

    labels, tokens, seconds = arm_table(rounds, names, costs, args.max_gamma)
    states: dict[str, Callable[[Round], object]] = {
        "one arm": lambda r: 0,
        "workload": lambda r: r.workload,
        "lookup context": lambda r: r.lookup,
        "previous round (whose 4 drafts pass)": lambda r: r.previous_full,
        "workload x lookup x previous": lambda r: (r.workload, r.lookup, r.previous_full),
        "prompt (known in advance)": lambda r: (r.workload, r.prompt),
        "round (acceptances known in advance)": lambda r: id(r),
    }
    scopes = {
        "mixed": list(range(len(rounds))),
        **{w: [i for i, r in enumerate(rounds) if r.workload == w] for w in ids},
    }
    results: dict[str, Any] = {}
    for scope, rows in scopes.items():
        chosen = [rounds[i] for i in rows]
        t, s = tokens[rows], seconds[rows]
        single, single_choice = oracle(t, s, [0] * len(rows))
        entry: dict[str, Any] = {
            "rounds": len(rows),
            "best_single_arm": labels[single_choice[0]],
            "best_single_tokens_per_second": round(single, 2),
            "by_state": {},
        }
        # Each drafter at its own best length, and plain decoding, against the best single arm.
        rates = t.sum(axis=0) / s.sum(axis=0)
        entry["best_per_drafter"] = {
            name: {
                "arm": labels[column],
                "vs_best_single": round(float(rates[column]) / single, 4),
            }
            for name in ["plain", *names]
            for column in [
                max(
                    (i for i, label in enumerate(labels) if label.split("/")[0] == name),
                    key=lambda i: float(rates[i]),
                )
            ]
        }
        for state, key in states.items():
            rate, choice = oracle(t, s, [key(chosen[i]) for i in range(len(rows))])
            arms = sorted({labels[a] for a in choice.values()})
            entry["by_state"][state] = {
                "states": len(choice),
                "vs_best_single": round(rate / single, 4),
                "arms": arms if len(arms) <= 8 else f"{len(arms)} different arms",
            }
        entry["confidence_stop"] = {}
        for d, name in enumerate(names):
            if not chosen or not chosen[0].top[d]:
                continue
            rule = confidence_rule(chosen, d, name, costs, args.max_gamma)
            entry["confidence_stop"][name] = {
                "threshold": rule["threshold"],
                "max_gamma": rule["max_gamma"],
                "vs_best_single": round(rule["rate"] / single, 4),
                **_confidence_signal(chosen, d),
            }
        results[scope] = entry

    report = {
        "machine": machine,
        "kind": "adaptive_headroom",
        "settings": {
            "regime": args.regime,
            "sampling": {"temperature": sampling.temperature, "top_p": sampling.top_p},
            "drafters": names,
            "reference": "demo-draft/4",
            "prompts_per_workload": args.prompts,
            "seeds": seeds,
            "max_gamma": args.max_gamma,
            "max_new_tokens": args.max_new_tokens,
            "cost_prompts_per_workload": args.cost_prompts,
            "command": " ".join(["python", *sys.argv]),
        },
        "costs": {
            "draft_ms_line": {k: [round(v, 4) for v in line] for k, line in costs.draft.items()},
            "target_ms_line": [round(v, 4) for v in costs.target],
            "measured_per_round": measured,
        },
        "scopes": results,
        "wall_seconds": round(time.perf_counter() - started, 1),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    for scope, entry in results.items():
        print(f"{scope}: {entry['rounds']} rounds, best single arm {entry['best_single_arm']}")
        for state, row in entry["by_state"].items():
            print(f"  {state:40s} {row['vs_best_single']:.4f}  ({row['states']} states)")
        for name, rule in entry["confidence_stop"].items():
            print(f"  confidence stop {name:24s} {rule['vs_best_single']:.4f}  {rule}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
