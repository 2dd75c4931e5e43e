"""The shipped SmolLM2 draft (``flashspec/drafts/smollm2``) against what users already have.

    python benchmarks/smollm2_draft.py                       # 6 HumanEval + 6 chat prompts
    python benchmarks/smollm2_draft.py --humaneval 2 --chat 2 --max-new-tokens 32 --quick

Held-out prompts, as chat requests (the tokenizer's chat template; every method stops at the
end of turn): HumanEval functions to complete (``flashspec bench engine``'s requests; HumanEval
is kept out of the draft's training data) and everyday requests written for this file, whose
topics and wording are not among ``scripts/draft_chat_data.py``'s.

Methods, run on each prompt one after another in a rotating order, after an untimed warm-up:

- ``hf_greedy`` / ``hf_greedy_bf16``: HF ``generate``, greedy, float32 / bfloat16 weights;
- ``fs_draft`` / ``fs_draft_bf16``: ``flashspec generate --target smollm2 --drafter model
  --gamma 4``: the shipped draft every round, 4 drafts (acceptance and tokens per round of the
  draft alone);
- ``fs_default`` / ``fs_default_bf16``: ``flashspec generate --target smollm2``: the shipped
  draft, prompt lookup and plain decoding, chosen each round by the throughput model;
- ``fs_lookup`` / ``fs_lookup_bf16``: the same without the draft (``--drafter prompt-lookup
  --adaptive``: prompt lookup and plain decoding), the default before the draft shipped;
- ``hf_sample`` / ``fs_sample`` (float32) and ``hf_sample_bf16`` / ``fs_sample_bf16``:
  temperature 0.7, top-p 0.95; flashspec with the default engine. Speedups of sampled runs are
  ratios of tokens per second (the answers differ; their distribution is the target's, which
  the chi-squared tests check);
- with ``--tree``: ``fs_draft_tree`` (the draft every round, a token tree of that shape),
  ``fs_merged_tree`` (the draft's tree and prompt lookup's merged into one,
  ``--drafter model+prompt-lookup``), ``fs_tree`` and ``fs_tree_sample`` (the default engine
  with trees);
- ``_q`` rows (unless ``--no-gguf``): the same engines on the default load, the GGUF file's
  blocks through flashspec's quantized kernels (exactly the dequantized float32 weights),
  measured against HF float32;
- ``llamacpp``: llama.cpp on the same GGUF and token ids, greedy, when ``llama_cpp`` imports.

HF assisted generation is not among them: the shipped draft reads the target's hidden states,
so it has no standalone form an ``assistant_model`` could take.

Step costs (``costs``): per dtype, one decode step of the target (one token after a 64-token
prompt, on its cache), its verify of gamma + 1 tokens (and the same with torch's own linear layers,
``flashspec.models.untuned``), and one draft step (the draft's head
and one layer on its own state), timed alternately, medians of ``COST_REPEATS``; from them a
round's cost in target steps and the per-draft acceptance a 1.5x or 1.8x speedup needs at that
cost (a ceiling: the round's bookkeeping is left out).

Greedy rows are checked token for token against HF greedy of the same dtype (a tie at the
first difference, within the dtype's rounding, counts as equal:
``flashspec.bench.identity.compare_greedy``).

Writes ``benchmarks/results/smollm2-draft.json`` (or ``--out``): machine, versions, git sha,
the draft's card, per-prompt records, and per workload and method the medians of tokens/s
ratios, acceptance, tokens per round and identity counts. Not a test: numbers depend on load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flashspec.bench.chat_requests import ChatRequest, chat_ids, humaneval_requests
from flashspec.bench.common import machine_info, progress, quiet_timing, write_json
from flashspec.bench.identity import compare_greedy
from flashspec.drafters import FeatureDrafter
from flashspec.drafters.shared_head import feature_hidden
from flashspec.flags.options import EngineOptions
from flashspec.loading.drafts import bundled_draft
from flashspec.models import ForwardSignature, crop_cache, new_cache, untuned
from flashspec.trees import TreeShape

RESULTS = Path(__file__).resolve().parent / "results"
CHAT_PROMPTS = (
    "What are the main differences between Python 2 and Python 3?",
    "Write a short poem about autumn leaves.",
    "How do I read a file line by line in Python?",
    "Summarise the plot of Romeo and Juliet in three sentences.",
    "What is the difference between TCP and UDP?",
    "Give me a simple recipe for pancakes.",
    "Why do cats purr?",
    "How can I speed up a slow SQL query?",
)
SAMPLING = {"temperature": 0.7, "top_p": 0.95}
SUFFIX = {"float32": "", "bfloat16": "_bf16", "gguf": "_q"}
"""Method-name suffix per load: float32 and bfloat16 dequantize the file, gguf keeps its
blocks (the default engine, ``flashspec.quant``)."""
GREEDY_METHODS = ("fs_draft", "fs_default")
SAMPLED = ("hf_sample", "fs_sample")


def requests(humaneval: int, chat: int) -> list[ChatRequest]:
    """The held-out chat requests of a run."""
    talk = [ChatRequest(f"chat/{i}", "chat", "chat", text) for i, text in enumerate(CHAT_PROMPTS)]
    return humaneval_requests(humaneval) + talk[:chat]


class Methods:
    """The engines and HF models of a run; ``run(method, ids, n)`` times one generation."""

    def __init__(
        self, gamma: int, dtypes: tuple[str, ...], tree: TreeShape | None = None
    ) -> None:
        self.engines: dict[str, Any] = {}
        self.models: dict[str, Any] = {}
        self.flags: dict[str, str] = {}
        for load in dtypes:
            # "gguf": the default load (the file's blocks), whose outputs are float32's.
            suffix = SUFFIX[load]
            dtype = "auto" if load == "gguf" else load
            base = "flashspec generate --target smollm2"
            dflag = {"float32": " --dtype float32", "bfloat16": " --dtype bfloat16"}.get(load, "")
            builds = {
                "fs_draft": (EngineOptions(target="smollm2", drafter="model", gamma=gamma,
                                           dtype=dtype), f"{base} --drafter model --gamma {gamma}"),
                "fs_default": (EngineOptions(target="smollm2", dtype=dtype), base),
                "fs_lookup": (EngineOptions(target="smollm2", drafter="prompt-lookup",
                                            adaptive=True, dtype=dtype),
                              f"{base} --drafter prompt-lookup --adaptive"),
                "fs_sample": (EngineOptions(target="smollm2", dtype=dtype, seed=0, **SAMPLING),
                              f"{base} --temperature 0.7 --top-p 0.95"),
            }  # fmt: skip
            if tree is not None:
                shape = f" --tree {tree}"
                builds["fs_draft_tree"] = (EngineOptions(target="smollm2", drafter="model",
                                           gamma=gamma, dtype=dtype, tree=str(tree)),
                                           f"{base} --drafter model --gamma {gamma}{shape}")
                builds["fs_merged_tree"] = (EngineOptions(target="smollm2",
                                            drafter="model+prompt-lookup", gamma=gamma,
                                            dtype=dtype, tree=str(tree)),
                                            f"{base} --drafter model+prompt-lookup --gamma "
                                            f"{gamma}{shape}")
                builds["fs_tree"] = (EngineOptions(target="smollm2", dtype=dtype, tree=str(tree)),
                                     base + shape)
                builds["fs_tree_sample"] = (EngineOptions(target="smollm2", dtype=dtype, seed=0,
                                            tree=str(tree), **SAMPLING),
                                            f"{base} --temperature 0.7 --top-p 0.95{shape}")
            for name, (options, flag) in builds.items():
                self.engines[name + suffix] = options.build()
                self.flags[name + suffix] = flag + dflag
            if load != "gguf":
                self.models[load] = self.engines["fs_default" + suffix].target.model
        first = self.engines[next(iter(self.engines))]
        self.tokenizer = first.tokenizer
        self.eos = list(first.target.eos_token_ids)
        self.llama: Any = None
        self.notes: dict[str, str] = {}

    def setup_llamacpp(self) -> None:
        """llama.cpp on the same GGUF, if ``llama_cpp`` imports (else a note says why not)."""
        from flashspec.loading import resolve_named

        try:
            import llama_cpp
        except ImportError as exc:
            self.notes["llamacpp"] = f"skipped: llama_cpp is not importable ({exc})"
            return
        threads = torch.get_num_threads()
        self.llama = llama_cpp.Llama(
            model_path=resolve_named("smollm2"), n_threads=threads, n_threads_batch=threads,
            n_ctx=4096, logits_all=False, verbose=False,
        )  # fmt: skip
        self.notes["llamacpp"] = f"llama-cpp-python {llama_cpp.__version__}, {threads} threads"

    def names(self) -> list[str]:
        hf = ("hf_greedy", "hf_greedy_bf16", "hf_sample", "hf_sample_bf16")
        out = [m for m in hf if reference_dtype(m) in self.models]
        return out + list(self.engines) + (["llamacpp"] if self.llama is not None else [])

    def run(self, method: str, ids: list[int], n: int) -> dict[str, Any]:
        x = torch.tensor([ids], dtype=torch.int64)
        record: dict[str, Any] = {}
        with quiet_timing():
            start = time.perf_counter()
            if method in self.engines:
                result = self.engines[method].generate(input_ids=x, max_new_tokens=n)
                tokens = list(result.tokens[0])
                stats = result.stats
                record.update(rounds=stats.rounds, drafted=stats.drafted, accepted=stats.accepted,
                              arm_rounds=dict(stats.arm_rounds))  # fmt: skip
            elif method == "llamacpp":
                tokens = self._llamacpp(ids, n)
            else:
                model = self.models[reference_dtype(method)]
                sample = method.startswith("hf_sample")
                with untuned(model), torch.inference_mode():  # HF's own linear layers
                    out = model.generate(
                        x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=sample,
                        temperature=SAMPLING["temperature"] if sample else None,
                        top_p=SAMPLING["top_p"] if sample else None, top_k=None,
                        eos_token_id=self.eos, pad_token_id=self.eos[0],
                    )  # fmt: skip
                tokens = out[0, len(ids) :].tolist()
            seconds = time.perf_counter() - start
        record.update(tokens=[int(t) for t in tokens], seconds=seconds)
        return record

    def _llamacpp(self, ids: list[int], n: int) -> list[int]:
        tokens: list[int] = []
        self.llama.reset()
        for token in self.llama.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0,
                                         reset=True):  # fmt: skip
            tokens.append(int(token))
            if int(token) in self.eos or len(tokens) >= n:
                break
        return tokens


COST_REPEATS = 48
GOALS = (1.5, 1.8)
"""Speedups whose break-even acceptance ``step_costs`` reports (the issue's targets)."""


def tokens_per_round(alpha: float, gamma: int) -> float:
    """Expected tokens a round yields when each draft is accepted with probability ``alpha``
    (given the earlier ones were): 1 + alpha + ... + alpha ** gamma."""
    return float(sum(alpha**k for k in range(gamma + 1)))


def needed_acceptance(goal: float, round_cost: float, gamma: int) -> float | None:
    """The per-draft acceptance at which ``tokens_per_round / round_cost`` (a round's cost in
    target steps, overheads left out, so a ceiling) reaches ``goal``; None if even 1.0 does not."""
    if tokens_per_round(1.0, gamma) < goal * round_cost:
        return None
    low, high = 0.0, 1.0
    for _ in range(40):
        mid = (low + high) / 2
        low, high = (mid, high) if tokens_per_round(mid, gamma) < goal * round_cost else (low, mid)
    return math.ceil(high * 1e4) / 1e4  # rounded up: what it reports does reach the goal


@torch.inference_mode()
def step_costs(methods: Methods, ids: list[int], gamma: int) -> dict[str, dict[str, Any]]:
    """Per load (float32, bfloat16, gguf): the target's one-token step, its (gamma + 1)-token
    verify and the draft's one-token step (ms, medians, timed alternately on caches cropped
    back each time); a round's cost in target steps (verify + gamma drafts) and the
    acceptance each of ``GOALS`` needs at that cost."""
    out: dict[str, dict[str, Any]] = {}
    for name, engine in methods.engines.items():
        if not name.startswith("fs_draft"):
            continue
        drafter = next(d for d in engine.drafters if isinstance(d, FeatureDrafter))
        draft, model = drafter.draft, engine.target.model
        prompt = torch.tensor([ids[:64]], dtype=torch.int64)
        target_cache = {ForwardSignature.of(model).cache_arg: new_cache(model)}
        hidden = model.model(input_ids=prompt, **target_cache, use_cache=True).last_hidden_state
        token = model.lm_head(hidden[:, -1:]).argmax(-1)
        draft_cache = {ForwardSignature.of(draft).cache_arg: new_cache(draft)}
        state = feature_hidden(draft, hidden[:, :-1], prompt[:, 1:], **draft_cache)[:, -1:]
        cache = target_cache[ForwardSignature.of(model).cache_arg]
        length = cache.get_seq_length()
        block = token.repeat(1, gamma + 1)
        target_ms: list[float] = []
        verify_ms: list[float] = []
        stock_ms: list[float] = []  # the verify with torch's own linear layers (untuned)
        draft_ms: list[float] = []
        for _ in range(COST_REPEATS):
            start = time.perf_counter()
            model(input_ids=token, **target_cache, use_cache=True)
            target_ms.append((time.perf_counter() - start) * 1e3)
            crop_cache(cache, cache.get_seq_length() - length)
            start = time.perf_counter()
            model(input_ids=block, **target_cache, use_cache=True)
            verify_ms.append((time.perf_counter() - start) * 1e3)
            crop_cache(cache, cache.get_seq_length() - length)
            with untuned(model):
                start = time.perf_counter()
                model(input_ids=block, **target_cache, use_cache=True)
                stock_ms.append((time.perf_counter() - start) * 1e3)
            crop_cache(cache, cache.get_seq_length() - length)
            start = time.perf_counter()
            drafted = draft.lm_head(state).argmax(-1)
            state = feature_hidden(draft, state, drafted, **draft_cache)
            draft_ms.append((time.perf_counter() - start) * 1e3)
        t, v, d = (statistics.median(x) for x in (target_ms, verify_ms, draft_ms))
        round_cost = v / t + gamma * d / t
        load = "gguf" if name.endswith("_q") else reference_dtype(name)
        out[load] = {
            "target_step_ms": round(t, 3), "verify_ms": round(v, 3), "draft_step_ms": round(d, 3),
            "draft_over_target": round(d / t, 4), "verify_over_target": round(v / t, 4),
            "round_over_target": round(round_cost, 4),
            "verify_untuned_over_target": round(statistics.median(stock_ms) / t, 4),
            "needed_acceptance": {str(g): needed_acceptance(g, round_cost, gamma) for g in GOALS},
        }  # fmt: skip
    return out


def reference_dtype(method: str) -> str:
    """The dtype of the HF model a method is measured against: the quantized load's weights
    take exactly their dequantized float32 values (and its greedy output is float32's)."""
    return "bfloat16" if method.endswith("_bf16") else "float32"


def baseline(method: str) -> str:
    """What a method's speedup is measured against: HF of the same dtype and decoding."""
    stem = method.removesuffix("_bf16").removesuffix("_q")
    kind = "hf_sample" if stem.endswith("sample") else "hf_greedy"
    return kind + ("_bf16" if method.endswith("_bf16") else "")


def measure(methods: Methods, chosen: list[ChatRequest], n: int) -> list[dict[str, Any]]:
    names = methods.names()
    records = []
    for index, request in enumerate(progress(chosen, desc="prompts", unit="prompt")):
        ids = chat_ids(methods.tokenizer, request)
        order = names[index % len(names) :] + names[: index % len(names)]
        done = {name: methods.run(name, ids, n) for name in order}
        runs = {name: done[name] for name in names}  # run rotated, recorded in one order
        for run in runs.values():
            run["new_tokens"] = len(run["tokens"])
            run["tokens_per_second"] = len(run["tokens"]) / run["seconds"]
        for name, run in runs.items():
            base = runs[baseline(name)]
            run["speedup"] = run["tokens_per_second"] / base["tokens_per_second"]
            if "sample" not in name and not name.startswith("hf_"):
                model = methods.models[reference_dtype(name)]
                verdict = compare_greedy(model, ids, run["tokens"], base["tokens"])
                run["identity"] = verdict.status
        records.append({"id": request.id, "workload": request.workload,
                        "prompt_tokens": len(ids), "methods": runs})  # fmt: skip
    return records


def summarise(records: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in records[0]["methods"]:
        runs = [r["methods"][name] for r in records]
        entry: dict[str, Any] = {
            "prompts": len(runs),
            "baseline": baseline(name),
            "speedup_median": round(statistics.median(r["speedup"] for r in runs), 4),
            "tokens_per_second_median": round(
                statistics.median(r["tokens_per_second"] for r in runs), 2
            ),
            "new_tokens_mean": round(statistics.mean(r["new_tokens"] for r in runs), 1),
        }
        if "drafted" in runs[0]:
            drafted = sum(r["drafted"] for r in runs)
            accepted = sum(r["accepted"] for r in runs)
            entry["acceptance_rate"] = round(accepted / drafted, 4) if drafted else None
            entry["tokens_per_round"] = round(
                sum(r["new_tokens"] for r in runs) / sum(r["rounds"] for r in runs), 3
            )
            arms: dict[str, int] = {}
            for r in runs:
                for arm, count in r["arm_rounds"].items():
                    arms[arm] = arms.get(arm, 0) + count
            entry["arm_rounds"] = arms
        if "identity" in runs[0]:
            statuses = [r["identity"] for r in runs]
            entry["identity"] = {s: statuses.count(s) for s in ("identical", "tie", "mismatch")}
        out[name] = entry
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--humaneval", type=int, default=6, help="HumanEval requests (6)")
    parser.add_argument("--chat", type=int, default=6, help=f"chat requests (6, at most "
                        f"{len(CHAT_PROMPTS)})")  # fmt: skip
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--no-bf16", action="store_true", help="no bfloat16 engines")
    parser.add_argument("--no-gguf", action="store_true",
                        help="no engines on the default load (the GGUF file's blocks, '_q')")
    parser.add_argument("--tree", type=TreeShape.parse, default=None, metavar="DEPTH,NODES,TOP_K",
                        help="also run the engines with token trees of this shape "
                        "(fs_draft_tree, fs_tree, fs_tree_sample)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="a smoke run (no llama.cpp)")
    parser.add_argument("--out", type=Path, default=RESULTS / "smollm2-draft.json")
    args = parser.parse_args(argv)
    folder = bundled_draft("smollm2")
    if folder is None:
        print("no shipped smollm2 draft in this flashspec (flashspec/drafts/smollm2)")
        return 2
    began = time.perf_counter()
    machine = machine_info()  # the load average at the start (write_json adds the end's)
    dtypes = ("float32",) + (() if args.no_bf16 else ("bfloat16",))
    dtypes += () if args.no_gguf else ("gguf",)
    methods = Methods(args.gamma, dtypes, args.tree)
    if not args.quick:
        methods.setup_llamacpp()
    chosen = requests(args.humaneval, args.chat)
    warm = chat_ids(methods.tokenizer, chosen[0])
    for name in methods.names():
        methods.run(name, warm, 8)
    costs = step_costs(methods, warm, args.gamma)
    records = measure(methods, chosen, args.max_new_tokens)
    summary = {
        workload: summarise([r for r in records if r["workload"] == workload])
        for workload in dict.fromkeys(r["workload"] for r in records)
    }
    for rows in summary.values():
        for name, row in rows.items():
            if name.startswith("fs_draft") and row.get("tokens_per_round"):
                # The draft every round at a fixed gamma: the per-draft acceptance its tokens per
                # round imply, to set beside what each goal needs.
                row["per_draft_acceptance"] = needed_acceptance(
                    row["tokens_per_round"], 1.0, args.gamma
                )
    card_path = folder / "card.json"
    data = {
        "machine": machine,
        "kind": "smollm2-draft",
        "settings": {
            "max_new_tokens": args.max_new_tokens,
            "gamma": args.gamma,
            "tree": None if args.tree is None else dataclasses.asdict(args.tree),
            "sampling": SAMPLING,
            "engines": methods.flags,
            "speedup": "median over prompts of the tokens/s ratio to the baseline (HF of the "
            "same dtype and decoding), new tokens over the wall seconds of the whole call",
            "notes": {
                **methods.notes,
                "hf_assisted": "not measured: the shipped draft reads the target's hidden "
                "states and has no standalone form for assistant_model",
            },
        },
        "draft_card": json.loads(card_path.read_text()) if card_path.exists() else None,
        "costs": costs,
        "summary": summary,
        "prompts": records,
        "wall_seconds": round(time.perf_counter() - began, 1),
    }
    write_json(data, args.out)
    for workload, rows in summary.items():
        print(f"== {workload}")
        for name, row in rows.items():
            extra = "".join(
                f" {key}={row[key]}"
                for key in ("acceptance_rate", "tokens_per_round", "identity")
                if key in row
            )
            print(f"{name:16s} {row['speedup_median']:.3f}x vs {row['baseline']}"
                  f" ({row['tokens_per_second_median']} tok/s){extra}")  # fmt: skip
    for dtype, cost in costs.items():
        print(f"step cost {dtype}: draft {cost['draft_step_ms']} ms / target "
              f"{cost['target_step_ms']} ms = {cost['draft_over_target']}; round "
              f"{cost['round_over_target']} target steps; acceptance needed "
              f"{cost['needed_acceptance']}")  # fmt: skip
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
