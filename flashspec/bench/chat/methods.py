"""What the real-model benchmark times: the methods (``METHODS``) and ``ChatMethods``, the models,
engines and llama.cpp instances of a run, each timed one generation at a time."""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...models.linear import untuned
from .. import runner
from ..common import quiet_timing

WORKLOADS = ("humaneval", "copy")
HF_LOOKUP_TOKENS = 10
LLAMACPP_LOOKUP_TOKENS = 10
LLAMACPP_CONTEXT = 4096
FP32_METHODS = ("hf_greedy", "hf_lookup", "fs_default", "fs_lookup")
BF16_METHODS = ("hf_greedy_bf16", "fs_default_bf16")
LLAMACPP_METHODS = ("llamacpp", "llamacpp_lookup")
METHODS = (
    "hf_greedy",
    "hf_greedy_bf16",
    "hf_lookup",
    "fs_default",
    "fs_default_bf16",
    "fs_lookup",
    "llamacpp",
    "llamacpp_lookup",
)
SWEEP_PREFIX = "fs_lookup_gamma"


def baseline_of(method: str) -> str:
    """The HF greedy run a method's identity (and same-dtype speedup) is measured against."""
    return "hf_greedy_bf16" if method.endswith("_bf16") else "hf_greedy"


# ----------------------------------------------------------------------------------- methods


@dataclass
class Run(runner.Run):
    """One method on one prompt, with the rounds per arm of an engine that chooses."""

    arm_rounds: dict[str, int] | None = None

    def record(self) -> dict[str, Any]:
        out = super().record()
        if self.arm_rounds is not None:
            out["arm_rounds"] = dict(self.arm_rounds)
        return out


def llamacpp_module() -> tuple[Any, str | None]:
    """``llama_cpp`` (or None) and why it is unavailable."""
    try:
        return importlib.import_module("llama_cpp"), None
    except ImportError as exc:  # pragma: no cover - depends on the machine
        return None, f"llama_cpp is not importable ({exc}); pip install llama-cpp-python"


