"""Configuration objects for the speculative decoding engine.

Every field is checked when the object is built, so a bad value fails at the line that wrote it,
with a message naming the field and a valid alternative.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

import torch

from ._validate import is_int
from .legacy import EarlierField
from .trees.tree import TreeShape

Method = Literal["auto", "rejection", "greedy", "typical"]
ResidualBackend = Literal["auto", "native", "torch"]

_METHODS = ("auto", "rejection", "greedy", "typical")
_RESIDUALS = ("auto", "native", "torch")
AUTO_DTYPE = "auto"
"""The default dtype: float32 activations and weights, except that a GGUF file on a CPU keeps
its quantized layers as blocks (``flashspec.quant``) instead of being dequantized."""
_DTYPES: dict[str, torch.dtype] = {
    AUTO_DTYPE: torch.float32,
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def resolve_dtype(dtype: str | torch.dtype, *, argument: str = "dtype") -> torch.dtype:
    """Turn ``"float32"``/``"bf16"``/``torch.float16``... into a ``torch.dtype``.

    Raises:
        ValueError: naming ``argument`` when the value is not a supported floating dtype.
    """
    if isinstance(dtype, torch.dtype):
        if not dtype.is_floating_point:
            raise ValueError(f"{argument} must be a floating-point dtype, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(
        f"{argument}={dtype!r} is not supported; use one of {sorted(set(_DTYPES))} or a torch.dtype"
    )


@dataclass
class SamplingConfig:
    """How tokens are drafted, verified and sampled.

    Attributes:
        gamma: drafts proposed per round (>= 1). The engine drafts fewer near ``max_new_tokens``
            or the context limit.
        temperature: 0 means greedy decoding (output equal to the target's greedy output);
            > 0 samples from the target's distribution after temperature, top-k and top-p.
        top_k: keep only the k most likely tokens (0 disables).
        top_p: nucleus sampling mass in (0, 1]; 1.0 disables.
        method: ``"auto"`` picks ``"greedy"`` for temperature 0 and ``"rejection"`` otherwise.
            ``"rejection"`` is lossless speculative sampling (Leviathan et al. 2023, Alg. 1).
            ``"greedy"`` accepts the longest prefix equal to the target's argmax.
            ``"typical"`` is LOSSY: it accepts any draft the target finds "typical enough"
            (p(x) > min(typical_epsilon, typical_delta * exp(-H(p)))); the output no longer follows
            the target's distribution. Use it only when speed matters more than fidelity.
        residual: where the replacement token after a rejection (and each sampled draft) is
            drawn: ``"native"`` (the C kernel ``flashspec._residual``; CPU float32 only),
            ``"torch"``, or ``"auto"`` (native when available and applicable, torch otherwise).
        typical_epsilon: probability ceiling of the typical-acceptance threshold.
        typical_delta: entropy-scaled part of the typical-acceptance threshold.
        confidence_threshold: a model drafter stops proposing once the top probability of its
            distribution falls below this value (None disables; HF uses 0.4); in a ragged
            batch each row stops on its own, the others draft on.
        dynamic_gamma: adapt the draft length during a generation, per arm: +2 after a round
            in which every draft was accepted, -1 otherwise, within [1, max_gamma] (the
            schedule HF calls "heuristic"). Starts from the arm's gamma each generation.
        max_gamma: upper bound of the dynamic draft length (an arm whose gamma is larger
            keeps its own gamma as the bound).
        seed: seed for the engine's random generator (None: nondeterministic).
        repetition_penalty: HF's ``repetition_penalty`` (> 0; 1.0 = off): the logit of every
            token in the prompt or generated so far is divided by it where positive and
            multiplied by it where negative.
        presence_penalty: OpenAI's (in [-2, 2]; 0 = off): subtracted from the logit of every
            token generated at least once (the prompt does not count).
        frequency_penalty: OpenAI's (in [-2, 2]; 0 = off): times the number of times a token
            was generated, subtracted from its logit.
        logit_bias: token id -> value in [-100, 100], added to that token's logit (OpenAI's
            ``logit_bias``).

    Penalties and bias apply, in that order, before temperature, top-k and top-p, to the
    target's logits at each position of a round as that position sees the output (committed
    tokens and the drafts before it), so the output follows the penalized target exactly.
    """

    gamma: int = 4
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    method: Method = "auto"
    residual: ResidualBackend = "auto"
    typical_epsilon: float = 0.09
    typical_delta: float = 0.3
    confidence_threshold: float | None = None
    dynamic_gamma: bool = False
    max_gamma: int = 16
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None

    @property
    def penalized(self) -> bool:
        """Whether a penalty or a bias changes the target's logits."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str, hint: str = "") -> None:
            if not ok:
                got = getattr(self, name)
                raise ValueError(f"SamplingConfig.{name} must be {rule}, got {got!r}" + hint)

        check(is_int(self.gamma) and self.gamma >= 1, "gamma", "an integer >= 1", "; try gamma=4")
        check(
            _is_real(self.temperature) and self.temperature >= 0,
            "temperature",
            "a finite number >= 0",
            "; use 0 for greedy decoding, or e.g. 0.7 or 1.0 to sample",
        )
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", "an integer >= 0 (0 = off)")
        check(
            _is_real(self.top_p) and 0.0 < self.top_p <= 1.0,
            "top_p",
            "in (0, 1] (1.0 = off)",
            "; try top_p=0.9",
        )
        check(self.method in _METHODS, "method", f"one of {_METHODS}")
        check(self.residual in _RESIDUALS, "residual", f"one of {_RESIDUALS}")
        if self.method in ("rejection", "typical") and self.temperature == 0:
            raise ValueError(
                f"SamplingConfig.method={self.method!r} samples, so it needs temperature > 0; "
                "for temperature=0 use method='greedy' (or 'auto')"
            )
        if self.method == "greedy" and self.temperature != 0:
            raise ValueError(
                f"SamplingConfig.method='greedy' but temperature={self.temperature}; set "
                "temperature=0, or use method='rejection' (or 'auto') to sample losslessly"
            )
        check(
            _is_real(self.typical_epsilon) and 0.0 < self.typical_epsilon <= 1.0,
            "typical_epsilon",
            "in (0, 1]",
        )
        check(_is_real(self.typical_delta) and self.typical_delta > 0, "typical_delta", "> 0")
        threshold = self.confidence_threshold
        check(
            threshold is None or (_is_real(threshold) and 0.0 <= threshold <= 1.0),
            "confidence_threshold",
            "None (off) or in [0, 1]",
            "; try 0.4",
        )
        check(isinstance(self.dynamic_gamma, bool), "dynamic_gamma", "True or False")
        check(is_int(self.max_gamma) and self.max_gamma >= 1, "max_gamma", "an integer >= 1")
        check(self.seed is None or is_int(self.seed), "seed", "an integer or None")
        check(
            _is_real(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "a finite number > 0 (1.0 = off)",
            "; try 1.1",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            check(_is_real(value) and -2.0 <= value <= 2.0, name, "in [-2, 2] (0 = off)")
        bias = self.logit_bias
        if bias is not None:
            if not isinstance(bias, Mapping):
                raise ValueError(
                    "SamplingConfig.logit_bias must be a mapping of token id -> value in "
                    f"[-100, 100], got {type(bias).__name__}"
                )
            for token, value in bias.items():
                if not is_int(token) or token < 0:
                    raise ValueError(
                        f"SamplingConfig.logit_bias keys must be token ids (integers >= 0), "
                        f"got {token!r}"
                    )
                if not _is_real(value) or not -100.0 <= value <= 100.0:
                    raise ValueError(
                        f"SamplingConfig.logit_bias[{token}] must be in [-100, 100], got {value!r}"
                    )
            self.logit_bias = {int(t): float(v) for t, v in bias.items()}

    @property
    def resolved_method(self) -> Literal["rejection", "greedy", "typical"]:
        """The acceptance rule actually used (``"auto"`` resolved by temperature)."""
        if self.method == "auto":
            return "greedy" if self.temperature == 0 else "rejection"
        return self.method


SelectorKind = Literal["model", "ucb1", "thompson"]
_SELECTORS = ("model", "ucb1", "thompson")
SelectionContext = Literal["none", "lookup"]
Batching = Literal["ragged", "lockstep"]
BatchDrafting = Literal["follow", "fixed"]
_BATCH_DRAFTING = ("follow", "fixed")
SeededChoice = Literal["fixed", "follow"]
_SEEDED = ("fixed", "follow")
_BATCHING = ("ragged", "lockstep")
_CONTEXTS = ("none", "lookup")


@dataclass
class BanditConfig:
    """Online choice of the round's arm: a (drafter, gamma) pair, or plain decoding.

    The engine's arms are every drafter with every gamma in ``gammas``, plus plain decoding
    (gamma 0: one target forward, one token) when ``plain`` is set. With more than one arm a
    selector picks the arm each round and is rewarded with the tokens the round emitted per
    second of its wall time, so the engine drops to plain decoding when no drafter pays and
    returns when one does. The choice depends only on past rounds, so output stays exact.

    Attributes:
        selector: ``"model"`` (the default; ``ThroughputModel``): predicts each arm's tokens per
            second from a per-drafter acceptance posterior (Thompson-sampled) and measured
            costs, and also chooses the draft length of every arm whose gamma is not fixed
            (``gammas=None``), in [1, ``SamplingConfig.max_gamma``]. ``"ucb1"`` (mean + c *
            scale * sqrt(2 ln t / n)) and ``"thompson"`` (posterior sampling, Gaussian on
            tokens/s; see ``ThompsonSelector``) learn each arm's tokens/s from the rounds'
            rewards alone, and leave the draft length to ``SamplingConfig`` (fixed, or
            ``dynamic_gamma``). ``flashspec bench adaptive`` compares the three.
        exploration: the constant c of UCB1. Rewards are divided by the largest single-round
            reward seen, which sits far above the arms' means (one fully accepted round of
            prompt lookup emits many times the tokens of an average one), so the textbook
            c = 1 explores almost round-robin over a few hundred rounds; 0.3 is the default.
        window_size: if set, only the last ``window_size`` rounds count (adapts to drift, e.g.
            a stream of prompts of different kinds). For ``"model"``: the rounds of memory of
            a drafter's acceptance posteriors, counted in its own rounds (default 256; an
            unplayed drafter's posterior widens again four times as slowly).
        gammas: draft lengths to choose among (each >= 1); None: ``SamplingConfig.gamma`` alone.
        plain: add the plain-decoding arm (gamma 0).
        seed: seed of the selector's own random source (never the generation's).
        context: ``"lookup"`` keeps separate statistics for rounds in which a prompt-lookup
            drafter finds an n-gram match and rounds in which it finds none (and could only
            draft nothing): which arm pays differs a lot between the two, and whether there is
            a match is known before the round, from committed tokens only. Needs a
            ``PromptLookupDrafter`` among the drafters. ``"none"``: one set of statistics.
        batches: with a single fixed arm (one drafter, no ``gammas``, no ``plain``): in rounds
            of two or more rows, ``"follow"`` (the default) lets the throughput model choose
            the draft length, or plain decoding, from the batch's measured costs: verification
            reads rows x (gamma + 1) tokens, so the length that pays shrinks as the batch
            grows, to none. ``"fixed"``: the arm as configured at every batch size. A batch of
            one, and a seeded sampled generation (see ``seeded``), always run the arm as
            configured.
        seeded: a sampled generation given a seed. ``"fixed"`` (the default): it runs the
            first arm (the first drafter at ``SamplingConfig.gamma``) every round, so that its
            output depends on the seed alone. A policy's choices follow measured times, and
            which arm a round runs decides which random draws it takes, so a seeded generation
            that followed them would change from run to run (its distribution stays exact
            either way). ``"follow"``: the policy chooses as in unseeded generations; faster
            when drafting stops paying, but a seed no longer fixes the output. Greedy
            generations always follow the policy: their output does not depend on the arm.
        n_arms: the earlier library's field: if set, the number of arms the engine must end
            up with (checked when it is built).
        strategy: the earlier library's name for ``selector`` (the same values).
    """

    selector: SelectorKind = "model"
    exploration: float = 0.3
    window_size: int | None = None
    gammas: tuple[int, ...] | None = None
    plain: bool = False
    seed: int | None = None
    context: SelectionContext = "none"
    batches: BatchDrafting = "follow"
    seeded: SeededChoice = "fixed"
    n_arms: int | None = None
    # A descriptor, not a shared default: checked and copied to selector as __init__ assigns
    # it (flashspec.legacy).
    strategy: EarlierField[SelectorKind] = EarlierField("selector", _SELECTORS)  # noqa: RUF009

    def __post_init__(self) -> None:
        if self.n_arms is not None and (not is_int(self.n_arms) or self.n_arms < 1):
            raise ValueError(
                f"BanditConfig.n_arms must be None or an integer >= 1, got {self.n_arms!r}"
            )
        if self.context not in _CONTEXTS:
            raise ValueError(
                f"BanditConfig.context must be one of {_CONTEXTS}, got {self.context!r}"
            )
        if self.selector not in _SELECTORS:
            raise ValueError(
                f"BanditConfig.selector must be one of {_SELECTORS}, got {self.selector!r}"
            )
        if not _is_real(self.exploration) or self.exploration < 0:
            raise ValueError(
                f"BanditConfig.exploration must be a finite number >= 0, got {self.exploration!r}"
            )
        window = self.window_size
        if window is not None and (not is_int(window) or window < 1):
            raise ValueError(
                f"BanditConfig.window_size must be None or an integer >= 1, got {window!r}"
            )
        if self.gammas is not None:
            if isinstance(self.gammas, (str, bytes)) or not all(
                is_int(g) and g >= 1 for g in self.gammas
            ):
                raise ValueError(
                    "BanditConfig.gammas must be None or a sequence of integers >= 1, got "
                    f"{self.gammas!r}; e.g. gammas=(2, 4, 8) (plain decoding is plain=True)"
                )
            if not self.gammas:
                raise ValueError(
                    "BanditConfig.gammas is empty; use None for SamplingConfig.gamma alone"
                )
            self.gammas = tuple(dict.fromkeys(int(g) for g in self.gammas))
        if self.batches not in _BATCH_DRAFTING:
            raise ValueError(
                f"BanditConfig.batches must be one of {_BATCH_DRAFTING}, got {self.batches!r}"
            )
        if self.seeded not in _SEEDED:
            raise ValueError(f"BanditConfig.seeded must be one of {_SEEDED}, got {self.seeded!r}")
        if not isinstance(self.plain, bool):
            raise ValueError(f"BanditConfig.plain must be True or False, got {self.plain!r}")
        if self.seed is not None and not is_int(self.seed):
            raise ValueError(f"BanditConfig.seed must be an integer or None, got {self.seed!r}")


@dataclass
class FlashSpecConfig:
    """Top-level engine configuration.

    Attributes:
        sampling: drafting and acceptance settings.
        bandit: drafter selection settings (used with several drafters).
        device: device for models loaded by name (``"cpu"``, ``"cuda"``, ``"cuda:1"``...).
        dtype: dtype for models loaded by name: ``"auto"`` (the default: float32, and a GGUF
            file on a CPU keeps its quantized layers as they are in the file), or a dtype to
            load (and dequantize a GGUF file) in: ``"float32"``, ``"bfloat16"``,
            ``torch.float16``.
        target_name, drafter_name: the target and drafter ``SpeculativeEngine.from_pretrained``
            loads when it is given none (the earlier library's fields).
        max_new_tokens: the default of ``generate``/``stream`` (128 when None).
        batching: how the rows of a batch advance. ``"ragged"`` (the default): every row
            commits its own accepted drafts each round, as it would alone. ``"lockstep"``: every
            row emits as many tokens as the row that accepted fewest (the earlier engine; kept
            to measure against). Models whose cache cannot move rows along the columns
            (sliding-window, chunked or local attention layers, recurrent state) always run in
            lockstep; both are exact.
        compile: the compiled path (``flashspec.compiled``): static KV caches and
            ``torch.compile`` for the drafter's one-token step and the target's verification.
            ``True`` turns it on (an error if a model cannot take it), ``False`` off,
            ``"auto"`` (the default) on where it pays: on CUDA, and on a CPU in the server,
            where the first call's compile is paid once. The engine logs which and why.
        tree: verify a token tree instead of a chain of drafts (``flashspec.trees``): up to
            ``depth`` levels (and no more than the round's gamma), ``nodes`` nodes, ``top_k``
            children a node, from drafters that propose trees (prompt lookup, the feature
            draft). Rounds of one row on the eager path, with greedy or rejection sampling and
            no penalties or grammar; other rounds keep chains. None (the default): chains.
    """

    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    bandit: BanditConfig = field(default_factory=BanditConfig)
    device: str = "cpu"
    dtype: str | torch.dtype = AUTO_DTYPE
    target_name: str | None = None
    drafter_name: str | None = None
    max_new_tokens: int | None = None
    batching: Batching = "ragged"
    compile: bool | Literal["auto"] = "auto"
    tree: TreeShape | None = None

    def __post_init__(self) -> None:
        if self.compile not in (True, False, "auto") or not isinstance(self.compile, (bool, str)):
            raise ValueError(
                f"FlashSpecConfig.compile must be True, False or 'auto', got {self.compile!r}"
            )
        if self.batching not in _BATCHING:
            raise ValueError(
                f"FlashSpecConfig.batching must be one of {_BATCHING}, got {self.batching!r}"
            )
        for name in ("target_name", "drafter_name"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"FlashSpecConfig.{name} must be None or a model path/hub id, got {value!r}"
                )
        if self.max_new_tokens is not None and (
            not is_int(self.max_new_tokens) or self.max_new_tokens < 0
        ):
            raise ValueError(
                "FlashSpecConfig.max_new_tokens must be None or an integer >= 0, "
                f"got {self.max_new_tokens!r}"
            )
        if not isinstance(self.sampling, SamplingConfig):
            got = type(self.sampling).__name__
            raise TypeError(f"FlashSpecConfig.sampling must be a SamplingConfig, got {got}")
        if not isinstance(self.bandit, BanditConfig):
            raise TypeError(
                f"FlashSpecConfig.bandit must be a BanditConfig, got {type(self.bandit).__name__}"
            )
        if self.tree is not None and not isinstance(self.tree, TreeShape):
            raise TypeError(
                "FlashSpecConfig.tree must be None or a TreeShape(depth, nodes, top_k), "
                f"got {type(self.tree).__name__}"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"FlashSpecConfig.device={self.device!r} is not a device; use e.g. 'cpu' or 'cuda'"
            ) from exc
        resolve_dtype(self.dtype, argument="FlashSpecConfig.dtype")

    @property
    def torch_dtype(self) -> torch.dtype:
        """``dtype`` as a ``torch.dtype``."""
        return resolve_dtype(self.dtype, argument="FlashSpecConfig.dtype")
