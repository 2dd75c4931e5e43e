"""``flashspec bench adaptive`` code paths on tiny random models: workloads, schema, checks."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

import numpy as np
import pytest

from flashspec import ModelDrafter, PromptLookupDrafter, TargetModel, bench
from flashspec.bench import adaptive as A
from tests.helpers.models import build_char_tokenizer, build_llama, perturbed_copy


def test_copy_prompts_end_with_the_renamed_header() -> None:
    prompts = A.copy_prompts(3)
    assert prompts, "no held-out stdlib function found"
    for prompt in prompts:
        assert prompt.source == "copy"
        body, header = prompt.text.rstrip("\n").rsplit("\n\n\n", 1)
        name = prompt.id.rsplit(".", 1)[1]
        first = body.splitlines()[0]
        assert first.startswith(f"def {name}") and first[len(f"def {name}")] in " ("
        # The header is the function's own first line under the new name.
        assert header == f"def {name}_copy" + first[len(f"def {name}") :]


def test_mixed_stream_keeps_each_workload_in_order() -> None:
    he = [bench.Prompt(f"h{i}", "humaneval", "x") for i in range(5)]
    cp = [bench.Prompt(f"c{i}", "copy", "y") for i in range(5)]
    stream = A.mixed_stream(he, cp, seed=3)
    assert sorted(p.id for p in stream) == sorted(p.id for p in he + cp)
    assert [p for p in stream if p.source == "humaneval"] == he
    assert [p.id for p in stream] != [p.id for p in he + cp]  # actually shuffled


MAX_NEW = 6


def tiny_regime(name: str, seeds: int = 1) -> dict[str, Any]:
    tokenizer = build_char_tokenizer()
    target_model = build_llama(0, layers=2)
    target = TargetModel(model=target_model, tokenizer=tokenizer)
    drafters: list[Any] = [
        ModelDrafter(perturbed_copy(target_model, 0.05, seed=1), name="tiny-draft"),
        PromptLookupDrafter(),
    ]
    texts = [("humaneval", "def add(a, b):\n    return"), ("copy", "abc abc abc abc")]
    stream = [
        (bench.Prompt(f"tiny/{i}", source, text), tokenizer(text)["input_ids"])
        for i, (source, text) in enumerate(texts)
    ]
    args = argparse.Namespace(
        window=None,
        exploration=0.3,
        max_new_tokens=MAX_NEW,
        no_progress=True,
        selectors=A.SELECTORS,
        seeds=seeds,
    )
    return A.run_regime(name, target, drafters, stream, args)


@pytest.fixture(scope="module")
def regime() -> dict[str, Any]:
    # Greedy makes one pass whatever --seeds says.
    return tiny_regime("greedy", seeds=3)


def test_regime_schema(regime: dict[str, Any]) -> None:
    json.dumps(regime)
    assert set(regime) == set(A.WORKLOADS)
    for entry in regime.values():
        fixed = entry["fixed"]
        # 2 drafters x 3 gammas + plain, each drafter with dynamic gamma, the model drafter
        # with the confidence stop.
        assert len(fixed) == 2 * len(A.FIXED_GAMMAS) + 1 + 2 + 1, sorted(fixed)
        assert "plain" in fixed and all(tps > 0 for tps in fixed.values())
        assert entry["best_fixed"]["tokens_per_second"] == max(fixed.values())
        assert set(entry["adaptive"]) == {f"adaptive-{s}" for s in A.SELECTORS}
        for run in entry["adaptive"].values():
            assert run["tokens_per_second"] > 0
            assert run["beats_every_fixed"] == (run["vs_best_fixed"] > 1)
            assert sum(run["arm_rounds"].values()) > 0
            # Every row-round emits at least one token and at most its drafts plus one.
            per_round = run["per_round"]
            assert 1 <= per_round["emitted"] <= per_round["drafted"] + 1
            assert 0 <= per_round["draft_ms"] <= per_round["ms"]
        best = entry["best_fixed"]["per_round"]
        assert 1 <= best["emitted"] <= best["drafted"] + 1
        # The raw runs are stored, and they add up to the reported speeds.
        assert set(entry["per_prompt"]) == set(fixed) | set(entry["adaptive"])
        for name, runs in entry["per_prompt"].items():
            tps = sum(t for _, t, _ in runs) / sum(s for _, _, s in runs)
            reported = fixed.get(name) or entry["adaptive"][name]["tokens_per_second"]
            assert tps == pytest.approx(reported, abs=0.01), name
    # One prompt per workload: nothing to hold out; the mixed stream has two.
    assert regime["humaneval"]["held_out_best_fixed"] == {"tokens_per_second": 0.0, "chosen": []}
    held_out = regime["mixed"]["held_out_best_fixed"]
    assert len(held_out["chosen"]) == 2 and held_out["tokens_per_second"] > 0
    for run in regime["mixed"]["adaptive"].values():
        assert run["vs_held_out_best_fixed"] == pytest.approx(
            run["tokens_per_second"] / held_out["tokens_per_second"], rel=1e-3
        )


def test_regime_interval_holds_the_ratio(regime: dict[str, Any]) -> None:
    for entry in regime.values():
        for run in entry["adaptive"].values():
            low, high = run["vs_best_fixed_ci95"]
            # The whole-workload ratio is one of the resamples' ratios' neighbours: inside the
            # interval, give or take the rounding of the stored numbers.
            assert low - 1e-3 <= run["vs_best_fixed"] <= high + 1e-3


def test_paired_interval_against_exact_ratios() -> None:
    base = {seed: (100, 1.0 + 0.1 * seed) for seed in range(30)}
    # Same runs: ratio 1 in every resample.
    assert A.paired_interval(base, base) == pytest.approx((1.0, 1.0))
    # Twice as fast on every prompt: exactly 2, however prompts are resampled.
    fast = {seed: (tokens, seconds / 2) for seed, (tokens, seconds) in base.items()}
    assert A.paired_interval(fast, base) == pytest.approx((2.0, 2.0))
    # Faster on half the prompts only: the interval straddles the whole-stream ratio and is
    # wide, since which prompts a resample draws moves the ratio.
    mixed = {s: (t, sec / (2 if s % 2 else 1)) for s, (t, sec) in base.items()}
    whole = (sum(t for t, _ in mixed.values()) / sum(x for _, x in mixed.values())) / (
        sum(t for t, _ in base.values()) / sum(x for _, x in base.values())
    )
    low, high = A.paired_interval(mixed, base)
    assert low < whole < high and high - low > 0.1
    # Prompts that do not pair up give no interval.
    assert all(map(math.isnan, A.paired_interval(base, {0: (1, 1.0)})))


def test_held_out_best_chooses_on_the_other_half() -> None:
    # Prompts 0, 2 form one half, 1, 3 the other. "a" is fastest on the first, "b" on the
    # second: each half is measured with the configuration the other half chose.
    runs = {
        "a": {0: (100, 1.0), 1: (100, 4.0), 2: (100, 1.0), 3: (100, 4.0)},
        "b": {0: (100, 2.0), 1: (100, 2.0), 2: (100, 2.0), 3: (100, 2.0)},
        "c": {0: (100, 8.0), 1: (100, 8.0), 2: (100, 8.0), 3: (100, 8.0)},
    }
    tps, chosen = A.held_out_best(runs)
    assert chosen == ["b", "a"]
    # Half {0, 2} measured with b (4 s), half {1, 3} with a (8 s).
    assert tps == pytest.approx(400 / 12)
    assert A.held_out_best({"a": {0: (1, 1.0)}}) == (0.0, [])


def test_held_out_best_is_free_of_the_maximums_bias() -> None:
    # 15 configurations of the same true speed (100 tokens/s) measured with 10% noise per
    # prompt: the largest of the measured speeds overstates it, the held-out choice does not.
    rng = np.random.default_rng(0)
    largest, held_out = [], []
    for _ in range(200):
        runs = {
            f"arm{i}": {k: (100, float(np.exp(rng.normal(0.0, 0.1)))) for k in range(40)}
            for i in range(15)
        }
        largest.append(max(A._rate(r, set(range(40))) for r in runs.values()))
        held_out.append(A.held_out_best(runs)[0])
    assert np.mean(largest) > 102.0
    assert abs(np.mean(held_out) - 100.0) < 0.5


def test_mixed_fixed_numbers_pool_both_workloads(regime: dict[str, Any]) -> None:
    # A fixed configuration keeps no state between prompts, so its mixed-stream speed lies
    # between its speeds on the two workloads.
    for name, tps in regime["mixed"]["fixed"].items():
        a, b = regime["humaneval"]["fixed"][name], regime["copy"]["fixed"][name]
        assert min(a, b) - 0.01 <= tps <= max(a, b) + 0.01, name


def test_targets_follow_the_numbers(regime: dict[str, Any]) -> None:
    checks = A.check_targets({"greedy": regime}, A.SELECTORS)
    assert set(checks) == {f"greedy/adaptive-{s}" for s in A.SELECTORS}
    for key, verdict in checks.items():
        run = regime["mixed"]["adaptive"][key.split("/")[1]]
        assert verdict["beats_every_fixed_on_mixed"] == run["beats_every_fixed"]
        ratios = [regime[w]["adaptive"][key.split("/")[1]]["vs_plain"] for w in A.WORKLOADS]
        assert verdict["within_5pct_of_plain_or_faster"] == all(r >= 0.95 for r in ratios)


def test_selector_list_option() -> None:
    assert A._selector_list("model, ucb1,model") == ("model", "ucb1")
    for bad in ("", "eps", "model,eps"):
        with pytest.raises(argparse.ArgumentTypeError, match="one or more of model"):
            A._selector_list(bad)


def test_sampled_passes_add_up_per_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[str, int, int]] = []
    run = A.Config.run

    def record(
        self: A.Config, workload: str, ids: list[int], max_new: int, seed: int, prompt: int
    ) -> None:
        seen.append((self.name, seed, prompt))
        run(self, workload, ids, max_new, seed, prompt)

    monkeypatch.setattr(A.Config, "run", record)
    sampled = tiny_regime("sample", seeds=2)
    configs = len(sampled["humaneval"]["fixed"]) + 2 * len(A.SELECTORS)
    # Two passes over both prompts, every configuration once per prompt and pass, each pass
    # under its own seeds.
    assert len(seen) == 2 * 2 * configs
    assert {seed for _, seed, _ in seen} == {1000, 1001, 1000 + A.SEED_STRIDE, 1001 + A.SEED_STRIDE}
    # A fresh order per prompt: the same configuration does not always run first.
    firsts = {seen[i * configs][0] for i in range(4)}
    assert len(firsts) > 1, firsts
    # Greedy output is the same under every seed: one pass.
    seen.clear()
    tiny_regime("greedy", seeds=2)
    assert len(seen) == 2 * configs and {seed for _, seed, _ in seen} == {1000, 1001}


def test_runs_of_one_prompt_add_up() -> None:
    class Engine:
        def generate(self, ids: list[int], **kwargs: Any) -> Any:
            stats = argparse.Namespace(
                new_tokens=5,
                time_total=0.5,
                row_rounds=1,
                drafted=0,
                emitted=5,
                time_draft=0.0,
                arm_rounds={"plain": 1},
            )
            return argparse.Namespace(stats=stats)

    config = A.Config("x", "plain", Engine())  # type: ignore[arg-type]
    config.run("copy", [1], 5, seed=1000, prompt=0)
    config.run("copy", [1], 5, seed=1000 + A.SEED_STRIDE, prompt=0)
    config.run("copy", [1], 5, seed=1001, prompt=1)
    assert config.per_prompt["copy"] == {0: (10, 1.0), 1: (5, 0.5)}
