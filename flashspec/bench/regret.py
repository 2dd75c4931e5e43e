"""``flashspec bench regret``: the arm selectors' synthetic regret on Bernoulli arms, against
the Auer et al. UCB1 bound (``regret.json``, ``regret.png``)."""

from __future__ import annotations

import argparse
import itertools
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._validate import is_int
from ..flags import argtypes
from ..select.bandit import Selector, ThompsonSelector, UCB1Selector
from .common import DEFAULT_OUT, machine_info, progress, pyplot, write_json

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

# K Bernoulli arms with fixed means; each run pulls for ``horizon`` rounds with UCB1 (c = 1,
# ``reward_scale=1.0``: textbook UCB1) and with Thompson sampling (Beta(1, 1) priors), on the same
# reward draws (common random numbers, so the two are compared on equal luck). Regret is the
# pseudo-regret ``t·μ* - Σ_s μ(arm chosen at s)``, the quantity the Auer et al. (2002) UCB1 bound
# ``Σ_{i: Δi > 0} 8 ln t / Δi + (1 + π²/3) Σ Δi`` bounds.
#
# The issue asked to reproduce an earlier library's figures (K = 3, T = 10,000, UCB1 regret 100.2
# against a bound of about 526, Thompson 18.9) whose means were not recorded. No K = 3 setup
# with means on a 0.05 grid has a bound of 526 (``bound_search`` lists the nearest); the default
# means (0.9, 0.7, 0.4), gaps 0.2 and 0.5, have the nearest bound, 518.8.
#
# Only the standard library (and the selectors) is imported at module level: ``flashspec``'s
# parser imports this module to add the command's arguments, and NumPy is not needed for that.

DEFAULT_MEANS = (0.9, 0.7, 0.4)
DEFAULT_HORIZON = 10_000
DEFAULT_RUNS = 200
QUICK_HORIZON = 2_000
QUICK_RUNS = 20
CURVE_POINTS = 400
SELECTORS = ("ucb1", "thompson")
# The earlier library's figures the issue quotes (setup unknown): K, T, bound, regrets.
EARLIER_K, EARLIER_T, EARLIER_BOUND = 3, 10_000, 526.0
EARLIER_REGRET = {"ucb1": 100.2, "thompson": 18.9}


def auer_bound(means: tuple[float, ...], t: int) -> float:
    """Auer, Cesa-Bianchi & Fischer (2002), Theorem 1: UCB1's expected regret after ``t`` pulls.

    ``Σ_{i: Δi > 0} 8 ln t / Δi + (1 + π²/3) Σ_i Δi``, Δi the gap of arm i to the best mean.
    """
    best = max(means)
    gaps = [best - m for m in means if best - m > 0]
    return sum(8.0 * math.log(t) / d for d in gaps) + (1.0 + math.pi**2 / 3.0) * sum(gaps)


def bound_search(target: float, horizon: int, k: int = 3, step: float = 0.05) -> list[Any]:
    """The K-armed Bernoulli setups (means on a ``step`` grid) whose bound is nearest ``target``.

    The bound depends on the gaps only, so one entry per distinct gap set: its bound and an
    example of means, nearest first (five entries).
    """
    grid = [round(i * step, 10) for i in range(round(1 / step) + 1)]
    found: dict[tuple[float, ...], tuple[float, ...]] = {}
    for means in itertools.combinations(reversed(grid), k):
        gaps = tuple(round(means[0] - m, 10) for m in means[1:])
        # One example per gap set: the first found, which has the highest means.
        found.setdefault(gaps, means)
    ranked = sorted(found.items(), key=lambda kv: abs(auer_bound(kv[1], horizon) - target))
    return [
        {"gaps": list(gaps), "means": list(means), "bound": round(auer_bound(means, horizon), 1)}
        for gaps, means in ranked[:5]
    ]


def make(kind: str, n_arms: int, exploration: float, seed: int) -> Selector:
    """The selector ``kind`` as the benchmark runs it: rewards are Bernoulli, so scale 1."""
    if kind == "ucb1":
        return UCB1Selector(n_arms, c=exploration, reward_scale=1.0)
    return ThompsonSelector(n_arms, reward_scale=1.0, seed=seed)


