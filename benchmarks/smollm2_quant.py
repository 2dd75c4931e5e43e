"""SmolLM2-135M from its GGUF file on the quantized path against what a CPU user would pick.

    python benchmarks/smollm2_quant.py                        # 6 HumanEval + 6 chat requests
    python benchmarks/smollm2_quant.py --humaneval 1 --chat 1 --max-new-tokens 16 --quick
    python benchmarks/smollm2_quant.py --target PATH.gguf --out FILE   # another GGUF of it
    python benchmarks/smollm2_quant.py --memory               # resident memory only

Methods, on each held-out chat request one after another in a rotating order, after an
untimed warm-up, greedy, 128 new tokens, the same token ids for every method:

- ``hf_fp32`` / ``hf_bf16``: HF ``generate`` on transformers' dequantized GGUF model (float32 /
  bfloat16 weights, transformers' own layers and forward);
- ``fs_plain``: flashspec's target on the quantized path, plain decoding (one forward a token,
  the argmax): what the kernels and the forward give without speculation;
- ``fs_default``: ``flashspec generate --target smollm2`` (the default engine: quantized layers,
  the shipped draft, prompt lookup and plain decoding chosen per round);
- ``llamacpp`` / ``llamacpp_lookup``: llama.cpp (llama-cpp-python) on the same GGUF, plain and
  with its own prompt-lookup drafting, the same thread count.

Greedy rows of flashspec are checked against ``hf_fp32`` (transformers' dequantized model) under
the tie rule (``flashspec.bench.identity.compare_greedy``); llama.cpp's against it too (it
quantizes activations, so its text may differ). Resident memory after loading each method's
model, and again after it generated the reply to the first chat request, is measured in a fresh
process (``--rss METHOD``), beside two references: ``imports``,
a process that only imports torch and transformers' Llama model code (what any engine built on
transformers' models holds before a weight loads), and ``llamacpp_alone``, llama.cpp loaded in
a process without torch (the ``llamacpp`` entry imports this benchmark's torch too). Then the
cost of one target forward of 1..5 rows (a step, a verification) after 150 and 1,000 tokens,
and of a prompt's prefill, with the fused C decoder step and without it.
``--memory`` runs only those, each process once untimed first (so the conversions and
metadata caches a first load writes are not counted), into ``results/smollm2-memory.json``.
Writes ``benchmarks/results/smollm2-quant.json``: machine, versions, git sha, per-request
records, per workload and method the medians of tokens/s and of the ratio to llama.cpp plain
and to HF fp32. Not a test: numbers depend on load.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from flashspec.bench.chat_requests import ChatRequest, chat_ids, humaneval_requests
from flashspec.bench.common import machine_info, progress, quiet_timing, write_json
from flashspec.bench.identity import compare_greedy
from flashspec.flags.options import EngineOptions
from flashspec.loading import resolve_named
from flashspec.models import Padding, untuned

RESULTS = Path(__file__).resolve().parent / "results"
# Held-out everyday requests (written for this file; not among the draft's training prompts).
CHAT = (
    "Explain what a hash table is to a beginner.",
    "Write a haiku about a lighthouse in winter.",
    "What should I pack for a weekend hiking trip?",
    "How does a refrigerator keep food cold?",
    "Give three tips for writing clear emails.",
    "What is the difference between weather and climate?",
    "How do I reverse a list in Python without using reverse()?",
    "Why do leaves change colour in autumn?",
)
METHODS = ("hf_fp32", "hf_bf16", "fs_plain", "fs_default", "llamacpp", "llamacpp_lookup")
TARGET = ["smollm2"]
"""The model every method loads: the named target, or a GGUF file given with --target."""


def target_file() -> str:
    return str(resolve_named(TARGET[0])) if TARGET[0] == "smollm2" else TARGET[0]


LOOKUP_TOKENS = 10


def requests(humaneval: int, chat: int) -> list[ChatRequest]:
    talk = [ChatRequest(f"chat/{i}", "chat", "chat", text) for i, text in enumerate(CHAT)]
    return humaneval_requests(humaneval) + talk[:chat]


def rss_mb() -> float:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def load(method: str) -> Any:
    """The object a method runs: an engine, an HF model or a llama.cpp model (``imports``:
    none, only transformers' Llama model code imported)."""
    if method == "imports":
        from transformers.models.llama import modeling_llama

        return modeling_llama
    if method in ("hf_fp32", "hf_bf16"):
        dtype = "float32" if method == "hf_fp32" else "bfloat16"
        return EngineOptions(target=TARGET[0], drafter="prompt-lookup", dtype=dtype).build()
    if method in ("fs_plain", "fs_default"):
        return EngineOptions(target=TARGET[0]).build()
    import llama_cpp
    from llama_cpp import llama_speculative

    threads = torch.get_num_threads()
    draft = (
        llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
        if method == "llamacpp_lookup"
        else None
    )
    return llama_cpp.Llama(
        model_path=target_file(), n_threads=threads, n_threads_batch=threads,
        n_ctx=4096, logits_all=draft is not None, verbose=False, draft_model=draft,
    )  # fmt: skip


class Methods:
    def __init__(self, quick: bool) -> None:
        self.objects: dict[str, Any] = {}
        self.notes: dict[str, str] = {}
        for method in METHODS:
            if quick and method.startswith("llamacpp"):
                continue
            if method == "fs_plain" and "fs_default" in self.objects:
                self.objects[method] = self.objects["fs_default"]
                continue
            try:
                self.objects[method] = load(method)
            except ImportError as exc:
                self.notes[method] = f"skipped: {exc}"
        engine = self.objects["fs_default"]
        self.tokenizer = engine.tokenizer
        self.eos = list(engine.target.eos_token_ids)
        self.reference = self.objects["hf_fp32"].target.model
        self.notes["fs_default"] = "engine: " + ", ".join(d.name for d in engine.drafters)

    def names(self) -> list[str]:
        return [m for m in METHODS if m in self.objects]

    def run(self, method: str, ids: list[int], n: int) -> dict[str, Any]:
        with quiet_timing():
            start = time.perf_counter()
            record = decode(method, self.objects[method], ids, n, self.eos)
            seconds = time.perf_counter() - start
        tokens = record["tokens"]
        record.update(seconds=seconds, new_tokens=len(tokens),
                      tokens_per_second=len(tokens) / seconds)  # fmt: skip
        return record


def decode(method: str, obj: Any, ids: list[int], n: int, eos: list[int]) -> dict[str, Any]:
    """Greedy continuation of ``ids`` (at most ``n`` tokens) by ``method``'s object (``load``):
    ``{"tokens": [...]}``, with the engine's round counters for ``fs_default``."""
    x = torch.tensor([ids], dtype=torch.int64)
    if method == "fs_default":
        result = obj.generate(input_ids=x, max_new_tokens=n)
        return {"tokens": [int(t) for t in result.tokens[0]], "rounds": result.stats.rounds,
                "accepted": result.stats.accepted, "drafted": result.stats.drafted}  # fmt: skip
    if method == "fs_plain":
        return {"tokens": _plain(obj.target, x, n, eos)}
    if method.startswith("hf_"):
        model = obj.target.model
        with untuned(model), torch.inference_mode():
            out = model.generate(
                x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                temperature=None, top_p=None, top_k=None, eos_token_id=eos, pad_token_id=eos[0],
            )  # fmt: skip
        return {"tokens": [int(t) for t in out[0, len(ids) :]]}
    tokens: list[int] = []
    obj.reset()
    for token in obj.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
        tokens.append(int(token))
        if int(token) in eos or len(tokens) >= n:
            break
    return {"tokens": tokens}


@torch.inference_mode()
def _plain(target: Any, x: torch.Tensor, n: int, eos: list[int]) -> list[int]:
    """Plain decoding on flashspec's target: one forward a token, the argmax."""
    target.reset()
    padding = Padding(torch.zeros(1, dtype=torch.int64))
    out: list[int] = []
    logits = target.forward(x, padding, 1)
    while len(out) < n:
        token = int(logits[0, -1].argmax())
        out.append(token)
        if token in eos:
            break
        logits = target.forward(torch.tensor([[token]]), padding, 1)
    return out


def measure(methods: Methods, chosen: list[ChatRequest], n: int) -> list[dict[str, Any]]:
    names = methods.names()
    records = []
    for index, request in enumerate(progress(chosen, desc="requests", unit="request")):
        ids = chat_ids(methods.tokenizer, request)
        order = names[index % len(names) :] + names[: index % len(names)]
        done = {name: methods.run(name, ids, n) for name in order}
        runs = {name: done[name] for name in names}
        reference = runs["hf_fp32"]["tokens"]
        for name, run in runs.items():
            if name != "hf_fp32":
                verdict = compare_greedy(methods.reference, ids, run["tokens"], reference)
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
            "tokens_per_second_median": round(
                statistics.median(r["tokens_per_second"] for r in runs), 2
            ),
        }
        for base in ("llamacpp", "hf_fp32"):
            if base in records[0]["methods"]:
                ratios = [
                    r["methods"][name]["tokens_per_second"]
                    / r["methods"][base]["tokens_per_second"]
                    for r in records
                ]
                entry[f"over_{base}_median"] = round(statistics.median(ratios), 4)
        if "drafted" in runs[0]:
            rounds = sum(r["rounds"] for r in runs)
            entry["tokens_per_round"] = round(sum(r["new_tokens"] for r in runs) / rounds, 3)
        if "identity" in runs[0]:
            statuses = [r["identity"] for r in runs]
            entry["identity"] = {s: statuses.count(s) for s in ("identical", "tie", "mismatch")}
        out[name] = entry
    return out


