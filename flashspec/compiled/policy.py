"""Whether an engine runs the compiled path: ``FlashSpecConfig.compile`` resolved against the
models and the machine, with the reason, logged once per engine."""

from __future__ import annotations

import logging
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from ..models import CausalLM

LOG = logging.getLogger("flashspec")

CompileSetting = bool | Literal["auto"]

_ATTENTION = ("sdpa", "eager")

AUTO_CPU_PARAMETERS = 50_000_000
"""Largest target ``"auto"`` compiles on a CPU (in a server). Measured on the 2-core machine
(``benchmarks/results/compiled*.json``): the 4.5M-parameter demo target's rounds ran ~1.6x
faster compiled than eager; SmolLM2-135M's, bound by its matrix products, ran no faster (0.97x
in float32) after a two-minute compile. The line sits between the two."""


@dataclass(frozen=True)
class CompileDecision:
    """Whether the compiled path is on, and why (the engine's one log line)."""

    on: bool
    reason: str

    def line(self) -> str:
        """The log line: ``compiled path on|off: reason``."""
        return f"flashspec: compiled path {'on' if self.on else 'off'}: {self.reason}"


def obstacle(lm: CausalLM) -> str | None:
    """Why ``lm`` cannot run on a static cache compiled, or None if it can."""
    config = lm.config
    if getattr(lm, "tracks_features", False):
        return (
            f"a drafter reads {lm.name}'s hidden states (a features draft), which the compiled "
            "step does not return"
        )
    if lm.support.stateful:
        return f"{lm.name} keeps recurrent state, which a static attention cache does not hold"
    if lm.window is not None:
        return f"{lm.name} attends through a window ({lm.window})"
    if not lm.support.chunked_exact:
        return f"{lm.name} reads one token per forward after its cache (flashspec.kv.state)"
    if lm.padded_batches is not None:
        return f"{lm.name} cannot batch rows of different lengths ({lm.padded_batches})"
    if not lm.shiftable:
        return (
            f"{lm.name}'s cache is not plain attention with positions and a mask "
            "(sliding-window layers, attention windowed otherwise, or a forward without "
            "position_ids/attention_mask)"
        )
    attention = getattr(lm.model.config, "_attn_implementation", "sdpa") or "sdpa"
    if attention not in _ATTENTION:
        return f"{lm.name} uses {attention} attention; the compiled path supports {_ATTENTION}"
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True):
        return f"{lm.name} has a sliding window"
    return None


def _weights(model: torch.nn.Module) -> int:
    """Weights of ``model``: its parameters and the weights its quantized layers hold as
    blocks (``flashspec.quant``), which are buffers, not parameters."""
    from ..quant.layers import QuantEmbedding, QuantLinear

    count = sum(p.numel() for p in model.parameters())
    for module in model.modules():
        if isinstance(module, QuantLinear):
            count += module.out_features * module.in_features
        elif isinstance(module, QuantEmbedding):
            count += module.num_embeddings * module.embedding_dim
    return count


def _compiler() -> str | None:
    for name in ("g++", "c++", "clang++"):
        if shutil.which(name):
            return name
    return None


def resolve_compile(
    setting: CompileSetting, models: Sequence[CausalLM], *, long_lived: bool = False
) -> CompileDecision:
    """Resolve ``setting`` for the target and drafter models ``models``.

    ``True`` turns the path on (raising if a model cannot take it), ``False`` off. ``"auto"``
    turns it on where it was measured to pay: on CUDA, and on a CPU only in a long-lived
    process (``long_lived``: the server) and for a target of at most ``AUTO_CPU_PARAMETERS``
    parameters. The first call's compile (about a minute per model on the 2-core machine the
    project measures on) is paid once for many requests there, while a single generation would
    not repay it; larger models, bound by their matrix products, were not faster compiled.

    Raises:
        ValueError: ``setting`` is True and a model cannot run compiled (the message says why).
    """
    if setting is False:
        return CompileDecision(False, "compile=False")
    problems = [p for p in (obstacle(lm) for lm in models) if p is not None]
    device = models[0].device if models else None
    if device is not None and device.type == "cpu" and _compiler() is None:
        problems.append("torch.compile needs a C++ compiler on a CPU and none was found")
    if problems:
        if setting is True:
            raise ValueError(
                "compile=True cannot be honoured: "
                + "; ".join(problems)
                + ". Use compile='auto' (which falls back to eager) or compile=False"
            )
        return CompileDecision(False, "compile='auto' and " + "; ".join(problems))
    if setting is True:
        return CompileDecision(True, "compile=True")
    if device is not None and device.type == "cuda":
        return CompileDecision(True, "compile='auto' on CUDA (decode steps replayed as graphs)")
    if long_lived:
        parameters = _weights(models[0].model) if models else 0
        if parameters > AUTO_CPU_PARAMETERS:
            return CompileDecision(
                False,
                f"compile='auto' on a CPU and the target has {parameters / 1e6:.0f}M parameters: "
                "models this large were measured no faster compiled (matrix products dominate); "
                "pass compile=True (--compile on) to try",
            )
        return CompileDecision(
            True, "compile='auto' in a long-running server on a CPU: the first call compiles once"
        )
    return CompileDecision(
        False,
        "compile='auto' on a CPU outside a server: compiling takes about a minute per model "
        "on first use, more than one generation saves; pass compile=True (--compile on) for "
        "repeated generations",
    )