def simulate(
    means: tuple[float, ...],
    horizon: int,
    runs: int,
    seed: int = 0,
    exploration: float = 1.0,
    show_progress: bool = False,
) -> dict[str, npt.NDArray[np.float64]]:
    """Cumulative pseudo-regret, ``runs`` x ``horizon``, of each selector in ``SELECTORS``."""
    import numpy as np

    k = len(means)
    gaps = np.max(means) - np.asarray(means, dtype=np.float64)
    regret = {kind: np.empty((runs, horizon)) for kind in SELECTORS}
    pulls = {kind: np.zeros(k) for kind in SELECTORS}
    for run in progress(range(runs), desc="regret", unit="run", disable=not show_progress):
        rng = np.random.default_rng([seed, run])
        # One draw per (round, arm), shared by both selectors: arm a pays 1 at round s when
        # draws[s][a] < means[a], whichever selector pulls it.
        draws = (rng.random((horizon, k)) < np.asarray(means)).astype(float).tolist()
        selector_seed = int(rng.integers(2**62))
        for kind in SELECTORS:
            selector = make(kind, k, exploration, selector_seed)
            chosen = [0] * horizon
            for s in range(horizon):
                arm = selector.select()
                selector.update(arm, draws[s][arm])
                chosen[s] = arm
            arms = np.asarray(chosen)
            regret[kind][run] = np.cumsum(gaps[arms])
            pulls[kind] += np.bincount(arms, minlength=k)
    return {**regret, **{f"{kind}_pulls": pulls[kind] / runs for kind in SELECTORS}}


def _stats(values: npt.NDArray[np.float64]) -> dict[str, float]:
    import numpy as np

    n = len(values)
    std = float(np.std(values, ddof=1)) if n > 1 else 0.0
    pct = np.percentile(values, [5, 25, 50, 75, 95])
    return {
        "mean": round(float(np.mean(values)), 3),
        "std": round(std, 3),
        "sem": round(std / math.sqrt(n), 3),
        "min": round(float(np.min(values)), 3),
        "p5": round(float(pct[0]), 3),
        "p25": round(float(pct[1]), 3),
        "median": round(float(pct[2]), 3),
        "p75": round(float(pct[3]), 3),
        "p95": round(float(pct[4]), 3),
        "max": round(float(np.max(values)), 3),
    }


def _check(
    means: tuple[float, ...], horizon: int, runs: int, seed: int, exploration: float
) -> None:
    if len(means) < 2 or any(not (0.0 <= m <= 1.0 and math.isfinite(m)) for m in means):
        raise ValueError(
            f"means must be two or more Bernoulli means in [0, 1] (e.g. {DEFAULT_MEANS}), "
            f"got {means!r}"
        )
    if len(set(means)) == 1:
        raise ValueError(f"means must not all be equal (no arm is worse), got {means!r}")
    for name, value in (("horizon", horizon), ("runs", runs)):
        if not is_int(value, minimum=1):
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if not is_int(seed, minimum=0):
        raise ValueError(f"seed must be an integer >= 0 (e.g. 0), got {seed!r}")
    if not math.isfinite(exploration) or exploration < 0:
        raise ValueError(
            f"exploration must be a finite number >= 0 (e.g. 1.0), got {exploration!r}"
        )