STEP_ROWS = (1, 2, 3, 4, 5)
STEP_CONTEXTS = (150, 1000)
STEP_REPEATS = 15


@torch.inference_mode()
def step_costs(engine: Any) -> dict[str, Any]:
    """Median ms of one target forward of m rows after a prompt of each of ``STEP_CONTEXTS``
    tokens, and of the first prompt's prefill: the fused C decoder step
    (``flashspec.quant.decoder``) against the per-operation forward (the plan taken away),
    interleaved call by call."""
    from flashspec.quant.decoder import fused_of

    target = engine.target
    inner = next(m for m in target.model.modules() if fused_of(m) is not None)
    fused = fused_of(inner)
    padding = Padding(torch.zeros(1, dtype=torch.int64))
    generator = torch.Generator().manual_seed(0)
    prompts = {c: torch.randint(100, 40000, (1, c), generator=generator) for c in STEP_CONTEXTS}
    modes = {"fused": fused, "per_operation": None}
    times: dict[str, dict[str, list[float]]] = {mode: {} for mode in modes}
    for _ in range(STEP_REPEATS):
        for context, prompt in prompts.items():
            for mode, plan in modes.items():
                if plan is None:
                    inner.__dict__.pop("_flashspec_fused", None)
                else:
                    inner.__dict__["_flashspec_fused"] = plan
                target.reset()
                start = time.perf_counter()
                target.forward(prompt, padding, 1)
                if context == STEP_CONTEXTS[0]:
                    times[mode].setdefault("prefill", []).append(time.perf_counter() - start)
                for m in STEP_ROWS:
                    ids = torch.randint(100, 40000, (1, m), generator=generator)
                    start = time.perf_counter()
                    target.forward(ids, padding, m)
                    key = f"{context}:{m}"
                    times[mode].setdefault(key, []).append(time.perf_counter() - start)
                    target.rollback(context)
    inner.__dict__["_flashspec_fused"] = fused
    return {
        "context": STEP_CONTEXTS[0],
        "contexts": list(STEP_CONTEXTS),
        "repeats": STEP_REPEATS,
        "ms": {
            mode: {k: round(statistics.median(v) * 1e3, 3) for k, v in rows.items()}
            for mode, rows in times.items()
        },
    }