class ChatMethods:
    """The models, engines and llama.cpp instances of a run; ``run(method, ids)`` times one.

    Every flashspec engine is built by ``EngineOptions(...).build()`` from the flags the
    method stands for, so the measured engine is the one ``flashspec generate`` builds.
    """

    def __init__(
        self,
        target: str,
        *,
        gamma: int = 4,
        draft: str | None = None,
        sweep_gammas: tuple[int, ...] = (),
        llamacpp: bool = True,
        threads: int | None = None,
        build: Callable[..., Any] | None = None,
    ) -> None:
        from ...flags.options import EngineOptions
        from ...loading import is_gguf, resolve_model_path

        self.target = target
        self.gamma = gamma
        self.notes: dict[str, str] = {}

        def options(**kw: Any) -> Any:
            # Fixed-length lookup takes no draft model; everything else gets the run's draft.
            return EngineOptions(target=target, draft=None if "drafter" in kw else draft, **kw)

        make = build or (lambda **kw: options(**kw).build())
        fixed = f"flashspec generate --target {target} --drafter prompt-lookup --gamma"
        self.flags: dict[str, str] = {
            "fs_default": f"flashspec generate --target {target}",
            "fs_default_bf16": f"flashspec generate --target {target} --dtype bfloat16",
            "fs_lookup": f"{fixed} {gamma}",
        }
        self.engines: dict[str, Any] = {
            "fs_default": make(gamma=gamma),
            "fs_default_bf16": make(gamma=gamma, dtype="bfloat16"),
            "fs_lookup": make(gamma=gamma, drafter="prompt-lookup"),
        }
        for g in sweep_gammas:
            name = f"{SWEEP_PREFIX}{g}"
            if g == gamma:
                self.engines[name] = self.engines["fs_lookup"]
            else:
                self.engines[name] = make(gamma=g, drafter="prompt-lookup")
            self.flags[name] = f"{fixed} {g}"
        default = self.engines["fs_default"]
        self.tokenizer = default.tokenizer
        self.model = default.target.model  # HF methods share the default engine's weights
        self.model_bf16 = self.engines["fs_default_bf16"].target.model
        self.eos: list[int] = list(default.target.eos_token_ids)
        self.drafters = {
            name: [d.name for d in engine.drafters] for name, engine in self.engines.items()
        }
        self.llamas: dict[str, Any] = {}
        self.gguf: str | None = None
        if llamacpp:
            self._setup_llamacpp(resolve_model_path(target), is_gguf, threads)
        else:
            self.notes["llamacpp"] = "skipped (--no-llamacpp)"

    def _setup_llamacpp(
        self, path: str, is_gguf: Callable[[str], bool], threads: int | None
    ) -> None:
        if not is_gguf(path):
            self.notes["llamacpp"] = f"skipped: {path} is not a GGUF file"
            return
        llama_cpp, why = llamacpp_module()
        if llama_cpp is None:
            self.notes["llamacpp"] = f"skipped: {why}"
            return
        self.gguf = path
        n_threads = threads or torch.get_num_threads()
        try:
            lookup = importlib.import_module("llama_cpp.llama_speculative")
            common: dict[str, Any] = {
                "model_path": path,
                "n_threads": n_threads,
                "n_threads_batch": n_threads,
                "n_ctx": LLAMACPP_CONTEXT,
                "logits_all": False,
                "verbose": False,
            }
            self.llamas["llamacpp"] = llama_cpp.Llama(**common)
            self.llamas["llamacpp_lookup"] = llama_cpp.Llama(
                **common,
                draft_model=lookup.LlamaPromptLookupDecoding(
                    num_pred_tokens=LLAMACPP_LOOKUP_TOKENS
                ),
            )
        except Exception as exc:  # a broken build must not take the benchmark down
            self.llamas.clear()
            self.notes["llamacpp"] = f"skipped: llama.cpp failed to load the model ({exc})"
            return
        self.notes["llamacpp"] = (
            f"llama-cpp-python {getattr(llama_cpp, '__version__', '?')}, {n_threads} threads, "
            f"n_ctx {LLAMACPP_CONTEXT}, greedy (temp 0, top_k 1); lookup: "
            f"LlamaPromptLookupDecoding(num_pred_tokens={LLAMACPP_LOOKUP_TOKENS})"
        )

    def available(self, method: str) -> bool:
        if method in LLAMACPP_METHODS:
            return method in self.llamas
        return method in METHODS or method in self.engines

    def model_for(self, method: str) -> Any:
        """The HF model whose logits decide a tie for ``method``'s identity check."""
        return self.model_bf16 if method.endswith("_bf16") else self.model

    def run(self, method: str, ids: list[int], max_new_tokens: int) -> Run:
        if method in self.engines:
            return self._run_engine(method, ids, max_new_tokens)
        if method in self.llamas:
            return self._run_llamacpp(method, ids, max_new_tokens)
        return self._run_hf(method, ids, max_new_tokens)

    def _run_engine(self, method: str, ids: list[int], n: int) -> Run:
        engine = self.engines[method]
        x = torch.tensor([ids], dtype=torch.int64)
        with quiet_timing():
            start = time.perf_counter()
            result = engine.generate(input_ids=x, max_new_tokens=n)
            seconds = time.perf_counter() - start
        stats = result.stats
        return Run(
            [int(t) for t in result.tokens[0]],
            seconds,
            rounds=stats.rounds,
            drafted=stats.drafted,
            accepted=stats.accepted,
            arm_rounds=dict(stats.arm_rounds) if method.startswith("fs_default") else None,
        )

    def _run_hf(self, method: str, ids: list[int], n: int) -> Run:
        model = self.model_bf16 if method == "hf_greedy_bf16" else self.model
        x = torch.tensor([ids], dtype=torch.int64)
        kwargs: dict[str, Any] = {
            "attention_mask": torch.ones_like(x),
            "max_new_tokens": n,
            "do_sample": False,
            "temperature": None,
            "top_p": None,
            "top_k": None,
            "eos_token_id": self.eos or None,
            "pad_token_id": self.eos[0] if self.eos else 0,
        }
        if method == "hf_lookup":
            kwargs["prompt_lookup_num_tokens"] = HF_LOOKUP_TOKENS
        # HF as users have it: torch's own linear layers, not the target's tuned ones.
        with (
            untuned(model),
            runner.forward_counter(model) as calls,
            quiet_timing(),
            torch.inference_mode(),
        ):
            start = time.perf_counter()
            out = model.generate(x, **kwargs)
            seconds = time.perf_counter() - start
        tokens = [int(t) for t in out[0, len(ids) :].tolist()]
        return Run(tokens, seconds, rounds=calls[0] if method == "hf_lookup" else None)

    def _run_llamacpp(self, method: str, ids: list[int], n: int) -> Run:
        llm = self.llamas[method]
        tokens: list[int] = []
        with quiet_timing():
            start = time.perf_counter()
            llm.reset()  # no reuse of the previous prompt's cache: every run pays its prefill
            for token in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
                tokens.append(int(token))
                if int(token) in self.eos or len(tokens) >= n:
                    break
            seconds = time.perf_counter() - start
        return Run(tokens, seconds)