def run_regret(
    out_dir: Path | None = None,
    *,
    means: tuple[float, ...] = DEFAULT_MEANS,
    horizon: int = DEFAULT_HORIZON,
    runs: int = DEFAULT_RUNS,
    seed: int = 0,
    exploration: float = 1.0,
    name: str = "regret",
    show_progress: bool = False,
    plot: bool = True,
) -> dict[str, Any]:
    """Simulate, summarise, and write ``<name>.json`` (and ``<name>.png``) into ``out_dir``.

    Args:
        out_dir: where the files go (default ``benchmarks/results``).
        means: the Bernoulli arms' means (two or more, in [0, 1]).
        horizon: pulls per run (T).
        runs: independent runs (seeds ``[seed, run]``).
        seed: base seed.
        exploration: UCB1's c.
        name: file stem.
        show_progress: a progress bar on stderr.
        plot: write the PNG too (when matplotlib is installed).

    Returns:
        What the JSON holds: ``machine``, ``setup``, ``bound``, ``selectors`` (final regret
        statistics and mean pulls per arm), ``curve`` (mean and 5th/95th percentiles of the
        cumulative regret at ``curve.t``, and the bound there) and ``reference``.
    """
    import numpy as np

    means = tuple(float(m) for m in means)
    _check(means, horizon, runs, seed, exploration)
    machine = machine_info()
    sims = simulate(means, horizon, runs, seed, exploration, show_progress)
    # Evenly spaced points for the linear plot, geometrically spaced ones for the log plot.
    points = min(CURVE_POINTS, horizon)
    spaced = np.concatenate([np.linspace(1, horizon, points), np.geomspace(1, horizon, points)])
    ts = np.unique(spaced.round().astype(int))
    curve: dict[str, Any] = {
        "t": ts.tolist(),
        "bound": [round(auer_bound(means, int(t)), 3) for t in ts],
    }
    selectors: dict[str, Any] = {}
    for kind in SELECTORS:
        at = sims[kind][:, ts - 1]
        curve[kind] = {
            "mean": np.round(at.mean(axis=0), 3).tolist(),
            "p5": np.round(np.percentile(at, 5, axis=0), 3).tolist(),
            "p95": np.round(np.percentile(at, 95, axis=0), 3).tolist(),
        }
        selectors[kind] = {
            "final_regret": _stats(sims[kind][:, -1]),
            "mean_pulls_per_arm": np.round(sims[f"{kind}_pulls"], 1).tolist(),
        }
    data: dict[str, Any] = {
        "machine": machine,
        "kind": "regret",
        "setup": {
            "arms": "Bernoulli",
            "means": list(means),
            "K": len(means),
            "horizon": horizon,
            "runs": runs,
            "seed": seed,
            "ucb1": f"UCB1Selector(c={exploration}, reward_scale=1.0): mean + c·√(2 ln t / n)",
            "thompson": "ThompsonSelector(reward_scale=1.0): Beta(1, 1) priors",
            "regret": "pseudo-regret t·μ* - Σ μ(chosen arm), averaged over runs",
            "rewards": "common random numbers: both selectors see the same draws per run",
            "command": " ".join(sys.argv),
        },
        "bound": {
            "formula": "Σ_{i: Δi > 0} 8 ln T / Δi + (1 + π²/3) Σ Δi (Auer et al. 2002, Thm 1)",
            "gaps": [round(max(means) - m, 10) for m in means if m < max(means)],
            "at_horizon": round(auer_bound(means, horizon), 3),
        },
        "selectors": selectors,
        "curve": curve,
        "reference": {
            "earlier_library": {
                "K": EARLIER_K,
                "T": EARLIER_T,
                "ucb1_bound": EARLIER_BOUND,
                "regret": EARLIER_REGRET,
            },
            "setups_nearest_bound_526": bound_search(EARLIER_BOUND, EARLIER_T, EARLIER_K),
        },
    }
    out = DEFAULT_OUT if out_dir is None else Path(out_dir)
    write_json(data, out / f"{name}.json")
    plt = pyplot() if plot else None
    if plt is not None:
        plot_regret(data, out / f"{name}.png", plt)
        print(f"wrote {out / f'{name}.png'}", file=sys.stderr)
    return data