LLAMACPP_ALONE = """
import json, sys
import llama_cpp
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
model = llama_cpp.Llama(model_path=sys.argv[1], n_threads=2, n_ctx=4096, verbose=False)
loaded = rss()
model.create_chat_completion([{"role": "user", "content": sys.argv[2]}],
                             max_tokens=int(sys.argv[3]), temperature=0.0)
print(json.dumps({"after_load": loaded, "after_generate": rss()}))
"""
"""llama.cpp's resident memory after load and after a chat reply, in a process that imports
nothing else."""

RSS_REFERENCES = ("imports", "llamacpp_alone")


def resident_memory(methods: list[str], n: int, warm: bool = False) -> dict[str, dict[str, Any]]:
    """RSS (MB) after loading each method's model and after it generated ``n`` greedy tokens for
    the first chat request, each in a fresh process, with the two references
    (``RSS_REFERENCES``) and the file's size: ``{"after_load": {...}, "after_generate": {...}}``.
    ``warm``: run each process once before the measured one, so conversions and metadata
    caches a first load writes are not counted."""
    size = Path(target_file()).stat().st_size / 2**20
    out: dict[str, dict[str, Any]] = {"after_load": {"file": size}, "after_generate": {}}
    for method in [*RSS_REFERENCES, *methods]:
        if method == "llamacpp_alone" and "llamacpp" not in methods:
            continue
        command = (
            [sys.executable, "-c", LLAMACPP_ALONE, target_file(), CHAT[0], str(n)]
            if method == "llamacpp_alone"
            else [sys.executable, __file__, "--rss", method, "--target", TARGET[0],
                  "--max-new-tokens", str(n)]
        )  # fmt: skip
        for _ in range(2 if warm else 1):
            proc = subprocess.run(
                command, capture_output=True, text=True, timeout=900, env=os.environ.copy()
            )
        lines = proc.stdout.strip().splitlines()
        if proc.returncode != 0 or not lines:
            out["after_load"][method] = proc.stderr[-300:]
            continue
        reading = json.loads(lines[-1])
        for key in ("after_load", "after_generate"):
            if reading.get(key) is not None:
                out[key][method] = reading[key]
    return out


def child_rss(method: str, n: int) -> dict[str, float | None]:
    """In a fresh process: RSS after loading ``method``'s model, and after it generated ``n``
    greedy tokens for the first chat request (None for ``imports``, which loads no model)."""
    obj = load(method)
    gc.collect()
    reading: dict[str, float | None] = {"after_load": rss_mb(), "after_generate": None}
    if method == "imports":
        return reading
    request = ChatRequest("chat/0", "chat", "chat", CHAT[0])
    if method.startswith("llamacpp"):
        obj.create_chat_completion([{"role": "user", "content": CHAT[0]}], max_tokens=n,
                                   temperature=0.0)  # fmt: skip
    else:
        with quiet_timing():
            decode(method, obj, chat_ids(obj.tokenizer, request), n,
                   list(obj.target.eos_token_ids))  # fmt: skip
    gc.collect()
    reading["after_generate"] = rss_mb()
    return reading


def settings(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """The run's settings as its results file records them."""
    return {"target": args.target, "file": Path(target_file()).name,
            "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads(),
            **extra}  # fmt: skip


def memory_only(args: argparse.Namespace) -> int:
    """``--memory``: the resident-memory measurements alone, written to their own file."""
    machine = machine_info()
    methods = [m for m in METHODS if m != "fs_plain"]  # fs_plain loads what fs_default loads
    notes: dict[str, str] = {}
    try:
        import llama_cpp  # noqa: F401
    except ImportError as exc:
        methods = [m for m in methods if not m.startswith("llamacpp")]
        notes["llamacpp"] = f"skipped: {exc}"
    began = time.perf_counter()
    memory = resident_memory(methods, args.max_new_tokens, warm=True)
    data = {
        "machine": machine,
        "kind": "smollm2-memory",
        "settings": settings(args, request=CHAT[0], notes=notes),
        "resident_mb_after_load": memory["after_load"],
        "resident_mb_after_generate": memory["after_generate"],
        "wall_seconds": round(time.perf_counter() - began, 1),
    }
    write_json(data, args.out or RESULTS / "smollm2-memory.json")
    print("resident MB:", memory)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--humaneval", type=int, default=6)
    parser.add_argument("--chat", type=int, default=6, help=f"at most {len(CHAT)}")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true", help="a smoke run (no llama.cpp)")
    parser.add_argument("--no-rss", action="store_true", help="skip the memory measurements")
    parser.add_argument("--rss", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--memory", action="store_true",
        help="only the resident-memory measurements (default --out: results/smollm2-memory.json)",
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--target", default="smollm2", help="'smollm2' (its Q4_1 file) or another GGUF of it"
    )
    args = parser.parse_args(argv)
    TARGET[0] = args.target
    if args.rss:
        print(json.dumps(child_rss(args.rss, args.max_new_tokens)))
        return 0
    if args.memory:
        return memory_only(args)
    began = time.perf_counter()
    machine = machine_info()
    try:
        from flashspec import quant

        machine["quant_backend"] = quant.backend()
        machine["quant_threads"] = quant.kernel_threads()
    except ImportError:
        machine["quant_backend"] = None
    methods = Methods(args.quick)
    chosen = requests(args.humaneval, args.chat)
    warm = chat_ids(methods.tokenizer, chosen[0])
    for name in methods.names():
        methods.run(name, warm, 8)
    records = measure(methods, chosen, args.max_new_tokens)
    summary = {
        workload: summarise([r for r in records if r["workload"] == workload])
        for workload in dict.fromkeys(r["workload"] for r in records)
    }
    with quiet_timing():
        steps = step_costs(methods.objects["fs_default"])
    memory = {} if args.no_rss else resident_memory(methods.names(), args.max_new_tokens)
    data = {
        "machine": machine,
        "kind": "smollm2-quant",
        "settings": settings(
            args,
            llamacpp_lookup_tokens=LOOKUP_TOKENS,
            notes=methods.notes,
            speedup="median over requests of the tokens/s ratio (new tokens over the wall "
            "seconds of the whole call, prefill included)",
        ),
        "summary": summary,
        "resident_mb_after_load": memory.get("after_load", {}),
        "resident_mb_after_generate": memory.get("after_generate", {}),
        "step_costs": steps,
        "prompts": records,
        "wall_seconds": round(time.perf_counter() - began, 1),
    }
    write_json(data, args.out or RESULTS / "smollm2-quant.json")
    for workload, rows in summary.items():
        print(f"== {workload}")
        for name, row in rows.items():
            extra = " ".join(f"{k}={v}" for k, v in row.items() if k != "prompts")
            print(f"{name:16s} {extra}")
    print("step ms:", steps["ms"])
    if memory:
        print("resident MB after load:", memory)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