def plot_regret(data: dict[str, Any], path: Path, plt: Any) -> None:
    """Mean cumulative regret against t (5th-95th percentile bands) and the UCB1 bound.

    Two panels: linear axes (the bound towers over both), and log-log axes, where Thompson
    sampling's regret and the early pulls are visible.
    """
    curve, setup = data["curve"], data["setup"]
    t = curve["t"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for ax, log in zip(axes, (False, True), strict=True):
        for kind, colour in zip(SELECTORS, ("tab:blue", "tab:orange"), strict=True):
            final = data["selectors"][kind]["final_regret"]
            label = f"{kind}: {final['mean']:.1f} ± {final['std']:.1f} at T"
            # Log axes: from the first t with positive mean regret (the first pulls may all
            # have gone to the best arm), or the line would plunge to log 0.
            first = next((i for i, m in enumerate(curve[kind]["mean"]) if m > 0), 0) if log else 0
            ax.plot(t[first:], curve[kind]["mean"][first:], color=colour, label=label)
            ax.fill_between(
                t[first:],
                curve[kind]["p5"][first:],
                curve[kind]["p95"][first:],
                color=colour,
                alpha=0.2,
            )
        bound = data["bound"]["at_horizon"]
        ax.plot(t, curve["bound"], "k--", label=f"UCB1 bound (Auer 2002): {bound:.1f} at T")
        ax.set_xlabel("t (pulls)")
        ax.set_ylabel("cumulative pseudo-regret")
        if log:
            ax.set_xscale("log")
            ax.set_yscale("log")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="lower right" if log else "upper left")
    means = ", ".join(f"{m:g}" for m in setup["means"])
    fig.suptitle(
        f"Bernoulli arms ({means}), T = {setup['horizon']:,}, {setup['runs']} runs: "
        "mean, 5th-95th percentile band",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------------- CLI


def probabilities(text: str) -> tuple[float, ...]:
    """argparse type: comma-separated Bernoulli means, e.g. ``0.9,0.7,0.4``."""
    try:
        means = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be comma-separated numbers such as 0.9,0.7,0.4, got {text!r}"
        ) from None
    if len(means) < 2 or not all(0.0 <= m <= 1.0 for m in means) or len(set(means)) == 1:
        raise argparse.ArgumentTypeError(
            f"must be two or more means in [0, 1], not all equal (e.g. 0.9,0.7,0.4), got {text!r}"
        )
    return means


HELP = "selectors' synthetic regret on Bernoulli arms"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``flashspec bench regret`` options (besides ``--quick``/``--out-dir``/...)."""
    parser.add_argument(
        "--means",
        type=probabilities,
        default=DEFAULT_MEANS,
        help="Bernoulli means of the arms (default 0.9,0.7,0.4)",
    )
    parser.add_argument(
        "--horizon",
        type=argtypes.positive_int,
        default=None,
        help=f"pulls per run, T (default {DEFAULT_HORIZON:,}; {QUICK_HORIZON:,} with --quick)",
    )
    parser.add_argument(
        "--runs",
        type=argtypes.positive_int,
        default=None,
        help=f"runs averaged (default {DEFAULT_RUNS}; {QUICK_RUNS} with --quick)",
    )
    parser.add_argument(
        "--seed", type=argtypes.nonnegative_int, default=0, help="base seed (default 0)"
    )
    parser.add_argument(
        "--exploration",
        type=argtypes.finite_float,
        default=1.0,
        help="UCB1's exploration constant c (default 1)",
    )
    parser.add_argument("--name", default="regret", help="result file stem (default regret)")


def main(args: argparse.Namespace) -> int:
    """``flashspec bench regret``."""
    if args.exploration < 0:
        raise SystemExit(f"--exploration must be >= 0, got {args.exploration}")
    horizon = args.horizon or (QUICK_HORIZON if args.quick else DEFAULT_HORIZON)
    runs = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    data = run_regret(
        Path(args.out_dir),
        means=tuple(args.means),
        horizon=horizon,
        runs=runs,
        seed=args.seed,
        exploration=args.exploration,
        name=args.name,
        show_progress=not args.no_progress,
    )
    print(
        f"Bernoulli arms {tuple(data['setup']['means'])}, T = {horizon:,}, {runs} runs: "
        f"UCB1 bound {data['bound']['at_horizon']:.1f}"
    )
    for kind in SELECTORS:
        f = data["selectors"][kind]["final_regret"]
        print(
            f"  {kind:<9} regret {f['mean']:.1f} ± {f['std']:.1f} (sd; sem {f['sem']:.1f}), "
            f"median {f['median']:.1f}, 5-95% [{f['p5']:.1f}, {f['p95']:.1f}]"
        )
    return 0
